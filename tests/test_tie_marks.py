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
from localspec.engine.drafters import DraftContext, HistoryDrafter, Proposal, TreeRequest
from localspec.engine.history_index import MARK_CLEAR, MARK_TIED, MARK_UNKNOWN
from localspec.engine.history_store import HistoryStore
from localspec.engine.stats import GenerationStats

from .engine_helpers import PROMPTS, trust

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


def test_each_branch_of_a_history_tree_ends_just_before_its_first_known_near_tie() -> None:
    store = HistoryStore.in_memory("v", max_tokens=1000)
    c, t = MARK_CLEAR, MARK_TIED
    store.index.add([1, 7, 8, 9, 10, 11, 12, 13], [c, c, c, c, c, c, t, c])  # tied at 12
    store.index.add([5, 7, 8, 9, 20, 21, 22, 23], [c, c, c, c, c, c, c, c])
    store.index.add([6, 7, 8, 9, 30, 31, 32], [c, c, c, c, t, c, c])  # tied at its first
    tree = store.index.lookup_tree([7, 8, 9], depth=4, max_nodes=16)
    assert tree is not None
    paths: dict[int, tuple[int, ...]] = {}
    for i, (tok, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
        paths[i] = (*paths[parent], tok) if parent >= 0 else (tok,)
    leaves = {paths[i] for i in paths if i not in tree.parents}
    assert leaves == {(10, 11), (20, 21, 22, 23)}
    # The drafter's tree holds the same ways.
    request = TreeRequest(nodes=16, depth=4, branches=4, width=1, floor=0.0,
                          estimate=lambda conf: conf)
    prop = HistoryDrafter().propose_tree(DraftContext(seq=[4, 7, 8, 9], history=store), request)
    assert sorted(prop.tokens) == [10, 11, 20, 21, 22, 23]


def _controller(tie_rate: float) -> DraftController:
    # A compute-bound curve (each token in a pass costs 60% of a one-token pass) and free
    # drafts it prices by their acceptance alone.
    points = {1: 0.010, 2: 0.016, 13: 0.082, 16: 0.10, 32: 0.196, 64: 0.388}
    ctl = DraftController(CostModel.from_measurements(points, 12, 0.005), 12,
                          ties=NearTieRate(prior=tie_rate))
    trust(ctl.acceptance["history"])  # long copies are priced here, not capped as unproven
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


def test_marked_tie_rates_learn_from_what_the_marked_positions_met() -> None:
    ties = NearTieRate()
    clear0, tied0 = ties.marked_rate(MARK_CLEAR), ties.marked_rate(MARK_TIED)
    assert clear0 is not None and tied0 is not None and clear0 < tied0
    assert ties.marked_rate(MARK_UNKNOWN) is None
    # Positions marked tied that a later guard (a narrower drift) decides in one pass: each
    # copy's last position, marked tied, is verified clear.
    for _ in range(30):
        ties.observe_marked([MARK_CLEAR] * 5 + [MARK_TIED], 6, tied=False)
    learned_tied = ties.marked_rate(MARK_TIED)
    assert learned_tied is not None and learned_tied < tied0 / 2
    # Clear-marked positions that tie: the clear rate rises.
    for _ in range(30):
        ties.observe_marked([MARK_CLEAR] * 3, 3, tied=True)
    learned_clear = ties.marked_rate(MARK_CLEAR)
    assert learned_clear is not None and learned_clear > 2 * clear0


def test_a_tie_is_counted_against_the_mark_of_the_position_it_met() -> None:
    ties = NearTieRate()
    tied0 = ties.marked_rate(MARK_TIED)
    # The copy ran to its document's end: the position after (where the tie was) has no
    # mark, so the marked positions before it, all accepted, count as clear.
    for _ in range(20):
        ties.observe_marked([MARK_TIED, MARK_TIED], 3, tied=True)
    after = ties.marked_rate(MARK_TIED)
    assert tied0 is not None and after is not None and after < tied0


def test_auto_prices_marked_positions_by_the_rates_it_learned() -> None:
    ties = NearTieRate(prior=0.0)
    # A flat curve: the whole copy is worth verifying, so its last position's rate counts.
    flat = CostModel.from_measurements({1: 0.010, 2: 0.0101, 13: 0.0105, 16: 0.0106}, 12, 0.005)
    ctl = DraftController(flat, 12, ties=ties)
    ends_tied = _copy(3, [MARK_CLEAR] * 3 + [MARK_TIED])
    before = ctl.tie_rates(ends_tied)
    assert isinstance(before, list) and before[-1] == pytest.approx(0.8)
    # Copies whose tied-marked last position was decided in one pass, verified through the
    # controller as the decoder reports them; a second request's controller shares the rates.
    for _ in range(40):
        ctl.observe(ends_tied, n_verified=3, n_accepted=3, tied=False)
    ctl.end_request()
    later = DraftController(ctl.costs, 12, ties=ties)
    after = later.tie_rates(ends_tied)
    assert isinstance(after, list) and after[-1] < 0.3
    # The same copy is worth more than to a controller that knows only the priors.
    fresh = DraftController(ctl.costs, 12, ties=NearTieRate(prior=0.0))
    n_later, rate_later = later._free_prefix(ends_tied)
    n_fresh, rate_fresh = fresh._free_prefix(ends_tied)
    # Priced by the prior, the copy stops short of its tied-marked position's pass; priced
    # by what was learned, it is verified whole and worth more.
    assert n_fresh < n_later == 3 and rate_later > rate_fresh


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


@pytest.mark.parametrize("tree", [False, True], ids=["chains", "trees"])
def test_a_repeat_never_drafts_across_a_position_marked_tied(
        tree: bool, target_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = HistoryStore.in_memory(history.vocabulary_id(target_gguf))
    drafted_at: list[tuple[int, list[int]]] = []  # (first output position, each node's depth)
    propose, propose_tree = HistoryDrafter.propose, HistoryDrafter.propose_tree

    def spy(self: HistoryDrafter, ctx: DraftContext, budget: int) -> Proposal:
        prop = propose(self, ctx, budget)
        drafted_at.append((len(ctx.seq), list(range(len(prop.tokens)))))
        return prop

    def spy_tree(self: HistoryDrafter, ctx: DraftContext, request: TreeRequest) -> Proposal:
        prop = propose_tree(self, ctx, request)
        depths: list[int] = []
        for parent in prop.parent_list():
            depths.append(depths[parent] + 1 if parent >= 0 else 0)
        drafted_at.append((len(ctx.seq), depths))
        return prop

    with SpeculativeEngine.load(target_gguf, None, ModelSettings(n_ctx=512),
                                history=store) as eng:
        prompt = list(eng.tokenize(PROMPTS[3], chat=False))
        _, margins = _one_token_margins(eng, prompt, N)
        between = sorted(margins[1:])
        guard = (between[len(between) // 4] + between[len(between) // 4 + 1]) / 2
        steep = Calibration({1: 0.01, 2: 0.02, 13: 0.13}, 0.005, guard / 2)
        eng.use_calibration(steep, learn=False)
        req = GenerationRequest(tuple(prompt), max_tokens=N,
                                draft=DraftSettings(mode="history", tree=tree))
        eng.clear_caches()
        first = eng.generate(req)
        marks = next(store.index.marked_documents())[1].tolist()[-len(first.tokens):]
        tied = {len(prompt) + i for i, m in enumerate(marks) if m == MARK_TIED}
        # A flat curve: a copy pays at any length, so only the marks can stop one short.
        flat = Calibration({1: 0.010, 2: 0.0101, 13: 0.0105, 16: 0.0106, 32: 0.011, 64: 0.012},
                           0.005, guard / 2)
        eng.use_calibration(flat, learn=False)
        monkeypatch.setattr(HistoryDrafter, "propose", spy)
        monkeypatch.setattr(HistoryDrafter, "propose_tree", spy_tree)
        eng.clear_caches()
        with eng.frozen_history():
            again = eng.generate(req)
    assert again.tokens == first.tokens
    assert tied, marks
    drafts = [(start, depths) for start, depths in drafted_at if depths]
    assert drafts, drafted_at
    for start, depths in drafts:
        assert not tied & {start + d for d in depths}, (start, depths, sorted(tied))
    assert again.stats.drafters["history"].accepted >= len(again.tokens) // 2
    # The statistics count the steps a tie stopped, through a process boundary too: none
    # where the first run decoded plainly, and only at the ties the marks knew. (A chain is
    # priced by its marks and may stop one token short instead; a tree is priced by the
    # running rate, so its copies run into the ties.)
    assert first.stats.tie_stops == 0 and again.stats.tie_stops <= len(tied)
    assert again.stats.tie_stops >= 1 or not tree
    assert GenerationStats.from_json(again.stats.to_json()).tie_stops == again.stats.tie_stops
