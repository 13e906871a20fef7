"""Numbers as people read them, the same in the CLI and the chat app; text from files as a
terminal can show it."""

from __future__ import annotations

import unicodedata


def human_bytes(n: int | float | None, missing: str = "-") -> str:
    """Bytes in decimal units, as Ollama and disk vendors show them (``4.7 GB``)."""
    if n is None:
        return missing
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def human_count(n: int | None, missing: str = "-") -> str:
    """A parameter count as ``1.5B`` / ``500.0M`` / ``12.0K``."""
    if n is None:
        return missing
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def printable(text: str) -> str:
    """``text`` with control and format characters escaped (``\\n``, ``\\x1b``, ``\\u202e``):
    a string from a model file or from llama.cpp, said in one line, can neither break the
    line, nor drive the terminal, nor reorder what follows it."""
    if text.isprintable():
        return text
    return "".join(ch.encode("unicode_escape").decode("ascii")
                   if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") else ch
                   for ch in text)
