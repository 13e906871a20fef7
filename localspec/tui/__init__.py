"""The Textual chat app. ``open_tui`` is the entry point the CLI calls.

Nothing is imported from Textual at package import: ``localspec.tui.open_tui`` is looked up by
``localspec run`` and the ``tui`` subcommand, and the engine never imports this package.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..chat_store import ChatStore, DamagedChatHistory
from ..errors import DamagedChatStoreError, LocalspecError

if TYPE_CHECKING:
    from ..loading import EngineSpec

log = logging.getLogger(__name__)

# How a user who said no (or a script that cannot be asked) moves a damaged chat history aside.
RESET_HINT = ("`localspec tui --reset-damaged-chats` moves it aside and starts an empty "
              "chat history")


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


def can_ask() -> bool:
    """Whether someone can answer a question in the app: Textual reads keys from stdin and
    draws on stderr."""
    return all(stream is not None and stream.isatty() for stream in (sys.stdin, sys.stderr))


def open_chat_store(*, reset_damaged: bool, ask: bool,
                    path: Path | None = None) -> ChatStore | DamagedChatHistory:
    """The chat store the app starts with (the default database unless ``path``).

    A damaged database is moved aside at once with ``reset_damaged``; otherwise, when the app
    can ``ask``, it comes back as DamagedChatHistory for the app to ask about; otherwise
    DamagedChatStoreError is raised, naming the file and the flag that moves it. ChatStoreError
    (a folder in its place, no permission) is raised as it is: moving would not help.
    """
    try:
        return ChatStore(path)
    except DamagedChatStoreError as exc:
        damaged = DamagedChatHistory(exc)
    if reset_damaged:
        store = damaged.recover()
        log.warning("moved the damaged chat history %s (%s) aside to %s; starting an empty one",
                    damaged.path, damaged.error.reason, damaged.aside)
        return store
    if ask:
        return damaged
    raise _refused(damaged)


def _refused(damaged: DamagedChatHistory) -> DamagedChatStoreError:
    return DamagedChatStoreError(damaged.path, damaged.error.reason, hint=RESET_HINT)


def _keeping_history(save: Any, history: str) -> Any:
    """``save``, writing ``history`` whatever the settings it is given hold."""
    def write(settings: Any) -> Any:
        return save(replace(settings, history=history))

    return write


def open_tui(spec: EngineSpec | None = None, *, url: str | None = None,
             api_key: str | None = None, reset_damaged_chats: bool = False,
             history_setting: str | None = None) -> int:
    """Open the chat app, loading ``spec`` (or connecting to ``url``) first when given.

    Raises LocalspecError for a malformed config file or a chat history that cannot be used
    (the CLI prints it). A damaged chat history is moved aside with ``reset_damaged_chats``,
    else the app asks first; declining raises DamagedChatStoreError once the app has closed.
    Everything else that goes wrong once the app is running is shown inside the app.
    """
    from ..config import load_settings, save_settings

    settings = load_settings()
    save: Any = save_settings
    if history_setting is not None:
        # --history for this session only: what the app saves keeps config.toml's own value.
        save = _keeping_history(save_settings, settings.history)
        settings = replace(settings, history=history_setting)
    # Before the heavy imports below: a chat history that cannot be used fails in a blink.
    history = open_chat_store(reset_damaged=reset_damaged_chats, ask=can_ask())
    if not can_ask():  # else Textual fails on a closed stdin, or draws into a file for ever
        raise LocalspecError("the chat app needs a terminal (stdin and stderr on one); to "
                             "answer one prompt without it: localspec run PAIR \"PROMPT\"")

    from ..engine.llama_backend import route_llama_logs_to_logging
    from ..models.library import DefaultLibrary
    from ..monitor import SystemMonitor
    from .app import LocalspecApp

    factory: Any
    if url is not None:
        factory, spec = remote_factory(url, api_key)
    else:
        from .. import paths
        from ..open_engine import open_chat_engine

        def factory(engine_spec: EngineSpec) -> Any:
            # A serve of the same pair if one runs, else a private engine process: a native
            # crash there is one line in the chat and a restart, not the end of the app.
            return open_chat_engine(engine_spec, log_file=paths.cache_dir() / "engine.log")
    # llama.cpp writes to stderr (which Textual draws on) unless its log goes to `logging`.
    route_llama_logs_to_logging()
    try:
        with _logs_to_file():
            app = LocalspecApp(factory, SystemMonitor(), history, DefaultLibrary(), settings,
                               save_settings=save, spec=spec)
            result = app.run()
    finally:
        store = history.store if isinstance(history, DamagedChatHistory) else history
        if store is not None:
            store.close()
    if isinstance(history, DamagedChatHistory) and history.store is None:
        raise _refused(history)  # declined (or quit) in the app: the file is where it was
    return int(result or 0)
