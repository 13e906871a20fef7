"""Small text helpers shared by the model subcommands' output."""

from __future__ import annotations


def human_size(n: int | None) -> str:
    """Bytes as a short human size (``4.7 GB``), or ``-`` when unknown."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def human_count(n: int | None) -> str:
    """A parameter count as ``1.5B`` / ``500M`` / ``12K``."""
    if n is None:
        return "-"
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def table(rows: list[list[str]], header: list[str]) -> str:
    """A plain aligned text table (scripts should use --json instead of parsing this)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in [header, *rows]]
    return "\n".join(lines)
