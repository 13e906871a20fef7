"""``localspec tui`` (and ``localspec`` alone): the chat app."""

from __future__ import annotations

import argparse

from ..errors import LocalspecError
from .params import add_argument


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("tui", help="the chat app (the default with no command)",
                       description="Chat with a draft/target pair, with live VRAM and token-rate "
                                   "gauges, a pair picker and a model manager.")
    p.add_argument("--pair", help="load this catalogue or user pair on start")
    p.add_argument("--target", metavar="MODEL", help="target model: .gguf path or Ollama name")
    p.add_argument("--draft", metavar="MODEL", help="draft model: .gguf path or Ollama name")
    p.add_argument("--url", help="chat with an OpenAI-compatible server instead (e.g. "
                                 "http://127.0.0.1:8080)")
    p.add_argument("--api-key", help="bearer token for --url")
    add_argument(p, "history", help_extra=" (for this session; config.toml keeps its own)")
    p.add_argument("--reset-damaged-chats", action="store_true",
                   help="if the chat history database is damaged, move it aside (it is kept, "
                        "renamed *.damaged-DATE) and start an empty one without asking")
    p.set_defaults(func=run, pair=None, target=None, draft=None, url=None, api_key=None,
                   reset_damaged_chats=False, history=None)


def run(args: argparse.Namespace) -> int:
    # Textual and llama_cpp are imported only here: `localspec --help` stays instant.
    from dataclasses import replace

    from ..config import load_settings
    from ..history import load_config, scope_for
    from ..loading import EngineSpec, spec_from_pair
    from ..options import model_settings
    from ..tui import open_tui

    if args.url and (args.pair or args.target):
        raise LocalspecError("give either --url or a pair/--target, not both")
    load_config()  # a bad [history] value is one line now, not when a pair is picked (F2)
    spec = None
    if args.pair or args.target or args.draft:
        if args.pair and args.target:
            raise LocalspecError("give either --pair or --target/--draft, not both")
        if args.draft and not args.target:
            raise LocalspecError("--draft needs --target")
        settings = load_settings()
        if args.history is not None:
            settings = replace(settings, history=args.history)
        target_settings, draft_settings = model_settings(settings)
        if args.pair:
            spec = spec_from_pair(args.pair, target_settings, draft_settings)
        else:
            spec = EngineSpec(target=args.target, draft=args.draft,
                              target_settings=target_settings, draft_settings=draft_settings,
                              draft_mode="model" if args.draft else "lookup")
        spec = replace(spec, history=scope_for("chat", settings))
    return open_tui(spec, url=args.url, api_key=args.api_key,
                    reset_damaged_chats=args.reset_damaged_chats,
                    history_setting=args.history)
