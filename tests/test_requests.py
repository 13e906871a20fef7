"""One request path: run, serve and the chat app build the same engine request for the same
messages and settings, the drafting rule ("the draft model when one is loaded, else prompt
lookup") included, on a real tiny pair and on its target alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from localspec.chat_engine import LocalChatEngine
from localspec.cli import parse
from localspec.cli.common import engine_spec, settings_from
from localspec.cli.run import request_for
from localspec.engine import GenerationRequest, SpeculativeEngine
from localspec.engine.drafters import PromptLookupDrafter
from localspec.loading import load_engine
from localspec.open_engine import open_chat_engine
from localspec.remote import draft_fields, sampling_fields
from localspec.requests import (
    ChatOptions,
    build_request,
    draft_from_settings,
    draft_mode_for,
    recommended_mode,
)
from localspec.server import ServerConfig
from localspec.server.app import create_app
from localspec.server.running import BackgroundServer

SYSTEM, PROMPT = "Answer briefly.", "name three colours"


def _recording(engine: SpeculativeEngine) -> list[GenerationRequest]:
    """The requests the (real) engine is asked to stream, in order."""
    seen: list[GenerationRequest] = []
    stream = engine.stream

    def recorded(req: GenerationRequest, cancel: Any = None) -> Iterator[Any]:
        seen.append(req)
        return stream(req, cancel)

    engine.stream = recorded  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("with_draft", [True, False], ids=["pair", "target-alone"])
def test_run_serve_and_chat_app_build_the_same_request(target_gguf: Path, draft_gguf: Path,
                                                       with_draft: bool) -> None:
    argv = ["run", "--target", str(target_gguf), "--ctx", "512", "--draft-k", "3", "-n", "6",
            "--system", SYSTEM, "--stop", "\n\n", *(["--draft", str(draft_gguf)] * with_draft),
            PROMPT]
    args = parse(argv)
    settings = settings_from(args, read_config=True)
    spec = engine_spec(args, None, settings)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    with load_engine(spec) as engine:
        assert (engine.draft is not None) == with_draft
        seen = _recording(engine)
        run_request = request_for(engine, args, settings, spec.draft_mode, PROMPT)

        # The chat app: its screen's options (mode "model" from the settings, whatever the
        # pair holds), answered by the in-process engine.
        draft = draft_from_settings(settings)
        assert draft.mode == "model"
        options = ChatOptions(max_tokens=settings.max_tokens, sampling=run_request.sampling,
                              draft=draft, stop=("\n\n",))
        for _ in LocalChatEngine(engine, "tiny").stream_chat(messages, options):
            pass
        # serve: the same fields as the chat app's engine process sends (RemoteEngine's), over
        # HTTP to the server's app on the same engine, which drafts as configured otherwise.
        app = create_app(engine, ServerConfig(model_id="tiny", draft=draft))
        body = {"model": "tiny", "messages": messages, "max_tokens": settings.max_tokens,
                "stop": ["\n\n"], **sampling_fields(run_request.sampling), **draft_fields(draft)}
        with BackgroundServer(app) as server:
            answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        chat_tokens = engine.tokenize(engine.chat_prompt(messages), chat=True)

    chat_request, serve_request = seen
    assert run_request == chat_request == serve_request
    # The rule, applied alike: the draft model where it is loaded, else prompt lookup.
    assert run_request.draft.mode == ("model" if with_draft else PromptLookupDrafter.name)
    assert run_request.draft.k == 3 and run_request.max_tokens == 6
    assert run_request.stop == ("\n\n",)
    assert run_request.prompt_tokens == chat_tokens


def test_the_rule_leaves_modes_that_need_no_draft_model_alone() -> None:
    for mode in ("lookup", "none"):
        assert draft_mode_for(mode, has_draft_model=False) == mode
    assert draft_mode_for("model", has_draft_model=True) == "model"
    assert draft_mode_for("model", has_draft_model=False) == "lookup"
    assert recommended_mode(True) == "model" and recommended_mode(False) == "lookup"


def test_a_request_without_drafting_options_drafts_as_the_engine_holds(
        target_gguf: Path, draft_gguf: Path) -> None:
    with SpeculativeEngine.load(target_gguf, None) as alone:
        assert build_request(alone, "hi", ChatOptions()).draft.mode == "lookup"
        # A server's configuration is the default, fitted the same way.
        configured = draft_from_settings(settings_from(parse(["run", "-k", "2"]), False))
        fitted = build_request(alone, "hi", ChatOptions(), default_draft=configured).draft
        assert (fitted.mode, fitted.k) == ("lookup", 2)


def test_a_bad_file_reaches_the_chat_app_once_with_its_title(tmp_path: Path) -> None:
    """The chat app's way in leaves validation to where the engine loads: the engine process's
    refusal of a file that is no GGUF comes back as one error, titled as the file's problem."""
    from localspec.errors import LocalspecError
    from localspec.loading import EngineSpec

    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"this is not a model\n" * 64)
    with pytest.raises(LocalspecError) as caught:
        open_chat_engine(EngineSpec(target=str(bad), draft_mode="lookup"))
    assert caught.value.title == "Invalid model file"
    assert "notes.gguf" in caught.value.message
