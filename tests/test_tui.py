"""The TUI driven by Pilot with the real engine on tiny GGUF models; NVML and the registry faked."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from textual import events
from textual.app import App
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Input, Static

from localspec.chat_engine import LocalChatEngine
from localspec.chat_store import ChatStore, DamagedChatHistory
from localspec.config import load_settings, save_settings
from localspec.engine import ModelSettings
from localspec.errors import ModelLoadError
from localspec.loading import EngineSpec, load_engine
from localspec.models.library import PairStatus
from localspec.options import Settings
from localspec.tui import open_chat_store
from localspec.tui.app import LocalspecApp
from localspec.tui.messages import ChatDeleted, WorkFailed
from localspec.tui.screens.chats import ChatListScreen
from localspec.tui.screens.dialogs import ConfirmScreen, ErrorScreen
from localspec.tui.screens.pairs import PairPickerScreen
from localspec.tui.widgets.machine_gauge import MachineGauge
from tests.tui_fakes import FIXED_CPU_SAMPLE, FakeLibrary, FakeMonitor

SIZE = (120, 36)
pytestmark = pytest.mark.anyio  # anyio's pytest plugin (anyio comes with httpx) runs async tests


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def in_process(spec: EngineSpec) -> LocalChatEngine:
    """The engine in the test's own process (fast); the engine process has its own tests."""
    return LocalChatEngine(load_engine(spec), spec.display_name)


@pytest.fixture
def make_app(tmp_path: Path, target_gguf: Path, draft_gguf: Path
             ) -> Callable[..., LocalspecApp]:
    db = tmp_path / "chats.sqlite3"

    def make(settings: Settings | None = None, spec: EngineSpec | None = "tiny",  # type: ignore
             factory: Any = in_process, monitor: Any = None,
             library: Any = None,
             store: ChatStore | DamagedChatHistory | None = None) -> LocalspecApp:
        # One llama.cpp thread: on a loaded 2-core machine more threads spin against the UI.
        one = ModelSettings(n_threads=1)
        if spec == "tiny":
            spec = EngineSpec(target=str(target_gguf), draft=str(draft_gguf), pair_name="tiny",
                              target_settings=one, draft_settings=one)
        return LocalspecApp(factory, monitor or FakeMonitor(), store or ChatStore(db),
                            library or FakeLibrary(target_gguf, draft_gguf),
                            settings or Settings(max_tokens=40, threads=1),
                            save_settings=save_settings,
                            spec=spec, export_dir=tmp_path / "exports", sample_interval=0.05)

    return make


async def wait_for(pilot: Any, cond: Callable[[], bool], timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out waiting")
        await pilot.pause(0.05)


async def send(pilot: Any, app: LocalspecApp, text: str) -> None:
    box = app.chat.prompt_box
    box.load_text(text)
    box.focus()
    await pilot.press("enter")
    await pilot.pause()


async def test_send_stream_regenerate_and_persist(make_app: Callable[..., LocalspecApp]) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await send(pilot, app, "write some code")
        await wait_for(pilot, lambda: not app.chat.generating)
        user, answer = app.chat._messages()
        assert user.text == "write some code" and answer.text
        assert answer.stats_line and "tokens" in answer.stats_line and "TTFT" in answer.stats_line
        # What streamed is exactly what the engine produces for the same request (greedy).
        engine = app.engine.engine
        hist = [{"role": "system", "content": app.settings.system_prompt},
                {"role": "user", "content": "write some code"}]
        from localspec.engine import GenerationRequest
        from localspec.options import sampling_params
        from localspec.requests import draft_from_settings, fit_draft

        ref = engine.generate(GenerationRequest(
            tuple(engine.tokenize(engine.chat_prompt(hist), chat=True)), max_tokens=40,
            sampling=sampling_params(app.settings),
            draft=fit_draft(draft_from_settings(app.settings), True)))
        assert answer.text == ref.text
        first = answer.text
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: not app.chat.generating and len(app.chat._messages()) == 2
                       and bool(app.chat._messages()[1].stats_line))
        assert app.chat._messages()[1].text == first
        chat_id = app.chat.chat_id
        stored = app.store.messages(chat_id)
        assert [m.role for m in stored] == ["user", "assistant"]
        assert stored[1].content == first and stored[1].stats["completion_tokens"] > 0
        await pilot.press("ctrl+t")  # drafted-text view
        await pilot.pause()
        assert app.chat.show_drafted
    # A new app over the same database reopens the chat.
    app2 = make_app(spec=None)
    async with app2.run_test(size=SIZE) as pilot:
        await pilot.press("f5")
        await pilot.pause()
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app2.chat._messages()) == 2)
        assert app2.chat._messages()[1].text == first
        assert app2.chat.chat_id == chat_id


class SlowEngine(LocalChatEngine):
    """The real engine, streaming at a human pace so a key press lands mid-answer."""

    def stream_chat(self, messages: Any, options: Any, cancel: Any = None) -> Any:
        for event in super().stream_chat(messages, options, cancel):
            time.sleep(0.005)
            yield event

    def close(self) -> None:
        self.closed = True
        super().close()


def slow_factory(spec: EngineSpec) -> SlowEngine:
    return SlowEngine(load_engine(spec), spec.display_name)


async def test_text_typed_right_after_enter_stays_in_the_box(
        make_app: Callable[..., LocalspecApp]) -> None:
    """Keys in one burst (a fast typist, a paste without bracketed paste) reach the box before
    the screen handles the Enter: emptying the box then dropped them."""
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        box = app.chat.prompt_box
        box.focus()
        await pilot.pause()
        for key, char in [("h", "h"), ("i", "i"), ("enter", "\r"), ("n", "n"), ("e", "e"),
                          ("x", "x"), ("t", "t")]:
            key_event = events.Key(key, char)
            key_event.set_sender(app)
            app._driver.send_message(key_event)  # noqa: SLF001  one burst, as a terminal sends
        await pilot.pause(0.5)
        await wait_for(pilot, lambda: not app.chat.generating)
        assert [m.text for m in app.chat._messages() if m.role == "user"] == ["hi"]
        assert box.text == "next"


async def test_escape_stops_a_generation(make_app: Callable[..., LocalspecApp]) -> None:
    app = make_app(Settings(max_tokens=3000, threads=1), factory=slow_factory)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await send(pilot, app, "go on forever")
        await wait_for(pilot, lambda: app.chat._stream_tokens > 0)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.chat.generating)
        answer = app.chat._messages()[-1]
        assert answer.stats_line and "stopped" in answer.stats_line
        stored = app.store.messages(app.chat.chat_id)
        assert stored[-1].stats["finish_reason"] == "cancelled"
        assert stored[-1].stats["completion_tokens"] < 3000
        # The engine is consistent afterwards: the next answer works.
        from dataclasses import replace

        app.settings = replace(app.settings, max_tokens=20)
        await send(pilot, app, "and now briefly")
        await wait_for(pilot, lambda: not app.chat.generating and len(app.chat._messages()) == 4)


async def test_quit_during_generation_exits_cleanly(make_app: Callable[..., LocalspecApp]) -> None:
    app = make_app(Settings(max_tokens=3000, threads=1), factory=slow_factory)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await send(pilot, app, "long answer")
        await wait_for(pilot, lambda: app.chat._stream_tokens > 0)
        await pilot.press("ctrl+q")
    assert app.return_value == 0
    assert app.engine is None  # closed after the generation left it
    assert app.monitor.closed  # type: ignore[attr-defined]


async def test_a_chat_left_mid_answer_frees_the_engine(make_app: Callable[..., LocalspecApp]
                                                      ) -> None:
    """Ctrl+N while answering drops the answer's late tokens, and once its worker has let go
    of the engine, the engine counts as free: quitting closes it at once."""
    app = make_app(Settings(max_tokens=3000, threads=1), factory=slow_factory)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        engine = app.engine
        await send(pilot, app, "long answer")
        await wait_for(pilot, lambda: app.chat._stream_tokens > 0)
        await pilot.press("ctrl+n")
        await wait_for(pilot, app.chat.idle.is_set)
        assert app.chat._messages() == [] and not app.chat.generating
        await pilot.press("ctrl+q")
    assert app.engine is None and getattr(engine, "closed", False)


async def test_switch_pair_in_the_picker(make_app: Callable[..., LocalspecApp]) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await pilot.press("f2")
        await wait_for(pilot, lambda: getattr(app.screen, "pairs", {}).get("tiny-lookup")
                       is not None and app.screen.pairs["tiny-lookup"].present is not None)
        table = app.screen.query_one(DataTable)
        table.move_cursor(row=table.get_row_index("absent"))
        await pilot.press("enter")  # not pulled: stays on the picker
        await pilot.pause()
        assert app.screen.__class__.__name__ == "PairPickerScreen"
        table.move_cursor(row=table.get_row_index("tiny-lookup"))
        await wait_for(pilot, lambda: "needs ~4.3 GB" in str(
            app.screen.query_one("#pair-detail").render()))
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.spec is not None and app.spec.pair_name == "tiny-lookup")
        assert not app.engine.info.has_draft_model
        await send(pilot, app, "hello")
        await wait_for(pilot, lambda: not app.chat.generating and len(app.chat._messages()) == 2)
        assert load_settings().last_pair == "tiny-lookup"


async def test_a_bad_history_setting_met_when_a_pair_is_picked_is_a_message(
        make_app: Callable[..., LocalspecApp], isolated_home: Path) -> None:
    """config.toml edited while the app runs: picking a pair reads [history] again, and a bad
    value there is a dismissible message; the app and the words in the box stay."""
    from localspec.config import config_path

    app = make_app(spec=None)
    async with app.run_test(size=SIZE) as pilot:
        app.chat.prompt_box.load_text("half a question")
        config_path().parent.mkdir(parents=True, exist_ok=True)
        config_path().write_text("[history]\nmax_tokens = 100\n")
        await pilot.press("f2")
        await wait_for(pilot, lambda: getattr(app.screen, "pairs", {}).get("tiny") is not None
                       and app.screen.pairs["tiny"].present is not None)
        table = app.screen.query_one(DataTable)
        table.move_cursor(row=table.get_row_index("tiny"))
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen))
        assert "max_tokens" in app.screen.error_message
        assert app.is_running and app.engine is None
        assert app.chat.prompt_box.text == "half a question"


async def test_damaged_models_show_as_damaged(make_app: Callable[..., LocalspecApp],
                                              target_gguf: Path, draft_gguf: Path) -> None:
    lib = FakeLibrary(target_gguf, draft_gguf, damaged=True)
    app = make_app(spec=None, library=lib)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        await wait_for(pilot, lambda: getattr(app.screen, "pairs", {}).get("broken")
                       is not None and app.screen.pairs["broken"].present is not None)
        picker = app.screen
        table = picker.query_one(DataTable)
        row = table.get_row_index("broken")
        assert table.get_row_at(row)[4] == "DAMAGED"
        table.move_cursor(row=row)
        await wait_for(pilot, lambda: "sha256-0123456789ab" in str(
            picker.query_one("#pair-detail").render()))
        notes: list[str] = []
        picker.notify = lambda message, **_: notes.append(message)  # type: ignore[method-assign]
        await pilot.press("enter")  # refused: stays on the picker, nothing is loaded
        await pilot.pause()
        assert app.screen is picker and app.spec is None
        assert len(notes) == 1
        assert notes[0].startswith("Cannot load broken") and "520,812,345" in notes[0]
        await pilot.press("escape")
        await pilot.press("f3")
        models = app.screen.query_one("#models", DataTable)
        await wait_for(pilot, lambda: models.row_count == 3)
        cells = models.get_row_at(models.get_row_index("broken:7b"))
        assert cells[1] == "DAMAGED" and "localspec pull broken:7b" in cells[2]


async def test_load_failure_is_a_dismissible_message(make_app: Callable[..., LocalspecApp]
                                                     ) -> None:
    def failing(spec: EngineSpec) -> Any:
        raise ModelLoadError("out of memory loading tiny-target (needs 40 GB)")

    app = make_app(factory=failing)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen))
        assert app.screen.error_title == "Model failed to load"
        assert "out of memory" in app.screen.error_message
        await pilot.press("enter")
        await pilot.pause()
        assert not isinstance(app.screen, ErrorScreen)
        await send(pilot, app, "anyone there?")  # no engine: a notification, no crash
        assert app.chat._messages() == []


async def test_gauges_show_the_monitor(make_app: Callable[..., LocalspecApp]) -> None:
    app = make_app(spec=None, monitor=FakeMonitor(FIXED_CPU_SAMPLE))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.chat.query_one(MachineGauge).sample is not None)
        group = app.chat.query_one(MachineGauge).render()
        text = "\n".join(t.plain for t in group.renderables)  # type: ignore[attr-defined]
        assert "No NVIDIA driver" in text
        assert app.monitor.watched is None  # type: ignore[attr-defined]  # no pair: no models


async def test_the_gauges_follow_the_process_that_holds_the_models(
        make_app: Callable[..., LocalspecApp]) -> None:
    """The chat app's engine runs in a process of its own (here, for speed, in this one): the
    gauges' "this process" is that one, followed across a restart."""
    monitor = FakeMonitor(FIXED_CPU_SAMPLE)
    app = make_app(monitor=monitor)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await wait_for(pilot, lambda: getattr(monitor, "watched", None) == os.getpid())


async def test_model_manager_pull_cancel_delete_inspect(make_app: Callable[..., LocalspecApp]
                                                        ) -> None:
    app = make_app(spec=None)
    lib: FakeLibrary = app.library  # type: ignore[assignment]
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f3")
        screen = app.screen
        await wait_for(pilot, lambda: screen.query_one("#models", DataTable).row_count == 2)
        screen.query_one("#pull-name", Input).value = "qwen3:0.6b"
        await pilot.click("#pull")
        await wait_for(pilot, lambda: screen.pulling is None)
        assert [m.name for m in lib.models][-1] == "qwen3:0.6b"
        assert len(screen._bars) == 2
        await wait_for(pilot, lambda: screen.query_one("#models", DataTable).row_count == 3)
        lib.pull_delay = 0.2
        screen.query_one("#pull-name", Input).value = "slow:latest"
        await pilot.click("#pull")
        await wait_for(pilot, lambda: bool(screen._bars))
        await pilot.click("#cancel-pull")
        await wait_for(pilot, lambda: screen.pulling is None)
        assert "slow:latest" not in [m.name for m in lib.models]
        # Ctrl+X cancels too, though the name box (whose own Ctrl+X cuts) has the focus.
        name_box = screen.query_one("#pull-name", Input)
        name_box.value = "slow:latest"
        name_box.focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: bool(screen._bars) and screen.pulling is not None)
        await pilot.press("ctrl+x")
        await wait_for(pilot, lambda: screen.pulling is None)
        assert "slow:latest" not in [m.name for m in lib.models]
        assert name_box.value == "slow:latest"
        # A delete that fails is said, and the list stays: the models are still there.
        lib.delete_error = OSError(13, "Permission denied")
        screen.query_one("#models", DataTable).focus()
        await pilot.press("ctrl+d")
        await pilot.pause()
        await pilot.press("y")
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen))
        assert "Permission denied" in app.screen.error_message
        await pilot.press("enter")
        await pilot.pause()
        assert screen.query_one("#models", DataTable).row_count == 3
        lib.delete_error = None
        screen.query_one("#models", DataTable).focus()
        await pilot.press("ctrl+i")
        await wait_for(pilot, lambda: "GGUF metadata" in str(
            screen.query_one("#model-detail").render()))
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: "smaller" in str(screen.query_one("#model-detail").render()))
        await pilot.press("ctrl+d")
        await pilot.pause()
        await pilot.press("y")
        await wait_for(pilot, lambda: lib.deleted == ["tiny-target:latest"])


async def test_leaving_the_model_manager_keeps_its_pull_and_typed_name(
        make_app: Callable[..., LocalspecApp]) -> None:
    """Esc while a pull runs: the pull goes on (its end is said wherever the user is), and
    the name typed in the box is there on coming back."""
    app = make_app(spec=None)
    lib: FakeLibrary = app.library  # type: ignore[assignment]
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f3")
        screen = app.screen
        lib.pull_delay = 0.05
        screen.query_one("#pull-name", Input).value = "slow:latest"
        await pilot.click("#pull")
        await wait_for(pilot, lambda: screen.pulling is not None)
        screen.query_one("#pull-name", Input).value = "next:one"  # typed meanwhile
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is not screen)
        await wait_for(pilot, lambda: "slow:latest" in [m.name for m in lib.models])
        await pilot.press("f3")
        await wait_for(pilot, lambda: app.screen is screen)
        assert screen.query_one("#pull-name", Input).value == "next:one"
        await wait_for(pilot, lambda: "slow:latest" in [
            str(row.value) for row in screen.query_one("#models", DataTable).rows])


async def test_deleting_the_open_chat_starts_afresh(make_app: Callable[..., LocalspecApp],
                                                   tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.sqlite3")
    shown = store.create_chat("shown")
    store.add_message(shown.id, "user", "hello")
    store.add_message(shown.id, "assistant", "hi there")
    other = store.create_chat("other")
    app = make_app(spec=None, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await app.chat.open_chat(shown.id)
        assert len(app.chat._messages()) == 2

        async def delete(chat_id: int) -> None:
            await pilot.press("f5")
            await pilot.pause()
            table = app.screen.query_one(DataTable)
            table.move_cursor(row=table.get_row_index(str(chat_id)))
            await pilot.press("d")
            await pilot.pause()
            await pilot.press("y")
            await pilot.pause()

        await delete(other.id)  # not the one shown: the conversation stays
        assert app.chat.chat_id == shown.id and len(app.chat._messages()) == 2
        await pilot.press("escape")
        await delete(shown.id)  # the one shown: the chat screen starts an empty chat
        await wait_for(pilot, lambda: app.chat.chat_id is None and not app.chat._messages())
        assert store.list_chats() == []
        # An export that fails (a file where the folder should be) is shown as an error.
        kept = store.create_chat("kept")
        await pilot.press("escape")
        await pilot.press("f5")
        await pilot.pause()
        (tmp_path / "exports").write_text("not a folder")
        await pilot.press("e")
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen))
        error = app.screen
        assert isinstance(error, ErrorScreen) and error.error_title == "System error"
        assert [c.id for c in store.list_chats()] == [kept.id]


class ScreenHost(App[None]):
    """A bare app around one screen: the screen gets only its collaborators, and what it posts
    up is recorded."""

    def __init__(self, screen: Screen[Any]) -> None:
        super().__init__()
        self.hosted = screen
        self.posted: list[Message] = []

    def on_mount(self) -> None:
        self.push_screen(self.hosted)

    def on_work_failed(self, message: WorkFailed) -> None:
        self.posted.append(message)

    def on_chat_deleted(self, message: ChatDeleted) -> None:
        self.posted.append(message)


async def test_a_plain_rate_of_zero_does_not_break_the_gauge() -> None:
    """An answer of no tokens once measured plain decoding at 0 tok/s; the gauge compares
    every later rate with it, and must not divide by it."""
    from localspec.tui.widgets.rate_gauge import RateGauge, RateReading

    class Host(App[None]):
        def compose(self) -> Any:
            yield RateGauge()

    app = Host()
    async with app.run_test(size=SIZE) as pilot:
        gauge = app.query_one(RateGauge)
        gauge.reading = RateReading(tokens_per_second=5.0, plain_tokens_per_second=0.0)
        await pilot.pause()
        assert app.is_running
        gauge.reading = RateReading(tokens_per_second=5.0, plain_tokens_per_second=2.0)
        await pilot.pause()
        assert "×2.50" in str(gauge.query_one("#rate-headline", Static).render())


async def test_pair_picker_needs_only_its_collaborators(target_gguf: Path,
                                                        draft_gguf: Path) -> None:
    def estimate_spec(pair: PairStatus) -> EngineSpec:
        return EngineSpec(target=pair.target, draft=pair.draft, pair_name=pair.name)

    picker = PairPickerScreen(FakeLibrary(target_gguf, draft_gguf), estimate_spec,
                              lambda: (7 * 10**9, "VRAM"))
    async with ScreenHost(picker).run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "7.0 GB free VRAM" in str(
            picker.query_one("#pair-detail").render()))
        await pilot.press("enter")
        await wait_for(pilot, lambda: not picker.is_attached)

    class Unreadable(FakeLibrary):
        def pairs(self) -> list[PairStatus]:
            raise OSError("models.toml: permission denied")

    host = ScreenHost(PairPickerScreen(Unreadable(target_gguf, draft_gguf), estimate_spec,
                                       lambda: (None, "memory")))
    async with host.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: bool(host.posted))
        assert isinstance(host.posted[0], WorkFailed)
        assert "permission denied" in str(host.posted[0].error)


async def test_chat_list_reports_deletions_up(tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.sqlite3")
    chat = store.create_chat("to delete")
    host = ScreenHost(ChatListScreen(store, tmp_path / "exports"))
    async with host.run_test(size=SIZE) as pilot:
        await pilot.press("d")
        await pilot.pause()
        await pilot.press("y")
        await wait_for(pilot, lambda: bool(host.posted))
        assert isinstance(host.posted[0], ChatDeleted) and host.posted[0].chat_id == chat.id
        assert host.hosted.query_one(DataTable).row_count == 0
    store.close()


async def test_settings_are_saved(make_app: Callable[..., LocalspecApp],
                                  isolated_home: Path) -> None:
    app = make_app(spec=None)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        await pilot.pause()
        settings_screen = app.screen
        settings_screen.query_one("#temperature", Input).value = "0.8"
        settings_screen.query_one("#k", Input).value = "nope"
        await pilot.press("ctrl+s")
        await pilot.pause()
        # A bad value: a modal naming the parameter, the value and the range; the form stays.
        assert app.screen.__class__.__name__ == "ErrorScreen"
        assert app.screen.error_message == \
            "K (auto or a number) must be auto or a whole number >= 0 and <= 32, got 'nope'"
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is settings_screen
        settings_screen.query_one("#k", Input).value = "auto"
        settings_screen.query_one("#temperature", Input).value = "inf"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert "Temperature" in app.screen.error_message and "got inf" in \
            app.screen.error_message
        await pilot.press("enter")
        await pilot.pause()
        settings_screen.query_one("#temperature", Input).value = "0.8"
        settings_screen.query_one("#k", Input).value = "7"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.settings.temperature == 0.8 and app.settings.k == 7
    assert load_settings().temperature == 0.8


async def test_chat_through_a_remote_server(make_app: Callable[..., LocalspecApp],
                                            target_gguf: Path, draft_gguf: Path) -> None:
    """`localspec tui --url`: the same chat against an OpenAI-compatible server."""
    from localspec.engine import GenerationRequest, SamplingParams, SpeculativeEngine
    from localspec.server import ServerConfig
    from localspec.server.app import create_app
    from localspec.server.running import BackgroundServer
    from localspec.tui import remote_factory

    engine = SpeculativeEngine.load(target_gguf, draft_gguf, ModelSettings(n_ctx=1024,
                                                                           n_threads=1))
    server = BackgroundServer(create_app(engine, ServerConfig(model_id="tiny"))).start()
    try:
        factory, spec = remote_factory(server.url)
        app = make_app(spec=spec, factory=factory, settings=Settings(max_tokens=24, threads=1))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.engine is not None)
            await send(pilot, app, "hello remote")
            await wait_for(pilot, lambda: not app.chat.generating)
            _, answer = app.chat._messages()
            assert answer.text and "tokens" in answer.stats_line
            hist = [{"role": "system", "content": app.settings.system_prompt},
                    {"role": "user", "content": "hello remote"}]
        local = engine.generate(GenerationRequest(
            prompt_tokens=engine.tokenize(engine.chat_prompt(hist), chat=True), max_tokens=24,
            sampling=SamplingParams(temperature=app.settings.temperature)))
        assert app.settings.temperature == 0  # greedy: the remote answer is the engine's
        assert answer.text == local.text
    finally:
        server.stop()
        engine.close()


# -- a damaged chat history ---------------------------------------------------------------------
def damaged_history(tmp_path: Path) -> tuple[Path, bytes, DamagedChatHistory]:
    """A chat database of random bytes, found damaged the way open_tui finds it on a terminal."""
    db = tmp_path / "damaged" / "chats.sqlite3"
    db.parent.mkdir()
    original = os.urandom(8192)
    db.write_bytes(original)
    history = open_chat_store(reset_damaged=False, ask=True, path=db)
    assert isinstance(history, DamagedChatHistory)
    return db, original, history


async def wait_for_question(pilot: Any, app: LocalspecApp) -> str:
    """Wait until the question about the damaged file is on screen, laid out; return its text."""
    def laid_out() -> bool:
        buttons = app.screen.query("#yes, #no") if isinstance(app.screen, ConfirmScreen) else []
        return len(buttons) == 2 and all(b.region.area for b in buttons)

    await wait_for(pilot, laid_out)
    return str(app.screen.query_one(".dialog-body", Static).render())


async def test_damaged_history_moved_aside_with_consent(make_app: Callable[..., LocalspecApp],
                                                        tmp_path: Path) -> None:
    db, original, history = damaged_history(tmp_path)
    app = make_app(store=history, monitor=FakeMonitor(FIXED_CPU_SAMPLE))
    async with app.run_test(size=SIZE) as pilot:
        text = await wait_for_question(pilot, app)
        assert text == (f"{db} is damaged (file is not a database). Move it aside to "
                        f"{history.aside} and start with an empty chat history?")
        # Under the question the gauges keep running; the command palette (a priority key that
        # would reach saved chats) stays shut.
        await wait_for(pilot, lambda: app.chat.query_one(MachineGauge).sample is not None)
        await pilot.press("ctrl+p")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.click("#yes")
        await wait_for(pilot, lambda: app.engine is not None)  # the pair loads once answered
        assert history.aside.read_bytes() == original
        await send(pilot, app, "hello again")
        await wait_for(pilot, lambda: not app.chat.generating and len(app.chat._messages()) == 2)
        stored = app.store.messages(app.chat.chat_id)
        assert [m.role for m in stored] == ["user", "assistant"] and stored[1].content
    assert history.store is app.store
    reopened = ChatStore(db)
    assert [c.id for c in reopened.list_chats()] == [app.chat.chat_id]
    reopened.close()


async def test_declining_leaves_the_damaged_history_alone(make_app: Callable[..., LocalspecApp],
                                                          tmp_path: Path) -> None:
    db, original, history = damaged_history(tmp_path)
    app = make_app(store=history, spec=None)
    async with app.run_test(size=SIZE) as pilot:
        assert str(db) in await wait_for_question(pilot, app)
        await pilot.click("#no")
        await pilot.pause()
    assert app.return_value == 1
    assert history.store is None  # open_tui reports the file on stderr after this
    assert db.read_bytes() == original
    assert [p.name for p in db.parent.iterdir()] == ["chats.sqlite3"]


async def test_a_failed_move_is_shown_and_asked_again(make_app: Callable[..., LocalspecApp],
                                                      tmp_path: Path) -> None:
    db, original, history = damaged_history(tmp_path)
    history.aside.write_bytes(b"someone else's file")  # the name is taken after the question
    app = make_app(store=history, spec=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_question(pilot, app)
        await pilot.click("#yes")
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen))
        assert app.screen.error_title == "Chat history unavailable"
        assert f"cannot move {db} aside" in app.screen.error_message
        await pilot.press("enter")
        await wait_for_question(pilot, app)
        await pilot.click("#no")
        await pilot.pause()
    assert app.return_value == 1
    assert db.read_bytes() == original  # nothing overwritten, nothing moved
    assert history.aside.read_bytes() == b"someone else's file"


def test_control_characters_are_shown_harmlessly() -> None:
    from localspec.tui.widgets.chat_message import visible

    assert visible("a\x05b\nc\td\x7f") == "a\u2405b\nc\td\u2421"


async def test_a_crash_of_the_engine_process_keeps_the_chat(
        make_app: Callable[..., LocalspecApp]) -> None:
    """The chat app's real engine process (as `localspec` runs it): kill -SEGV of it, idle or
    mid-answer, shows one line, keeps the conversation, restarts, and answers the next
    question."""
    import os
    import signal
    import threading
    from dataclasses import replace

    from textual.widgets import Static

    from localspec.open_engine import open_chat_engine

    app = make_app(Settings(max_tokens=3000, threads=1), factory=open_chat_engine)

    def notices() -> list[str]:
        return [str(w.render()) for w in app.chat.query(".notice").results(Static)]

    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None, timeout=60)
        assert app.engine.info.where == "engine process"
        app.settings = replace(app.settings, max_tokens=20)
        await send(pilot, app, "first question")
        await wait_for(pilot, lambda: not app.chat.generating and len(app.chat._messages()) == 2)
        first_pid = app.engine.pid
        os.kill(first_pid, signal.SIGSEGV)  # idle: noticed by the app within a sample
        await wait_for(pilot, lambda: len(notices()) == 1, timeout=30)
        assert notices()[0].startswith("engine stopped: signal 11 (SIGSEGV)")
        assert notices()[0].endswith("; restarting")
        await wait_for(pilot, lambda: not app._restarting, timeout=60)
        assert app.engine.pid != first_pid
        # Mid-answer: the partial answer goes, the conversation stays. (Pilot's pauses wait
        # for the app to go idle, so the kill comes from a thread watching the engine.)
        app.settings = replace(app.settings, max_tokens=3000, temperature=1.0)
        engine = app.engine

        def kill_while_generating() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                doing = engine.activity()
                if doing is not None and doing.phase in ("verifying", "decoding", "drafting"):
                    os.kill(engine.pid, signal.SIGSEGV)
                    return
                time.sleep(0.001)

        killer = threading.Thread(target=kill_while_generating)
        killer.start()
        await send(pilot, app, "a long answer please")
        await wait_for(pilot, lambda: len(notices()) == 2, timeout=30)
        assert notices()[1].startswith("engine stopped: signal 11 (SIGSEGV) while ")
        assert not app.chat.generating
        await wait_for(pilot, lambda: not app._restarting, timeout=60)
        app.settings = replace(app.settings, max_tokens=12, temperature=0.0)
        await send(pilot, app, "are you back?")
        await wait_for(pilot, lambda: not app.chat.generating and
                       app.chat._messages()[-1].role == "assistant" and
                       bool(app.chat._messages()[-1].stats_line), timeout=60)
        roles = [m.role for m in app.chat._messages()]
        assert roles == ["user", "assistant", "user", "user", "assistant"]
        assert app.chat._messages()[-1].text


# -- an engine that restarts, a server that goes away ---------------------------------------------
@pytest.fixture(scope="session")
def slow_pair(models_dir: Path) -> tuple[Path, Path]:
    """A real pair that takes seconds to load in llama.cpp (as an F16 1.5B does here): a
    300,000-word vocabulary, twice a Qwen model's, on an otherwise tiny model."""
    from localspec.models.tiny import TinyModelSpec, shallow_copy, write_tiny_model

    spec = TinyModelSpec(seed=13, n_embd=32, n_head=4, n_head_kv=2, n_ff=64, n_layer=2,
                         layer_scale=0.2, words=tuple(f"w{i}" for i in range(300_000)),
                         name="tiny-slow")
    return (write_tiny_model(models_dir / "slow-target.gguf", spec),
            write_tiny_model(models_dir / "slow-draft.gguf", shallow_copy(spec, 1)))


def slow_spec(pair: tuple[Path, Path]) -> EngineSpec:
    one = ModelSettings(n_threads=1, n_ctx=1024)
    return EngineSpec(target=str(pair[0]), draft=str(pair[1]), pair_name="tiny-slow",
                      target_settings=one, draft_settings=one)


def notice_lines(app: LocalspecApp) -> list[str]:
    return [str(w.render()) for w in app.chat.query(".notice").results(Static)]


def answered(app: LocalspecApp, count: int) -> bool:
    msgs = app.chat._messages()
    return (not app.chat.generating and len(msgs) == count and msgs[-1].role == "assistant"
            and bool(msgs[-1].text) and "tokens" in (msgs[-1].stats_line or ""))


async def test_a_message_sent_while_the_engine_restarts_waits_and_is_answered(
        make_app: Callable[..., LocalspecApp], slow_pair: tuple[Path, Path]) -> None:
    """kill -SEGV of the chat app's engine process (a pair that takes seconds to load): a
    message sent while it restarts shows that it waits, and is answered once the engine is
    back; one sent before the app has noticed (the dead engine does not take it) too."""
    import signal

    from localspec.open_engine import open_chat_engine
    from localspec.tui.screens.chat import WAITING_LINE

    app = make_app(Settings(max_tokens=8, threads=1), spec=slow_spec(slow_pair),
                   factory=open_chat_engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None, timeout=120)
        assert app.engine.info.where == "engine process"
        first_pid = app.engine.pid
        os.kill(first_pid, signal.SIGSEGV)  # idle: noticed by the app within a sample
        await wait_for(pilot, lambda: app._restarting, timeout=30)
        await send(pilot, app, "are you there?")
        user, waiting = app.chat._messages()
        assert user.text == "are you there?" and waiting.role == "assistant"
        assert waiting.stats_line == WAITING_LINE  # the message waits, visibly
        assert app.chat.query_one("#loading").display
        assert app._restarting  # still loading: the message was sent during the restart
        await wait_for(pilot, lambda: answered(app, 2), timeout=120)
        assert app.engine.pid != first_pid
        assert len(notice_lines(app)) == 1
        assert [m.role for m in app.store.messages(app.chat.chat_id)] == ["user", "assistant"]

        # Sent before the app has noticed: the app stops sampling (so it cannot notice between
        # answers), the engine is killed and reaped, and the message finds nobody at the socket.
        app.sample_interval = 3600
        await pilot.pause(0.2)
        second_pid = app.engine.pid
        os.kill(second_pid, signal.SIGSEGV)
        deadline = time.monotonic() + 30
        while app.engine.end() is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert not app._restarting
        await send(pilot, app, "and now?")
        await wait_for(pilot, lambda: app._restarting, timeout=30)
        assert app.chat._messages()[-1].stats_line.startswith(WAITING_LINE)
        await wait_for(pilot, lambda: answered(app, 4), timeout=120)
        assert app.engine.pid not in (first_pid, second_pid)
        lines = notice_lines(app)
        assert len(lines) == 2 and lines[1].startswith("engine stopped: signal 11 (SIGSEGV)")
        assert [m.role for m in app.store.messages(app.chat.chat_id)] == \
            ["user", "assistant", "user", "assistant"]


async def test_a_served_pair_whose_server_goes_away_falls_back_to_an_own_engine(
        make_app: Callable[..., LocalspecApp], slow_pair: tuple[Path, Path]) -> None:
    """The chat app attached to a `localspec serve` of its pair; the server is killed: the app
    says so once, loads the pair in an engine process of its own, and answers the message sent
    meanwhile and the ones after."""
    import re
    import subprocess
    import sys

    from localspec.open_engine import open_chat_engine

    target, draft = slow_pair
    serve = subprocess.Popen([sys.executable, "-m", "localspec", "serve", "--target",
                              str(target), "--draft", str(draft), "--ctx", "1024", "--port", "0",
                              "--threads", "1"], stderr=subprocess.PIPE, text=True)
    try:
        assert serve.stderr is not None
        url = next(m[1] for line in serve.stderr
                   if (m := re.search(r"at (http://127\.0\.0\.1:\d+)/v1 ", line)))
        app = make_app(Settings(max_tokens=8, threads=1), spec=slow_spec(slow_pair),
                       factory=open_chat_engine)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.engine is not None, timeout=120)
            assert app.engine.info.where == f"localspec serve at {url}"
            await send(pilot, app, "hello server")
            await wait_for(pilot, lambda: answered(app, 2), timeout=120)
            serve.kill()  # gone without a word (its engine process follows it)
            await send(pilot, app, "still there?")
            await wait_for(pilot, lambda: answered(app, 4), timeout=120)
            assert app.engine.info.where == "engine process"
            [line] = notice_lines(app)
            assert line.startswith(f"the localspec serve at {url} is gone (falling back to an "
                                   "engine process of this app's own for tiny-slow)")
            await send(pilot, app, "and again")
            await wait_for(pilot, lambda: answered(app, 6), timeout=120)
            assert len(notice_lines(app)) == 1  # said once
    finally:
        serve.kill()
        serve.wait()


# -- what the user typed is never dropped -------------------------------------------------------
class FakeFullDiskStore(ChatStore):
    """A fake: the real store whose writes fail as SQLite's do on a full disk (a full disk
    cannot be made safely here)."""

    full = True

    def add_message(self, *args: Any, **kwargs: Any) -> Any:
        if self.full:
            import sqlite3

            raise sqlite3.OperationalError("database or disk is full")
        return super().add_message(*args, **kwargs)


class FakeLockedStore(ChatStore):
    """A fake: the real store whose chat-list writes fail as SQLite's do when another process
    holds the database."""

    def rename_chat(self, *args: Any, **kwargs: Any) -> Any:
        import sqlite3

        raise sqlite3.OperationalError("database is locked")

    delete_chat = rename_chat


async def test_a_locked_history_in_the_chat_list_is_a_message(
        make_app: Callable[..., LocalspecApp], tmp_path: Path) -> None:
    store = FakeLockedStore(tmp_path / "locked.sqlite3")
    chat = store.create_chat("kept")
    app = make_app(spec=None, store=store)
    async with app.run_test(size=SIZE) as pilot:
        app.chat.prompt_box.load_text("unsent words")
        for keys in (["r", "ctrl+a", "n", "e", "w", "enter"], ["d", "y"]):
            await pilot.press("f5")
            await wait_for(pilot, lambda: isinstance(app.screen, ChatListScreen))
            for key in keys:
                await pilot.press(key)
                await pilot.pause()
            await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen))
            error = app.screen
            assert isinstance(error, ErrorScreen) and error.error_title == "Chat history error"
            assert "database is locked" in error.error_message
            await pilot.press("enter")  # the message goes; the chat list stays usable
            await wait_for(pilot, lambda: isinstance(app.screen, ChatListScreen))
            await pilot.press("escape")
            await pilot.pause()
        assert app.is_running and app.chat.prompt_box.text == "unsent words"
        assert [c.title for c in store.list_chats()] == [chat.title]


async def test_a_full_disk_keeps_the_message_in_the_box(make_app: Callable[..., LocalspecApp],
                                                        tmp_path: Path) -> None:
    store = FakeFullDiskStore(tmp_path / "full.sqlite3")
    app = make_app(store=store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await send(pilot, app, "words worth keeping")
        assert app.is_running and not app.chat.generating
        assert app.chat.prompt_box.text == "words worth keeping"
        assert app.chat._messages() == []
        assert notice_lines(app) == ["Not sent: the chat history cannot be written: database "
                                     "or disk is full (your message is still in the box)"]
        store.full = False  # room again: Enter sends what is in the box
        await pilot.press("enter")
        await wait_for(pilot, lambda: answered(app, 2))
        assert app.chat.prompt_box.text == ""
        assert [m.content for m in store.messages(app.chat.chat_id)][0] == "words worth keeping"
        store.full = True  # the answer cannot be saved: it stays on screen, said in one line
        await send(pilot, app, "once more")
        await wait_for(pilot, lambda: len(notice_lines(app)) == 2)
        assert app.is_running and app.chat.prompt_box.text == "once more"


async def test_a_multi_line_paste_is_kept_whole(make_app: Callable[..., LocalspecApp]) -> None:
    from textual import events

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        box = app.chat.prompt_box
        box.focus()
        lines = [f"line {i}: " + " ".join(["the code"] * 8) for i in range(1500)]  # ~115 KB
        pasted = "\n".join(lines)
        app.post_message(events.Paste(pasted))  # as the terminal driver sends a paste
        await wait_for(pilot, lambda: bool(box.text))
        assert box.text == pasted and len(pasted) > 100_000
        # Far longer than the tiny model's context: refused in one message, and the text goes
        # back into the box instead of staying in the conversation (and every later prompt).
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen))
        assert app.screen.error_title == "Prompt too long"
        await pilot.press("enter")
        await wait_for(pilot, lambda: box.text == pasted)
        assert app.chat._messages() == []
        assert all(not app.store.messages(c.id) for c in app.store.list_chats())
        # A paste that fits, with a line typed after it (Ctrl+J starts a new line).
        box.clear()
        app.post_message(events.Paste("first line\nsecond line"))
        await wait_for(pilot, lambda: bool(box.text))
        await pilot.press("ctrl+j", "t", "h", "e")
        assert box.text == "first line\nsecond line\nthe"
        await pilot.press("enter")
        await wait_for(pilot, lambda: answered(app, 2))
        assert app.chat._messages()[0].text == "first line\nsecond line\nthe"


async def test_machine_panel_shows_the_placement(make_app: Callable[..., LocalspecApp]) -> None:
    from localspec.tui.widgets.machine_gauge import MachineGauge

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        gauge = app.chat.query_one(MachineGauge)
        await wait_for(pilot, lambda: gauge.placement is not None)
        assert "no GPU" in gauge.placement  # llama.cpp here is a CPU-only build
        assert gauge.placement == app.engine.info.placement
        await pilot.pause()
        assert "placement: no GPU" in "".join(str(r) for r in gauge.render().renderables)
