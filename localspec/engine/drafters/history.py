"""Drafting from the history of earlier requests: suffix decoding.

The engine keeps an index of what its target wrote before (``history_store``): earlier answers
with the end of their prompts, and the chat app's saved conversations. This drafter proposes
what followed the longest earlier match of the current context's end, each token weighted by the
share of the longest matches that came that far and continued with it. Free to run (a lookup is
tens of microseconds on a million tokens) and, where a request repeats an earlier one (an agent
resending a file, a tool call in a fixed schema, "the same again with one change"), right for
long runs.

Where such a copy parts from the target's text (the one change), the context's end matches
nothing for a while: the target's new tokens are in no earlier text. But the earlier text goes
on after the change, and the target's usually rejoins it within a few tokens (a name renamed, a
line added). So the drafter remembers where its last copy parted, and once the target writes a
token the earlier text holds just past that point, it resumes the copy from there. On the F16
agent trace this re-synced copy's first token was right four times in five, at positions where
no proposal matched (see benchmarks/README.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..history_index import MARK_TIED, Continuation
from .base import DraftContext, Drafter
from .proposal import Proposal, TreeRequest


@dataclass(frozen=True, slots=True)
class _Copy:
    """An earlier text being copied: from position ``start`` of the context on, ``tokens``
    (with their marks) as the earlier text went on."""

    start: int
    tokens: tuple[int, ...]
    marks: tuple[int, ...]

    def parted(self, seq: Sequence[int]) -> _Copy | None:
        """Where ``seq`` (written since ``start``) parts from this copy: the earlier text from
        that position on; None while it still follows it."""
        written = seq[self.start:]
        m = next((i for i, (a, b) in enumerate(zip(written, self.tokens, strict=False))
                  if a != b), None)
        if m is None:
            return None
        return _Copy(self.start + m, self.tokens[m:], self.marks[m:])

    def rest(self, seq: Sequence[int]) -> _Copy | None:
        """What this copy goes on with after ``seq`` (which still follows it); None where
        nothing is left."""
        done = len(seq) - self.start
        return _Copy(len(seq), self.tokens[done:], self.marks[done:]) \
            if done < len(self.tokens) else None


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
    # A copy is remembered, to resume where it parts, when its match was at least this
    # confident (a match of four tokens or more): a shorter one is no copy of anything.
    COPY_CONFIDENCE = 0.5
    # For how many of the target's tokens after a copy parted it may be resumed, and how far
    # past the parting the earlier text is searched for the target's last token (a few
    # tokens replaced, or a few more).
    RESUME_WINDOW = 24
    RESUME_LEAD = 8
    # A resumed copy's confidence, every token (its first was right at 0.8 on the F16 trace,
    # those after it at about 0.9); the controller's bins learn what it is worth here.
    RESUME_CONFIDENCE = 0.75
    # The longest tail a copy keeps: as far as a draft can go, and the window past it.
    TAIL = 64 + RESUME_WINDOW

    def __init__(self) -> None:
        self._copy: _Copy | None = None  # the last confident copy proposed, or a resumed one
        self._resumed_copy = False  # whether that copy is a resumed one
        self._parted: _Copy | None = None  # where the last copy parted, and what followed

    def propose(self, ctx: DraftContext, budget: int) -> Proposal:
        if budget <= 0 or ctx.history is None:
            return Proposal(source=self.name)
        self._follow(ctx.seq)
        # Past the budget: the token after it has the mark that says whether the position
        # after the draft was a near-tie, and the rest is what a copy that parts resumes from.
        found = ctx.history.lookup(ctx.seq, max(budget + 1, self.TAIL))
        confidences = self._confidences(found) if found is not None else []
        confident = bool(confidences) and confidences[0] >= self.COPY_CONFIDENCE
        if found is not None and confident:
            self._copy, self._resumed_copy = _Copy(len(ctx.seq), found.tokens, found.marks), False
        resumed = None if confident else self._resumed(ctx.seq)
        if resumed is not None:
            # Followed like any copy: where it parts again (a later change), it resumes there.
            self._copy, self._resumed_copy, self._parted = resumed, True, None
            return self._proposal(list(resumed.tokens),
                                  [self.RESUME_CONFIDENCE] * len(resumed.tokens),
                                  resumed.marks, budget)
        if found is None:
            return Proposal(source=self.name)
        n = next((i for i, share in enumerate(found.agreement)
                  if i and share < self.MIN_AGREEMENT), len(found.tokens))
        return self._proposal(list(found.tokens[:n]), confidences[:n], found.marks, budget)

    def _confidences(self, found: Continuation) -> list[float]:
        # A chain is a tree whose every token's parent is the one before it.
        return self._given_parents(found.agreement, range(-1, len(found.agreement) - 1),
                                   found.match_length)

    def _proposal(self, tokens: list[int], confidences: list[float], marks: Sequence[int],
                  budget: int) -> Proposal:
        n = min(len(tokens), budget)
        kept = list(marks[:n + 1])
        if MARK_TIED in kept[:n]:
            # Where the target met a near-tie before, batched verification stops again (a
            # one-token pass decides it): tokens past it would be checked for nothing.
            n = kept.index(MARK_TIED)
            del kept[n + 1:]
        return Proposal(source=self.name, tokens=tokens[:n], confidences=confidences[:n],
                        marks=kept)

    def _follow(self, seq: Sequence[int]) -> None:
        """Note where the last copy parted from what the target wrote since it was proposed."""
        if self._copy is not None and (parted := self._copy.parted(seq)) is not None:
            self._parted, self._copy, self._resumed_copy = parted, None, False

    def _resumed(self, seq: Sequence[int]) -> _Copy | None:
        """A resumed copy the target still follows, from where it got to; else the parted
        copy from just past where the target's last token rejoins it, within the window; None
        where it does not. (Searched for again, a resumed copy's next step would start from
        the first use of a token that comes back, a comma or a bracket, not from where the
        target got to.)"""
        if self._copy is not None and self._resumed_copy:
            return self._copy.rest(seq)
        parted = self._parted
        since = len(seq) - parted.start if parted is not None else 0
        if parted is None or not 0 < since <= self.RESUME_WINDOW:
            return None
        last = seq[-1]
        for k in range(1, min(len(parted.tokens), since + self.RESUME_LEAD)):
            if parted.tokens[k - 1] == last:
                return _Copy(len(seq), parted.tokens[k:], parted.marks[k:])
        return None

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
        trie = Proposal(source=self.name, tokens=list(found.tokens),
                        confidences=self._given_parents(found.shares, found.parents,
                                                        found.match_length),
                        parents=list(found.parents))
        out.graft(trie, request.nodes, request.branches)  # within the leaves the target holds
        return out

    def _given_parents(self, shares: Sequence[float], parents: Sequence[int],
                       match_length: int) -> list[float]:
        """Each token's confidence given the ones above it were right, as the controller
        multiplies them: the share of the matches through its parent that went on through it,
        and a match as long as the context's plus the tokens above it (a copy the target
        follows 8 tokens past a 5-token match is no coincidence any more). ``parents`` as a
        tree's (-1: the context's end), parents first."""
        depths: list[int] = []
        out: list[float] = []
        for share, parent in zip(shares, parents, strict=True):
            above, depth = (shares[parent], depths[parent] + 1) if parent >= 0 else (1.0, 0)
            depths.append(depth)
            out.append(share / above * self._discount(match_length + depth))
        return out

    def _discount(self, match_length: int) -> float:
        # A long earlier match is far likelier to go on as before than a three-token one:
        # the confidence is the matches' agreement, discounted for a short match.
        return 1.0 - 0.5 ** (match_length / self.MATCH_HALF)
