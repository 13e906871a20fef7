"""Small text helpers shared by the model subcommands' output."""

from __future__ import annotations

from ..formatting import human_bytes, human_count

__all__ = ["human_bytes", "human_count", "table"]


def table(rows: list[list[str]], header: list[str]) -> str:
    """A plain aligned text table (scripts should use --json instead of parsing this)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in [header, *rows]]
    return "\n".join(lines)
