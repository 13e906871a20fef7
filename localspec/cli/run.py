"""``localspec run``: stream one answer to stdout, statistics to stderr with --verbose."""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import LocalspecError
from .common import (
    add_draft_options,
    add_model_options,
    add_sampling_options,
    decode_text,
    engine_spec,
    settings_from,
    stdin_text,
)

if TYPE_CHECKING:  # the engine (and llama_cpp) load only when a command runs
    from ..engine import GenerationRequest, SpeculativeEngine
    from ..engine.structure import OutputFormat

def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("run", help="generate with a pair: streams the text to stdout",
                       description="Generate with a draft/target pair. The prompt is sent as a "
                                   "chat message through the target's chat template (--raw for "
                                   "plain completion); it may also come on stdin, and text "
                                   "piped in beside the prompt's words goes before them. With "
                                   "a pair and no prompt on a terminal, opens the chat app. "
                                   "Settings not given as options come from config.toml's "
                                   "[chat], whose values replace the defaults shown here (and a "
                                   "pair's draft mode replaces the default mode).")
    p.add_argument("words", nargs="*", metavar="[PAIR|MODEL] PROMPT",
                   help="a pair name, or one model (then drafted by prompt lookup), unless "
                        "--target is given; then the prompt")
    add_model_options(p)
    add_draft_options(p)
    add_sampling_options(p)
    p.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    p.add_argument("--system", help="system prompt (chat mode)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="statistics and the engine's decisions to stderr")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, finish reason, statistics) at the end")
    p.add_argument("--schema", metavar="SCHEMA",
                   help="hold the answer to a JSON Schema: a file, the schema's JSON text, or "
                        "`object` for any JSON object (as response_format asks a server)")
    r = p.add_argument_group("remote")
    r.add_argument("--url", help="ask this OpenAI-compatible server (a `localspec serve`, "
                                 "llama-server, vLLM) instead of loading models here")
    r.add_argument("--api-key", default=None, help="Bearer key for --url")
    p.set_defaults(func=run)


def _split_words(args: argparse.Namespace) -> tuple[str | None, str | None]:
    words = list(args.words)
    pair = None if args.target else (words.pop(0) if words else None)
    return pair, _words_text(words)


def _words_text(words: list[str]) -> str | None:
    """The prompt's words as text. Bytes that are not UTF-8 reach Python as lone surrogates,
    which fail only later, deep in tokenizing; so they are named here, as stdin's are."""
    if not words:
        return None
    return decode_text(os.fsencode(" ".join(words)), "the prompt given as arguments")


def _prompt_text(words: str | None) -> str | None:
    """The prompt: the words, after any text piped in beside them (`cat notes.md | localspec
    run PAIR "summarise this"`), as in other LLM command lines; without words, stdin alone."""
    piped = _piped_text()
    if words is None:
        return piped
    if piped is None or not piped.strip():
        return words
    return f"{piped.rstrip()}\n\n{words}"


def _piped_text() -> str | None:
    """What a pipe or file on stdin holds, read to its end: never dropped, however slowly it
    comes. A stdin left open with nothing on it (a script's, an editor's task runner's) would
    be waited on silently, so after a second the wait is said, with the way out."""
    stdin = sys.stdin
    if stdin is None or stdin.isatty():
        return None
    try:
        ready, _, _ = select.select([stdin], [], [], 1.0)
    except (OSError, ValueError):  # not selectable (closed, or not a file descriptor)
        return None
    if not ready:
        print("localspec: waiting for the text on stdin (Ctrl-D ends it; give </dev/null "
              "where there is none)", file=sys.stderr, flush=True)
    return stdin_text()


def _output(args: argparse.Namespace) -> OutputFormat | None:
    """--schema, read and checked before any model loads."""
    if args.schema is None:
        return None
    from ..engine.structure import OutputFormat, SchemaError

    try:
        return OutputFormat.from_argument(args.schema)
    except SchemaError as exc:
        raise LocalspecError(f"--schema: {exc}") from None


def run(args: argparse.Namespace) -> int:
    output = _output(args)  # a bad schema is said before anything loads
    if args.url:
        return _run_remote(args, output)
    pair, prompt = _split_words(args)
    settings = settings_from(args, read_config=True)

    from ..history import scope_for

    # The user's own history, the chat app's: run is one more of their requests.
    spec = replace(engine_spec(args, pair, settings), history=scope_for("chat", settings))
    prompt = _prompt_text(prompt)
    if prompt is None:
        if output is not None:
            raise LocalspecError("--schema holds one answer: give the prompt (the chat app "
                                 "takes none)")
        return _open_tui(spec)
    if not prompt.strip():
        raise LocalspecError("the prompt is empty")
    from ..loading import load_engine

    with load_engine(spec) as engine:
        if args.verbose:
            _describe_load(engine)
        return _stream(engine, request_for(engine, args, settings, spec.draft_mode, prompt,
                                           output), args)


def request_for(engine: SpeculativeEngine, args: argparse.Namespace, settings: Any,
                draft_mode: str, prompt: str,
                output: OutputFormat | None = None) -> GenerationRequest:
    """The engine's request for ``run``'s prompt, built as every front end builds one
    (``output``: --schema's, read once)."""
    from ..requests import build_request, options_from_settings

    options = options_from_settings(settings, draft_mode=draft_mode, stop=args.stop)
    return build_request(engine, _prompt(args, prompt), replace(options, output=output))


def _run_remote(args: argparse.Namespace, output: OutputFormat | None) -> int:
    """``run --url``: the same answer from a server (its models, its drafting unless set)."""
    from ..remote import RemoteEngine
    from ..requests import options_from_settings

    if args.target or args.draft:
        raise LocalspecError("give either --url or models (--target/--draft), not both")
    prompt = _prompt_text(_words_text(list(args.words)))
    if prompt is None or not prompt.strip():
        raise LocalspecError("the prompt is empty (pass it as an argument or on stdin)")
    settings = settings_from(args, read_config=True)
    # The server drafts as it was configured unless a drafting flag is given.
    options = options_from_settings(settings, stop=args.stop, draft=any(
        getattr(args, name) is not None for name in ("draft_mode", "k", "k_max", "accept_rule",
                                                     "exact", "history")))
    options = replace(options, output=output)
    with RemoteEngine(args.url, api_key=args.api_key) as engine:
        asked = _prompt(args, prompt)
        events = (engine.stream_completion(asked, options) if isinstance(asked, str)
                  else engine.stream_chat(asked, options))
        return _print_events(events, args, threading.Event())


def _prompt(args: argparse.Namespace, prompt: str) -> Any:
    """The prompt as given (--raw), else the chat: --system's message, then the prompt's."""
    if args.raw:
        return prompt
    # Like the prompt's words, --system may hold bytes that are not UTF-8 (lone surrogates).
    text = decode_text(os.fsencode(args.system), "--system") if args.system else None
    system = [{"role": "system", "content": text}] if text else []
    return [*system, {"role": "user", "content": prompt}]


def _describe_load(engine: SpeculativeEngine) -> None:
    """--verbose: how llama.cpp was set up for each model (once per run)."""
    for role, runner in (("target", engine.target), ("draft", engine.draft)):
        if runner is not None:
            print(f"{role} {runner.path.name}: {runner.repack.describe()}", file=sys.stderr)
    if engine.placement is not None:
        print(f"placement: {engine.placement}", file=sys.stderr)


def _stream(engine: SpeculativeEngine, req: Any, args: argparse.Namespace) -> int:
    cancel = threading.Event()
    return _print_events(engine.stream(req, cancel), args, cancel)


def _print_events(events: Any, args: argparse.Namespace, cancel: threading.Event) -> int:
    from ..engine import Finished

    out = sys.stdout
    try:
        for event in events:
            if isinstance(event, Finished):
                if args.json:
                    json.dump({"text": event.text, "finish_reason": event.finish_reason,
                               "stats": event.stats.to_json()}, out)
                    out.write("\n")
                elif not event.text.endswith("\n"):
                    out.write("\n")
                out.flush()
                if args.verbose:
                    if event.stats.policy:
                        print(f"policy: {event.stats.policy}", file=sys.stderr)
                    print(event.stats.summary(), file=sys.stderr)
            elif not args.json:
                out.write(event.text)
                out.flush()
    except KeyboardInterrupt:
        cancel.set()
        raise
    return 0


def _open_tui(spec: Any) -> int:
    try:
        from ..tui import open_tui
    except ImportError:
        raise LocalspecError("no prompt given (pass it as an argument or on stdin)") from None
    return int(open_tui(spec))
