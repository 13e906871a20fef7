"""Auto's drafting policy against every fixed K, on simulated speculative steps.

The controller drives a model of a step: a cost table measured on a real pair (or a GPU's
shape), and drafted tokens that the target accepts with the probability their confidence
says. Ten thousand steps per case take well under a second, so auto's long-run token rate can
be held to the best fixed K's on several kinds of text. The engine's own figures come from
``benchmarks/engine_bench.py``; this pins the decision rule that produces them. Each policy
sees the same drafts step for step (common random numbers), so the comparison is not noise;
each figure pools several seeds' runs, since one run's long plain stretches move it by a few
percent.
The draft's catching up on tokens it skipped costs what the engine estimates before measuring
it (its batched tokens cost it what the target's cost the target, relatively).

One case fails as marked (xfail, strict: fixing it turns the mark red) and is open work.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import pytest

from localspec.engine.controller import (
    AcceptanceModel,
    CostModel,
    DraftController,
    NearTieRate,
    PeekSchedule,
)
from localspec.engine.drafters import Proposal

K_MAX = 8
FIXED_K = (1, 2, 3, 5, 8)
STEPS = 2500
REQUEST = 128  # tokens per request
SEEDS = range(4)

# The F16 1.5B target and 0.5B Q4_K_M draft on a 2-core AVX2 CPU: seconds to verify n tokens
# (a staircase, cheap up to 3 tokens), a draft token, and a step's first draft token (the draft
# first takes in the tokens the last step added).
CPU_F16 = ({1: 0.129, 2: 0.135, 3: 0.150, 4: 0.207, 5: 0.227, 6: 0.250, 7: 0.302},
           0.0255, 0.045)
# A GPU's shape: verification nearly flat in n, a fast draft.
GPU = ({1: 0.007, 9: 0.0086}, 0.0012, 0.0016)

# Kinds of text, as (confidence, share of drafted tokens): a drafted token is accepted with
# probability equal to its confidence.
CODE = ((0.98, 0.75), (0.7, 0.15), (0.25, 0.10))
PROSE = ((0.9, 0.35), (0.55, 0.35), (0.15, 0.30))
HOPELESS = ((0.3, 0.5), (0.05, 0.5))


@dataclass
class Outcome:
    tokens: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def cost_model(shape: tuple[dict[int, float], float, float]) -> CostModel:
    points, draft, first = shape
    costs = CostModel.from_measurements(points, K_MAX, draft)
    costs.draft_first = first
    return costs


@functools.cache
def _drafts(text: tuple[tuple[float, float], ...],
            seed: int) -> tuple[tuple[tuple[float, bool], ...], ...]:
    """Each step's K_MAX draft tokens as (confidence, accepted): the same for every policy,
    so drawn once per text and seed."""
    confs, shares = zip(*text, strict=True)
    steps = []
    for step in range(STEPS):
        rng = random.Random(1_000_003 * step + 7919 * seed + 17)
        out = []
        for _ in range(K_MAX):
            conf = rng.choices(confs, shares)[0]
            out.append((conf, rng.random() < conf))
        steps.append(tuple(out))
    return tuple(steps)


def _accepted(drafts: tuple[tuple[float, bool], ...], n: int) -> int:
    for i, (_, ok) in enumerate(drafts[:n]):
        if not ok:
            return i
    return n


def _fixed(k: int, text: tuple[tuple[float, float], ...], costs: CostModel) -> Outcome:
    out = Outcome()
    for seed in SEEDS:
        for drafts in _drafts(text, seed):
            n_acc = _accepted(drafts, k)
            out.tokens += n_acc + 1
            out.seconds += costs.drafting(k) + costs.verify(k + 1)
    return out


def _auto(text: tuple[tuple[float, float], ...],
          shape: tuple[dict[int, float], float, float]) -> Outcome:
    """Auto over every seed, each run from a fresh engine (its own costs and priors)."""
    out = Outcome()
    for seed in SEEDS:
        run = _auto_run(text, cost_model(shape), seed)
        out.tokens += run.tokens
        out.seconds += run.seconds
    return out


def _auto_run(text: tuple[tuple[float, float], ...], costs: CostModel,
              seed: int) -> Outcome:
    """As the engine drives the controller (``SpeculativeEngine._propose``), peeks included,
    in requests of REQUEST tokens that carry what they learn to the next."""
    acceptance, ties, peeks = {"model": AcceptanceModel()}, NearTieRate(), PeekSchedule()
    out = Outcome()
    behind = 0  # tokens the draft skipped while the target decoded alone
    ctl = DraftController(costs, K_MAX, acceptance=acceptance, ties=ties, peeks=peeks)
    request_end = REQUEST
    for drafts in _drafts(text, seed):
        if out.tokens >= request_end:
            ctl.end_request()
            ctl = DraftController(costs, K_MAX, acceptance=acceptance, ties=ties, peeks=peeks)
            request_end = out.tokens + REQUEST
        remaining = request_end - out.tokens
        if not ctl.model_worth_trying(K_MAX):
            if not ctl.should_peek(K_MAX, functools.partial(int, behind), remaining):
                out.tokens += 1
                out.seconds += costs.verify(1)
                ctl.observe_plain_step()
                behind += 1
                continue
            ctl.start_peek()
        prop = Proposal("model")
        while True:
            prop.tokens.append(len(prop.tokens))
            prop.confidences.append(drafts[len(prop.tokens) - 1][0])
            if len(prop.tokens) >= K_MAX or not ctl.keep_going(len(prop.tokens), prop):
                break
        out.seconds += costs.drafting(len(prop.tokens)) + costs.catch_up(behind)
        behind = 0
        prop.truncate(ctl.trim(prop))
        n = len(prop.tokens)
        n_acc = _accepted(drafts, n)
        out.tokens += n_acc + 1
        out.seconds += costs.verify(n + 1)
        if n:
            ctl.observe(prop, n, n_acc)
        else:
            ctl.observe_plain_step()
            behind += 1
    return out


@pytest.mark.parametrize(("shape", "text"), [
    pytest.param(CPU_F16, CODE, id="cpu-code"),
    pytest.param(CPU_F16, PROSE, id="cpu-prose", marks=pytest.mark.xfail(strict=True, reason=(
        "known: where drafting gains ~11% at best, the first depth's estimate (its last ~20 "
        "outcomes) still dips below the 5% margin now and then; auto decodes plainly until "
        "the estimate relaxes back, and on coming back the draft catches up on each skipped "
        "token: 0.95x the best fixed K, 1.06x plain (0.88x and 0.97x before the bins' "
        "stronger prior, the slower fade and the faster relax)"))),
    pytest.param(GPU, CODE, id="gpu-code"),
    pytest.param(GPU, PROSE, id="gpu-prose"),
])
def test_auto_keeps_up_with_the_best_fixed_k(shape: tuple[dict[int, float], float, float],
                                             text: tuple[tuple[float, float], ...]) -> None:
    costs = cost_model(shape)
    best = max(_fixed(k, text, costs).rate for k in FIXED_K)
    auto = _auto(text, shape).rate
    assert auto >= 0.97 * best, f"auto {auto:.2f} tok/s, best fixed K {best:.2f}"


def test_auto_never_drafts_below_plain_where_no_k_pays() -> None:
    """Each peek first catches the draft up on every token decoded plainly since the last
    (here ~7% of a target step per token, whatever the interval): when peeks counted accepted
    tokens as finds and ignored their odds, auto ran at 0.935x plain on such a draft. What is
    left is the cost of learning that the draft does not pay (the first request starts from a
    prior of 0.6), ~1.3% over these runs; single runs range from 0.974x to 0.994x."""
    costs = cost_model(CPU_F16)
    plain = 1 / costs.verify(1)
    assert max(_fixed(k, HOPELESS, costs).rate for k in FIXED_K) < plain
    assert _auto(HOPELESS, CPU_F16).rate >= 0.98 * plain


def test_a_steps_first_draft_token_costs_what_was_measured() -> None:
    costs = CostModel.from_measurements({1: 0.1, 5: 0.12}, K_MAX, 0.02)
    assert costs.drafting(0) == 0.0
    assert costs.drafting(3) == pytest.approx(0.06)  # unmeasured: a draft token
    costs.observe_draft_first(0.05)
    assert costs.drafting(3) == pytest.approx(0.05 + 2 * 0.02)
    costs.observe_draft_first(0.09)  # then a moving average
    assert 0.05 < costs.draft_first < 0.09
