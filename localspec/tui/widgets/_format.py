"""Small formatting helpers shared by the widgets (no Textual imports)."""

from __future__ import annotations

from rich.text import Text

from ...formatting import human_bytes as _human_bytes


def human_bytes(n: int | float | None) -> str:
    return _human_bytes(n, missing="—")


def bar(fraction: float | None, width: int = 18) -> Text:
    """A horizontal bar; green, then yellow above 75 %, red above 90 %."""
    if fraction is None:
        return Text("·" * width, style="dim")
    fraction = min(1.0, max(0.0, fraction))
    filled = round(fraction * width)
    style = "red" if fraction > 0.9 else "yellow" if fraction > 0.75 else "green"
    return Text.assemble(("█" * filled, style), ("░" * (width - filled), "dim"))


def percent(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}%"
