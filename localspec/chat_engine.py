"""One engine contract for every front end: chat messages (or a prompt) in, text chunks and one
``Finished`` with the full statistics out.

Two implementations: :class:`LocalChatEngine`, the speculative engine in this process (``run``,
``bench``, the engine process behind the chat app and ``serve``), and
:class:`localspec.remote.RemoteEngine`, any OpenAI-compatible server over HTTP (a ``localspec
serve``, the chat app's own engine process, llama-server, vLLM). Front ends are written against
:class:`ChatEngine` and never know which one they hold.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict

from .engine.decoder import Finished, SpeculativeEngine
from .engine.text import TextChunk
from .errors import LocalspecError
from .requests import ChatOptions, build_request

__all__ = ["ChatEngine", "ChatEvent", "ChatMessage", "ChatOptions", "EngineInfo",
           "EngineNotReadyError", "EngineUnreachableError", "LocalChatEngine"]


class ChatMessage(TypedDict):
    role: str  # system, user or assistant
    content: str


ChatEvent = TextChunk | Finished


class EngineNotReadyError(LocalspecError):
    """The request was not taken: the engine is loading, restarting or not there, so nothing was
    generated and the same request can be sent again once it is back. ``retry_after`` is the
    server's hint in seconds, when it gave one. Raised before the first event of a stream."""

    title = "Engine not ready"

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineUnreachableError(EngineNotReadyError):
    """Nothing answers at the engine's address: its process or server is gone (``stopped()``
    says so once that is known)."""

    title = "Engine unreachable"


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What a front end shows about the engine it talks to."""

    name: str
    target: str
    draft: str | None
    has_draft_model: bool
    where: str  # "in-process", "engine process", or the server's URL
    placement: str | None = None  # where the layers went, one line (None: not known)


class ChatEngine(Protocol):
    """What the chat app, ``run --url`` and ``bench --url`` need from an engine."""

    @property
    def info(self) -> EngineInfo: ...

    def stream_chat(self, messages: Sequence[ChatMessage], options: ChatOptions,
                    cancel: threading.Event | None = None) -> Iterator[ChatEvent]:
        """Text chunks, then one Finished. Setting ``cancel`` ends it promptly with a Finished
        whose reason is "cancelled". EngineNotReadyError (before any event): not taken, send
        it again once the engine is back; EngineStoppedError: the engine died answering it."""
        ...

    def stream_completion(self, prompt: str, options: ChatOptions,
                          cancel: threading.Event | None = None) -> Iterator[ChatEvent]: ...

    def stopped(self) -> str | None:
        """Why the engine is no longer there (its process died), or None while it is."""
        ...

    @property
    def model_pid(self) -> int | None:
        """The process that holds the models on this machine (what the gauges' "this process"
        shows), or None where they are another program's (a server's) or elsewhere."""
        ...

    def restart(self) -> None:
        """Bring a stopped engine back (a new engine process on the same pair; for a server
        that went away, an engine process of this app's own)."""
        ...

    def close(self) -> None: ...


class LocalChatEngine:
    """The speculative engine in this process, behind the contract: its requests are built by
    ``requests.build_request`` (the target's chat template; ``options.draft`` None drafts with
    the draft model when there is one), as every front end's are."""

    def __init__(self, engine: SpeculativeEngine, name: str) -> None:
        self.engine = engine
        has_draft = engine.draft is not None
        self._info = EngineInfo(name=name, target=str(engine.target.path),
                                draft=str(engine.draft.path) if engine.draft else None,
                                has_draft_model=has_draft, where="in-process",
                                placement=engine.placement)

    @property
    def info(self) -> EngineInfo:
        return self._info

    def stream_chat(self, messages: Sequence[ChatMessage], options: ChatOptions,
                    cancel: threading.Event | None = None) -> Iterator[ChatEvent]:
        return self.engine.stream(build_request(self.engine, messages, options), cancel)

    def stream_completion(self, prompt: str, options: ChatOptions,
                          cancel: threading.Event | None = None) -> Iterator[ChatEvent]:
        return self.engine.stream(build_request(self.engine, prompt, options), cancel)

    def stopped(self) -> str | None:
        return None  # in this process: if it died, so did we

    @property
    def model_pid(self) -> int | None:
        return os.getpid()

    def restart(self) -> None:
        pass

    def close(self) -> None:
        self.engine.close()
