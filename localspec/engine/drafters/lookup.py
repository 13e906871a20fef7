"""Prompt lookup: drafting by n-gram matches in the text so far."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import DraftContext, Drafter
from .proposal import Proposal, TreeRequest

if TYPE_CHECKING:
    from ..llama_backend import LlamaRunner
    from .base import DraftSettings


class PromptLookupDrafter(Drafter):
    """Proposes the tokens that followed the most recent earlier occurrence of the current
    suffix n-gram (longest n first). Free to run, and strong when the answer copies its prompt."""

    name = "lookup"
    title = "prompt lookup"
    prior_rate = 0.5
    # Recent occurrences of an n-gram kept: the continuations a tree may offer.
    CONTINUATIONS = 4
    # A match is measured back this far past its n-gram: a 4-gram says little, 40 tokens
    # copied in a row (an edit rewriting its input) say the copy goes on.
    LOOKBACK = 64
    # Matched tokens that halve the doubt in a match (8: 50%, 16: 75%, 32: 94%): the
    # confidence the acceptance model's bins start from, then learn from.
    MATCH_HALF = 8.0
    calibrated = True

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        # Each n-gram's most recent continuations (where they start), oldest first.
        self._index: dict[tuple[int, ...], list[int]] = {}
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
                ends = self._index.setdefault(tuple(seq[end - n:end]), [])
                ends.append(end)
                if len(ends) > self.CONTINUATIONS:
                    del ends[0]
        self._indexed = list(seq)

    def _matches(self, seq: Sequence[int]) -> tuple[int, list[int]]:
        """The longest suffix n-gram that occurred before, and where its continuations start
        (most recent first); (0, []) if none did."""
        if len(seq) < self.ngram_min + 1:
            return 0, []
        # Index everything but the last position so a suffix never matches itself.
        self._extend_index(seq[:-1])
        for n in range(min(self.ngram_max, len(seq) - 1), self.ngram_min - 1, -1):
            ends = self._index.get(tuple(seq[-n:]))
            if ends:
                return n, ends[::-1]
        return 0, []

    def _confidence(self, seq: Sequence[int], start: int, n: int) -> float:
        """How far the text before ``start`` matches the end of ``seq`` (at least the n-gram
        found, at most LOOKBACK), as a confidence that the copy goes on."""
        length = n
        while (length < self.LOOKBACK and start - length - 1 >= 0
               and seq[start - length - 1] == seq[-length - 1]):
            length += 1
        return 1.0 - 0.5 ** (length / self.MATCH_HALF)

    def propose(self, ctx: DraftContext, budget: int) -> Proposal:
        seq = ctx.seq
        n, starts = self._matches(seq) if budget > 0 else (0, [])
        if not starts:
            return Proposal(source=self.name)
        cont = list(seq[starts[0]:starts[0] + budget])
        conf = self._confidence(seq, starts[0], n)
        return Proposal(source=self.name, tokens=cont, confidences=[conf] * len(cont))

    def propose_tree(self, ctx: DraftContext, request: TreeRequest) -> Proposal:
        """The continuations of the suffix's recent occurrences as the branches of one tree,
        most recent first, shared beginnings merged (``Proposal.graft``)."""
        seq = ctx.seq
        n, starts = self._matches(seq) if request.nodes > 0 else (0, [])
        prop = Proposal(source=self.name)
        for start in starts:
            cont = list(seq[start:start + request.depth])
            conf = self._confidence(seq, start, n)
            prop.graft(Proposal(source=self.name, tokens=cont, confidences=[conf] * len(cont)),
                       request.nodes, request.branches)
        return prop
