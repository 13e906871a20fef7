"""Token bytes to streamed text: UTF-8 reassembly and stop strings that never leak."""

from __future__ import annotations

import codecs
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TextChunk:
    """Streamed text. ``drafted`` marks text of tokens the target accepted from a drafter."""

    text: str
    drafted: bool = False


class TextAssembler:
    """Accumulates token bytes; releases text that cannot be the start of a stop string."""

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self.stop = tuple(s for s in stop if s)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held: list[TextChunk] = []
        self.text = ""  # everything released so far
        self.stopped = False

    def _held_text(self) -> str:
        return "".join(c.text for c in self._held)

    def feed(self, data: bytes, drafted: bool) -> list[TextChunk]:
        """Add one token's bytes; return the chunks now safe to show."""
        if self.stopped:
            return []
        piece = self._decoder.decode(data)
        if piece:
            self._held.append(TextChunk(piece, drafted))
        return self._release(final=False)

    def finish(self) -> list[TextChunk]:
        tail = self._decoder.decode(b"", final=True)
        if tail and not self.stopped:
            self._held.append(TextChunk(tail, False))
        return self._release(final=True)

    def _release(self, final: bool) -> list[TextChunk]:
        held = self._held_text()
        if not held:
            return []
        cut = len(held)
        for s in self.stop:
            # Search from just before the held text: a stop may straddle released and held text,
            # but released text never contains a full stop string, so searching held suffices
            # together with the hold-back below.
            idx = held.find(s)
            if idx != -1 and idx < cut:
                cut = idx
                self.stopped = True
        if not self.stopped and not final:
            cut = len(held) - self._partial_stop_len(held)
        return self._emit(cut)

    def _partial_stop_len(self, held: str) -> int:
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(held)), best, -1):
                if held.endswith(s[:n]):
                    best = n
                    break
        return best

    def _emit(self, n_chars: int) -> list[TextChunk]:
        out: list[TextChunk] = []
        rest: list[TextChunk] = []
        left = n_chars
        for chunk in self._held:
            if left >= len(chunk.text):
                out.append(chunk)
                left -= len(chunk.text)
            elif left > 0:
                out.append(TextChunk(chunk.text[:left], chunk.drafted))
                rest.append(TextChunk(chunk.text[left:], chunk.drafted))
                left = 0
            else:
                rest.append(chunk)
        self._held = [] if self.stopped else rest
        self.text += "".join(c.text for c in out)
        return _merge(out)


def _merge(chunks: list[TextChunk]) -> list[TextChunk]:
    merged: list[TextChunk] = []
    for c in chunks:
        if merged and merged[-1].drafted == c.drafted:
            merged[-1] = TextChunk(merged[-1].text + c.text, c.drafted)
        else:
            merged.append(c)
    return merged
