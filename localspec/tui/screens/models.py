"""Model manager: local Ollama models; pull (per-layer progress, cancellable), delete, inspect,
suggest drafts for a target."""

from __future__ import annotations

import json
from typing import Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Header, Input, Label, ProgressBar, Static
from textual.worker import get_current_worker

from ...models.library import ModelLibrary
from ..messages import InfoReady, ModelsListed, PullFinished, PullProgressed, WorkFailed
from ..widgets._format import human_bytes
from .dialogs import ConfirmScreen


class ModelManagerScreen(Screen[None]):
    """The local models of ``library``. A listing, pull or delete that fails is posted up as
    WorkFailed."""

    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("f6", "refresh", "Refresh"),
        # priority: the name box keeps the focus after a pull starts, and its own keys
        # (Ctrl+D deletes a character, Ctrl+X cuts) would take these first.
        Binding("ctrl+d", "delete", "Delete", priority=True),
        Binding("ctrl+i", "inspect", "Inspect", priority=True),
        Binding("ctrl+s", "suggest", "Suggest drafts", priority=True),
        Binding("ctrl+x", "cancel_pull", "Cancel pull", priority=True),
    ]

    def __init__(self, library: ModelLibrary) -> None:
        super().__init__()
        self.library = library
        self.pulling: str | None = None
        self._bars: dict[str, ProgressBar] = {}

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(classes="manager"):
            with Horizontal(classes="toolbar"):
                yield Input(placeholder="model to pull, e.g. qwen2.5:0.5b", id="pull-name")
                yield Button("Pull", variant="primary", id="pull")
                yield Button("Cancel pull", id="cancel-pull", disabled=True)
            yield VerticalScroll(id="pulls")
            table: DataTable[str] = DataTable(cursor_type="row", id="models")
            table.add_columns("Model", "Size", "File")
            yield table
            with VerticalScroll(classes="detail"):
                yield Static("Ctrl+I inspect · Ctrl+S suggest drafts · Ctrl+D delete",
                             id="model-detail", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "Models"

    def on_screen_resume(self) -> None:
        self.action_refresh()  # each time it is shown: the store may have changed meanwhile

    # -- listing ------------------------------------------------------------------------------
    def action_refresh(self) -> None:
        self.list_models()

    @work(thread=True, exclusive=True, group="models", exit_on_error=False)
    def list_models(self) -> None:
        self._post_list()

    def _post_list(self) -> None:
        """In a worker: the store's models, or why they cannot be listed."""
        try:
            self.post_message(ModelsListed(self.library.local_models()))
        except Exception as exc:
            self.post_message(ModelsListed([], exc))

    def on_models_listed(self, message: ModelsListed) -> None:
        table = self.query_one("#models", DataTable)
        table.clear()
        for m in message.models:
            if m.problem:  # damaged: never shown with a size, as if it could be loaded
                table.add_row(m.name, "DAMAGED", m.problem, key=m.name)
            else:
                table.add_row(m.name, human_bytes(m.size), str(m.path), key=m.name)
        if message.error is not None:
            self.post_message(WorkFailed(message.error))
        elif not message.models:
            self._detail("Models", "No local Ollama models. Pull one above.")

    def _selected(self) -> str | None:
        table = self.query_one("#models", DataTable)
        if not table.row_count:
            self.notify("No model selected.", severity="warning")
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    def _detail(self, title: str, body: str) -> None:
        self.query_one("#model-detail", Static).update(f"{title}\n\n{body}")

    # -- pull ---------------------------------------------------------------------------------
    @on(Input.Submitted, "#pull-name")
    @on(Button.Pressed, "#pull")
    def start_pull(self) -> None:
        name = self.query_one("#pull-name", Input).value.strip()
        if not name:
            self.notify("Type a model name to pull.", severity="warning")
            return
        if self.pulling:
            self.notify(f"Already pulling {self.pulling}.", severity="warning")
            return
        self.pulling = name
        self.query_one("#cancel-pull", Button).disabled = False
        self.query_one("#pulls").remove_children()
        self._bars.clear()
        self.pull(name)

    @work(thread=True, exclusive=True, group="pull", exit_on_error=False)
    def pull(self, name: str) -> None:
        worker = get_current_worker()

        def progress(p: Any) -> None:
            self.post_message(PullProgressed(name, str(getattr(p, "digest", "") or ""),
                                             int(getattr(p, "completed", 0) or 0),
                                             int(getattr(p, "total", 0) or 0),
                                             str(getattr(p, "status", "") or "")))

        try:
            model = self.library.pull(name, progress, worker.cancelled_event)
        except Exception as exc:
            self.post_message(PullFinished(name, None,
                                           None if worker.is_cancelled else exc))
            return
        self.post_message(PullFinished(name, None if worker.is_cancelled else model))

    async def on_pull_progressed(self, message: PullProgressed) -> None:
        key = message.digest or message.status
        bar = self._bars.get(key)
        if bar is None:
            bar = ProgressBar(total=message.total or None, show_eta=True)
            self._bars[key] = bar
            label = (message.digest.removeprefix("sha256:")[:12] if message.digest
                     else message.status)
            await self.query_one("#pulls").mount(Horizontal(Label(label), bar,
                                                            classes="pull-row"))
        bar.update(total=message.total or None, progress=message.completed)

    def on_pull_finished(self, message: PullFinished) -> None:
        self.pulling = None
        self.query_one("#cancel-pull", Button).disabled = True
        if message.error is not None:
            self.post_message(WorkFailed(message.error))
        elif message.model is None:
            self.notify(f"Pull of {message.name} cancelled.")
        else:
            self.notify(f"Pulled {message.model.name} ({human_bytes(message.model.size)}).")
            self.action_refresh()

    @on(Button.Pressed, "#cancel-pull")
    def action_cancel_pull(self) -> None:
        if self.pulling:
            self.workers.cancel_group(self, "pull")

    # -- delete, inspect, suggest -------------------------------------------------------------
    def action_delete(self) -> None:
        name = self._selected()
        if name is None:
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.delete_model(name)

        self.app.push_screen(ConfirmScreen(f"Delete {name} from the Ollama store?"), confirmed)

    @work(thread=True, group="models-delete", exit_on_error=False)
    def delete_model(self, name: str) -> None:
        try:
            self.library.delete(name)
        except Exception as exc:  # the list stays as it is: the models are still there
            self.post_message(WorkFailed(exc))
            return
        self.post_message(InfoReady("Deleted", name))
        self._post_list()

    def action_inspect(self) -> None:
        name = self._selected()
        if name is not None:
            self.info(name, "inspect")

    def action_suggest(self) -> None:
        name = self._selected()
        if name is not None:
            self.info(name, "suggest")

    @work(thread=True, exclusive=True, group="models-info", exit_on_error=False)
    def info(self, name: str, what: str) -> None:
        lib = self.library
        try:
            if what == "inspect":
                meta = lib.inspect(name)
                body = "\n".join(f"{k}: {json.dumps(v) if not isinstance(v, str) else v}"
                                 for k, v in meta.items())
                self.post_message(InfoReady(f"GGUF metadata of {name}", body))
            else:
                drafts = lib.suggest_drafts(name)
                body = "\n".join(f"• {d}" for d in drafts) or "No known draft for this target."
                self.post_message(InfoReady(f"Drafts for {name}", body))
        except Exception as exc:
            self.post_message(InfoReady(f"{name}: failed", str(exc)))

    def on_info_ready(self, message: InfoReady) -> None:
        self._detail(message.title, message.body)

    def action_back(self) -> None:
        self.dismiss(None)
