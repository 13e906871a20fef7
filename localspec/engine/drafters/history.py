"""Drafting from the history of earlier requests: suffix decoding.

The engine keeps an index of what its target wrote before (``history_store``): earlier answers
with the end of their prompts, and the chat app's saved conversations. This drafter proposes
what followed the longest earlier match of the current context's end, each token weighted by the
share of the longest matches that continued with it. Free to run (a lookup is tens of
microseconds on a million tokens) and, where a request repeats an earlier one (an agent resending
a file, a tool call in a fixed schema, "the same again with one change"), right for long runs.
"""

from __future__ import annotations

from ..history_index import MARK_TIED
from .base import DraftContext, Drafter
from .proposal import Proposal, TreeRequest


class HistoryDrafter(Drafter):
    """Proposes the continuation of the longest match of the context's end in the engine's
    history; nothing where the engine keeps no history or it holds no match."""

    name = "history"
    title = "the history of earlier requests"
    prior_rate = 0.5
    needs_history = True
    companion = True  # its index is other requests: nothing prompt lookup or a draft model sees

    # A continuation is cut where fewer than this share of the longest matches still agree
    # with it: past that point the earlier requests disagree, and the draft is a coin toss
    # that costs a verified position each.
    MIN_AGREEMENT = 0.5
    # Matched context tokens that halve the doubt in a match (4: 50%, 8: 75%, 16: 94%).
    MATCH_HALF = 4.0
    calibrated = True

    def propose(self, ctx: DraftContext, budget: int) -> Proposal:
        if budget <= 0 or ctx.history is None:
            return Proposal(source=self.name)
        # One token past the budget: its mark says whether the position after the draft was
        # a near-tie.
        found = ctx.history.lookup(ctx.seq, budget + 1)
        if found is None:
            return Proposal(source=self.name)
        n = next((i for i, share in enumerate(found.agreement)
                  if i and share < self.MIN_AGREEMENT), len(found.tokens))
        n = min(n, budget)
        marks = list(found.marks[:n + 1]) if found.marks else []
        if MARK_TIED in marks[:n]:
            # Where the target met a near-tie before, batched verification stops again (a
            # one-token pass decides it): tokens past it would be checked for nothing.
            n = marks.index(MARK_TIED)
            del marks[n + 1:]
        length = self._discount(found.match_length)
        return Proposal(source=self.name, tokens=list(found.tokens[:n]),
                        confidences=[share * length for share in found.agreement[:n]],
                        marks=marks)

    def propose_tree(self, ctx: DraftContext, request: TreeRequest) -> Proposal:
        """Where the earlier matches went different ways (a file revised one change at a
        time, a schema's fields filled differently), each way as a branch: the target picks
        whichever it would have written, in the one pass."""
        out = Proposal(source=self.name)
        if request.nodes <= 0 or request.depth <= 0 or ctx.history is None:
            return out
        found = ctx.history.lookup_tree(ctx.seq, request.depth, request.nodes)
        if found is None:
            return out
        length = self._discount(found.match_length)
        trie = Proposal(source=self.name, tokens=list(found.tokens),
                        confidences=[share * length for share in found.shares],
                        parents=list(found.parents))
        out.graft(trie, request.nodes, request.branches)  # within the leaves the target holds
        return out

    def _discount(self, match_length: int) -> float:
        # A long earlier match is far likelier to go on as before than a three-token one:
        # the confidence is the matches' agreement, discounted for a short match.
        return 1.0 - 0.5 ** (match_length / self.MATCH_HALF)
