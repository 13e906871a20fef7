"""The Textual chat app. ``open_tui`` is the entry point the CLI calls.

Nothing is imported from Textual at package import: ``localspec.tui.open_tui`` is looked up by
``localspec run`` and the ``tui`` subcommand, and the engine never imports this package.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..loading import EngineSpec


@contextmanager
def _logs_to_file() -> Iterator[None]:
    """While the app owns the terminal, log lines (llama.cpp's included) go to a file."""
    from .. import paths

    root = logging.getLogger()
    saved = root.handlers[:]
    log_dir = paths.cache_dir()
    log_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_dir / "tui.log", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.handlers = [handler]
    try:
        yield
    finally:
        root.handlers = saved
        handler.close()


def remote_factory(url: str, api_key: str | None = None) -> tuple[Any, EngineSpec]:
    """An engine factory and spec that chat with an OpenAI-compatible server instead of
    loading models here (localspec serve, llama-server, vLLM)."""
    from ..loading import EngineSpec as _Spec
    from ..remote import RemoteEngine

    def factory(_spec: EngineSpec) -> Any:
        engine = RemoteEngine(url, api_key=api_key)
        engine.resolved_model()  # fail here (shown in the app) if the server is unreachable
        return engine

    return factory, _Spec(target=url, pair_name=url, draft_mode="remote")


def open_tui(spec: EngineSpec | None = None, *, url: str | None = None,
             api_key: str | None = None) -> int:
    """Open the chat app, loading ``spec`` (or connecting to ``url``) first when given.

    Raises LocalspecError for a malformed config file (the CLI prints it); everything that goes
    wrong once the app is running is shown inside the app.
    """
    from ..chat_store import ChatStore
    from ..config import load_settings, save_settings
    from ..engine.llama_backend import route_llama_logs_to_logging
    from ..models.library import DefaultLibrary
    from ..monitor import SystemMonitor
    from .app import LocalspecApp

    settings = load_settings()
    factory: Any
    if url is not None:
        factory, spec = remote_factory(url, api_key)
    else:
        from ..loading import load_engine

        factory = load_engine
    # llama.cpp writes to stderr (which Textual draws on) unless its log goes to `logging`.
    route_llama_logs_to_logging()
    store = ChatStore()
    try:
        with _logs_to_file():
            app = LocalspecApp(factory, SystemMonitor(), store, DefaultLibrary(), settings,
                               save_settings=save_settings, spec=spec)
            result = app.run()
    finally:
        store.close()
    return int(result or 0)
