"""What the engine is doing right now, readable by another process after this one died.

llama.cpp is native code: a kernel bug or a failed assertion kills the process with a signal, and
nothing in Python runs afterwards. So the engine writes what it is about to do (``loading``,
``prefill``, ``drafting``, ``verifying``, ``decoding``) and with which model into a small shared
memory board *before* each native call; a supervising process (the CLI's crash guard, the chat
app's or the server's engine supervisor) reads it after the death and can say "signal 11 while
verifying with model X" instead of nothing.

The board is process-global on purpose, like ``faulthandler``: it describes this process. Until a
supervisor installs one, writing is a no-op.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BOARD_SIZE = 1024
_ENCODING = "utf-8"


@dataclass(frozen=True, slots=True)
class Activity:
    phase: str
    model: str

    def describe(self) -> str:
        """``verifying with target.gguf`` (or just the phase when no model is named)."""
        name = Path(self.model).name if self.model else ""
        return f"{self.phase} with {name}" if name else self.phase


class Board:
    """A fixed-size shared buffer holding one ``phase\\0model\\0`` record."""

    def __init__(self, buf: mmap.mmap) -> None:
        self._buf = buf

    @classmethod
    def anonymous(cls) -> Board:
        """Shared with children forked after this call (the CLI's crash guard)."""
        return cls(mmap.mmap(-1, BOARD_SIZE, flags=mmap.MAP_SHARED))

    @classmethod
    def file(cls, path: Path) -> Board:
        """Backed by a file another process maps too (an engine process and its supervisor)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a+b") as fh:
            if fh.seek(0, 2) < BOARD_SIZE:
                fh.truncate(BOARD_SIZE)
            fh.flush()
            return cls(mmap.mmap(fh.fileno(), BOARD_SIZE))

    def write(self, phase: str, model: str) -> None:
        record = f"{phase}\0{model}\0".encode(_ENCODING, "replace")[: BOARD_SIZE - 1]
        # Phase first in a single slice assignment: a reader after a crash sees one record.
        self._buf[: len(record) + 1] = record + b"\0"

    def read(self) -> Activity | None:
        raw = bytes(self._buf[:BOARD_SIZE])
        parts = raw.split(b"\0")
        phase = parts[0].decode(_ENCODING, "replace") if parts else ""
        if not phase:
            return None
        model = parts[1].decode(_ENCODING, "replace") if len(parts) > 1 else ""
        return Activity(phase, model)

    def clear(self) -> None:
        self._buf[:1] = b"\0"


_board: Board | None = None


def install(board: Board | None) -> None:
    """Make the engine report into ``board`` (None: stop reporting)."""
    global _board
    _board = board


def report(phase: str, model: Path | str = "") -> None:
    """Record what the next native call does. Cheap: a few hundred bytes into shared memory."""
    if _board is not None:
        _board.write(phase, str(model))


def idle() -> None:
    if _board is not None:
        _board.clear()


@contextlib.contextmanager
def doing(phase: str, model: Path | str = "") -> Iterator[None]:
    """Report ``phase`` for the duration of a block (then idle, if it ended normally)."""
    report(phase, model)
    yield
    idle()
