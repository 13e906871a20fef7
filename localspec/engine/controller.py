"""Choosing how many tokens to draft, each step, so that speculation never costs throughput.

The cost side is measured on this machine: the target's time to decode n tokens in one batch and
the draft's time per token (calibrated at load, then tracked online). The benefit side is the
expected number of tokens a step yields, from per-token acceptance estimates: the draft model's
own confidence, calibrated online against what the target actually accepted. Whether to draft
at all is judged on the expected tokens per second of a whole step (Leviathan et al.'s expected
length); zero drafted tokens, plain decoding, is always a choice. Once drafting, each further
token is judged at the margin: worth it if the tokens it adds outweigh the seconds it adds,
priced at the long-run token rate (a renewal-reward argument: time already spent in a step is
spent whatever comes next, so it must not sway the choice).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from . import drafters, tree_planner
from .drafters import Proposal
from .history_index import MARK_CLEAR, MARK_TIED
from .tree_planner import TreePlan

# Confidence bins' upper edges: tenths, with the top tenth split. A copy's deep tokens (0.99
# and up, given the tokens before them held) and the first tokens of 9-token matches (0.9)
# pooled in one bin priced long copies at the first tokens' rate, and cut them short.
BIN_EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.97, 0.99, 1.0)
N_BINS = len(BIN_EDGES)
_BIN_CENTRES = tuple((lo + hi) / 2 for lo, hi in zip((0.0, *BIN_EDGES[:-1]), BIN_EDGES,
                                                      strict=True))


def confidence_bin(conf: float) -> int:
    """The bin of a confidence: the first whose upper edge is above it (the last holds 1)."""
    return min(bisect.bisect_right(BIN_EDGES, conf), N_BINS - 1)


def _slope(points: dict[int, float], ns: list[int]) -> float:
    """Seconds per extra token past the last measured point."""
    if len(ns) < 2:
        return 0.0
    a, b = ns[-2], ns[-1]
    return max(0.0, (points[b] - points[a]) / (b - a))


@dataclass(slots=True)
class CostModel:
    """Seconds per target decode of n tokens (index n), and per draft-model token."""

    target: list[float]
    draft_token: float
    smoothing: float = 0.25
    # False: a what-if's costs, fixed. The first-observation shortcuts below (a draft's first
    # token, its catch-up) would otherwise take this machine's times into a stated curve.
    learning: bool = True
    # Seconds of host work per node of a draft model's tree, outside any decode: ranking each
    # node's children, the KV cache's branch bookkeeping. No device pass prices it, and at GPU
    # speed it weighs like the passes a wide tree saves (benchmarks/README.md, 2026-12-04
    # evening: 0.36 ms a node here, against a 12 ms pass). It is this machine's CPU's, so
    # learned even where a what-if fixes the device's costs. Until a tree is drafted, a chain's
    # host work per drafted token stands in for it (see observe_draft_host); 0 before either.
    tree_node_host: float = 0.0
    tree_host_seen: bool = False  # a tree's host work has been observed
    # Seconds per token when the draft catches up, in one batch, on tokens it skipped while the
    # target decoded alone; 0 until observed (then estimated from the target's batched curve).
    catch_up_token: float = 0.0
    # Seconds of a step's first drafted token: the draft first takes in the 1-2 tokens the last
    # step added (one batch), which costs more than a draft token (here 45 ms against 25 for
    # the 0.5B draft on a CPU); 0 until observed (then a draft token).
    draft_first: float = 0.0
    # Measured target passes wider than ``target`` (token trees: up to 256 nodes, copies),
    # by width, in order of width.
    wide: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_measurements(cls, points: dict[int, float], k_max: int, draft: float) -> CostModel:
        """Piecewise-linear through measured (n tokens -> seconds) points. The curve is often
        concave (on a CPU with an F16 target, going from 1 to 2 tokens costs far more than
        from 5 to 6), so two points are not enough."""
        ns = sorted(points)
        table = [0.0]
        for n in range(1, k_max + 2):
            lo = max((m for m in ns if m <= n), default=ns[0])
            hi = min((m for m in ns if m >= n), default=ns[-1])
            if hi == lo:
                t = points[lo] + (n - lo) * _slope(points, ns) if n > lo else points[lo]
            else:
                t = points[lo] + (points[hi] - points[lo]) * (n - lo) / (hi - lo)
            table.append(max(t, points[ns[0]]))
        wide = {n: t for n, t in sorted(points.items()) if n >= len(table)}
        return cls(target=table, draft_token=draft, wide=wide)

    @classmethod
    def from_calibration(cls, t1: float, tn: float, n: int, k_max: int, draft: float) -> CostModel:
        return cls.from_measurements({1: t1, n: tn}, k_max, draft)

    def verify(self, n: int) -> float:
        table = self.target
        if n < len(table) or not self.wide:
            return table[min(n, len(table) - 1)]
        # Past the table (a token tree): linear between measured wide points, and past the
        # widest along the last segment's slope.
        lo_n, lo_t, slope = len(table) - 1, table[-1], 0.0
        for m, t in self.wide.items():  # kept in order of width (see observe_verify)
            if n <= m:
                return lo_t + (t - lo_t) * (n - lo_n) / (m - lo_n)
            lo_n, lo_t, slope = m, t, (t - lo_t) / (m - lo_n)
        return lo_t + max(0.0, slope) * (n - lo_n)

    def verify_floor(self, n: int) -> float:
        """The least a target pass over ``n`` tokens or more may cost: measured costs need not
        climb with width (noise, a wider kernel), and between and past the measured widths
        ``verify`` is linear, so its least is at ``n`` or at a measured width."""
        floor = self.verify(n)
        for t in self.target[n:]:
            floor = min(floor, t)
        for m, t in self.wide.items():
            if m >= n:
                floor = min(floor, t)
        return floor

    def observe_verify(self, n: int, seconds: float) -> None:
        if not self.learning:
            return
        if 0 < n < len(self.target):
            self.target[n] += self.smoothing * (seconds - self.target[n])
        elif n in self.wide:
            self.wide[n] += self.smoothing * (seconds - self.wide[n])
        elif n < self.widest:
            # A width between the measured ones becomes a point of its own: between them the
            # price is a straight line, and a CPU's is steps (Q4_K_M on AVX-512: 32 tokens
            # at 9.5 passes, 33 at 12.1, where the line said 9.6), so copies of 33-56 tokens
            # were priced cheap for good and took 17% longer than copies cut at 32.
            prior = self.verify(n)
            self.wide = dict(sorted({**self.wide,
                                     n: prior + self.smoothing * (seconds - prior)}.items()))

    @property
    def widest(self) -> int:
        """The widest target pass measured (or in the table): what a plan may rely on."""
        return max(len(self.target) - 1, max(self.wide, default=0))

    def node_host(self) -> float:
        """Host seconds a draft model's tree node costs (see ``tree_node_host``)."""
        return self.tree_node_host

    def observe_draft_host(self, tokens: int, seconds: float, tree: bool) -> None:
        """A draft model's proposal of ``tokens`` tokens spent ``seconds`` of host work.

        A tree's teaches the price of a tree node. A chain's, per token, stands in for it until
        a tree is drafted: the same kind of work (a pick over the draft's logits, bookkeeping;
        0.28-0.41 ms a chain token against 0.29-0.42 ms a tree node, benchmarks/README.md), so
        the first plan is priced from this CPU rather than at nothing (a GPU's first tree was
        a 60-node one, 23 ms of host work), and one slow first tree moves the price by the
        smoothing instead of setting it, where it could turn trees off for good."""
        if tokens <= 0 or (self.tree_host_seen and not tree):
            return
        self.tree_node_host = self._moved(self.tree_node_host, seconds / tokens)
        self.tree_host_seen = self.tree_host_seen or tree

    def draft_start(self) -> float:
        """Seconds of a step's first draft pass (see ``draft_first``)."""
        return self.draft_first if self.draft_first > 0 else self.draft_token

    def draft_pass(self, width: int) -> float:
        """Seconds of one draft pass over ``width`` tree nodes: a draft token, scaled as a
        batch of that width scales the target's pass (the draft runs on the same device)."""
        if width <= 1:
            return self.draft_token
        return self.draft_token * self.verify(width) / self.verify(1)

    def observe_draft(self, per_token: float) -> None:
        if not self.learning:
            return
        self.draft_token += self.smoothing * (per_token - self.draft_token)

    def observe_draft_pass(self, width: int, seconds: float) -> None:
        """A tree level's draft pass over ``width`` nodes took ``seconds``: read back, through
        the same scaling ``draft_pass`` prices it by, as the draft token it implies, so a
        request that drafts only trees keeps its draft's price as current as chains do."""
        self.observe_draft(seconds * self.verify(1) / self.verify(max(width, 1)))

    def observe_draft_first(self, seconds: float) -> None:
        if not self.learning:
            return
        self.draft_first = self._moved(self.draft_first, seconds)

    def drafting(self, n: int) -> float:
        """Seconds to draft ``n`` tokens in a step that follows a drafting step."""
        if n <= 0:
            return 0.0
        first = self.draft_first if self.draft_first > 0 else self.draft_token
        return first + (n - 1) * self.draft_token

    def catch_up(self, n: int) -> float:
        """Seconds for the draft to process ``n`` skipped tokens before it can draft."""
        if n <= 1:
            return 0.0
        per = self.catch_up_token
        if per <= 0:  # a batched token costs the draft what it costs the target, relatively
            widest = len(self.target) - 1
            per = self.draft_token * self.target[widest] / (widest * self.target[1])
        return n * per

    def observe_catch_up(self, n: int, seconds: float) -> None:
        if n > 1 and self.learning:
            self.catch_up_token = self._moved(self.catch_up_token, seconds / n)

    def _moved(self, price: float, seen: float) -> float:
        """A price that starts unknown (0) taken whole from its first observation, then
        moved toward each one by ``smoothing``."""
        return seen if price <= 0 else price + self.smoothing * (seen - price)


MAX_DEPTH = 33  # depths learned apart: a model's drafts are at most 32 tokens (a free
# drafter's copy may run longer: its deeper tokens share the last depth's estimate)


class AcceptanceModel:
    """P(target accepts a drafted token), learned online, two ways:

    * by the drafter's confidence, binned: each bin starts from a prior equal to its confidence
      and moves with the observed outcomes;
    * by depth in the draft: the acceptance of the first drafted token, of the second given the
      first was accepted, and so on. Acceptance is not the same at every depth (in prose here:
      ~64% for the first token, ~45% for the second), and one running rate for all depths made
      auto too pessimistic to draft even one token where one token paid.

    A depth's estimate is this request's outcomes there against a prior worth PRIOR_WEIGHT
    outcomes (what past requests saw at that depth or, at a depth no request has reached, this
    request's estimate one depth shallower); each newer outcome fades the older ones and the
    prior alike. So a request's own text takes over within a few steps (a code prompt after a
    copy-heavy one no longer drafts long for a dozen steps on borrowed optimism), and a draft
    that keeps being accepted is tried one token deeper instead of being held at the depth it
    happened to start with.

    Only tokens up to and including the first rejection are observed."""

    __slots__ = ("hits", "seen", "rates", "prior_rates", "_depth_hits",
                 "_depth_seen", "_depth_prior", "_observed", "_request_hits", "_request_seen",
                 "_sibling_hits", "_sibling_seen", "_calib_hits", "_calib_expected",
                 "_early_hits", "_early_expected", "_early_seen", "_early_ratios")

    # A token tree's other guesses (rank 1, 2, ... below the draft's first): P(the target
    # chose it | its parent was accepted), before any tree was verified, and the outcomes
    # that prior counts as. Learned over requests (a property of the pair, not of a text).
    SIBLING_PRIOR = (0.12, 0.06, 0.03)
    SIBLING_PRIOR_WEIGHT = 20.0

    # The carried prior counts as this many outcomes at each depth.
    PRIOR_WEIGHT = 4.0
    # Each newer outcome at a depth fades the older ones by this factor: a request drifts (code,
    # then prose), so its estimate covers roughly its last 1 / (1 - DECAY) outcomes. At 0.9
    # (ten outcomes) one unlucky run, where drafting gains only ~10%, dropped the first depth
    # below the margin, and auto decoded plainly for a hundred steps (simulated prose: 0.88x
    # the best fixed K).
    DECAY = 0.95
    # Per plain step, the fraction of this request's faded outcomes handed back to the prior
    # (see relax): a dip is retried within ~15 steps, not ~50.
    RELAX = 0.07

    # A confidence bin's prior, its own centre, counts as this many outcomes. At 2, a bin that
    # met five rejections in a row was trimmed ever after, so never verified again: stuck at
    # 0.04 for tokens accepted 15% of the time, taught to the depth estimates as that.
    BIN_PRIOR_WEIGHT = 10.0
    # This request's accepted tokens against what the bins predicted for them (see
    # request_estimate) start from agreement worth this many predicted acceptances.
    CALIB_PRIOR = 4.0
    # A request's first EARLY checked tokens say whether its own text bears out the pooled
    # bins (their acceptances over the bins' predictions). Until they are in, a drafter whose
    # last TRUSTED_AFTER requests all bore them out (each at TRUST_RATIO or better) is
    # trusted; any other is unproven in this request (see DraftController.UNPROVEN_LOSS).
    # On a cold index the type-hint edit's copies held and the rename prompt's did not, at
    # the same match lengths (offline, first tokens after an 8-11 token match: 8 of 8
    # against 4 of 7): one request's bins say little of the next one's text.
    EARLY = 8
    TRUSTED_AFTER = 3
    TRUST_RATIO = 0.8

    def __init__(self, prior_rate: float = 0.6) -> None:
        self.hits = [0.0] * N_BINS
        self.seen = [0.0] * N_BINS
        # None: no request has reached that depth yet (its prior is the depth above).
        self.prior_rates: list[float | None] = [prior_rate] + [None] * (MAX_DEPTH - 1)
        self._observed = False
        self.rates = [prior_rate] * MAX_DEPTH
        self._sibling_hits = [0.0] * len(self.SIBLING_PRIOR)
        self._sibling_seen = [0.0] * len(self.SIBLING_PRIOR)
        # Past requests' ratios over their first EARLY outcomes (see EARLY).
        self._early_ratios: list[float] = []
        self._forget()

    @property
    def unproven(self) -> bool:
        """Whether this request's drafts are yet to show the bins hold for its text, with
        past requests not reliably bearing them out either (see EARLY)."""
        return self._early_seen < self.EARLY and not self.trusted

    @property
    def trusted(self) -> bool:
        """Whether each of the last TRUSTED_AFTER requests bore out the bins' predictions."""
        ratios = self._early_ratios
        return len(ratios) >= self.TRUSTED_AFTER and min(ratios) >= self.TRUST_RATIO

    def _observe_early(self, ok: float, predicted: float) -> None:
        if self._early_seen >= self.EARLY:
            return
        self._early_hits += ok
        self._early_expected += predicted
        self._early_seen += 1.0
        if self._early_seen >= self.EARLY:
            ratio = self._early_hits / max(self._early_expected, 1e-9)
            self._early_ratios = [*self._early_ratios, ratio][-self.TRUSTED_AFTER:]

    @property
    def sibling_rates(self) -> list[float]:
        """P(the draft's rank-r guess, r = 1, 2, ..., is the target's choice | its parent
        was accepted)."""
        w = self.SIBLING_PRIOR_WEIGHT
        return [(h + w * p) / (n + w) for h, n, p in zip(self._sibling_hits, self._sibling_seen,
                                                          self.SIBLING_PRIOR, strict=True)]

    def observe_siblings(self, outcomes: Sequence[tuple[int, float, bool]]) -> None:
        """A tree's other guesses below accepted parents, as (rank, confidence, chosen): they
        teach the confidence bins (calibration extended from chains) and the rank rates."""
        for rank, conf, hit in outcomes:
            b = confidence_bin(conf)
            self.hits[b] += hit
            self.seen[b] += 1.0
            r = min(rank, len(self.SIBLING_PRIOR)) - 1
            if r >= 0:
                self._sibling_hits[r] += hit
                self._sibling_seen[r] += 1.0

    @property
    def rate(self) -> float:
        """The estimated acceptance of a first drafted token."""
        return self.rates[0]

    @rate.setter
    def rate(self, value: float) -> None:
        """Start over believing ``value`` at every depth (as if long observed)."""
        self.prior_rates = [value] * MAX_DEPTH
        self._forget()
        self._update()

    @property
    def prior_rate(self) -> float:
        first = self.prior_rates[0]
        assert first is not None
        return first

    def _forget(self) -> None:
        """Drop this request's outcomes: back to the prior at full weight."""
        self._depth_hits = [0.0] * MAX_DEPTH
        self._depth_seen = [0.0] * MAX_DEPTH
        self._depth_prior = [self.PRIOR_WEIGHT] * MAX_DEPTH
        # All of this request's outcomes, unfaded: what it carries to the next one.
        self._request_hits = [0.0] * MAX_DEPTH
        self._request_seen = [0.0] * MAX_DEPTH
        # This request's observed acceptances and the bins' predictions for them, faded.
        self._calib_hits = 0.0
        self._calib_expected = 0.0
        # This request's first EARLY outcomes, unfaded, and the bins' predictions for them.
        self._early_hits = self._early_expected = self._early_seen = 0.0

    def _update(self, start: int = 0) -> None:
        """Recompute the depth estimates from ``start`` down (O(MAX_DEPTH), once per step)."""
        for d in range(start, MAX_DEPTH):
            prior = self.prior_rates[d]
            above = self.prior_rates[d - 1] if d else None
            if prior is None:
                prior = self.rates[d - 1]
            elif above:
                # Past requests' profile over depth, at this request's level: scaled as this
                # request's estimate one depth shallower stands to its carried prior. Else a
                # depth that past prose held low stays low in code that the draft gets right,
                # and auto never drafts deep enough to learn otherwise.
                prior = min(1.0, prior * self.rates[d - 1] / above)
            w = self._depth_prior[d]
            self.rates[d] = (self._depth_hits[d] + w * prior) / (self._depth_seen[d] + w)

    def _count(self, depth: int, outcome: float) -> None:
        d = min(depth, MAX_DEPTH - 1)
        self._depth_hits[d] = self.DECAY * self._depth_hits[d] + outcome
        self._depth_seen[d] = self.DECAY * self._depth_seen[d] + 1.0
        self._depth_prior[d] *= self.DECAY
        self._request_hits[d] += outcome
        self._request_seen[d] += 1.0

    def estimate(self, conf: float) -> float:
        b = confidence_bin(conf)
        centre = _BIN_CENTRES[b]
        w = self.BIN_PRIOR_WEIGHT
        return (self.hits[b] + w * centre) / (self.seen[b] + w)

    def request_estimate(self, conf: float) -> float:
        """``estimate`` scaled by how this request's drafts fared against it.

        The bins pool every request, so a drafter priced by them alone (prompt lookup,
        history) repeats in one text what its copies earned in another: on a cold index the
        rename prompt drafted copy after failing copy at the confidence that a type-hint
        edit's exact copies had earned (0.93x the target alone in one of three runs). Every
        observed token was reached, so its outcome is a fair draw at its estimate: the
        request's acceptances over their predicted sum measures the bins' bias here."""
        p = self.estimate(conf)
        w = self.CALIB_PRIOR
        scaled = p * (self._calib_hits + w) / (self._calib_expected + w)
        return min(scaled, max(p, 0.99))

    def depth_rates(self, start: int, n: int) -> list[float]:
        """The estimated acceptance at depths ``start`` .. ``start + n - 1``."""
        if start + n <= MAX_DEPTH:
            return self.rates[start:start + n]
        return [self.rates[min(d, MAX_DEPTH - 1)] for d in range(start, start + n)]

    def observe(self, confidences: list[float], n_accepted: int) -> None:
        seen = confidences[: n_accepted + 1]
        for i, conf in enumerate(seen):
            b = confidence_bin(conf)
            ok = 1.0 if i < n_accepted else 0.0
            self._check_bins(conf, ok)
            self.hits[b] += ok
            self.seen[b] += 1.0
            self._count(i, ok)
        if seen:
            self._observed = True
            self._update()

    def observe_undrafted(self, conf: float, accepted: bool) -> None:
        """A proposal's first token, not drafted, against the token a plain step wrote there:
        a fair draw of whether it would have been accepted (a plain step picks or samples the
        target's token as verifying would test it). It counts toward this request's check of
        the bins (EARLY, request_estimate), not the bins: those learn from drafted tokens."""
        self._check_bins(conf, 1.0 if accepted else 0.0)

    def _check_bins(self, conf: float, ok: float) -> None:
        """One outcome against the bins' prediction for it (before the bins learn it): this
        request's check of them (EARLY, request_estimate)."""
        predicted = self.estimate(conf)
        self._calib_hits = self.DECAY * self._calib_hits + ok
        self._calib_expected = self.DECAY * self._calib_expected + predicted
        self._observe_early(ok, predicted)

    def teach(self, depth: int, predicted: float) -> None:
        """A drafted token dropped unverified: its predicted acceptance stands in for it."""
        self._count(depth, predicted)
        self._update(min(depth, MAX_DEPTH - 1))

    def relax(self) -> None:
        """Fade this request's outcomes while not drafting, so the estimates drift back to the
        prior and a bad patch is retried later."""
        if not any(self._depth_seen):  # nothing to fade (plain decoding): keep the step cheap
            return
        keep = 1.0 - self.RELAX
        self._depth_hits = [h * keep for h in self._depth_hits]
        self._depth_seen = [n * keep for n in self._depth_seen]
        self._depth_prior = [w + self.RELAX * (self.PRIOR_WEIGHT - w) for w in self._depth_prior]
        self._update()

    def start_request(self) -> None:
        """A new request starts from what past requests taught (this pair on this machine)."""
        self._forget()
        self._observed = False
        self._update()

    def end_request(self) -> None:
        """What this request saw, at the depths it reached, moves the next one's prior.

        Its acceptance over all its outcomes there, not the running estimate it ended on: auto
        stops drafting on bad news, so a request's last news leans bad, and carrying the
        estimate it stopped on ratcheted the prior down request after request (0.58 to 0.36 in
        20 simulated requests whose drafts were accepted 55% of the time)."""
        if not self._observed:
            return
        for d in range(MAX_DEPTH):
            seen = self._request_seen[d]
            if seen <= 0:
                continue
            prior = self.prior_rates[d]
            # A depth reached a few times says little: its outcomes weigh against the prior.
            base = self.rates[d] if prior is None else prior
            rate = (self._request_hits[d] + self.PRIOR_WEIGHT * base) / (seen + self.PRIOR_WEIGHT)
            self.prior_rates[d] = rate if prior is None else prior + 0.3 * (rate - prior)


def fill_acceptance(acceptance: dict[str, AcceptanceModel]) -> dict[str, AcceptanceModel]:
    """Give each registered drafter without an acceptance model one, from its own prior."""
    for name in drafters.names():
        if name not in acceptance:
            acceptance[name] = AcceptanceModel(prior_rate=drafters.get(name).prior_rate)
    return acceptance


class NearTieRate:
    """P(the target's choice at a verified position is a near-tie), learned online.

    Batched logits cannot decide a near-tie (see ``SpeculativeEngine.tie_margin``): the step
    ends there without its bonus token, and that position costs a one-token pass next. On a
    quantized target on a CPU the margin is wide (~0.55 logits for Q8_0 here) and prose is full
    of such positions, a third of the drafting steps on a story: counted as neither acceptance
    nor rejection, they made auto draft where plain decoding was faster. A property of the
    target's text, not of the drafter, so one rate serves every drafter; carried from request
    to request like the acceptance rates.

    Positions a copy from the history index brings with a mark (what the target met there
    when it wrote them: ``history_index.MARK_*``) have their own rates, learned from the
    positions verified with that mark and carried over requests: whether a position tied
    before ties again depends on the target, the guard and how far the batched passes move
    logits on this machine, none of which a constant knows."""

    __slots__ = ("rate", "prior", "_seen", "_marked")

    # Each mark's rate before any outcome, and how many outcomes that prior counts as.
    MARKED_PRIOR = {MARK_CLEAR: 0.02, MARK_TIED: 0.8}
    MARKED_PRIOR_WEIGHT = 10.0
    # Each newer outcome fades the older ones (and the prior) by this factor: a new load
    # measures another drift, so another guard, and the marks left under the old one
    # mean less (~the last 100 outcomes count).
    MARKED_DECAY = 0.99

    def __init__(self, prior: float = 0.05) -> None:
        self.rate = prior
        self.prior = prior
        self._seen = 0
        # Per mark: [ties, positions, prior weight], faded together.
        self._marked = {mark: [0.0, 0.0, self.MARKED_PRIOR_WEIGHT]
                        for mark in self.MARKED_PRIOR}

    def observe(self, checked: int, tied: bool) -> None:
        """``checked`` positions were decided in one pass; the last was a near-tie if ``tied``.

        The moving average (0.1 per position) of ``checked - 1`` plain outcomes and a last one,
        in closed form: it runs once per target pass."""
        self.rate = self.rate * 0.9 ** checked + (0.1 if tied else 0.0)
        self._seen += checked

    def marked_rate(self, mark: int) -> float | None:
        """P(a near-tie) at a position marked ``mark``; None for a mark that says nothing."""
        counts = self._marked.get(mark)
        if counts is None:
            return None
        ties, seen, weight = counts
        return (ties + weight * self.MARKED_PRIOR[mark]) / (seen + weight)

    def observe_marked(self, marks: Sequence[int], checked: int, tied: bool) -> None:
        """One pass decided ``checked`` positions, the last a near-tie if ``tied``; ``marks``:
        theirs, from the first (a copy may not know the last's). Each known mark learns
        whether its position tied."""
        last = checked - 1
        for i, mark in enumerate(marks[:checked]):
            counts = self._marked.get(mark)
            if counts is None:
                continue
            counts[0] = self.MARKED_DECAY * counts[0] + (1.0 if tied and i == last else 0.0)
            counts[1] = self.MARKED_DECAY * counts[1] + 1.0
            counts[2] *= self.MARKED_DECAY

    def start_request(self) -> None:
        self.rate = self.prior
        self._seen = 0

    def end_request(self) -> None:
        if self._seen:
            self.prior += 0.3 * (self.rate - self.prior)


class PeekSchedule:
    """When to "peek" (force one draft token, kept only if the draft is confident) while auto
    decodes plainly: after ``interval`` plain steps, doubling after each peek that finds
    nothing and back to the least after one that finds a draft worth verifying, so a draft
    that stopped paying is re-checked often at first and rarely once it keeps failing.

    A peek finds something when what it taught makes drafting worth it again; tokens accepted
    are not enough. Its odds of that (``odds``, from past peeks, recent ones weighing most)
    weigh what it could save: each peek first catches the draft up on every token decoded
    plainly since the last, a cost per skipped token that no interval dilutes.

    Carried from request to request like the acceptance rates, plain steps included: when
    every request started over at the least, a compute-bound target where drafting never paid
    (Q8_0 on an AVX2 CPU) took four peeks per 128-token request, each catching the draft up on
    every token it had skipped, and ran 6-10% below plain decoding."""

    __slots__ = ("interval", "streak", "_hits", "_looks")

    LEAST, MOST = 8, 128
    FADE = 0.8  # each newer peek fades the older ones: about the last five count

    def __init__(self) -> None:
        self.interval = self.LEAST
        self.streak = 0  # plain steps since anything was drafted
        self._hits = 0.0
        self._looks = 0.0

    @property
    def due(self) -> bool:
        return self.streak >= self.interval

    @property
    def odds(self) -> float:
        """P(a peek finds a draft worth drafting with), from past peeks (1/2 before any)."""
        return (self._hits + 1.0) / (self._looks + 2.0)

    def found(self, worth_it: bool) -> None:
        """A peek's outcome: whether drafting is worth it now."""
        self.streak = 0
        self._hits = self.FADE * self._hits + worth_it
        self._looks = self.FADE * self._looks + 1.0
        self.interval = self.LEAST if worth_it else min(2 * self.interval, self.MOST)


class TreePauses:
    """When the tree planner is not asked: a plan walks up to a few hundred nodes, a
    millisecond of host time and a tenth of a GPU's step, where its verdict is often the same
    chain step after step (a GPU's short pass prices each node's host work: benchmarks/
    README.md, 2026-12-04, night). So once a drafter's chain verdict has repeated AFTER
    times, it stands for the next 1, 2, 4, then up to MOST plans that drafter asks for while
    it keeps repeating; after a tree verdict, every plan is made. A tree found late costs at
    most those steps of chains (what ``--tree off`` drafts); verdicts that alternate (trees
    about as good as chains, seen on the tiny test models) are planned every time. Carried
    from request to request like the acceptance rates: a GPU's short requests would otherwise
    plan their first steps anew."""

    __slots__ = ("_chains", "_skip")

    AFTER, MOST = 4, 8

    def __init__(self) -> None:
        self._chains: dict[str, int] = {}  # chain verdicts in a row, by drafter
        self._skip: dict[str, int] = {}  # plans to skip before asking again, by drafter

    def skip(self, source: str) -> bool:
        """Whether ``source`` drafts a chain unplanned this time (counts the plan skipped)."""
        if self._skip.get(source, 0) <= 0:
            return False
        self._skip[source] -= 1
        return True

    def record(self, source: str, tree: bool, forced: bool = False) -> None:
        """The planner's verdict for ``source``: a tree, or a chain. ``forced``: a chain
        verdict that the request's end may have forced (too little room left for a tree to
        pay); it holds the pause where it is, neither lengthening it nor ending it, so the
        next request does not start with a pause its last few steps earned."""
        if forced and not tree:
            chains = self._chains.get(source, 0)
        else:
            chains = self._chains[source] = 0 if tree else self._chains.get(source, 0) + 1
        if chains >= self.AFTER:
            self._skip[source] = min(1 << min(chains - self.AFTER, self.MOST), self.MOST)


def _step_outcomes(probs: Sequence[float], costs: CostModel,
                   tie: float | Sequence[float]) -> Iterator[tuple[int, float, float]]:
    """(n, expected tokens, target seconds) of verifying the first n = 0 .. len(probs) drafted
    tokens, the i-th accepted with probability ``probs[i]`` given the ones before.

    A step yields 1 + p1 + p1*p2 + ... tokens on average (Leviathan et al.), each p scaled by
    the chance ``1 - tie`` that its position is not a near-tie. A tie yields what a rejection
    would (the accepted prefix, then the tied position from a one-token pass), so the count
    stands; the extra pass, taken with probability tie * (the chance of reaching the position),
    costs a single step. ``tie`` is one rate for every position or, where the positions are
    known (a copy from the history index: see ``tie_rates``), one per position: the drafted
    tokens' and then the one after the last (len(probs) + 1).

    O(n), one pass, shared by every decision the controller makes per step; it reads the cost
    table directly and stays inline because it runs per drafted token, at GPU step rates."""
    table = costs.target
    widest, t1 = len(table) - 1, table[1]
    ties = None if isinstance(tie, (int, float)) else tie
    rate = 0.0 if ties is not None else float(tie)  # type: ignore[arg-type]
    expected, prefix = 1.0, 1.0
    tied = ties[0] if ties is not None else rate  # P(a tie) summed over the positions reached
    for n in range(len(probs) + 1):
        if n:
            here = ties[n - 1] if ties is not None else rate
            prefix *= (1.0 - here) * probs[n - 1]
            expected += prefix
            tied += prefix * (ties[n] if ties is not None else rate)
        # Past the chain table (a free draft longer than k_max) the measured wide passes price
        # it: the table's last width would make every longer draft look free.
        seconds = table[n + 1] if n < widest else costs.verify(n + 1)
        yield n, expected, seconds + t1 * tied


def _step_rates(probs: Sequence[float], costs: CostModel, tie: float,
                start: float = 0.0) -> Iterator[tuple[int, float]]:
    """(n, tokens/s) of a step that drafts n = 0 .. len(probs) tokens and verifies them all;
    ``start``: seconds a step that drafts anything pays first (the draft catching up)."""
    for n, expected, seconds in _step_outcomes(probs, costs, tie):
        yield n, expected / (seconds + costs.drafting(n) + (start if n else 0.0))


def _best_prefix(probs: list[float], costs: CostModel,
                 tie: float | Sequence[float] = 0.0) -> tuple[int, float]:
    """(n, rate): the prefix length n of ``probs`` (drafted for free, as by prompt lookup) whose
    verification is expected to yield the most tokens per second."""
    best_n, best = 0, -1.0
    for n, expected, seconds in _step_outcomes(probs, costs, tie):
        if expected / seconds > best:  # ties keep the shorter prefix
            best_n, best = n, expected / seconds
    return best_n, best


@dataclass(frozen=True, slots=True)
class _Free:
    """A free drafter's costs for the tree planner: verification only."""

    costs: CostModel

    def verify(self, n: int) -> float:
        return self.costs.verify(n)

    def verify_floor(self, n: int) -> float:
        return self.costs.verify_floor(n)

    def draft_pass(self, width: int) -> float:
        return 0.0

    def draft_start(self) -> float:
        return 0.0

    def node_host(self) -> float:
        return 0.0


class DraftController:
    """Decides, per step, which drafter to use and how many of its tokens to verify.

    ``fixed_k`` set: always draft exactly that many (no early stop), like llama.cpp's --draft.
    Every decision is O(K): at GPU speeds a step is a few milliseconds, and this runs per token.
    """

    # Drafting must be predicted to beat plain decoding by this much: the acceptance estimate
    # is noisy, and a wrong "yes" costs a draft pass.
    MARGIN = 1.05
    # The longest draft a free drafter (prompt lookup, history) may offer. k_max bounds what
    # the draft model spends decoding; a copy costs nothing to draft, so its length is the
    # measured cost curve's to decide, within the widest pass measured: an agent resending a
    # file accepts 30-60 tokens in a row, where a 12-token cap leaves most of the gain.
    FREE_MAX = 64
    # What an unproven free draft (AcceptanceModel.unproven) may cost if its first token is
    # rejected: its pass less the plain step it replaces, in one-token passes. Priced by the
    # pooled bins alone, the rename prompt's first run verified a 22-token copy the target
    # rejected at once, 2.8 passes of a 113-token answer on a compute-bound target (Q4_K_M
    # on a 2-core AMX CPU), its whole loss to the target alone (0.974x). A copy the request
    # bears out is verified whole next step; on a flat (GPU) curve this caps nothing.
    UNPROVEN_LOSS = 1.5

    def __init__(self, costs: CostModel, k_max: int, fixed_k: int | None = None,
                 acceptance: dict[str, AcceptanceModel] | None = None,
                 ties: NearTieRate | None = None, peeks: PeekSchedule | None = None,
                 model: str | None = None, tree_pauses: TreePauses | None = None) -> None:
        self.costs = costs
        self.k_max = k_max
        self.fixed_k = fixed_k
        # One acceptance model per drafter name, carried by the caller from request to request;
        # a drafter it does not know yet starts from its own prior (kept in the caller's dict).
        self.acceptance = acceptance if acceptance is not None else {}
        fill_acceptance(self.acceptance)
        # The drafter whose tokens cost model decodes: the one auto prices, paces and peeks at.
        costly = model or drafters.costly_default()
        if costly is None:
            raise ValueError("no drafter that costs model decodes is registered")
        self.model = costly
        self.acceptance.setdefault(costly, AcceptanceModel())
        self.ties = ties or NearTieRate()
        for acc in self.acceptance.values():
            acc.start_request()
        self.ties.start_request()
        self.peeks = peeks or PeekSchedule()
        self._peeking = False
        # The token rate this request is expected to keep up (tokens/s): what a drafted token's
        # seconds are worth. Set with each decision to draft (model_worth_trying).
        self._long_run: float | None = None
        # Tree plans by what they were planned from (see tree_plan), the newest last; for this
        # request only (the costs they were priced at drift).
        self._trees: dict[tuple[object, ...], TreePlan | None] = {}
        self.tree_pauses = tree_pauses or TreePauses()
        self._unproven_cap: int | None = None
        # This step's unproven free proposals, (drafter, first token, its confidence): see
        # shadow.
        self._shadows: list[tuple[str, int, float]] = []

    @property
    def model_acc(self) -> AcceptanceModel:
        """The acceptance of the costly drafter's tokens."""
        return self.acceptance[self.model]

    # -- planning -----------------------------------------------------------------------------
    def plain_rate(self) -> float:
        return 1.0 / self.costs.verify(1)

    def _constant_rate(self, a: float | list[float], room: int,
                       behind: int = 0) -> tuple[int, float]:
        """Best (k, tokens/s) for drafting k tokens, the i-th accepted with probability
        ``a[i]`` (or ``a`` at every depth), the draft first catching up on ``behind`` tokens;
        k = 0 is plain decoding."""
        n = min(self.k_max, room)
        depths = a[:n] if isinstance(a, list) else [a] * n
        best_k, best = 0, self.plain_rate()
        start = self.costs.catch_up(behind)
        for k, rate in _step_rates(depths, self.costs, self.ties.rate, start):
            if k and rate > best:
                best_k, best = k, rate
        return best_k, best

    def model_worth_trying(self, room: int,
                           behind: Callable[[], int] | None = None) -> bool:
        """Whether drafting (some number of) model tokens is expected to beat plain decoding,
        the draft first catching up on the ``behind()`` tokens it has not seen (see
        ``expected_model_rate``; counted only where drafting would otherwise pay, since
        counting walks the whole sequence).

        Every length is considered, not just one token: verification cost is usually concave
        in the number of tokens, so K=1 can lose where K=5 wins."""
        if self.fixed_k is not None:
            return room > 0
        if room <= 0:
            return False
        rate, plain = self.expected_model_rate(room), self.plain_rate()
        self._long_run = max(rate, plain)
        if rate > self.MARGIN * plain and behind is not None:
            n = behind()
            if n > 0:
                rate = self.expected_model_rate(room, n)
        return rate > self.MARGIN * plain

    def expected_model_rate(self, room: int, behind: int = 0) -> float:
        """Tokens per second expected from the draft model's best chain this step. ``behind``:
        tokens of this answer the draft has not seen (a copy from history or the prompt was
        accepted since it last drafted); its catching up on them is this step's to pay, since
        the next copy leaves it behind again. On an F16 target here a step after a 60-token
        copy spent 0.3 s catching up to draft 5 tokens, two single steps' worth."""
        depths = self.model_acc.depth_rates(0, self.k_max)
        return self._constant_rate(depths, room, behind)[1]

    def _token_price(self) -> float:
        """Tokens that a second of this request is worth (see the module's docstring)."""
        if self._long_run is None:
            self._long_run = max(self.expected_model_rate(self.k_max), self.plain_rate())
        return self._long_run

    def keep_going(self, j: int, prop: Proposal) -> bool:
        """After j drafted tokens: is drafting more expected to beat stopping now?

        Stopping now verifies the best prefix of what was drafted; going on drafts to some
        longer n, whose unseen tokens are accepted at the running rates by depth, and pays
        n - j more draft tokens. Each option is worth its expected tokens less its seconds at
        the long-run rate; the j draft tokens already spent count for neither. (A ratio of
        tokens to seconds over the whole step, spent time included, stopped short after a
        confident start and drafted on after a doubtful one.) The drafted tokens' own
        confidences make this an early stop when the draft starts guessing."""
        if self.fixed_k is not None:
            return j < self.fixed_k
        if j >= self.k_max:
            return False
        price, per_token = self._token_price(), self.costs.draft_token
        probs = self._estimates(prop, j) + self.model_acc.depth_rates(j, self.k_max - j)
        stop = float("-inf")
        for n, expected, seconds in _step_outcomes(probs, self.costs, self.ties.rate):
            if n <= j:
                stop = max(stop, expected - price * seconds)
            elif expected - price * (seconds + (n - j) * per_token) > stop:
                return True
        return False

    def _estimates(self, prop: Proposal, n: int) -> list[float]:
        """The acceptance estimates of a model draft's first ``n`` tokens, from their
        confidences: each computed once and kept on the proposal (keep_going asks per token)."""
        while len(prop.estimates) < n:
            prop.estimates.append(self.model_acc.estimate(prop.confidences[len(prop.estimates)]))
        return prop.estimates[:n]

    def trim(self, prop: Proposal) -> int:
        """How many of the drafted tokens to verify (drafting time is already spent).

        Tokens dropped here are never verified, so they teach the running rate what the
        draft's confidence predicted for them; otherwise a draft that keeps guessing badly
        would keep being run (and paid for) only to be thrown away."""
        if self.fixed_k is not None or not prop.tokens:
            return len(prop.tokens)
        if prop.source != self.model:
            return self._free_prefix(prop)[0]
        probs = self._estimates(prop, len(prop.tokens))
        price = self._token_price()
        best_k, _ = max(((n, expected - price * seconds) for n, expected, seconds
                         in _step_outcomes(probs, self.costs, self.ties.rate)),
                        key=lambda nv: (nv[1], -nv[0]))
        if best_k < len(probs):
            self.model_acc.teach(best_k, probs[best_k])
        return best_k

    def free_cap(self, room: int) -> int:
        """The most tokens a free drafter may offer this step (see FREE_MAX); a fixed K is
        exactly K, whoever drafts."""
        if self.fixed_k is not None:
            return min(room, self.fixed_k)
        return min(room, max(self.k_max, min(self.FREE_MAX, self.costs.widest - 1)))

    def free_rate(self, prop: Proposal) -> float:
        """Tokens per second expected from verifying the best prefix of a free drafter's
        proposal, at that drafter's acceptance rate."""
        return self._free_prefix(prop)[1]

    # A free draft is priced only while the chance of reaching its next token is above this:
    # past it a token adds nothing worth a wider pass, and a copy may offer 63 tokens each step
    # (pricing them all took ~0.1 ms a drafter, per plain step too).
    REACH_FLOOR = 1e-3

    def tie_rates(self, prop: Proposal) -> float | list[float]:
        """The near-tie rate at each position a free draft's verification decides (its
        tokens', then the one after): by their marks where known (a copy meets its ties
        where they were, though not surely: the batched passes that wrote this request's KV
        cache move logits by up to the margin drift), else the running rate."""
        if not prop.marks:
            return self.ties.rate
        rate = self.ties.rate
        clear, tied = self.ties.marked_rate(MARK_CLEAR), self.ties.marked_rate(MARK_TIED)
        assert clear is not None and tied is not None
        # A clear mark never makes a position look likelier tied than the running rate (an
        # F16 target's, ~0, priced copies short at 0.02: 2.65x instead of 3.16x on sql).
        known = {MARK_CLEAR: min(rate, clear), MARK_TIED: tied}
        rates = [known.get(m, rate) for m in prop.marks[:len(prop.tokens) + 1]]
        rates += [rate] * (len(prop.tokens) + 1 - len(rates))
        return rates

    def unproven_cap(self) -> int:
        """The most tokens an unproven free draft may have (see UNPROVEN_LOSS): measured once
        a request, on the curve as it stood."""
        if self._unproven_cap is None:
            t1, n = self.costs.verify(1), 0
            while (n < self.FREE_MAX
                   and self.costs.verify(n + 2) <= t1 * (1.0 + self.UNPROVEN_LOSS)):
                n += 1
            self._unproven_cap = n
        return self._unproven_cap

    def _free_len(self, prop: Proposal) -> int:
        """How many of a free draft's tokens may be priced: all, or an unproven drafter's cap."""
        if self.acceptance[prop.source].unproven:
            return min(len(prop.tokens), self.unproven_cap())
        return len(prop.tokens)

    def _free_prefix(self, prop: Proposal) -> tuple[int, float]:
        ties = self.tie_rates(prop)
        n_max = self._free_len(prop)
        if len(prop.confidences) != len(prop.tokens):
            rate = self.acceptance[prop.source].rate
            return _best_prefix([rate] * n_max, self.costs, tie=ties)
        probs: list[float] = []
        seen: dict[float, float] = {}
        reach = 1.0
        for c in prop.confidences[:n_max]:  # a copy's tokens share a few confidences
            p = seen.get(c)
            if p is None:
                p = seen[c] = self._free_estimate(prop.source, c)
            probs.append(p)
            reach *= p
            if reach < self.REACH_FLOOR:
                break
        return _best_prefix(probs, self.costs, tie=ties)

    # -- token trees --------------------------------------------------------------------------
    # A tree must beat the best chain by this much: its sibling rates are learned slowly, and
    # on a steep cost curve a chain is what auto did before trees (it must never lose to it).
    TREE_MARGIN = 1.05
    TREE_PLANS_KEPT = 16

    def tree_plan(self, room: int, max_nodes: int, branches: int,
                  source: str | None = None) -> TreePlan | None:
        """The token tree worth drafting this step with drafter ``source`` (the costly one by
        default), or None where a chain is as good or, a chain having won repeatedly, no plan
        is made this step (``TreePauses``); today's chain policy then decides its length.
        ``room``: the longest path the request may still take; ``max_nodes``, ``branches``:
        what one target pass can hold."""
        if self.fixed_k is not None or branches < 2 or room < 1 or max_nodes < 2:
            return None
        # Only widths measured are priced: past them the curve is a guess.
        max_nodes = min(max_nodes, self.costs.widest - 1)
        if max_nodes < 2:
            return None
        source = source or self.model
        if source != self.model and self.acceptance[source].unproven:
            max_nodes = min(max_nodes, self.unproven_cap())
            if max_nodes < 2:
                return None
        if self.tree_pauses.skip(source):
            return None
        plan = self._tree_plan(room, max_nodes, source, branches)
        self.tree_pauses.record(source, tree=plan is not None,
                                forced=room < min(MAX_DEPTH - 1, max_nodes))
        return plan

    def _tree_plan(self, room: int, max_nodes: int, source: str,
                   branches: int) -> TreePlan | None:
        acc = self.acceptance[source]
        costs: tree_planner.TreeCosts = self.costs if source == self.model else _Free(self.costs)
        depth = acc.depth_rates(0, min(MAX_DEPTH, room, max_nodes))
        sib = acc.sibling_rates
        # Planning walks up to a few hundred nodes (about a millisecond): at GPU step rates that
        # is worth reusing while the rates it depends on stay where they were. It plans with
        # the rates on a grid of 0.02 (the near-tie rate 0.05: it moves at every step) and
        # keeps a few plans, since the free drafters and the model plan alternately.
        depth = [round(r * 50) / 50 for r in depth]
        sib = [round(r * 50) / 50 for r in sib]
        tie = round(self.ties.rate * 20) / 20
        # A node's host work is 0 until a chain or a tree is drafted, then moves as they are:
        # a plan made at one price must not outlive it (a share of a pass, on a grid of 0.001).
        host = round(costs.node_host() / costs.verify(1) * 1000) / 1000
        key = (tuple(depth), tuple(sib), tie, host, max_nodes, branches, source)
        if key in self._trees:
            self._trees[key] = self._trees.pop(key)  # the newest last
            return self._trees[key]
        tree = tree_planner.plan(depth, sib, costs, max_nodes=max_nodes, max_branches=branches,
                                 tie=tie)
        plan = None
        if not tree.is_chain:  # a tree: worth it only by a margin over the best chain
            chain = tree_planner.plan(depth, sib, costs, max_nodes=max_nodes,
                                      max_branches=branches, max_width=1, tie=tie)
            plan = tree if tree.rate > self.TREE_MARGIN * chain.rate else None
        if len(self._trees) >= self.TREE_PLANS_KEPT:
            del self._trees[next(iter(self._trees))]
        self._trees[key] = plan
        return plan

    def tree_estimates(self, prop: Proposal) -> list[float]:
        """P(each node matches the target's choice | its parent was accepted), each node by
        its own drafter's acceptance (a grafted branch by the free drafter's)."""
        if prop.source == self.model:
            own = self._estimates(prop, len(prop.tokens))
        else:
            own = [self._free_estimate(prop.source, c) for c in prop.confidences]
        if not prop.node_sources:
            return own
        return [own[i] if name == prop.source else self._free_estimate(name, prop.confidences[i])
                for i, name in enumerate(prop.node_sources)]

    def estimator(self, source: str) -> Callable[[float], float]:
        """How a drafted token of ``source`` at a confidence is priced: the draft model's by
        its bins (its depth rates follow the request), a free drafter's as ``_free_estimate``."""
        if source == self.model:
            return self.acceptance[source].estimate
        return functools.partial(self._free_estimate, source)

    def _free_estimate(self, source: str, confidence: float) -> float:
        acc = self.acceptance[source]
        calibrated = source in drafters.names() and drafters.get(source).calibrated
        return acc.request_estimate(confidence) if calibrated else acc.rate

    def trim_tree(self, prop: Proposal) -> None:
        """Keep the nodes of a drafted tree worth verifying (drafting is already spent)."""
        if self.fixed_k is not None or not prop.tokens:
            return
        path_p = tree_planner.path_probabilities(self.tree_estimates(prop), prop.parent_list())
        price = self._token_price()
        prop.keep_nodes(tree_planner.select(path_p, prop.parent_list(), self.costs, price,
                                            self.ties.rate))

    def observe_tree(self, prop: Proposal, path: Sequence[int],
                     choices: Sequence[int | None]) -> None:
        """The target verified a tree: it accepted the nodes ``path`` and chose
        ``choices[j]`` after the first j of them (None: a near-tie left undecided, last only).

        The first guesses (each node's most confident child) teach the acceptance by depth
        and confidence as a chain of them would have; the other guesses below accepted
        parents teach the confidence bins and the rank rates."""
        self.peeks.streak = 0
        self._shadows.clear()  # a step that drafted: its own outcomes teach
        tied = bool(choices) and choices[-1] is None
        self.ties.observe(len(path) + 1, tied)
        acc = self.acceptance[prop.source]
        kids = prop.children()
        conf = prop.confidences
        if prop.node_sources:
            # Grafted nodes teach no one: a graft holds only where its drafter differed from
            # the model (where they agreed the node is the model's), a biased sample of its
            # drafter's guesses. They are priced by what its own proposals taught it.
            kids = [[c for c in k if prop.node_sources[c] == prop.source] for k in kids]
        ranked = [sorted(k, key=lambda c: (-conf[c], c)) for k in kids]
        main: list[float] = []
        n_acc = 0
        for j in range(len(path) + 1):
            first = ranked[path[j - 1] if j else -1]
            if not first:
                break
            main.append(conf[first[0]])
            if j < len(path) and path[j] == first[0]:
                n_acc += 1
                continue
            break
        n_verified = len(main) if not tied or n_acc < len(path) else n_acc
        acc.observe(main[:n_verified], n_acc)
        others = []
        for j, choice in enumerate(choices):
            if choice is None:
                continue
            for rank, c in enumerate(ranked[path[j - 1] if j else -1][1:], start=1):
                others.append((rank, conf[c], prop.tokens[c] == choice))
        acc.observe_siblings(others)
        if self._peeking:
            self.observe_peek(self.model_worth_trying(self.k_max))

    # -- learning -----------------------------------------------------------------------------
    def observe(self, prop: Proposal, n_verified: int, n_accepted: int,
                tied: bool = False) -> None:
        """The target decided ``n_accepted`` + 1 positions of this draft: it accepted
        ``n_accepted`` tokens, then rejected one or (``tied``) met a near-tie it left undecided;
        only ``n_verified`` drafted tokens count for acceptance (a tie is neither)."""
        self.peeks.streak = 0
        self._shadows.clear()
        self.ties.observe(n_accepted + 1, tied)
        if prop.marks:
            self.ties.observe_marked(prop.marks, n_accepted + 1, tied)
        self.acceptance[prop.source].observe(prop.confidences[:n_verified], n_accepted)
        if self._peeking:
            # On Q8_0 here fib's peeks were accepted, but drafting never became worth it:
            # counted as finds, they kept auto looking every 8 steps, 0.93x plain decoding.
            self.observe_peek(self.model_worth_trying(self.k_max))

    def end_request(self) -> None:
        for acc in self.acceptance.values():
            acc.end_request()
        self.ties.end_request()

    def shadow(self, prop: Proposal) -> None:
        """A free drafter's proposal this step, which may go undrafted. While its drafter is
        unproven, a plain step scores its first token against the target's (see
        observe_plain_step). Else on a steep curve (a compute-bound target, 2 tokens at 2
        passes) an unproven copy is capped short of ever paying, so never verified, so never
        proven: auto decoded plainly beside copies the target went on to write, for whole
        requests (benchmarks/README.md, 2026-12-07, late, AVX-512)."""
        if prop.tokens and len(prop.confidences) == len(prop.tokens) and \
                self.acceptance[prop.source].unproven:
            self._shadows.append((prop.source, prop.tokens[0], prop.confidences[0]))

    def observe_plain_step(self, tied: bool | None = None, token: int | None = None) -> None:
        """A step that drafted nothing; ``tied``: whether its position was a near-tie (None:
        not measured, e.g. the position a near-tie left, counted already); ``token``: the
        token it wrote, which the step's shadowed proposals are scored against (at a near-tie
        verifying would have stopped, deciding nothing)."""
        shadows, self._shadows = self._shadows, []
        if token is not None and tied is not True:
            for source, first, conf in shadows:
                self.acceptance[source].observe_undrafted(conf, first == token)
        if tied is not None:
            self.ties.observe(1, tied)
        self.model_acc.relax()
        self.peeks.streak += 1
        if self._peeking:  # the peeked draft was not worth verifying
            self.observe_peek(False)

    def should_peek(self, room: int, behind: Callable[[], int] = lambda: 0,
                    remaining: int | None = None) -> bool:
        """Time for a cheap look at whether the draft model has become worth it again: only
        where near-perfect acceptance would pay for drafting at all (never on a compute-bound
        target, where every look would be a loss), and would repay, over the ``remaining``
        tokens, the draft's catching up on the tokens it skipped (``behind()``: counted only
        when a peek is otherwise due, since counting walks the whole sequence)."""
        if not self.peeks.due or room <= 0:
            return False
        _, best = self._constant_rate(0.95, room)
        plain = self.plain_rate()
        if best <= self.MARGIN * plain:
            return False
        saved = (room if remaining is None else remaining) * (1 / plain - 1 / best)
        return self.peeks.odds * saved > self.costs.catch_up(behind())

    def start_peek(self) -> None:
        """The coming draft is a peek; its outcome (observe*) sets when to look next."""
        self._peeking = True

    def observe_peek(self, worth_it: bool) -> None:
        self._peeking = False
        self.peeks.found(worth_it)

    # -- explaining ---------------------------------------------------------------------------
    def explain(self, room: int = 1 << 30) -> str:
        """Why auto drafts or not, from the measured costs (for --verbose and the chat app)."""
        t1 = self.costs.verify(1)
        k, rate = self._constant_rate(self.model_acc.depth_rates(0, self.k_max), room)
        # Near-ties matter where the guard is wide (quantized targets): say so when they do.
        ties = (f" and {self.ties.rate:.0%} of positions near-ties"
                if self.ties.rate >= 0.1 else "")
        if k == 0:
            k_probe = min(4, self.k_max)
            ratio = self.costs.verify(k_probe + 1) / t1
            return (f"plain decoding: verifying {k_probe + 1} tokens costs {ratio:.2f} single "
                    f"steps here, too much for the {self.model_acc.rate:.0%} acceptance "
                    f"expected{ties}")
        ratio = self.costs.verify(k + 1) / t1
        return (f"drafting ~{k} tokens: verifying {k + 1} costs {ratio:.2f} single steps here; "
                f"at {self.model_acc.rate:.0%} acceptance{ties} that predicts "
                f"{rate * t1:.2f}x plain")
