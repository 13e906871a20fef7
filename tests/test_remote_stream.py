"""The remote client's streams: cancel ends one at once whatever the server is doing (Esc in the
chat app), and a request the server did not take is told apart from one that failed."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localspec.chat_engine import ChatOptions, EngineNotReadyError, EngineUnreachableError
from localspec.engine import Finished, ModelSettings, SamplingParams, SpeculativeEngine, TextChunk
from localspec.errors import ContextOverflowError
from localspec.remote import RemoteEngine, RemoteError
from localspec.server import ServerConfig
from localspec.server.app import create_app
from localspec.server.running import BackgroundServer

HELLO = [{"role": "user", "content": "hello"}]
LONG = ChatOptions(max_tokens=4000, sampling=SamplingParams(temperature=1.0, seed=5))


@pytest.fixture(scope="module")
def served(target_gguf: Path, draft_gguf: Path) -> Iterator[tuple[BackgroundServer, Any]]:
    engine = SpeculativeEngine.load(target_gguf, draft_gguf,
                                    ModelSettings(n_ctx=4096, n_threads=1))
    app = create_app(engine, ServerConfig(model_id="tiny", queue_size=4))
    server = BackgroundServer(app).start()
    try:
        yield server, app.state.localspec
    finally:
        server.stop()
        engine.close()


def _stream_in_thread(remote: RemoteEngine, options: ChatOptions,
                      cancel: threading.Event | None = None,
                      completion: bool = False) -> tuple[threading.Thread, list[Any]]:
    events: list[Any] = []

    def run() -> None:
        try:
            events.extend(remote.stream_completion("the", options, cancel) if completion
                          else remote.stream_chat(HELLO, options, cancel))
        except Exception as exc:  # noqa: BLE001 - recorded for the test to look at
            events.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, events


def test_cancel_before_the_first_line_ends_the_stream_at_once(
        served: tuple[BackgroundServer, Any]) -> None:
    """A request whose prompt is not being answered yet (here: queued behind a long answer, as
    behind a slow prefill the client sees nothing either) stops when cancelled, not when its
    first line arrives; the server drops it. (A plain completion: its stream sends nothing
    before the first token, where a chat's sends the assistant's role at once.)"""
    server, state = served
    with RemoteEngine(server.url) as first, RemoteEngine(server.url) as second:
        first.resolved_model(), second.resolved_model()
        long_thread, long_events = _stream_in_thread(first, LONG)
        deadline = time.monotonic() + 30
        while not state.worker.busy:
            assert time.monotonic() < deadline, "the long answer did not start"
            time.sleep(0.005)
        cancel = threading.Event()
        waiting, events = _stream_in_thread(second, ChatOptions(max_tokens=8), cancel,
                                            completion=True)
        while state.worker.queued < 1:
            assert time.monotonic() < deadline, "the second request was not queued"
            time.sleep(0.005)
        cancel.set()
        waiting.join(30)
        assert not waiting.is_alive()
        # Returned while the answer ahead of it was still being generated: it did not wait for
        # a line that would only come once that answer was done.
        assert long_thread.is_alive()
        assert not any(isinstance(e, Finished) for e in long_events)
        assert len(events) == 1 and isinstance(events[0], Finished), events
        assert events[0].finish_reason == "cancelled" and events[0].text == ""
        long_thread.join(120)
    assert isinstance(long_events[-1], Finished) and long_events[-1].finish_reason == "length"
    while state.worker.queued or state.worker.busy:  # the dropped request is not answered
        assert time.monotonic() < deadline + 120
        time.sleep(0.01)


def test_cancel_while_a_server_says_nothing(tmp_path: Path) -> None:
    """A server that accepts the connection and never answers (a hung one, or one still
    processing before it sends anything): cancel returns at once, even before the model list."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    cancel = threading.Event()
    try:
        with RemoteEngine(f"http://127.0.0.1:{listener.getsockname()[1]}") as remote:
            thread, events = _stream_in_thread(remote, ChatOptions(max_tokens=8), cancel)
            deadline = time.monotonic() + 30
            while not accepted:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            cancel.set()
            thread.join(30)
            assert not thread.is_alive()
            assert len(events) == 1 and isinstance(events[0], Finished)
            assert events[0].finish_reason == "cancelled"
    finally:
        for sock in accepted:
            sock.close()
        listener.close()


def test_cancel_mid_answer_reads_nothing_more(served: tuple[BackgroundServer, Any]) -> None:
    server, _state = served
    cancel = threading.Event()
    events: list[Any] = []
    with RemoteEngine(server.url) as remote:
        for event in remote.stream_chat(HELLO, LONG, cancel):
            events.append(event)
            if len(events) == 2:
                cancel.set()
        # The connection was shut, so the next request works on a fresh one.
        again = list(remote.stream_chat(HELLO, ChatOptions(max_tokens=4)))
    assert [type(e) for e in events] == [TextChunk, TextChunk, Finished]
    assert events[-1].finish_reason == "cancelled"
    assert isinstance(again[-1], Finished) and again[-1].stats.completion_tokens == 4


def test_not_taken_is_told_apart(served: tuple[BackgroundServer, Any], target_gguf: Path,
                                 draft_gguf: Path) -> None:
    """Nothing listening, or a 503 while the engine loads: not taken (send it again later). A
    prompt longer than the context: the engine's own error. Anything else: a RemoteError."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    with RemoteEngine(f"http://127.0.0.1:{port}") as remote:
        with pytest.raises(EngineUnreachableError, match="cannot reach") as unreachable:
            list(remote.stream_chat(HELLO, ChatOptions(max_tokens=2)))
        assert isinstance(unreachable.value, RemoteError)

    gate = threading.Event()

    def slow_load() -> SpeculativeEngine:
        gate.wait(60)
        return SpeculativeEngine.load(target_gguf, draft_gguf, ModelSettings(n_threads=1))

    loading = BackgroundServer(create_app(slow_load, ServerConfig(model_id="solo"))).start()
    try:
        with RemoteEngine(loading.url, model="solo") as remote:
            with pytest.raises(EngineNotReadyError) as not_ready:
                list(remote.stream_chat(HELLO, ChatOptions(max_tokens=2)))
            assert not isinstance(not_ready.value, EngineUnreachableError)
            assert not_ready.value.retry_after is not None and not_ready.value.retry_after > 0
            assert "503" in not_ready.value.message
    finally:
        gate.set()
        loading.stop()

    server, _state = served
    with RemoteEngine(server.url) as remote:
        with pytest.raises(ContextOverflowError):
            list(remote.stream_chat([{"role": "user", "content": "the " * 6000}],
                                    ChatOptions(max_tokens=2)))
        with pytest.raises(RemoteError) as other:
            list(remote.stream_chat(HELLO, ChatOptions(max_tokens=2,
                                                       sampling=SamplingParams(top_p=7.0))))
        assert not isinstance(other.value, (EngineNotReadyError, ContextOverflowError))
