"""Near-tie marks: an answer goes into the history index with where the target met a near-tie,
a copy of it stops just before one, and auto prices a copy by where its ties are."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from localspec import history
from localspec.engine import DraftSettings, GenerationRequest, ModelSettings, SpeculativeEngine
from localspec.engine.calibration import Calibration
from localspec.engine.controller import CostModel, DraftController, NearTieRate
from localspec.engine.drafters import DraftContext, HistoryDrafter, Proposal
from localspec.engine.history_index import MARK_CLEAR, MARK_TIED, MARK_UNKNOWN
from localspec.engine.history_store import HistoryStore

from .engine_helpers import PROMPTS

N = 40


def _store_with(tokens: list[int], marks: list[int]) -> HistoryStore:
    store = HistoryStore.in_memory("v", max_tokens=1000)
    store.index.add(tokens, marks)
    return store


def test_a_copy_stops_just_before_a_known_near_tie() -> None:
    doc = [1, 2, 3, 10, 11, 12, 13, 14]
    marks = [0, 0, 0, MARK_CLEAR, MARK_CLEAR, MARK_TIED, MARK_CLEAR, MARK_CLEAR]
    ctx = DraftContext(seq=[7, 1, 2, 3], history=_store_with(doc, marks))
    prop = HistoryDrafter().propose(ctx, budget=5)
    # 12 was a near-tie: verification would stop there, so the draft ends before it, and
    # says the position after it is the tie.
    assert prop.tokens == [10, 11]
    assert prop.marks == [MARK_CLEAR, MARK_CLEAR, MARK_TIED]
    # Right at the tie: nothing to draft (a one-token pass decides it).
    at_tie = HistoryDrafter().propose(DraftContext(seq=[1, 2, 3, 10, 11], history=ctx.history),
                                      budget=5)
    assert at_tie.tokens == []
    # Past it: the copy goes on to the document's end; the budget bounds it, with the mark
    # of the position after the last token drafted.
    past = HistoryDrafter().propose(DraftContext(seq=[3, 10, 11, 12], history=ctx.history),
                                    budget=1)
    assert past.tokens == [13] and past.marks == [MARK_CLEAR, MARK_CLEAR]


def _controller(tie_rate: float) -> DraftController:
    # A compute-bound curve (each token in a pass costs 60% of a one-token pass) and free
    # drafts it prices by their acceptance alone.
    points = {1: 0.010, 2: 0.016, 13: 0.082, 16: 0.10, 32: 0.196, 64: 0.388}
    ctl = DraftController(CostModel.from_measurements(points, 12, 0.005), 12,
                          ties=NearTieRate(prior=tie_rate))
    return ctl


def _copy(n: int, marks: list[int] | None = None) -> Proposal:
    return Proposal(source="history", tokens=list(range(100, 100 + n)),
                    confidences=[1.0] * n, marks=marks or [])


def test_a_copy_marked_clear_is_worth_a_long_pass_where_the_running_rate_says_not() -> None:
    ctl = _controller(tie_rate=0.3)  # a run of near-ties just now
    clear = _copy(30, [MARK_CLEAR] * 31)
    unmarked = _copy(30)
    n_clear, rate_clear = ctl._free_prefix(clear)
    n_unmarked, rate_unmarked = ctl._free_prefix(unmarked)
    plain = ctl.plain_rate()
    assert rate_unmarked < plain < rate_clear
    assert n_clear > n_unmarked and n_clear >= 3 and ctl.trim(clear) == n_clear


def test_a_copy_ending_at_a_known_tie_is_priced_with_the_one_token_pass_it_leaves() -> None:
    ctl = _controller(tie_rate=0.0)
    ends_clear = _copy(3, [MARK_CLEAR] * 4)
    ends_tied = _copy(3, [MARK_CLEAR] * 3 + [MARK_TIED])
    n_clear, rate_clear = ctl._free_prefix(ends_clear)
    _, rate_tied = ctl._free_prefix(ends_tied)
    assert n_clear == 3
    t1, verify = ctl.costs.verify(1), ctl.costs.verify(4)
    # The same tokens, but the tied position's comes from a second, one-token pass where
    # the drafted ones are all accepted: dearer, and at most by that whole pass.
    assert rate_clear * verify / (verify + t1) <= rate_tied < rate_clear


def _one_token_margins(eng: SpeculativeEngine, prompt: list[int], n: int) -> tuple[list[int],
                                                                                  list[float]]:
    """Plain greedy decoding, one token a pass, and each position's top-2 logit margin."""
    runner = eng.target
    runner.truncate(0)
    logits = runner.sync(prompt, 1)[0]
    tokens: list[int] = []
    margins: list[float] = []
    for _ in range(n):
        top2 = np.sort(logits)[-2:]
        margins.append(float(top2[1] - top2[0]))
        tokens.append(int(np.argmax(logits)))
        if runner.is_eog(tokens[-1]):
            break
        logits = runner.decode([tokens[-1]], 1)[0]
    return tokens, margins


@pytest.mark.parametrize("precision", ["f32", "q4_k_m"])
def test_an_answer_is_recorded_with_the_near_ties_its_target_met(
        precision: str, quantized_pairs: dict[str, tuple[Path, Path]]) -> None:
    target, _ = quantized_pairs[precision]
    store = HistoryStore.in_memory(history.vocabulary_id(target))
    with SpeculativeEngine.load(target, None, ModelSettings(n_ctx=512), history=store) as eng:
        prompt = list(eng.tokenize(PROMPTS[0], chat=False))
        plain, margins = _one_token_margins(eng, prompt, N)
        # A guard between two of the margins met, so that about half the positions are ties.
        between = sorted(margins[1:])
        guard = (between[len(between) // 2 - 1] + between[len(between) // 2]) / 2
        # A steep curve: auto decodes plainly, and watches each plain step for a near-tie.
        eng.use_calibration(Calibration({1: 0.01, 2: 0.02, 13: 0.13}, 0.005, guard / 2),
                            learn=False)
        assert eng.tie_margin == pytest.approx(guard)
        eng.clear_caches()
        done = eng.generate(GenerationRequest(tuple(prompt), max_tokens=N,
                                              draft=DraftSettings(mode="history")))
    assert list(done.tokens) == [t for t in plain if not eng.target.is_eog(t)]
    docs = list(store.index.marked_documents())
    assert len(docs) == 1
    marks = docs[0][1].tolist()[-len(done.tokens):]
    # The first token comes from the prompt's pass, unwatched; each after it is marked by
    # its own one-token margin.
    expected = [MARK_UNKNOWN] + [MARK_TIED if m <= guard else MARK_CLEAR
                                 for m in margins[1:len(done.tokens)]]
    assert marks == expected
    assert MARK_TIED in marks and MARK_CLEAR in marks


def test_a_repeat_never_drafts_across_a_position_marked_tied(
        target_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = HistoryStore.in_memory(history.vocabulary_id(target_gguf))
    drafted_at: list[tuple[int, int]] = []  # (first output position, tokens)
    propose = HistoryDrafter.propose

    def spy(self: HistoryDrafter, ctx: DraftContext, budget: int) -> Proposal:
        prop = propose(self, ctx, budget)
        drafted_at.append((len(ctx.seq), len(prop.tokens)))
        return prop

    with SpeculativeEngine.load(target_gguf, None, ModelSettings(n_ctx=512),
                                history=store) as eng:
        prompt = list(eng.tokenize(PROMPTS[3], chat=False))
        _, margins = _one_token_margins(eng, prompt, N)
        between = sorted(margins[1:])
        guard = (between[len(between) // 4] + between[len(between) // 4 + 1]) / 2
        steep = Calibration({1: 0.01, 2: 0.02, 13: 0.13}, 0.005, guard / 2)
        eng.use_calibration(steep, learn=False)
        # Chains: tree proposals do not read the marks (yet).
        req = GenerationRequest(tuple(prompt), max_tokens=N,
                                draft=DraftSettings(mode="history", tree=False))
        eng.clear_caches()
        first = eng.generate(req)
        marks = next(store.index.marked_documents())[1].tolist()[-len(first.tokens):]
        tied = {len(prompt) + i for i, m in enumerate(marks) if m == MARK_TIED}
        # A flat curve: a copy pays at any length, so only the marks can stop one short.
        flat = Calibration({1: 0.010, 2: 0.0101, 13: 0.0105, 16: 0.0106, 32: 0.011, 64: 0.012},
                           0.005, guard / 2)
        eng.use_calibration(flat, learn=False)
        monkeypatch.setattr(HistoryDrafter, "propose", spy)
        eng.clear_caches()
        with eng.frozen_history():
            again = eng.generate(req)
    assert again.tokens == first.tokens
    assert tied, marks
    drafts = [(start, n) for start, n in drafted_at if n]
    assert drafts, drafted_at
    for start, n in drafts:
        assert not tied & set(range(start, start + n)), (start, n, sorted(tied))
    assert again.stats.drafters["history"].accepted >= len(again.tokens) // 2
