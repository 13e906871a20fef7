"""The localspec Textual app: composition of collaborators, screens and workers; no I/O itself.

Everything that touches a model, a file or the network comes in through the constructor (the
engine factory, the monitor, the chat store, the model library, the settings and how to save
them), so tests drive the app with the real engine on tiny models and fakes for the rest.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen
from textual.worker import get_current_worker

from .. import paths
from ..chat_engine import ChatEngine
from ..chat_store import ChatStore, DamagedChatHistory
from ..errors import LocalspecError
from ..loading import EngineSpec
from ..models.library import ModelLibrary, PairStatus
from ..monitor import MachineSample, Monitor
from ..options import Settings, model_settings
from .messages import (
    ChatDeleted,
    ChatHistoryMovedAside,
    ChatHistoryMoveFailed,
    EngineNotReady,
    EngineRestarted,
    EngineStopped,
    ModelLoaded,
    ModelLoadFailed,
    SampleTaken,
    WorkFailed,
)
from .screens.chat import ChatScreen
from .screens.dialogs import ConfirmScreen, ErrorScreen
from .screens.help import HelpScreen

EngineFactory = Callable[[EngineSpec], ChatEngine]


def describe_error(error: BaseException) -> tuple[str, str]:
    """(title, message) for an error shown in the app."""
    if isinstance(error, LocalspecError):
        return error.title, error.message
    if isinstance(error, MemoryError):
        return "Out of memory", "Not enough memory: try a smaller pair, fewer GPU layers or a " \
                                "smaller context."
    if isinstance(error, ValueError):
        return "Invalid setting", str(error)
    if isinstance(error, sqlite3.Error):  # SQLite's reason: "database is locked", "disk full"
        return "Chat history error", f"The chat history cannot be written: {error}"
    if isinstance(error, (ConnectionError, OSError)):
        return "System error", f"{type(error).__name__}: {error}"
    return "Unexpected error", f"{type(error).__name__}: {error}"


class LocalspecApp(App[int]):
    """Chat with a speculative pair, with the machine's state in view."""

    CSS_PATH = "localspec.tcss"
    TITLE = "localspec"
    BINDINGS = [
        Binding("f1", "help", "Help"),
        Binding("f2", "pairs", "Pairs"),
        Binding("f3", "models", "Models"),
        Binding("f4", "settings", "Settings"),
        Binding("f5", "chats", "Chats"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, engine_factory: EngineFactory, monitor: Monitor,
                 store: ChatStore | DamagedChatHistory, library: ModelLibrary,
                 settings: Settings, *,
                 save_settings: Callable[[Settings], Any] | None = None,
                 spec: EngineSpec | None = None, export_dir: Path | None = None,
                 sample_interval: float = 0.5) -> None:
        super().__init__()
        self.engine_factory = engine_factory
        self.monitor = monitor
        # A damaged history is resolved through a question before anything reads the store
        # (see "damaged chat history" below); ``store`` is set once it is.
        self.chat = ChatScreen(settings)
        self._store: ChatStore | None = None
        self.damaged_history: DamagedChatHistory | None = None
        if isinstance(store, DamagedChatHistory):
            self.damaged_history = store
            self.use_command_palette = False  # a priority key: it would reach saved chats
        else:
            self.store = store
        self.library = library
        self._settings = settings
        self._save_settings = save_settings
        self.initial_spec = spec
        self.export_dir = export_dir
        self.sample_interval = sample_interval
        self.engine: ChatEngine | None = None
        self._restarting = False
        self.spec: EngineSpec | None = None
        self.last_sample: MachineSample | None = None

    # -- what the chat screen is given (data flows down) ----------------------------------------
    @property
    def store(self) -> ChatStore:
        assert self._store is not None, "the chat history is not open yet"
        return self._store

    @store.setter
    def store(self, store: ChatStore) -> None:
        self._store = store
        self.chat.store = store

    @property
    def settings(self) -> Settings:
        return self._settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        self._settings = settings
        self.chat.settings = settings

    @property
    def pair_name(self) -> str | None:
        return self.spec.display_name if self.spec is not None else None

    def get_default_screen(self) -> Screen[Any]:
        return self.chat

    def on_mount(self) -> None:
        # After the first refresh the chat screen is composed, so its gauges can take data.
        self.call_after_refresh(self._start)

    def _start(self) -> None:
        if self._exit:  # quit before the first refresh: a worker started now is never cancelled
            return      # and its thread keeps the process alive after the app has closed
        self.watch_machine()
        if self.damaged_history is not None:
            self._ask_about_damaged_history(self.damaged_history)
        elif self.initial_spec is not None:
            self.load(self.initial_spec)

    # -- damaged chat history -----------------------------------------------------------------
    # Nothing uses the store until the user agrees to move the damaged file aside; the gauges
    # run meanwhile, and the first pair loads once the new store is in hand.
    def _ask_about_damaged_history(self, damaged: DamagedChatHistory) -> None:
        question = (f"{damaged.path} is damaged ({damaged.error.reason}). Move it aside to "
                    f"{damaged.aside} and start with an empty chat history?")

        def answered(move: bool | None) -> None:
            if move:
                self._move_history_aside(damaged)
            else:
                self.exit(1)  # the file stays; open_tui reports it once the app has closed

        self.push_screen(ConfirmScreen(question, title=damaged.error.title,
                                       yes="Move aside and continue", no="Quit"), answered)

    @work(thread=True, exclusive=True, group="chat-history", exit_on_error=False)
    def _move_history_aside(self, damaged: DamagedChatHistory) -> None:
        try:
            store = damaged.recover()
        except Exception as exc:  # shown in the app, then the question again
            self.post_message(ChatHistoryMoveFailed(exc))
            return
        self.post_message(ChatHistoryMovedAside(store, damaged.aside))

    def on_chat_history_moved_aside(self, message: ChatHistoryMovedAside) -> None:
        self.store = message.store
        self.damaged_history = None
        self.use_command_palette = self.ENABLE_COMMAND_PALETTE
        self.notify(f"Damaged chat history moved to {message.aside}")
        if self.initial_spec is not None:
            self.load(self.initial_spec)

    def on_chat_history_move_failed(self, message: ChatHistoryMoveFailed) -> None:
        damaged = self.damaged_history

        def dismissed(_: None) -> None:
            if damaged is not None:  # ask again: the user may have fixed it, or wants to quit
                self._ask_about_damaged_history(damaged)

        self.push_screen(ErrorScreen(*describe_error(message.error)), dismissed)

    # -- machine gauges -----------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="monitor", exit_on_error=False)
    def watch_machine(self) -> None:
        """Sample the machine every ``sample_interval`` seconds until the app exits."""
        worker = get_current_worker()
        while not worker.is_cancelled:
            # The models live in the engine's process (a restart makes a new one), not here.
            engine = self.engine
            self.monitor.watch(engine.model_pid if engine is not None else None)
            self.post_message(SampleTaken(self.monitor.sample()))
            worker.cancelled_event.wait(self.sample_interval)

    def on_sample_taken(self, message: SampleTaken) -> None:
        self.last_sample = message.sample
        if self.chat.is_mounted and not self._exit:  # samples may still arrive while quitting
            self.chat.show_sample(message.sample)
        # An engine process can die between answers too: notice it within a sample or two.
        if self.engine is not None and not self._restarting and not self.chat.generating:
            reason = self.engine.stopped()
            if reason is not None:
                self.post_message(EngineStopped(reason))

    # -- an engine process that died -----------------------------------------------------------
    # A message sent meanwhile waits for the engine (ChatScreen.engine_ready) and is answered
    # once it is back; one that the dead engine did not take is sent again.
    def on_engine_stopped(self, message: EngineStopped) -> None:
        """One line in the chat, the conversation kept, a new engine process started."""
        self._begin_restart(message.reason)

    def on_engine_not_ready(self, message: EngineNotReady) -> None:
        # The request waits either way; only an engine that has stopped needs restarting (a
        # server's own engine coming back, or one still loading, needs nothing from here).
        if self._restarting or self.engine is None:
            return
        reason = self.engine.stopped()
        if reason is not None:
            self._begin_restart(reason)

    def _begin_restart(self, reason: str) -> None:
        if self._restarting or self.engine is None:
            return
        self._restarting = True
        self.chat.engine_ready.clear()
        self.chat.add_notice(f"{reason}; restarting")
        self.chat.show_loading("restarting the engine…")
        self._restart(self.engine)

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _restart(self, engine: ChatEngine) -> None:
        try:
            engine.restart()
        except Exception as exc:  # shown in the app, never as a traceback
            self.post_message(EngineRestarted(exc))
            return
        self.post_message(EngineRestarted())

    def on_engine_restarted(self, message: EngineRestarted) -> None:
        self._restarting = False
        self.chat.show_loading(None)
        if self.spec is not None:
            self.chat.pair_label = _pair_label(self.spec)
        waiting = self.chat.generating
        if message.error is not None:
            # A waiting message gives up first (it stays in the conversation): sent again to
            # a dead engine it would start the next restart, and the next error, by itself.
            self.chat.action_stop()
            self.chat.engine_ready.set()
            self.show_error(message.error)
            return
        self.chat.engine_ready.set()
        if waiting:
            self.notify("Engine restarted: answering your message.")
        else:
            self.notify("Engine restarted: Ctrl+R asks again." if self.chat.unanswered()
                        else "Engine restarted.")

    def free_memory(self) -> tuple[int | None, str]:
        """Memory free for models by the latest sample (VRAM, else RAM), and which it is."""
        sample = self.last_sample
        return sample.free_memory_for_models() if sample else (None, "memory")

    # -- loading ------------------------------------------------------------------------------
    def spec_for_pair(self, pair: PairStatus) -> EngineSpec:
        target, draft = model_settings(self.settings)
        # The settings' lookup or none overrides the pair's choice; model follows the pair.
        mode = pair.draft_mode if self.settings.draft_mode == "model" else \
            self.settings.draft_mode
        from ..history import scope_for  # deferred: the engine's modules load with an engine

        return EngineSpec(target=pair.target, draft=pair.draft, target_settings=target,
                          draft_settings=draft, pair_name=pair.name, draft_mode=mode,
                          history=scope_for("chat", self.settings))

    def load(self, spec: EngineSpec) -> None:
        """Load a pair in a worker; the chat keeps working with the old one until it is ready."""
        self.chat.show_loading(f"loading {spec.display_name}…")
        self._load(spec)

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _load(self, spec: EngineSpec) -> None:
        t0 = time.perf_counter()
        try:
            engine = self.engine_factory(spec)
        except Exception as exc:  # shown in the app, never as a traceback
            self.post_message(ModelLoadFailed(spec, exc))
            return
        try:
            _ = engine.info  # a server is asked here, not by the chat screen's event loop
        except Exception as exc:
            _close(engine)
            self.post_message(ModelLoadFailed(spec, exc))
            return
        self.post_message(ModelLoaded(engine, spec, time.perf_counter() - t0))

    def on_model_loaded(self, message: ModelLoaded) -> None:
        old = self.engine
        if self.chat.generating:
            self.chat.action_stop()
        self.engine, self.spec = message.engine, message.spec
        self.chat.engine = message.engine
        self.chat.pair_name = message.spec.display_name
        self.chat.show_loading(None)
        self.chat.pair_label = _pair_label(message.spec)
        # info was read in the loading worker (a server's is cached since), so this never waits.
        self.chat.show_placement(message.engine.info.placement)
        self.chat.set_plain_rate(self.store.latest_rate(message.spec.display_name, "plain"))
        self.sub_title = message.spec.display_name
        self.notify(f"{message.spec.display_name} loaded in {message.seconds:.1f}s")
        if old is not None:
            self._close_engine(old)
        if message.spec.pair_name and message.spec.pair_name != self.settings.last_pair:
            from dataclasses import replace

            self.apply_settings(replace(self.settings, last_pair=message.spec.pair_name),
                                quiet=True)

    def on_model_load_failed(self, message: ModelLoadFailed) -> None:
        self.chat.show_loading(None)
        self.chat.pair_label = (_pair_label(self.spec) if self.spec is not None
                                else "no pair loaded — F2 to pick one")
        self.show_error(message.error)

    @work(thread=True, group="close", exit_on_error=False)
    def _close_engine(self, engine: ChatEngine) -> None:
        # A cancelled generation leaves the engine within a step; free it only after that.
        self.chat.idle.wait(30)
        _close(engine)

    # -- settings -----------------------------------------------------------------------------
    def apply_settings(self, settings: Settings, quiet: bool = False) -> None:
        self.settings = settings
        if self._save_settings is None:
            return
        try:
            where = self._save_settings(settings)
        except Exception as exc:
            self.show_error(exc)
            return
        if not quiet:
            self.notify(f"Settings saved to {where}" if where else "Settings saved")

    # -- errors -------------------------------------------------------------------------------
    def show_error(self, error: BaseException) -> None:
        title, message = describe_error(error)
        self.push_screen(ErrorScreen(title, message))

    def on_work_failed(self, message: WorkFailed) -> None:
        self.show_error(message.error)  # posted by a screen, bubbled up to here

    # -- actions ------------------------------------------------------------------------------
    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_pairs(self) -> None:
        from .screens.pairs import PairPickerScreen

        def chosen(pair: PairStatus | None) -> None:
            if pair is None:
                return
            try:  # config.toml is read again here, and may have been edited since
                spec = self.spec_for_pair(pair)
            except LocalspecError as exc:
                self.show_error(exc)
                return
            self.load(spec)

        self.push_screen(PairPickerScreen(self.library, self.spec_for_pair, self.free_memory),
                         chosen)

    def action_models(self) -> None:
        from .screens.models import ModelManagerScreen

        # One screen for the app's life, installed: leaving it (Esc) keeps a pull running and
        # the name typed in its box, where a new screen each time dropped both.
        if not self.is_screen_installed("models"):
            self.install_screen(ModelManagerScreen(self.library), "models")
        self.push_screen("models")

    def action_settings(self) -> None:
        from .screens.settings import SettingsScreen

        def saved(settings: Settings | None) -> None:
            if settings is not None:
                self.apply_settings(settings)

        self.push_screen(SettingsScreen(self.settings), saved)

    def action_chats(self) -> None:
        from .screens.chats import ChatListScreen

        async def chosen(chat_id: int | None) -> None:
            if chat_id is not None:
                await self.chat.open_chat(chat_id)

        export_dir = self.export_dir or paths.data_dir() / "exports"
        self.push_screen(ChatListScreen(self.store, export_dir), chosen)

    async def on_chat_deleted(self, message: ChatDeleted) -> None:
        if self.chat.chat_id == message.chat_id:  # the chat on screen is gone: start afresh
            await self.chat.open_chat(None)

    async def action_quit(self) -> None:
        # Cancel first: a generation stops between steps, a pull at its next chunk, and the app
        # then exits without waiting for either to run to the end.
        self.workers.cancel_all()
        self.exit(0)

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Pick a pair", "Load a catalogue or user pair", self.action_pairs)
        yield SystemCommand("Model manager", "Local Ollama models: pull, delete, inspect",
                            self.action_models)
        yield SystemCommand("Settings", "Draft mode, sampling, GPU layers, context, threads",
                            self.action_settings)
        yield SystemCommand("Saved chats", "Open, rename, delete or export chats",
                            self.action_chats)
        yield SystemCommand("New chat", "Start an empty conversation", self.chat.action_new_chat)
        yield SystemCommand("Regenerate", "Answer the last message again",
                            self.chat.action_regenerate)
        yield SystemCommand("Copy answer", "Copy the last answer to the clipboard",
                            self.chat.action_copy_answer)
        yield SystemCommand("Toggle drafted text", "Mark text accepted from the draft model",
                            self.chat.action_toggle_drafted)
        yield SystemCommand("Help", "Keys and what the numbers mean", self.action_help)

    def on_unmount(self) -> None:
        self.monitor.close()
        if self.engine is not None:
            engine, self.engine = self.engine, None
            # A cancelled generation leaves the engine within a step; free it only after that
            # (freeing a llama.cpp context under a running decode would crash the process).
            if self.chat.idle.wait(10):
                _close(engine)


def _close(engine: ChatEngine) -> None:
    engine.close()


def _pair_label(spec: EngineSpec) -> str:
    draft = spec.draft if spec.draft and spec.draft_mode == "model" else f"({spec.draft_mode})"
    return f"{spec.display_name}\ntarget {Path(spec.target).name}\ndraft  {Path(draft).name}"
