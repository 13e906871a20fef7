"""Pick a pair to load: catalogue and user pairs with presence, size, compatibility, memory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static
from textual.worker import get_current_worker

from ...loading import EngineSpec
from ...models.library import MemoryEstimate, ModelLibrary, PairStatus
from ..messages import EstimateReady, PairChecked, WorkFailed
from ..widgets._format import human_bytes

# How the pair would be loaded with the current settings (what its memory estimate is for).
EstimateSpec = Callable[[PairStatus], EngineSpec]
# Memory free for models now, and where: (bytes or None if unknown, "VRAM" / "RAM" / "memory").
FreeMemory = Callable[[], tuple[int | None, str]]

COLUMNS = ("Pair", "Target", "Draft", "Mode", "Present", "Size", "Compatible", "Source")


def _yes_no(value: bool | None) -> str:
    return "…" if value is None else ("yes" if value else "no")


def _presence(pair: PairStatus) -> str:
    return "DAMAGED" if pair.damaged else _yes_no(pair.present)


class PairPickerScreen(Screen[PairStatus | None]):
    """Dismisses with the chosen pair (the app loads it) or None.

    ``library`` lists and checks the pairs; ``estimate_spec`` and ``free_memory`` give the
    highlighted pair's memory estimate (both are called from a worker thread). A listing that
    fails is posted up as WorkFailed.
    """

    BINDINGS = [Binding("escape", "back", "Back"), Binding("enter", "choose", "Load", show=True)]

    def __init__(self, library: ModelLibrary, estimate_spec: EstimateSpec,
                 free_memory: FreeMemory) -> None:
        super().__init__()
        self.library = library
        self.estimate_spec = estimate_spec
        self.free_memory = free_memory
        self.pairs: dict[str, PairStatus] = {}

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(classes="manager"):
            yield Static("Pairs — Enter loads the highlighted pair", classes="panel-title")
            table: DataTable[str] = DataTable(cursor_type="row", id="pairs")
            table.add_columns(*COLUMNS)
            yield table
            yield Static("", id="pair-detail", classes="detail")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "Pick a pair"
        self.query_one(DataTable).focus()
        self.scan()

    @work(thread=True, exclusive=True, group="pairs", exit_on_error=False)
    def scan(self) -> None:
        """List the pairs, then check each one's files (reads GGUF headers: may be slow)."""
        worker = get_current_worker()
        try:
            pairs = self.library.pairs()
        except Exception as exc:
            self.post_message(WorkFailed(exc))
            return
        for p in pairs:
            self.post_message(PairChecked(p))
        for p in pairs:
            if worker.is_cancelled:
                return
            try:
                self.post_message(PairChecked(self.library.check_pair(p)))
            except Exception as exc:  # one bad pair must not hide the others
                from dataclasses import replace

                self.post_message(PairChecked(replace(p, present=False, problem=str(exc))))

    def on_pair_checked(self, message: PairChecked) -> None:
        p = message.pair
        table = self.query_one(DataTable)
        row = (p.name, p.target, p.draft or "—", p.draft_mode, _presence(p),
               human_bytes(p.size) if p.size else "—", _yes_no(p.compatible), p.source)
        if p.name in self.pairs:
            # A checked pair's cells ("1.3 MB" for "—") may need wider columns than the
            # listing's: without update_width the text is cut once the table has laid out.
            for col, value in zip(table.columns, row, strict=True):
                table.update_cell(p.name, col, value, update_width=True)
        else:
            table.add_row(*row, key=p.name)
        self.pairs[p.name] = p
        if table.cursor_row >= 0 and self._highlighted() == p.name:
            self._describe(p)

    def _highlighted(self) -> str | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        return key.value

    @on(DataTable.RowHighlighted)
    def highlighted(self, event: DataTable.RowHighlighted) -> None:
        pair = self.pairs.get(event.row_key.value or "")
        if pair is not None:
            self._describe(pair)

    def _describe(self, p: PairStatus) -> None:
        lines = [f"{p.name}: {p.why}" if p.why else p.name]
        if p.problem:
            lines.append(f"⚠ {p.problem}")
        self.query_one("#pair-detail", Static).update("\n".join(lines))
        if p.present:
            self.estimate(p)

    @work(thread=True, exclusive=True, group="estimate", exit_on_error=False)
    def estimate(self, pair: PairStatus) -> None:
        est: MemoryEstimate | Exception
        try:
            free, where = self.free_memory()
            est = self.library.estimate(self.estimate_spec(pair), free, where)
        except Exception as exc:
            est = exc
        self.post_message(EstimateReady(pair.name, est))

    def on_estimate_ready(self, message: EstimateReady) -> None:
        if message.pair != self._highlighted():
            return
        detail = self.query_one("#pair-detail", Static)
        pair = self.pairs[message.pair]
        base = f"{pair.name}: {pair.why}" if pair.why else pair.name
        est: Any = message.estimate
        if isinstance(est, Exception):
            detail.update(f"{base}\nmemory estimate unavailable: {est}")
            return
        free = f"{human_bytes(est.free)} free {est.where}" if est.free is not None else \
            f"free {est.where} unknown"
        text = (f"{base}\nneeds ~{human_bytes(est.total)} (weights {human_bytes(est.weights)} "
                f"+ KV cache {human_bytes(est.kv_cache)}) — {free}")
        if est.fits is False:
            text += "\n⚠ this will probably not fit: lower the GPU layers or the context (F4)"
        detail.set_class(est.fits is False, "warning")
        detail.update(text)

    @on(DataTable.RowSelected)
    def action_choose(self) -> None:
        name = self._highlighted()
        pair = self.pairs.get(name or "")
        if pair is None:
            return
        if pair.damaged:
            self.notify(f"Cannot load {pair.name}: {pair.problem} (or pull it again in the model "
                        "manager, F3)", severity="error")
            return
        if pair.present is False:
            self.notify(f"{pair.problem or 'models missing'} — pull them in the model manager "
                        "(F3)", severity="warning")
            return
        if pair.compatible is False:
            self.notify(f"Incompatible pair: {pair.problem}", severity="error")
            return
        self.dismiss(pair)

    def action_back(self) -> None:
        self.dismiss(None)
