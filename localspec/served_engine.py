"""The chat app's engine when a ``localspec serve`` on this machine already serves its pair.

The app is that server's client (one copy of the models in memory). The server is another
program, though: it can be stopped or killed while the app runs. Then this engine says so once
(``stopped()``), and ``restart()`` loads the same pair in an engine process of the app's own,
which answers from then on. While the server's own engine restarts (it answers 503), requests
are not taken and the front end waits (EngineNotReadyError), as with any engine coming back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from .chat_engine import (
    ChatEngine,
    ChatEvent,
    ChatMessage,
    ChatOptions,
    EngineInfo,
    EngineUnreachableError,
)
from .loading import EngineSpec
from .remote import RemoteEngine

log = logging.getLogger(__name__)


class ServedChatEngine:
    """A ``localspec serve`` of ``spec``'s files (process ``pid`` at ``url``), falling back to
    an engine process of this app's own for ``spec`` once that server is gone."""

    def __init__(self, spec: EngineSpec, url: str, pid: int, api_key: str | None = None,
                 model: str | None = None, log_file: Path | None = None,
                 server_history: str | None = None) -> None:
        self.spec = spec
        self.url = url
        self.pid = pid
        self._log_file = log_file
        # The chat's conversations go into the server's history index only where that index
        # is the chat app's own (config.toml joined them); else they stay out of it, and the
        # chat drafts from the history only once its own engine process takes over.
        shared = server_history is not None and server_history == spec.history
        self._engine: ChatEngine = RemoteEngine(url, api_key=api_key, model=model,
                                                where=f"localspec serve at {url}",
                                                history=shared)
        self._own = False  # True once the app's own engine process has taken over
        self._unreachable = threading.Event()  # a request found nothing listening at url

    @property
    def info(self) -> EngineInfo:
        return self._engine.info

    @property
    def attached(self) -> bool:
        """Whether the server still answers for this engine (not yet the app's own process)."""
        return not self._own

    def _watched(self, events: Iterator[ChatEvent]) -> Iterator[ChatEvent]:
        try:
            yield from events
        except EngineUnreachableError:
            if not self._own:
                self._unreachable.set()  # the server's front is gone, not just its engine
            raise

    def stream_chat(self, messages: Sequence[ChatMessage], options: ChatOptions,
                    cancel: threading.Event | None = None) -> Iterator[ChatEvent]:
        return self._watched(self._engine.stream_chat(messages, options, cancel))

    def stream_completion(self, prompt: str, options: ChatOptions,
                          cancel: threading.Event | None = None) -> Iterator[ChatEvent]:
        return self._watched(self._engine.stream_completion(prompt, options, cancel))

    @property
    def model_pid(self) -> int | None:
        return self._engine.model_pid if self._own else None  # the server is another program

    def stopped(self) -> str | None:
        """Cheap (the app asks between answers): the server's process, and whether a request
        found its address dead."""
        from .server.discovery import process_alive  # the server package loads on first use

        if self._own:
            return self._engine.stopped()
        if self._unreachable.is_set() or not process_alive(self.pid):
            return (f"the localspec serve at {self.url} is gone (falling back to an engine "
                    f"process of this app's own for {self.spec.display_name})")
        return None

    def restart(self) -> None:
        """Once the server is gone: load the pair in an engine process of this app's own (the
        server's own restarts need nothing from here)."""
        if self._own:
            self._engine.restart()
            return
        if self.stopped() is None:
            return
        from .server.config import ServerConfig
        from .server.engine_process import ProcessChatEngine

        own = ProcessChatEngine(self.spec, ServerConfig.private(self.spec.display_name),
                                log_file=self._log_file)
        _ = own.info  # asked here, on the restarting thread, not by a front end's event loop
        old, self._engine, self._own = self._engine, own, True
        old.close()
        log.warning("the localspec serve at %s is gone; %s now runs in an engine process of "
                    "this app's own (pid %s)", self.url, self.spec.display_name, own.pid)

    def close(self) -> None:
        self._engine.close()

