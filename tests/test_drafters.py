"""The drafter seam: a drafter is one class registered by name; the draft modes, the controller's
acceptance models and the statistics come from the registry, and the engine runs any drafter."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from localspec import options
from localspec.engine import (
    DraftContext,
    Drafter,
    DraftSettings,
    GenerationStats,
    ModelSettings,
    Proposal,
    SpeculativeEngine,
    drafters,
)
from localspec.engine.controller import CostModel, DraftController
from localspec.errors import LocalspecError
from localspec.params import InvalidOptionError

from .engine_helpers import PROMPTS, run

THROWAWAY = "repeat-last"


@pytest.fixture
def repeat_last() -> Iterator[list[tuple[int, int]]]:
    """A throwaway drafter, registered for one test: it proposes the last token again. Yields
    the (drafted, accepted) outcomes it was shown."""
    outcomes: list[tuple[int, int]] = []

    @drafters.register
    class RepeatLast(Drafter):
        name = THROWAWAY

        def propose(self, ctx: DraftContext, budget: int) -> Proposal:
            return Proposal(self.name, tokens=[ctx.seq[-1]] * budget)

        def observe(self, proposal: Proposal, n_accepted: int) -> None:
            outcomes.append((len(proposal.tokens), n_accepted))

    yield outcomes
    drafters.unregister(RepeatLast.name)


@pytest.fixture(scope="module")
def engine(target_gguf: Path, draft_gguf: Path) -> Iterator[SpeculativeEngine]:
    with SpeculativeEngine.load(target_gguf, draft_gguf, ModelSettings(n_ctx=512)) as eng:
        yield eng


@pytest.mark.parametrize("k", [None, 2])
def test_a_registered_drafter_runs_with_the_targets_greedy_output(
        engine: SpeculativeEngine, repeat_last: list[tuple[int, int]], k: int | None) -> None:
    drafted = 0
    for prompt in PROMPTS:
        plain = run(engine, prompt, mode="none", cold=True)
        repeat_last.clear()
        spec = run(engine, prompt, mode=THROWAWAY, k=k, cold=True)
        assert spec.tokens == plain.tokens, prompt
        s = spec.stats
        mine = s.drafters.get(THROWAWAY)
        # The only drafter in play: its statistics are the request's, and it was told what the
        # target accepted of each of its proposals.
        assert s.drafted == (mine.drafted if mine else 0)
        assert s.accepted == sum(n for _, n in repeat_last)
        assert s.drafted == sum(n for n, _ in repeat_last)
        assert s.draft_rounds == len(repeat_last) == (mine.rounds if mine else 0)
        drafted += s.drafted
    if k is not None:  # a fixed K verifies every proposal
        assert drafted > 0


def test_a_registered_free_drafter_backs_up_the_draft_model_under_auto(
        engine: SpeculativeEngine, repeat_last: list[tuple[int, int]]) -> None:
    for prompt in PROMPTS:
        spec = run(engine, prompt, mode="model", k=None, cold=True)
        assert spec.tokens == run(engine, prompt, mode="none", cold=True).tokens, prompt
        assert set(spec.stats.drafters) <= {"model", "lookup", THROWAWAY}
        assert spec.stats.drafted == sum(d.drafted for d in spec.stats.drafters.values())


def test_draft_modes_come_from_the_registry(repeat_last: list[tuple[int, int]]) -> None:
    assert drafters.draft_modes() == (*drafters.names(), "none")
    assert drafters.names()[:2] == ("model", "lookup")  # the built-in ones, in that order
    assert options.DRAFT_MODES == ("model", "lookup", "history", "none")  # what the CLI offers
    DraftSettings(mode=THROWAWAY).validate(has_draft_model=False)
    with pytest.raises(LocalspecError, match="draft mode 'model' needs a draft model"):
        DraftSettings(mode="model").validate(has_draft_model=False)
    with pytest.raises(ValueError, match="taken or reserved"):
        drafters.register(drafters.get(THROWAWAY))
    drafters.unregister(THROWAWAY)
    with pytest.raises(InvalidOptionError,
                       match=r"^draft_mode must be one of model, lookup, history, none, "
                             r"got 'repeat-last'$"):
        DraftSettings(mode=THROWAWAY).validate(has_draft_model=True)


def test_one_acceptance_model_per_drafter_from_its_prior(
        repeat_last: list[tuple[int, int]]) -> None:
    costs = CostModel.from_calibration(0.09, 0.15, 9, 8, 0.02)
    ctl = DraftController(costs, 8)
    assert set(ctl.acceptance) == set(drafters.names())
    for name in drafters.names():
        assert ctl.acceptance[name].prior_rate == drafters.get(name).prior_rate
    assert ctl.model == "model" and ctl.model_acc is ctl.acceptance["model"]
    before = {name: acc.rate for name, acc in ctl.acceptance.items()}
    ctl.observe(Proposal(THROWAWAY, tokens=[1, 2]), 2, 2)
    after = {name: acc.rate for name, acc in ctl.acceptance.items()}
    assert after[THROWAWAY] > before[THROWAWAY]
    assert {n: r for n, r in after.items() if n != THROWAWAY} == {
        n: r for n, r in before.items() if n != THROWAWAY}


def test_statistics_per_drafter_cross_a_process_boundary(engine: SpeculativeEngine) -> None:
    res = run(engine, PROMPTS[5], mode="lookup", k=3, cold=True)  # "print print print print"
    s = res.stats
    assert s.lookup_rounds == s.drafters["lookup"].rounds == s.draft_rounds > 0
    back = GenerationStats.from_json(s.to_json())
    assert back.drafters == s.drafters and back.lookup_rounds == s.lookup_rounds
    # A peer from before per-drafter statistics sends only its lookup rounds.
    assert GenerationStats.from_json({"lookup_rounds": 3}).lookup_rounds == 3


def _path(parents: Sequence[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def test_a_proposal_is_a_chain_or_a_tree() -> None:
    chain = Proposal("lookup", tokens=[4, 5, 6])
    assert chain.is_chain and chain.parent_list() == [-1, 0, 1] == drafters.chain(3)
    assert chain.path_to(2) == [0, 1, 2] and chain.confidences == [1.0, 1.0, 1.0]
    parents = [-1, 0, 0, 1, -1]
    tree = Proposal("lookup", tokens=[1, 2, 3, 4, 5], parents=list(parents))
    assert not tree.is_chain
    for node in range(5):
        assert tree.path_to(node) == _path(parents, node)
    tree.truncate(3)
    assert tree.tokens == [1, 2, 3] and tree.parents == [-1, 0, 0]
    with pytest.raises(ValueError, match="not an earlier node"):
        Proposal("lookup", tokens=[1, 2], parents=[-1, 1])
    with pytest.raises(ValueError, match="needs 2 parents"):
        Proposal("lookup", tokens=[1, 2], parents=[-1])
