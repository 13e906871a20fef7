"""Prompt lookup: drafting by n-gram matches in the text so far."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import DraftContext, Drafter
from .proposal import Proposal

if TYPE_CHECKING:
    from ..llama_backend import LlamaRunner
    from .base import DraftSettings


class PromptLookupDrafter(Drafter):
    """Proposes the tokens that followed the most recent earlier occurrence of the current
    suffix n-gram (longest n first). Free to run, and strong when the answer copies its prompt."""

    name = "lookup"
    title = "prompt lookup"
    prior_rate = 0.5

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed: list[int] = []

    @classmethod
    def create(cls, settings: DraftSettings,
               draft_model: LlamaRunner | None) -> PromptLookupDrafter:
        return cls(settings.lookup_ngram_max, settings.lookup_ngram_min)

    def _extend_index(self, seq: Sequence[int]) -> None:
        # Incremental: only n-grams ending at new positions are added; a different prefix
        # (new request) rebuilds from scratch.
        n_old = len(self._indexed)
        if n_old > len(seq) or list(seq[:n_old]) != self._indexed:
            self._index.clear()
            self._indexed = []
            n_old = 0
        for end in range(max(n_old, 1), len(seq) + 1):
            for n in range(self.ngram_min, self.ngram_max + 1):
                if end - n < 0:
                    break
                # The key is an n-gram ending at `end`; the value is where its continuation starts.
                self._index[tuple(seq[end - n:end])] = end
        self._indexed = list(seq)

    def propose(self, ctx: DraftContext, budget: int) -> Proposal:
        seq = ctx.seq
        if budget <= 0 or len(seq) < self.ngram_min + 1:
            return Proposal(source=self.name)
        # Index everything but the last position so a suffix never matches itself.
        self._extend_index(seq[:-1])
        for n in range(min(self.ngram_max, len(seq) - 1), self.ngram_min - 1, -1):
            start = self._index.get(tuple(seq[-n:]))
            if start is not None:
                cont = list(seq[start:start + budget])
                return Proposal(source=self.name, tokens=cont,
                                confidences=[float(n) / self.ngram_max] * len(cont))
        return Proposal(source=self.name)
