"""Live tokens/s with a sparkline, acceptance, draft vs verify time, and plain decoding's rate."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import Sparkline, Static


@dataclass(frozen=True, slots=True)
class RateReading:
    """What the rate gauge shows; None where not measured yet."""

    tokens_per_second: float | None = None
    acceptance: float | None = None
    draft_share: float | None = None  # draft time / (draft + verify time)
    plain_tokens_per_second: float | None = None
    generating: bool = False


class RateGauge(Vertical):
    """Token-rate panel. ``reading`` is set by the screen; ``push`` adds a sparkline point."""

    reading: reactive[RateReading] = reactive(RateReading, always_update=True, layout=True)

    def __init__(self, history: int = 60, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._history: deque[float] = deque([0.0] * history, maxlen=history)

    def compose(self) -> ComposeResult:
        yield Static(id="rate-headline")
        yield Sparkline(list(self._history), id="rate-spark")
        yield Static(id="rate-details")

    def push(self, tokens_per_second: float) -> None:
        self._history.append(tokens_per_second)
        self.query_one(Sparkline).data = list(self._history)

    def watch_reading(self, r: RateReading) -> None:
        if not self.is_mounted:
            return
        rate = "—" if r.tokens_per_second is None else f"{r.tokens_per_second:.1f}"
        head = Text.assemble((rate, "bold"), " tok/s", ("  ● live" if r.generating else "",
                                                         "green"))
        if r.plain_tokens_per_second is not None:
            head.append(f"   plain {r.plain_tokens_per_second:.1f}", style="dim")
            if r.tokens_per_second and r.plain_tokens_per_second > 0:
                head.append(f" (×{r.tokens_per_second / r.plain_tokens_per_second:.2f})",
                            style="dim")
        self.query_one("#rate-headline", Static).update(head)
        acc = "—" if r.acceptance is None else f"{r.acceptance:.0%}"
        share = ("—" if r.draft_share is None
                 else f"{r.draft_share:.0%} draft / {1 - r.draft_share:.0%} verify")
        self.query_one("#rate-details", Static).update(f"acceptance {acc}\ntime {share}")

    def on_mount(self) -> None:
        self.watch_reading(self.reading)
