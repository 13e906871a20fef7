"""Unit tests of the parts of the engine that need no model: text, sampling, drafting policy;
and the calibration cache, last of all one engine over the tiny models reading it."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from localspec.engine import calibration
from localspec.engine.controller import (
    AcceptanceModel,
    CostModel,
    DraftController,
    NearTieRate,
    PeekSchedule,
)
from localspec.engine.drafters import DraftContext, PromptLookupDrafter, Proposal
from localspec.engine.sampling import Candidates, SamplingParams, distribution, residual
from localspec.engine.text import TextAssembler
from tests.test_auto_policy import CPU_F16, cost_model


def test_stop_string_split_across_tokens_is_held_back() -> None:
    asm = TextAssembler(stop=("END",))
    out = asm.feed(b"hello E", False)
    assert "".join(c.text for c in out) == "hello "  # "E" could start END: held
    out = asm.feed(b"N", True)
    assert out == []
    out = asm.feed(b"D and more", False)
    assert out == [] and asm.stopped
    assert asm.text == "hello "


def test_held_text_released_when_not_a_stop() -> None:
    asm = TextAssembler(stop=("END",))
    asm.feed(b"x E", False)
    out = asm.feed(b"X", True)
    assert "".join(c.text for c in out) == "EX"
    assert asm.finish() == [] and asm.text == "x EX"


def test_utf8_split_across_tokens() -> None:
    asm = TextAssembler()
    data = "héllo 🙂".encode()
    pieces = [data[i:i + 1] for i in range(len(data))]
    text = "".join(c.text for p in pieces for c in asm.feed(p, False))
    text += "".join(c.text for c in asm.finish())
    assert text == "héllo 🙂"


def test_drafted_flag_survives_merging() -> None:
    asm = TextAssembler()
    a = asm.feed(b"ab", True)
    b = asm.feed(b"cd", False)
    assert [(c.text, c.drafted) for c in a + b] == [("ab", True), ("cd", False)]


def test_distribution_filters_in_llama_cpp_order() -> None:
    logits = np.array([4.0, 3.0, 2.0, -5.0, 1.0], dtype=np.float32)
    p = distribution(logits, [], SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0))
    assert p[3] == 0 and p[4] == 0 and abs(p.sum() - 1) < 1e-12
    assert p[0] > p[1] > p[2] > 0
    # min_p 0.2 keeps tokens with at least 20% of the top token's probability.
    q = distribution(logits, [], SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2))
    assert q[0] > 0 and q[1] > 0 and q[2] == 0
    # repeat penalty lowers a positive logit that was seen recently.
    r = distribution(logits, [0], SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                                 repeat_penalty=4.0))
    assert r[0] < r[1]


def _cands(ids: list[int], probs: list[float]) -> Candidates:
    return Candidates(np.array(ids), np.zeros(len(ids)), np.array(probs))


def test_residual_is_normalised_positive_part() -> None:
    p = _cands([0, 1, 2], [0.5, 0.3, 0.2])
    q = _cands([1, 0, 2], [0.6, 0.2, 0.2])  # another order: matched by token id
    r = residual(p, q)
    assert np.allclose(r.probs, [1.0, 0.0, 0.0]) and list(r.ids) == [0, 1, 2]
    assert np.allclose(residual(p, p).probs, p.probs)
    # Tokens the draft could not propose keep their full target probability.
    only = residual(_cands([0, 1, 5], [0.4, 0.4, 0.2]), _cands([0], [1.0]))
    assert np.allclose(only.probs, [0.0, 2 / 3, 1 / 3])


def test_candidates_match_a_dense_reference() -> None:
    """The sparse processed distribution equals a straightforward dense computation of
    llama-cpp-python's chain (top-k, top-p, min-p, temperature) on a 152k vocabulary."""
    rng = np.random.default_rng(3)
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=0.7, top_k=0),
                   SamplingParams(temperature=1.1, top_k=0, min_p=0.0, top_p=0.9),
                   SamplingParams(temperature=0.5, top_k=20, top_p=1.0, min_p=0.0)):
        logits = (rng.standard_normal(151_936) * 2.5).astype(np.float32)
        logits[rng.integers(0, 151_936, 30)] += 9.0  # a peaked head, as real models have
        x = logits.astype(np.float64)
        order = np.argsort(-x, kind="stable")
        if params.top_k:
            order = order[:params.top_k]
        probs = np.exp(x[order] - x[order][0])
        probs /= probs.sum()
        cut = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1) if params.top_p < 1 \
            else order.size
        order, probs = order[:cut], probs[:cut]
        keep = probs >= params.min_p * probs[0]
        order = order[keep]
        want = np.exp((x[order] - x[order][0]) / params.temperature)
        dense = np.zeros(151_936)
        dense[order] = want / want.sum()
        got = distribution(logits, [], params)
        assert np.allclose(got, dense, atol=1e-12), params


def test_lookup_proposes_the_continuation_of_the_latest_match() -> None:
    d = PromptLookupDrafter(ngram_max=3, ngram_min=2)
    seq = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    prop = d.propose(DraftContext(seq), 4)
    assert prop.tokens == [4, 5, 9, 9]
    assert d.propose(DraftContext([7, 8]), 4).tokens == []
    # Incremental use on a longer sequence agrees with a fresh drafter.
    longer = DraftContext(seq + [4, 5, 6, 1, 2])
    assert d.propose(longer, 3).tokens == PromptLookupDrafter(3, 2).propose(longer, 3).tokens


def test_lookups_confidence_grows_with_how_long_the_copy_has_matched() -> None:
    """A copy that has matched 30 tokens (an edit rewriting its input) is far likelier to go on
    than a bare n-gram: the confidence the acceptance bins price it by says so."""
    d = PromptLookupDrafter()
    text = list(range(100, 140))
    short = d.propose(DraftContext([*text, 7, 8, *text[20:24]]), 4)
    long = PromptLookupDrafter().propose(DraftContext([*text, 7, 8, *text[:30]]), 4)
    assert short.tokens == text[24:28] and long.tokens == text[30:34]
    assert short.confidences[0] <= 0.3 < 0.9 < long.confidences[0] < 1.0


def _controller(t1: float, per_extra: float, draft: float, k_max: int = 8) -> DraftController:
    costs = CostModel.from_calibration(t1, t1 + per_extra * k_max, k_max + 1, k_max, draft)
    return DraftController(costs, k_max)


def test_compute_bound_target_never_drafts() -> None:
    # Verifying n tokens costs n single steps (a quantized target on a small CPU).
    ctl = _controller(t1=0.04, per_extra=0.04, draft=0.01)
    ctl.model_acc.rate = 0.95
    assert not ctl.model_worth_trying(room=100)


def test_bandwidth_bound_target_drafts_and_stops_on_low_confidence() -> None:
    # Verifying extra tokens is nearly free (F16 on CPU, any target on a GPU).
    ctl = _controller(t1=0.09, per_extra=0.006, draft=0.02)
    ctl.model_acc.rate = 0.8
    assert ctl.model_worth_trying(room=100)
    confident = Proposal("model", tokens=[1, 2], confidences=[0.95, 0.95])
    doubtful = Proposal("model", tokens=[1, 2], confidences=[0.95, 0.05])
    assert ctl.keep_going(2, confident)
    assert not ctl.keep_going(2, doubtful)
    # Trimming drops a trailing token that is unlikely to be accepted.
    assert ctl.trim(doubtful) == 1


def test_the_draft_models_catching_up_on_a_copy_is_priced_into_its_next_draft() -> None:
    # The F16 target here (AMX machine, issue #27's curve): the draft model pays at 85%
    # acceptance, but after a 60-token copy from history its catching up (5 ms a token in one
    # batch) costs two single steps first, more than its next chain gains over plain decoding.
    costs = CostModel.from_measurements({1: 0.165, 4: 0.215, 8: 0.284}, k_max=8, draft=0.04)
    costs.catch_up_token = 0.005
    ctl = DraftController(costs, 8)
    ctl.model_acc.rate = 0.85
    assert ctl.model_worth_trying(room=100)
    assert ctl.model_worth_trying(room=100, behind=lambda: 4)
    assert not ctl.model_worth_trying(room=100, behind=lambda: 60)
    # A free drafter's copy is then held to the lower bar of what the model could do now.
    assert ctl.expected_model_rate(8, behind=60) < ctl.expected_model_rate(8)
    assert ctl.expected_model_rate(8, behind=60) < 0.95 * ctl.expected_model_rate(8)


def test_only_the_answers_tokens_count_as_the_draft_being_behind() -> None:
    from types import SimpleNamespace

    from localspec.engine.decoder import SpeculativeEngine

    class Draft:  # a drafter whose cache holds the first ``seen`` tokens of any sequence
        def __init__(self, seen: int) -> None:
            self.seen = seen

        def behind(self, seq: list[int]) -> int:
            return len(seq) - self.seen

    prompt, answer = list(range(100)), list(range(100, 130))
    run = SimpleNamespace(seq=prompt + answer, out=answer)
    # A fresh draft behind on the whole prompt and answer: only the answer is this step's.
    assert SpeculativeEngine._answer_behind(run, Draft(0)) == 30 - 2
    # A draft that drafted 5 tokens ago: the usual 1-2 tokens a step adds are no catching up.
    assert SpeculativeEngine._answer_behind(run, Draft(125)) == 3
    assert SpeculativeEngine._answer_behind(run, Draft(128)) == 0
    assert SpeculativeEngine._answer_behind(run, Draft(130)) == 0


def test_acceptance_model_learns_from_outcomes() -> None:
    acc = AcceptanceModel()
    before = acc.estimate(0.55)
    for _ in range(50):
        acc.observe([0.55, 0.55], n_accepted=2)
    assert acc.estimate(0.55) > before
    assert acc.rate > 0.9
    for _ in range(200):
        acc.relax()
    assert abs(acc.rate - acc.prior_rate) < 0.05


def test_a_copys_sure_tokens_are_priced_apart_from_a_short_matchs_first_tokens() -> None:
    """A copy's tokens deep in a long match (0.99 and up) are accepted far more often than
    the first tokens of a 9-token match (0.9): pooled in one bin, the first ones' rejections
    priced the sure ones too, and cut long copies short."""
    acc = AcceptanceModel()
    for _ in range(40):
        acc.observe([0.92], n_accepted=0)
        acc.observe([0.995] * 8, n_accepted=8)
    assert acc.estimate(0.92) < 0.5
    assert acc.estimate(0.995) > 0.99


def test_a_width_between_the_measured_ones_is_priced_as_it_was_found() -> None:
    """A CPU's pass costs climb in steps, not along the line between measured widths: on
    Q4_K_M here 32 tokens cost 9.5 passes and 33 cost 12.1. A width a copy used is learned,
    so the copies after it are priced at what it took, and the widths beside it too."""
    costs = CostModel.from_measurements({1: 1.0, 2: 1.9, 16: 6.9, 32: 9.5, 64: 16.6}, 12, 0.1)
    line = costs.verify(33), costs.verify(40)
    assert line[0] < 10.0
    for _ in range(12):
        costs.observe_verify(33, 12.1)
    assert costs.verify(33) == pytest.approx(12.1, abs=0.1)
    assert costs.verify(40) > line[1]
    assert costs.verify(32) == pytest.approx(9.5) and costs.widest == 64
    assert list(costs.wide) == sorted(costs.wide)


def test_fixed_k_drafts_exactly_k() -> None:
    costs = CostModel.from_calibration(0.04, 0.36, 9, 8, 0.01)
    ctl = DraftController(costs, 8, fixed_k=3)
    p = Proposal("model", tokens=[1, 2], confidences=[0.01, 0.01])
    assert ctl.model_worth_trying(room=10)
    assert ctl.keep_going(2, p) and not ctl.keep_going(3, p)
    assert ctl.trim(p) == 2


def test_concave_verify_cost_considers_longer_drafts() -> None:
    # One extra token costs half a step, five cost little more (F16 on a CPU): K=1 loses,
    # K=5 wins, so drafting must be judged over all lengths, not one.
    costs = CostModel.from_measurements({1: 0.064, 2: 0.11, 5: 0.12, 8: 0.14},
                                        k_max=8, draft=0.01)
    ctl = DraftController(costs, 8)
    ctl.model_acc.rate = 0.75
    assert ctl._constant_rate(0.75, room=1)[0] == 0  # K=1 alone loses
    assert ctl.model_worth_trying(room=100)
    assert ctl.keep_going(1, Proposal("model", tokens=[1], confidences=[0.97]))


def test_fixed_costs_learn_nothing_not_even_a_first_observation() -> None:
    """A what-if's stated costs (``use_calibration(learn=False)``) stay as stated: the draft's
    first-token and catch-up prices, which take their first observation whole when learning,
    are not this machine's either."""
    def observed(costs: CostModel) -> CostModel:
        costs.observe_verify(2, 9.0)
        costs.observe_verify(32, 9.0)
        costs.observe_draft(9.0)
        costs.observe_draft_pass(4, 9.0)
        costs.observe_draft_first(9.0)
        costs.observe_catch_up(8, 9.0)
        return costs

    def fresh() -> CostModel:
        return CostModel.from_measurements({1: 0.01, 2: 0.011, 5: 0.012, 32: 0.02}, 4, 0.001)

    fixed = fresh()
    fixed.learning = False
    assert observed(fixed) == replace(fresh(), learning=False)
    learning = observed(fresh())  # the same observations move every price when learning
    assert learning.verify(2) > 0.011 and learning.wide[32] > 0.02
    assert learning.draft_token > 0.001
    assert learning.draft_first == 9.0 and learning.catch_up_token == 9.0 / 8
    # A tree node's host work is this machine's CPU's: learned under fixed device costs too.
    fixed.observe_draft_host(10, 0.004, tree=True)
    assert fixed.node_host() == pytest.approx(0.0004)
    fixed.observe_draft_host(10, 0.008, tree=True)
    assert 0.0004 < fixed.node_host() < 0.0008


def test_a_chains_host_work_prices_tree_nodes_until_a_tree_is_drafted() -> None:
    costs = CostModel.from_measurements({1: 0.012, 2: 0.0121, 32: 0.013}, 4, 0.0006)
    assert costs.node_host() == 0.0
    costs.observe_draft_host(8, 0.0024, tree=False)  # 0.3 ms a chain token
    assert costs.node_host() == pytest.approx(0.0003)
    costs.observe_draft_host(4, 0.0008, tree=False)
    assert 0.0002 < costs.node_host() < 0.0003
    # One slow first tree (cold caches: 4x) moves the price by the smoothing, not to itself.
    before = costs.node_host()
    costs.observe_draft_host(50, 50 * 4 * before, tree=True)
    assert costs.node_host() == pytest.approx(before + costs.smoothing * 3 * before)
    # From then on, trees alone teach it: a chain's work is not a tree's.
    after = costs.node_host()
    costs.observe_draft_host(8, 0.0001, tree=False)
    assert costs.node_host() == after
    # With no chain drafted first, a tree's own host work is taken whole.
    fresh = CostModel.from_measurements({1: 0.012, 2: 0.0121, 32: 0.013}, 4, 0.0006)
    fresh.observe_draft_host(40, 0.016, tree=True)
    assert fresh.node_host() == pytest.approx(0.0004)


def test_peeks_only_where_drafting_could_pay_and_back_off() -> None:
    compute_bound = _controller(t1=0.04, per_extra=0.04, draft=0.02)
    for _ in range(200):
        compute_bound.observe_plain_step()
    assert not compute_bound.should_peek(room=50)

    ctl = _controller(t1=0.09, per_extra=0.006, draft=0.02)
    ctl.model_acc.rate = 0.05  # the draft has been failing: not worth trying now
    assert not ctl.model_worth_trying(room=50)
    for _ in range(PeekSchedule.LEAST - 1):
        ctl.observe_plain_step()
    assert not ctl.should_peek(room=50)
    ctl.observe_plain_step()
    assert ctl.should_peek(room=50)
    ctl.observe_peek(False)  # nothing found: wait twice as long next time
    for _ in range(PeekSchedule.LEAST):
        ctl.observe_plain_step()
    assert not ctl.should_peek(room=50)
    for _ in range(PeekSchedule.LEAST):
        ctl.observe_plain_step()
    assert ctl.should_peek(room=50)


def test_peek_backoff_is_carried_to_the_next_request() -> None:
    """A pair where peeks keep finding nothing is not re-checked from scratch every request:
    each look catches the draft up on every token it skipped."""
    costs = CostModel.from_calibration(0.09, 0.09 + 0.006 * 8, 9, 8, 0.02)
    shared = PeekSchedule()

    def request_peeks(n_plain: int) -> int:
        ctl = DraftController(costs, 8, acceptance={"model": AcceptanceModel(prior_rate=0.05)},
                              peeks=shared)
        peeks = 0
        for _ in range(n_plain):
            if ctl.should_peek(room=50):
                ctl.start_peek()
                ctl.observe_peek(False)
                peeks += 1
            else:
                ctl.observe_plain_step()
        ctl.end_request()
        return peeks

    assert request_peeks(128) == 4  # after 8, 16, 32 and 64 plain steps
    assert shared.interval == PeekSchedule.MOST
    # The next requests go on where the last one left off: one look per 128 plain steps.
    assert request_peeks(100) == 0
    assert request_peeks(PeekSchedule.MOST) == 1
    ctl = DraftController(costs, 8, peeks=shared)
    ctl.start_peek()
    ctl.observe_peek(True)  # a peek that found a good draft: look often again
    assert shared.interval == PeekSchedule.LEAST


def test_peek_repays_the_drafts_catching_up() -> None:
    # Q4_K_M-like on a CPU: a 9-token verify costs 4 steps, a draft token 0.3 of one. Near-
    # perfect acceptance would pay a little, not enough to catch the draft up on 150 tokens.
    cpu = _controller(t1=0.09, per_extra=0.034, draft=0.027)
    for _ in range(200):
        cpu.observe_plain_step()
    assert cpu.should_peek(room=8, behind=lambda: 1, remaining=100)
    assert not cpu.should_peek(room=8, behind=lambda: 150, remaining=100)
    cpu.costs.observe_catch_up(150, 150 * 0.0001)  # measured: catching up is nearly free
    assert cpu.should_peek(room=8, behind=lambda: 150, remaining=100)
    # GPU-like: verification nearly free, the draft fast: the same look is worth it.
    gpu = _controller(t1=0.007, per_extra=0.0002, draft=0.001)
    for _ in range(200):
        gpu.observe_plain_step()
    assert gpu.should_peek(room=8, behind=lambda: 150, remaining=100)


def test_acceptance_carries_over_between_requests() -> None:
    shared = AcceptanceModel()
    first = DraftController(CostModel.from_calibration(0.09, 0.15, 9, 8, 0.02), 8,
                            acceptance={"model": shared})
    for _ in range(20):
        first.observe(Proposal("model", tokens=[1, 2], confidences=[0.9, 0.9]), 2, 0)
    first.end_request()
    second = DraftController(first.costs, 8, acceptance={"model": shared})
    # Starts from what the first request learned (the default prior is 0.6).
    assert second.model_acc.rate < 0.5


def test_unreached_depths_borrow_from_the_depth_above() -> None:
    """A draft whose first token keeps being accepted is expected to be accepted one token
    deeper too, and auto drafts that token. An unreached depth used to stay at the 0.6 prior:
    on a fresh F16 engine auto then drafted one token per step where three or more paid."""
    acc = AcceptanceModel()
    assert acc.depth_rates(0, 3) == pytest.approx([0.6] * 3)
    for _ in range(12):
        acc.observe([0.95], n_accepted=1)
    first, second, third = acc.depth_rates(0, 3)
    assert first > 0.85 and second == first and third == first
    # F16-like staircase on a CPU: 2-4 tokens cost little more than 1, a draft token 1/4 step.
    costs = CostModel.from_measurements({1: 0.15, 2: 0.165, 3: 0.17, 4: 0.19, 5: 0.29},
                                        k_max=4, draft=0.04)
    ctl = DraftController(costs, 4, acceptance={"model": acc})
    for _ in range(12):  # this request's own outcomes: the controller starts a request afresh
        ctl.observe(Proposal("model", tokens=[1], confidences=[0.95]), 1, 1)
    assert ctl.keep_going(1, Proposal("model", tokens=[1], confidences=[0.95]))


def test_deeper_depths_follow_this_requests_level() -> None:
    """Prose taught low acceptance at depth 2; in the next request (code the draft gets right)
    the first drafted token keeps being accepted. Depth 2, never reached yet, is expected at
    past requests' shape but this request's level: held at prose's rate, auto drafted one
    token per step where two paid (0.91x the best fixed K on a prose prompt after another)."""
    acc = AcceptanceModel()
    acc.start_request()
    for _ in range(30):  # prose: the first token accepted about half the time, rarely two
        acc.observe([0.5, 0.5], n_accepted=1)
        acc.observe([0.5, 0.5], n_accepted=0)
    acc.end_request()
    acc.start_request()
    carried = acc.depth_rates(0, 2)
    assert carried[1] < carried[0] < 0.6
    for _ in range(8):  # this request: only one token drafted per step, always accepted
        acc.observe([0.9], n_accepted=1)
    first, second = acc.depth_rates(0, 2)
    assert first > carried[0] + 0.2
    # The same ratio to the carried prior at the depth no outcome of this request reached.
    assert second == pytest.approx(carried[1] * first / carried[0])


def test_a_request_trusts_its_own_outcomes_within_a_few_steps() -> None:
    """A prompt after a copy-heavy one (97% accepted) is judged by its own acceptance after
    a handful of steps, not a dozen: borrowed optimism drafted too long on the next prompt."""
    acc = AcceptanceModel()
    acc.rate = 0.97
    acc.start_request()
    for i in range(6):  # 60% accepted: 1, 0, 1, 1, 0, 1
        acc.observe([0.9], n_accepted=0 if i in (1, 4) else 1)
    assert acc.rate < 0.8
    # Long runs of acceptance still reach near-certainty: the prior fades with the outcomes.
    for _ in range(40):
        acc.observe([0.9], n_accepted=1)
    assert acc.rate > 0.95


def test_near_ties_count_against_drafting() -> None:
    """A near-tie ends a step without its bonus token and costs a one-token pass next. Where a
    third of positions are near-ties (prose on a quantized target on a CPU, where the margin is
    ~0.55 logits), a draft that would pay without them does not."""
    # Q8_0-like on a CPU: 2 tokens cost 1.05 steps, a draft token a third of a step.
    costs = CostModel.from_measurements({1: 0.12, 2: 0.126, 3: 0.15, 4: 0.17}, 3, 0.04)
    ctl = DraftController(costs, 3)
    ctl.model_acc.rate = 0.6
    assert ctl.model_worth_trying(room=50)
    ctl.ties.rate = 0.33
    assert not ctl.model_worth_trying(room=50)
    assert "plain decoding" in ctl.explain() and "33% of positions near-ties" in ctl.explain()


def test_near_tie_rate_is_learned_and_carried() -> None:
    ties = NearTieRate(prior=0.05)
    ctl = DraftController(CostModel.from_calibration(0.09, 0.15, 9, 8, 0.02), 8, ties=ties)
    prop = Proposal("model", tokens=[1, 2], confidences=[0.9, 0.9])
    for i in range(60):  # three positions decided per step, every other step ends on a tie
        ctl.observe(prop, 2, 2, tied=i % 2 == 0)
    assert 0.1 < ties.rate < 0.25  # one position in six
    # A tie is neither an acceptance nor a rejection.
    assert ctl.model_acc.rate > 0.9
    ctl.end_request()
    ctl = DraftController(ctl.costs, 8, ties=ties)
    assert ties.rate > 0.05  # the next request starts from what this one saw


def test_plain_steps_count_toward_the_near_tie_rate() -> None:
    """A near-tie is a property of the target's text: the positions auto decodes plainly
    count too. Else a rate one tie raised stays up while auto decodes plainly, and prices
    every later copy as if ties cut it short."""
    ctl = DraftController(CostModel.from_calibration(0.06, 0.42, 16, 12, 0.03), 12)
    ctl.ties.rate = 0.3
    ctl.observe_plain_step(tied=None)  # not measured (the position a tie left): no news
    assert ctl.ties.rate == 0.3
    for _ in range(30):
        ctl.observe_plain_step(tied=False)
    assert ctl.ties.rate < 0.02
    ctl.observe_plain_step(tied=True)
    assert ctl.ties.rate > 0.09


def test_wide_passes_are_timed_while_their_tokens_get_cheaper() -> None:
    """Calibration times wider passes (for trees and long copies) while a token in them costs
    at least 10% less than in a pass half as wide: a copy accepted whole yields every token it
    holds, so a wide pass pays wherever its tokens are cheaper, however many one-token passes
    it costs."""
    # One-token passes, as measured on a 2-core AVX-512 machine with the real 1.5B targets.
    q4_k_m = {1: 1.0, 13: 8.29, 16: 8.17, 32: 11.9, 64: 17.85, 128: 27.37, 256: 58.2}
    assert [w for w in calibration.WIDE_WIDTHS
            if calibration.cheaper_per_token(q4_k_m, w)] == [16, 32, 64, 128]
    # F16 on a 2-core AMX machine (seconds): 16 tokens at 25.8 ms each are only 9% cheaper
    # than the widest chain width's (13, 28.4 ms), but 27% cheaper than in a pass of 8, and
    # a 32-token pass was cheaper again (21.5 ms): the first wide width is weighed against
    # half its width, not against whatever chain width happens to lie below it.
    f16 = {1: 0.1636, 2: 0.1885, 4: 0.2120, 8: 0.2831, 12: 0.3331, 13: 0.3689, 16: 0.4128}
    assert calibration.cheaper_per_token(f16, 16)
    assert calibration.cheaper_per_token({**f16, 32: 0.6882}, 32)
    assert not calibration.cheaper_per_token({**f16, 32: 0.80}, 32)  # 25 ms: no cheaper


def test_top_k_ids_finds_the_k_largest_without_a_full_partition() -> None:
    """The column-maxima search returns exactly the top-k values on peaked, ordinary, flat and
    tied logits, when the top tokens crowd into one column of its grid, and when the best
    token sits in the ragged tail of a vocabulary the grid does not divide."""
    from localspec.engine.sampling import _GRID_ROWS, _top_k_ids

    rng = np.random.default_rng(11)
    cases = []
    for n in (151_936, 151_936 + 37, 256):
        for scale, peak in ((2.5, 9.0), (1.0, 0.0), (0.001, 0.0), (30.0, 40.0)):
            x = (rng.standard_normal(n) * scale).astype(np.float32)
            x[rng.integers(0, n, 5)] += peak
            cases.append(x)
        tied = np.round(rng.standard_normal(n)).astype(np.float32)  # a few distinct values
        cases.append(tied)
        crowded = (rng.standard_normal(n)).astype(np.float32)
        cols = n // _GRID_ROWS
        crowded[7::cols] += 20.0  # every row's token of one column beats the rest
        cases.append(crowded)
        tail = (rng.standard_normal(n)).astype(np.float32)
        tail[-1] += 50.0
        cases.append(tail)
    for x in cases:
        for k in (1, 40, 300):
            if k >= x.size:
                continue
            got = _top_k_ids(x, k)
            want = np.argsort(-x, kind="stable")[:k]
            assert got.size == np.unique(got).size == k
            assert np.array_equal(np.sort(x[got]), np.sort(x[want])), (x.size, k)


def test_confidence_is_the_top_probability() -> None:
    from localspec.engine.sampling import confidence

    x = np.full(151_936, -30.0, dtype=np.float32)
    x[[3, 9]] = [2.0, 2.0 - np.log(3.0)]  # p(top) = 3/4 up to the far tail
    assert abs(confidence(x) - 0.75) < 1e-3
    x[9] = -8.5  # more than 10 logits below: left out, as documented
    assert confidence(x) == 1.0


def test_gumbel_noise_is_the_same_for_few_and_many_candidates() -> None:
    """Small candidate sets hash and score with Python numbers, large ones with numpy: a
    token's noise, the coupled choice and prob_of must not depend on which path ran."""
    from localspec.engine.sampling import (
        _FEW,
        _gumbel_of,
        _noise_key,
        coupled_choice,
        gumbel_noise,
    )

    rng = np.random.default_rng(5)
    for seed, position in ((7, 0), (-3, 41), (2**63 + 5, 10_000)):
        many = rng.choice(151_936, size=_FEW * 3, replace=False).astype(np.int64)
        few = many[:_FEW]
        key = _noise_key(seed, position)
        assert np.allclose([_gumbel_of(key, int(t)) for t in few],
                           gumbel_noise(seed, position, many)[:_FEW], rtol=1e-15, atol=0)
        # A Gumbel sample: mean ~0.577 (Euler's constant) over many tokens.
        assert abs(float(gumbel_noise(seed, position, np.arange(20_000)).mean()) - 0.577) < 0.03

        logits = rng.standard_normal(_FEW * 3)
        logits[_FEW:] -= 1e3  # the extra tokens cannot win
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        big = Candidates(many, logits, probs)
        small = Candidates(few, logits[:_FEW], probs[:_FEW] / probs[:_FEW].sum())
        a, b = (coupled_choice(c, 0.8, seed, position) for c in (big, small))
        assert a.token == b.token and abs(a.margin - b.margin) < 1e-9
        tok = int(few[3])
        assert abs(big.prob_of(tok) - small.prob_of(tok)) < 1e-12
        assert big.prob_of(-1) == small.prob_of(-1) == 0.0


def test_carried_prior_is_what_requests_saw_not_how_they_ended() -> None:
    """Auto stops drafting on bad news, so requests tend to end on it: carrying the estimate a
    request ended on dragged the prior down request after request."""
    acc = AcceptanceModel(prior_rate=0.55)
    for _ in range(20):
        acc.start_request()
        for accepted in [1] * 11 + [0] * 9:  # 55% accepted, the rejections last
            acc.observe([0.5], n_accepted=accepted)
        assert acc.rate < 0.45  # this request's running estimate ends low
        acc.end_request()
    assert acc.prior_rate == pytest.approx(0.55, abs=0.03)


def test_a_dip_in_acceptance_is_retried_within_a_few_plain_steps() -> None:
    """Where drafting gains ~10% (55% accepted here), a short unlucky run drops the estimate
    below the margin. Decoding plainly teaches nothing, so the estimate must drift back to
    what past requests saw soon: at 2% a step auto stayed plain for ~50 steps after each dip
    (simulated prose: 0.88x the best fixed K)."""
    ctl = DraftController(cost_model(CPU_F16), 8)
    ctl.model_acc.rate = 0.55
    ctl.ties.rate = 0.0
    assert ctl.model_worth_trying(8)
    for _ in range(3):
        ctl.model_acc.observe([0.5], n_accepted=0)
    assert not ctl.model_worth_trying(8)
    plain_steps = 0
    while not ctl.model_worth_trying(8):
        ctl.observe_plain_step()
        plain_steps += 1
        assert plain_steps <= 20
    assert plain_steps >= 2  # a dip is not forgotten at once either


def test_a_few_rejections_do_not_shut_a_confidence_bin() -> None:
    """Tokens trimmed are never verified, so a confidence bin that trimming shuts out stays
    at whatever it last learned. Five straight rejections of tokens the draft gave 15% (one
    chance in three at that rate) had this CPU's controller trim such tokens ever after: their
    bin stuck at 0.04 while the target accepted 15% of them."""
    ctl = DraftController(cost_model(CPU_F16), 8)
    ctl.model_acc.rate = 0.55
    for _ in range(5):
        ctl.model_acc.observe([0.15], n_accepted=0)
    doubtful = Proposal("model", tokens=[7], confidences=[0.15])
    assert ctl.trim(doubtful) == 1  # one more token costs 6 ms here: still worth verifying
    for _ in range(40):  # a bin that keeps failing does close
        ctl.model_acc.observe([0.15], n_accepted=0)
    assert ctl.trim(Proposal("model", tokens=[7], confidences=[0.15])) == 0


def _copy(n: int = 3) -> Proposal:
    return Proposal("lookup", tokens=list(range(100, 100 + n)), confidences=[0.75] * n)


def test_a_free_drafters_bins_are_rescaled_by_this_requests_own_outcomes() -> None:
    """Prompt lookup's confidence bins pool every request: on a cold index, the copies a
    type-hint edit got right priced the rename prompt's copies, which the target kept
    rejecting, and auto kept verifying them on a steep curve (Q4_K_M on a 2-core AMX CPU:
    0.93x the target alone in one run of three). Within a few rejections a request's own
    outcomes must stop that, and the next request must start from the bins again."""
    points = {1: 0.085, 2: 0.128, 4: 0.187, 8: 0.28, 13: 0.29, 16: 0.36, 32: 0.55, 64: 0.93}
    acceptance: dict[str, AcceptanceModel] = {}
    ctl = DraftController(CostModel.from_measurements(points, 8, 0.01), 8,
                          acceptance=acceptance)
    for _ in range(100):  # past requests: copies at this confidence were accepted
        ctl.observe(_copy(), 3, 3)
    ctl.end_request()
    ctl = DraftController(CostModel.from_measurements(points, 8, 0.01), 8,
                          acceptance=acceptance)
    assert ctl.trim(_copy()) == 3
    for _ in range(5):  # this request: every copy's first token is rejected
        ctl.observe(_copy(), 1, 0)
    assert acceptance["lookup"].estimate(0.75) > 0.9  # the pooled bin has barely moved
    assert ctl.trim(_copy()) == 0
    ctl.end_request()
    again = DraftController(CostModel.from_measurements(points, 8, 0.01), 8,
                            acceptance=acceptance)
    assert again.trim(_copy()) == 3
    # A request whose copies keep being accepted is priced at least as the bins say.
    for _ in range(20):
        again.observe(_copy(), 3, 3)
    lookup = acceptance["lookup"]
    assert lookup.request_estimate(0.75) >= lookup.estimate(0.75)


STEEP = {1: 0.085, 2: 0.128, 4: 0.187, 8: 0.28, 13: 0.29, 16: 0.36, 32: 0.55, 64: 0.93}


def test_an_unproven_free_drafters_copy_risks_little_until_the_request_bears_it_out() -> None:
    """On a cold index one edit prompt's copies held and taught the bins, and the next edit
    prompt's first long copy was rejected at its first token: on a compute-bound target that
    pass was 2.8 one-token passes of a 113-token answer, its whole loss to the target alone.
    Until a request's first checked tokens bear the bins out, and unless the drafter's last
    requests all did, a copy may cost at most UNPROVEN_LOSS passes if rejected at once."""
    acceptance: dict[str, AcceptanceModel] = {}

    def request() -> DraftController:
        return DraftController(CostModel.from_measurements(STEEP, 8, 0.01), 8,
                               acceptance=acceptance)

    def long_copy() -> Proposal:
        return Proposal("lookup", tokens=list(range(100, 140)), confidences=[0.75] * 40)

    ctl = request()
    for _ in range(100):  # one earlier request whose copies held
        ctl.observe(_copy(), 3, 3)
    ctl.end_request()
    ctl = request()
    lookup = acceptance["lookup"]
    cap = ctl.unproven_cap()
    t1 = ctl.costs.verify(1)
    assert ctl.costs.verify(cap + 1) <= t1 * (1 + ctl.UNPROVEN_LOSS) < ctl.costs.verify(cap + 2)
    assert lookup.unproven and ctl.trim(long_copy()) == cap < 10
    for _ in range(3):  # this request's copies hold too: 9 checked tokens
        ctl.observe(_copy(), 3, 3)
    assert not lookup.unproven and ctl.trim(long_copy()) > cap
    ctl.end_request()
    ctl = request()  # two requests bore the bins out: not yet enough to trust the next
    assert lookup.unproven and ctl.trim(long_copy()) == cap
    for _ in range(3):
        ctl.observe(_copy(), 3, 3)
    ctl.end_request()
    ctl = request()  # three did: the next request's first copy is verified long
    assert lookup.trusted and ctl.trim(long_copy()) > cap
    for _ in range(8):  # a request whose copies fail at once
        ctl.observe(_copy(), 1, 0)
    ctl.end_request()
    ctl = request()
    assert not lookup.trusted and ctl.trim(long_copy()) == cap


def test_an_unproven_copy_capped_short_of_paying_is_scored_at_plain_steps() -> None:
    """Where 2 tokens cost 2 passes (Q4_K_M on a 2-core AVX-512 CPU) the cap leaves an
    unproven copy nothing worth verifying, so it was never checked and never proven. A plain
    step scores the first token of each unproven proposal against the token it wrote: the
    request's own evidence, for or against, without verifying anything."""
    steeper = {1: 0.05, 2: 0.10, 3: 0.13, 8: 0.30, 16: 0.35, 32: 0.47, 64: 0.85}

    def request() -> tuple[DraftController, AcceptanceModel]:
        ctl = DraftController(CostModel.from_measurements(steeper, 8, 0.01), 8)
        return ctl, ctl.acceptance["history"]

    def copy() -> Proposal:
        return Proposal("history", tokens=list(range(100, 140)), confidences=[0.95] * 40)

    ctl, acc = request()
    assert acc.unproven and ctl.unproven_cap() == 1 and ctl.trim(copy()) == 0
    ctl.shadow(copy())
    ctl.observe_plain_step(tied=True, token=100)  # a near-tie: verifying decides nothing
    ctl.shadow(copy())
    ctl.observe(_copy(), 1, 1)  # a step that drafted: its own outcome teaches
    ctl.observe_plain_step(tied=False, token=100)
    for _ in range(acc.EARLY - 1):  # had either step above been scored, the last proves it
        ctl.shadow(copy())
        ctl.observe_plain_step(tied=False, token=100)
    assert acc.unproven
    ctl.shadow(copy())
    ctl.observe_plain_step(tied=False, token=100)
    assert not acc.unproven and ctl.trim(copy()) >= 16
    ctl, acc = request()  # a request whose copies' first tokens the target does not write
    for _ in range(acc.EARLY):
        ctl.shadow(copy())
        ctl.observe_plain_step(tied=False, token=7)
    assert not acc.unproven and ctl.trim(copy()) == 0
    # The pooled bins learn only drafts: as a request's that saw none.
    assert acc.estimate(0.95) == pytest.approx(AcceptanceModel().estimate(0.95))


def test_on_a_flat_curve_an_unproven_copy_is_not_capped() -> None:
    """Where a wide pass costs little more than a narrow one (a GPU), a rejected copy costs
    little: the cap is the free drafters' longest draft."""
    flat = {1: 0.010, 2: 0.0101, 4: 0.0102, 8: 0.0105, 16: 0.011, 32: 0.012, 64: 0.014}
    ctl = DraftController(CostModel.from_measurements(flat, 8, 0.001), 8)
    assert ctl.acceptance["lookup"].unproven
    assert ctl.unproven_cap() == ctl.FREE_MAX


def test_a_chain_widths_cost_is_the_median_of_its_rounds() -> None:
    """One slow moment (a timing of 9.0 among ~1.0s) moves one round, not the width's cost;
    every width is timed once a round, widths interleaved."""
    from localspec.engine.calibration import median_times

    script = iter([1.0, 2.0, 9.0, 2.1, 1.1, 9.0])  # round 1: w2, w3; round 2; round 3
    order: list[int] = []

    def timed(w: int) -> float:
        order.append(w)
        return next(script)

    assert median_times(timed, [2, 3], 3) == {2: 1.1, 3: 2.1}
    assert order == [2, 3, 2, 3, 2, 3]


# -- the calibration cache ------------------------------------------------------------------------
Damage = Callable[[dict[str, Any]], None]


def _drop_one(cal: dict[str, Any]) -> None:
    del cal["target_points"]["1"]


def _set(name: str, value: object) -> Damage:
    def damage(cal: dict[str, Any]) -> None:
        cal[name] = value
    return damage


def _point(width: str, value: object) -> Damage:
    def damage(cal: dict[str, Any]) -> None:
        cal["target_points"][width] = value
    return damage


# Each still parses as JSON; each would crash a reader or skew auto's decisions.
DAMAGE: dict[str, Damage] = {
    "no one-token cost": _drop_one,
    "draft token NaN": _set("draft_token", float("nan")),
    "draft token inf": _set("draft_token", float("inf")),
    "draft token negative": _set("draft_token", -1.0),
    "draft token text": _set("draft_token", "0.001"),
    "drift null": _set("drift", None),
    "measuring time negative": _set("seconds", -3.0),
    "a zero cost": _point("2", 0.0),
    "an infinite cost": _point("2", float("inf")),
    "a cost that is true": _point("2", True),
    "a width of 0": _point("0", 0.01),
    "a negative width": _point("-4", 0.01),
    "a width that is no number": _point("two", 0.01),
}


@pytest.mark.parametrize("damage", list(DAMAGE.values()), ids=list(DAMAGE))
def test_a_damaged_calibration_cache_is_no_cache(damage: Damage,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    key = "k" * 64
    good = calibration.Calibration({1: 0.01, 2: 0.012, 16: 0.05}, 0.002, 0.001, 1.5)
    calibration.store(key, good)
    assert calibration.load_cached(key) == good
    path = calibration._path(key)
    data = json.loads(path.read_text())
    damage(data["calibration"])
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.DEBUG, logger=calibration.log.name):
        assert calibration.load_cached(key) is None
    assert any("ignoring the calibration cache" in r.getMessage() for r in caplog.records)


def test_an_engine_measures_again_over_a_damaged_calibration_cache(target_gguf: Path,
                                                                   draft_gguf: Path) -> None:
    """A cache with its one-token cost gone (it broke `demo` on every run): the engine loads
    as if none were cached, measures on its first drafting request, and overwrites it."""
    from localspec.engine import ModelSettings, SpeculativeEngine

    from .engine_helpers import run

    settings = ModelSettings(n_ctx=256)
    with SpeculativeEngine.load(target_gguf, draft_gguf, settings) as engine:
        run(engine, "the model and the draft", max_tokens=8)
        path = calibration._path(engine._calibration_key())
    data = json.loads(path.read_text())
    del data["calibration"]["target_points"]["1"]
    path.write_text(json.dumps(data))
    with SpeculativeEngine.load(target_gguf, draft_gguf, settings) as engine:
        assert engine.calibration is None
        run(engine, "the model and the draft", max_tokens=8)
        assert engine.calibration is not None and 1 in engine.calibration.target_points
    assert "1" in json.loads(path.read_text())["calibration"]["target_points"]
