"""Choosing how many tokens to draft, each step, so that speculation never costs throughput.

The cost side is measured on this machine: the target's time to decode n tokens in one batch and
the draft's time per token (calibrated at load, then tracked online). The benefit side is the
expected number of tokens a step yields, from per-token acceptance estimates: the draft model's
own confidence, calibrated online against what the target actually accepted. Drafting continues
while one more token raises the expected tokens per second (Leviathan et al.'s expected-length
argument applied one token at a time); zero drafted tokens, plain decoding, is always a choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .drafters import Proposal

N_BINS = 10


@dataclass(slots=True)
class CostModel:
    """Seconds per target decode of n tokens (index n), and per draft-model token."""

    target: list[float]
    draft_token: float
    smoothing: float = 0.25

    @classmethod
    def from_calibration(cls, t1: float, tn: float, n: int, k_max: int, draft: float) -> CostModel:
        slope = max(0.0, (tn - t1) / (n - 1))
        table = [0.0] + [t1 + slope * (i - 1) for i in range(1, k_max + 2)]
        return cls(target=table, draft_token=draft)

    def verify(self, n: int) -> float:
        return self.target[min(n, len(self.target) - 1)]

    def observe_verify(self, n: int, seconds: float) -> None:
        if 0 < n < len(self.target):
            self.target[n] += self.smoothing * (seconds - self.target[n])

    def observe_draft(self, per_token: float) -> None:
        self.draft_token += self.smoothing * (per_token - self.draft_token)


@dataclass(slots=True)
class AcceptanceModel:
    """P(target accepts a drafted token), binned by the drafter's confidence and learned online.

    Each bin starts from a prior equal to its confidence and moves with the observed outcomes;
    only tokens up to and including the first rejection are observed."""

    hits: list[float] = field(default_factory=lambda: [0.0] * N_BINS)
    seen: list[float] = field(default_factory=lambda: [0.0] * N_BINS)
    prior_weight: float = 2.0
    # The running per-token acceptance, used before a token's own confidence is known.
    rate: float = 0.6
    prior_rate: float = 0.6

    def estimate(self, conf: float) -> float:
        b = min(int(conf * N_BINS), N_BINS - 1)
        centre = (b + 0.5) / N_BINS
        return (self.hits[b] + self.prior_weight * centre) / (self.seen[b] + self.prior_weight)

    def observe(self, confidences: list[float], n_accepted: int) -> None:
        for i, conf in enumerate(confidences[: n_accepted + 1]):
            b = min(int(conf * N_BINS), N_BINS - 1)
            ok = 1.0 if i < n_accepted else 0.0
            self.hits[b] += ok
            self.seen[b] += 1.0
            self.rate += 0.1 * (ok - self.rate)

    def relax(self) -> None:
        """Drift back towards the prior while not drafting, so a bad patch is retried later."""
        self.rate += 0.02 * (self.prior_rate - self.rate)


class DraftController:
    """Decides, per step, which drafter to use and how many of its tokens to verify.

    ``fixed_k`` set: always draft exactly that many (no early stop), like llama.cpp's --draft.
    """

    def __init__(self, costs: CostModel, k_max: int, fixed_k: int | None = None) -> None:
        self.costs = costs
        self.k_max = k_max
        self.fixed_k = fixed_k
        self.model_acc = AcceptanceModel()
        self.lookup_acc = AcceptanceModel(rate=0.5, prior_rate=0.5)

    # -- planning -----------------------------------------------------------------------------
    def _rate(self, probs: list[float], draft_seconds: float) -> float:
        """Expected tokens per second of verifying drafts with these acceptance estimates."""
        expected, p = 1.0, 1.0
        for a in probs:
            p *= a
            expected += p
        return expected / (draft_seconds + self.costs.verify(len(probs) + 1))

    def plain_rate(self) -> float:
        return 1.0 / self.costs.verify(1)

    def model_worth_trying(self, room: int) -> bool:
        """Whether drafting even one model token is expected to beat plain decoding."""
        if self.fixed_k is not None:
            return True
        a = self.model_acc.rate
        return self._rate([a], self.costs.draft_token) > self.plain_rate() and room > 0

    def expected_model_rate(self, room: int) -> float:
        a, best = self.model_acc.rate, self.plain_rate()
        for k in range(1, min(self.k_max, room) + 1):
            best = max(best, self._rate([a] * k, k * self.costs.draft_token))
        return best

    def keep_going(self, j: int, prop: Proposal) -> bool:
        """After j drafted tokens: is a (j+1)-th worth its draft and verify time?"""
        if self.fixed_k is not None:
            return j < self.fixed_k
        if j >= self.k_max:
            return False
        probs = [self.model_acc.estimate(c) for c in prop.confidences]
        now = self._rate(probs, j * self.costs.draft_token)
        nxt = self._rate(probs + [self.model_acc.rate], (j + 1) * self.costs.draft_token)
        return nxt > now

    def trim(self, prop: Proposal, draft_seconds: float) -> int:
        """How many of the drafted tokens to verify (drafting time is already spent)."""
        if self.fixed_k is not None or not prop.tokens:
            return len(prop.tokens)
        acc = self.lookup_acc if prop.source == "lookup" else self.model_acc
        probs = [acc.estimate(c) if prop.source == "model" else acc.rate for c in prop.confidences]
        best_k, best = 0, self._rate([], draft_seconds)
        for k in range(1, len(probs) + 1):
            r = self._rate(probs[:k], draft_seconds)
            if r > best:
                best_k, best = k, r
        return best_k

    def lookup_rate(self, prop: Proposal) -> float:
        probs = [self.lookup_acc.rate] * len(prop.tokens)
        return max(self._rate(probs[:k], 0.0) for k in range(len(probs) + 1))

    # -- learning -----------------------------------------------------------------------------
    def observe(self, prop: Proposal, n_verified: int, n_accepted: int) -> None:
        if prop.source == "model":
            self.model_acc.observe(prop.confidences[:n_verified], n_accepted)
        else:
            self.lookup_acc.observe(prop.confidences[:n_verified], n_accepted)

    def observe_plain_step(self) -> None:
        self.model_acc.relax()
