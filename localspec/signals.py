"""Signal names for the lines that say how a process died (a leaf: the standard library only)."""

from __future__ import annotations

import signal


def signal_name(signum: int, unknown: str | None = None) -> str:
    """``SIGSEGV`` for 11; for a number that names no signal here, ``unknown`` (by default
    ``signal N``)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return unknown if unknown is not None else f"signal {signum}"
