"""The main screen: the conversation, the prompt, and the gauges beside them."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Header, ProgressBar, Static
from textual.worker import get_current_worker

from ...chat_engine import (
    ChatEngine,
    ChatEvent,
    ChatOptions,
    EngineNotReadyError,
    EngineUnreachableError,
)
from ...chat_engine import ChatMessage as Turn
from ...chat_store import ChatStore, StoredMessage
from ...engine import GenerationStats, TextChunk
from ...errors import ContextOverflowError, EngineStoppedError
from ...monitor import MachineSample
from ...options import Settings, sampling_params
from ...requests import draft_from_settings
from ..messages import (
    EngineNotReady,
    EngineStopped,
    GenerationFailed,
    GenerationFinished,
    GenerationWithdrawn,
    TokensArrived,
    WorkFailed,
)
from ..widgets.chat_message import ChatMessage
from ..widgets.machine_gauge import MachineGauge
from ..widgets.prompt import PromptBox
from ..widgets.rate_gauge import RateGauge, RateReading

log = logging.getLogger(__name__)
T = TypeVar("T")

# Streamed text is posted every BATCH_TOKENS chunks or BATCH_SECONDS, whichever comes first:
# one message per token would flood the event loop at a few hundred tokens/s.
BATCH_TOKENS = 8
BATCH_SECONDS = 0.03
# A request the engine did not take is sent again after the server's Retry-After, within these
# bounds: soon enough to answer as the engine is back, not so often as to busy a loading server.
RETRY_MIN_SECONDS = 0.25
RETRY_MAX_SECONDS = 2.0
# How long a message waits on an address where nothing listens with no restart under way: a
# crashed engine process can take seconds to be reaped (then the app restarts it); a server
# given with --url that is simply not there is reported after this.
UNREACHABLE_GIVE_UP_SECONDS = 10.0
WAITING_LINE = "engine restarting… the answer follows once it is back (Esc gives up)"


def stats_line(stats: GenerationStats, reason: str, k: int | None) -> str:
    """The line under each answer."""
    parts = [f"{stats.completion_tokens} tokens", f"{stats.tokens_per_second:.1f} tok/s"]
    if stats.drafted:
        parts += [f"acceptance {stats.acceptance_rate:.0%}",
                  f"mean accepted {stats.mean_accepted_length:.2f}"]
    parts.append(f"K {k}" if k is not None else f"K auto (mean {stats.mean_k:.1f})")
    parts.append(f"TTFT {stats.ttft_seconds * 1000:.0f} ms")
    if reason == "cancelled":
        parts.append("stopped")
    line = " · ".join(parts)
    # Why the engine drafted as it did (auto's reasoning from this machine's measured costs).
    return f"{line}\n{stats.policy}" if stats.policy else line


class ChatScreen(Screen[None]):
    """Chat with the loaded pair. The app sets ``engine``, ``store``, ``settings``, ``pair_name``
    and ``pair_label`` (data flows down); errors go up as WorkFailed messages."""

    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+y", "copy_answer", "Copy"),
        Binding("ctrl+t", "toggle_drafted", "Drafted"),
    ]

    engine: reactive[ChatEngine | None] = reactive(None)
    pair_label: reactive[str] = reactive("no pair loaded — F2 to pick one")
    show_drafted: reactive[bool] = reactive(False)

    def __init__(self, settings: Settings) -> None:
        super().__init__(id="chat-screen")
        # Set by the app (data flows down): the chat history once it is open, the settings,
        # and the loaded pair's name.
        self.store: ChatStore | None = None
        self.settings = settings
        self.pair_name: str | None = None
        self.chat_id: int | None = None
        self.generation = 0
        self.generating = False
        self._streaming: ChatMessage | None = None
        self._stream_started = 0.0
        self._stream_tokens = 0
        self._stream_drafted = 0
        self._last_reading = RateReading()
        self._k: int | None = None
        self.idle = threading.Event()  # set while no generation worker is using the engine
        self.idle.set()
        # The last generation started: its worker sets ``idle`` when it ends. Not
        # ``generation``, which also moves when a chat is left mid-answer (so that the
        # abandoned answer's late messages are dropped): that worker still holds the engine.
        self._started = 0
        # Cleared by the app while the engine restarts: a message sent meanwhile waits for it.
        self.engine_ready = threading.Event()
        self.engine_ready.set()
        self._asked: ChatMessage | None = None  # the user message being answered

    def _history(self) -> ChatStore:
        assert self.store is not None, "the app opens the chat history before any chat"
        return self.store

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat-column"):
                yield VerticalScroll(id="conversation")
                yield PromptBox(placeholder="Message (Enter sends · Shift+Enter or Ctrl+J: "
                                            "new line)", id="prompt")
            with Vertical(id="sidebar"):
                yield Static("Pair", classes="panel-title")
                yield Static(self.pair_label, id="pair-label")
                loading = ProgressBar(total=None, show_eta=False, show_percentage=False,
                                      id="loading")
                loading.display = False
                yield loading
                yield Static("Machine", classes="panel-title")
                yield MachineGauge(id="machine")
                yield Static("Token rate", classes="panel-title")
                yield RateGauge(id="rate")
        yield Footer()

    def on_mount(self) -> None:
        self.prompt_box.focus()

    @property
    def prompt_box(self) -> PromptBox:
        return self.query_one("#prompt", PromptBox)

    # -- attributes set by the app ------------------------------------------------------------
    def watch_pair_label(self, label: str) -> None:
        if self.is_mounted:
            self.query_one("#pair-label", Static).update(label)

    def show_loading(self, label: str | None) -> None:
        """Show (label) or hide (None) the loading indicator."""
        self.query_one("#loading", ProgressBar).display = label is not None
        if label is not None:
            self.pair_label = label

    def show_placement(self, placement: str | None) -> None:
        """Where the loaded pair's layers went, under the VRAM gauge."""
        gauges = self.query(MachineGauge)
        if gauges:
            gauges.first().placement = placement

    def show_sample(self, sample: MachineSample) -> None:
        gauges = self.query(MachineGauge)
        if not gauges:  # composing, or torn down while quitting
            return
        gauges.first().sample = sample
        if self.generating:
            self.query_one(RateGauge).push(self._live_rate() or 0.0)

    def set_plain_rate(self, rate: float | None) -> None:
        from dataclasses import replace

        self._set_reading(replace(self._last_reading, plain_tokens_per_second=rate))

    def _set_reading(self, reading: RateReading) -> None:
        self._last_reading = reading
        self.query_one(RateGauge).reading = reading

    # -- conversation -------------------------------------------------------------------------
    def _messages(self) -> list[ChatMessage]:
        return list(self.query(ChatMessage))

    def unanswered(self) -> bool:
        """Whether the conversation ends with a message that has no answer."""
        msgs = self._messages()
        return bool(msgs) and msgs[-1].role == "user" and not self.generating

    async def open_chat(self, chat_id: int | None) -> None:
        """Show a stored chat (None: a new, empty one)."""
        if self.generating:  # stop it; its late messages no longer match self.generation
            self.action_stop()
            self.generation += 1
            self.generating = False
        conv = self.query_one("#conversation", VerticalScroll)
        await conv.remove_children()
        self.chat_id = chat_id
        self._streaming = None
        if chat_id is None:
            return
        widgets = []
        for m in self._history().messages(chat_id):
            line = m.stats.get("line") if m.stats else None
            w = ChatMessage(m.role, m.content, m.spans, line, self.show_drafted)
            w.message_id = m.id  # type: ignore[attr-defined]
            widgets.append(w)
        await conv.mount_all(widgets)
        conv.scroll_end(animate=False)

    @on(PromptBox.Submitted, "#prompt")
    async def send(self, event: PromptBox.Submitted) -> None:
        text = event.text.strip()
        if not text:
            return
        if self.engine is None:
            self.notify("Load a pair first (F2).", severity="warning")
            return
        if self.generating:
            self.notify("Still answering — Esc stops it.", severity="warning")
            return
        # Stored first, and the box emptied only once it is: a write that fails (a full disk)
        # leaves the message where the user typed it.
        stored = self._store_or_say("Not sent",
                                    lambda store: self._store_user_message(store, text),
                                    kept_in_box=True)
        if stored is None:
            return
        event.prompt_box.take(event.text)
        msg = ChatMessage("user", text)
        msg.message_id = stored.id  # type: ignore[attr-defined]
        await self.query_one("#conversation").mount(msg)
        await self._start_generation()

    def _store_user_message(self, store: ChatStore, text: str) -> StoredMessage:
        if self.chat_id is None:
            chat = store.create_chat(text[:48], self.pair_name, self.settings.system_prompt)
            self.chat_id = chat.id
        return store.add_message(self.chat_id, "user", text)

    def _store_or_say(self, what: str, write: Callable[[ChatStore], T],
                      kept_in_box: bool = False) -> T | None:
        """``write(store)``, or None and one line in the conversation when the chat history
        cannot be written (SQLite's reason: "database or disk is full", "readonly database")."""
        try:
            return write(self._history())
        except sqlite3.Error as exc:
            log.error("chat history write failed: %s", exc)
            kept = " (your message is still in the box)" if kept_in_box else ""
            self.add_notice(f"{what}: the chat history cannot be written: {exc}{kept}")
            return None

    def _delete_stored(self, what: str, message_id: int) -> bool:
        def delete(store: ChatStore) -> bool:
            store.delete_message(message_id)
            return True

        return self._store_or_say(what, delete) is not None

    async def _start_generation(self) -> None:
        settings = self.settings
        history: list[Turn] = []
        if settings.system_prompt:
            history.append({"role": "system", "content": settings.system_prompt})
        history += [{"role": m.role, "content": m.text} for m in self._messages()]
        asked = self._messages()
        self._asked = asked[-1] if asked and asked[-1].role == "user" else None
        answer = ChatMessage("assistant", show_drafted=self.show_drafted)
        conv = self.query_one("#conversation", VerticalScroll)
        await conv.mount(answer)
        if not self.engine_ready.is_set():
            answer.set_stats(WAITING_LINE)
        conv.scroll_end(animate=False)
        self._streaming = answer
        self.generation += 1
        self.generating = True
        self._stream_started = 0.0
        self._stream_tokens = self._stream_drafted = 0
        assert self.engine is not None
        draft = draft_from_settings(settings)  # the engine fits it to the models it holds
        self._k = draft.k
        options = ChatOptions(max_tokens=settings.max_tokens, sampling=sampling_params(settings),
                              draft=draft)
        # In this order: an abandoned answer's worker that ends in between must not find
        # itself the last one started and set ``idle`` under the new one.
        self._started = self.generation
        self.idle.clear()
        self._set_reading(RateReading(generating=True,
                                      plain_tokens_per_second=self._last_reading
                                      .plain_tokens_per_second))
        self.generate(self.engine, history, options, self.generation)

    @work(thread=True, exclusive=True, group="generate", exit_on_error=False)
    def generate(self, engine: ChatEngine, history: list[Turn], options: ChatOptions,
                 generation: int) -> None:
        """Render the chat, stream the answer, post it in batches. Runs in a thread."""
        worker = get_current_worker()
        try:
            events = self._when_taken(engine, history, options, generation,
                                      worker.cancelled_event)
            if events is None:
                self.post_message(GenerationWithdrawn(generation, "given up before the engine "
                                                                  "was back"))
                return
            batch: list[TextChunk] = []
            last = time.monotonic()
            for event in events:
                if not isinstance(event, TextChunk):  # Finished (or a remote engine's kind)
                    if batch:
                        self.post_message(TokensArrived(generation, tuple(batch)))
                    self.post_message(GenerationFinished(generation, event))
                    return
                batch.append(event)
                now = time.monotonic()
                if len(batch) >= BATCH_TOKENS or now - last >= BATCH_SECONDS:
                    self.post_message(TokensArrived(generation, tuple(batch)))
                    batch, last = [], now
        except Exception as exc:
            self.post_message(GenerationFailed(generation, exc))
        finally:
            if generation == self._started:  # a newer generation may already hold the engine
                self.idle.set()

    def _when_taken(self, engine: ChatEngine, history: list[Turn], options: ChatOptions,
                    generation: int, cancel: threading.Event) -> Iterator[ChatEvent] | None:
        """The answer's events once the engine has taken the request: while it restarts (or
        its server's engine does), the request waits and is sent again. None if cancelled
        first. Runs in the generation's thread."""
        unreachable_since: float | None = None
        while True:
            if not self.engine_ready.is_set():
                unreachable_since = None  # a restart is under way: it decides
                while not self.engine_ready.wait(0.05):
                    if cancel.is_set():
                        return None
            if cancel.is_set():
                return None
            events = iter(engine.stream_chat(history, options, cancel))
            try:
                first = next(events)
            except StopIteration:
                return iter(())
            except EngineNotReadyError as exc:
                now = time.monotonic()
                if isinstance(exc, EngineUnreachableError):
                    unreachable_since = unreachable_since or now
                    if now - unreachable_since > UNREACHABLE_GIVE_UP_SECONDS:
                        raise
                self.post_message(EngineNotReady(generation, exc.message))
                delay = min(max(exc.retry_after or 0.0, RETRY_MIN_SECONDS), RETRY_MAX_SECONDS)
                if cancel.wait(delay):
                    return None
                continue
            return _chain(first, events)

    def _live_rate(self) -> float | None:
        if not self._stream_started:
            return None
        dt = time.monotonic() - self._stream_started
        return self._stream_tokens / dt if dt > 0.05 else None

    async def on_tokens_arrived(self, message: TokensArrived) -> None:
        if message.generation != self.generation or self._streaming is None:
            return
        if not self._stream_started:
            self._stream_started = time.monotonic()
            self._streaming.set_stats(None)  # no longer waiting for the engine, if it was
        self._stream_tokens += len(message.chunks)
        self._stream_drafted += sum(c.drafted for c in message.chunks)
        await self._streaming.append(message.chunks)
        conv = self.query_one("#conversation", VerticalScroll)
        if conv.max_scroll_y - conv.scroll_y < 3 * conv.size.height:
            conv.scroll_end(animate=False)
        self._set_reading(RateReading(
            tokens_per_second=self._live_rate(),
            acceptance=(self._stream_drafted / self._stream_tokens
                        if self._stream_tokens else None),
            draft_share=self._last_reading.draft_share,
            plain_tokens_per_second=self._last_reading.plain_tokens_per_second,
            generating=True))

    def on_generation_finished(self, message: GenerationFinished) -> None:
        if message.generation != self.generation or self._streaming is None:
            return
        fin, answer = message.finished, self._streaming
        self.generating = False
        self._streaming = None
        st = fin.stats
        line = stats_line(st, fin.finish_reason, self._k)
        answer.set_stats(line)
        if self.chat_id is not None:
            chat_id = self.chat_id
            stats = {**st.to_json(), "line": line, "finish_reason": fin.finish_reason}
            stored = self._store_or_say("The answer is shown but not saved", lambda store:
                                        store.add_message(chat_id, "assistant", answer.text,
                                                          answer.spans, stats))
            if stored is not None:
                answer.message_id = stored.id  # type: ignore[attr-defined]
        timed = st.draft_seconds + st.verify_seconds
        plain = self._last_reading.plain_tokens_per_second
        if st.drafted == 0 and st.lookup_rounds == 0 and self.settings.draft_mode == "none":
            # An answer without drafting is a measurement of plain decoding on this pair.
            measured = st.decode_tokens_per_second or st.tokens_per_second
            # An answer of no tokens (the end came first) measured nothing.
            plain = measured if measured > 0 else plain
            if self.pair_name and measured > 0:
                try:
                    self._history().record_rate(self.pair_name, "plain", measured)
                except sqlite3.Error as exc:  # a measurement, not the user's words: log it
                    log.warning("cannot record the plain rate: %s", exc)
        self._set_reading(RateReading(
            tokens_per_second=st.decode_tokens_per_second or st.tokens_per_second,
            acceptance=st.acceptance_rate if st.drafted else None,
            draft_share=st.draft_seconds / timed if timed > 0 else None,
            plain_tokens_per_second=plain, generating=False))

    def on_engine_not_ready(self, message: EngineNotReady) -> None:
        # The worker waits and sends again; the message goes on up to the app, which restarts
        # the engine if it has stopped.
        if message.generation == self.generation and self._streaming is not None:
            self._streaming.set_stats(f"{WAITING_LINE}\n{message.reason}")

    async def on_generation_withdrawn(self, message: GenerationWithdrawn) -> None:
        if message.generation != self.generation:
            return
        await self._end_unanswered()
        self.add_notice(f"Not answered: {message.why} (Ctrl+R asks again)")

    async def _end_unanswered(self) -> None:
        self.generating = False
        if self._streaming is not None:
            await self._streaming.remove()
            self._streaming = None
        self._set_reading(RateReading(
            plain_tokens_per_second=self._last_reading.plain_tokens_per_second))

    async def on_generation_failed(self, message: GenerationFailed) -> None:
        if message.generation != self.generation:
            return
        await self._end_unanswered()
        if isinstance(message.error, ContextOverflowError):
            await self._take_back()
        if isinstance(message.error, EngineStoppedError):
            # The conversation stays; the app says what happened in one line and restarts.
            self.post_message(EngineStopped(message.error.message))
            return
        self.post_message(WorkFailed(message.error))

    async def _take_back(self) -> None:
        """A message the engine can never answer (longer than its context) goes back into the
        box, where it can be shortened, instead of staying in every later prompt."""
        asked, self._asked = self._asked, None
        box = self.prompt_box
        if asked is None or not asked.is_attached or box.text.strip():
            return  # gone already, or the user has typed something new meanwhile
        mid = getattr(asked, "message_id", None)
        if mid is not None and not self._delete_stored("Kept in the conversation", mid):
            return
        await asked.remove()
        box.load_text(asked.text)
        box.move_cursor(box.document.end)

    def add_notice(self, text: str) -> None:
        """One line in the conversation that is not part of it (not stored, not sent)."""
        conv = self.query_one("#conversation", VerticalScroll)
        conv.mount(Static(text, classes="notice", markup=False))
        conv.scroll_end(animate=False)

    # -- actions ------------------------------------------------------------------------------
    def action_stop(self) -> None:
        """Esc: stop the answer being generated (the engine stops between steps)."""
        if self.generating:
            self.workers.cancel_group(self, "generate")

    async def action_regenerate(self) -> None:
        if self.generating or self.engine is None:
            return
        msgs = self._messages()
        if not msgs:
            return
        last = msgs[-1]
        if last.role == "assistant":
            mid = getattr(last, "message_id", None)
            if mid is not None and not self._delete_stored("Not regenerated", mid):
                return
            await last.remove()
        await self._start_generation()

    async def action_new_chat(self) -> None:
        await self.open_chat(None)
        self.prompt_box.focus()

    def action_copy_answer(self) -> None:
        answers = [m for m in self._messages() if m.role == "assistant"]
        if not answers:
            self.notify("Nothing to copy yet.")
            return
        self.app.copy_to_clipboard(answers[-1].text)
        self.notify("Answer copied to the clipboard.")

    async def action_toggle_drafted(self) -> None:
        self.show_drafted = not self.show_drafted
        for m in self._messages():
            await m.set_show_drafted(self.show_drafted)
        self.notify("Drafted text highlighted (green: accepted from the draft)"
                    if self.show_drafted else "Markdown view")


def _chain(first: ChatEvent, rest: Iterator[ChatEvent]) -> Iterator[ChatEvent]:
    yield first
    yield from rest
