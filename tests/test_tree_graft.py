"""Free drafters' branches grafted into the draft model's tree: shared beginnings are one node,
the room given bounds what is added, each node is priced by its own drafter, grafts teach no
acceptance model, and trimming keeps the sources straight."""

from __future__ import annotations

import pytest

from localspec.engine.controller import AcceptanceModel, CostModel, DraftController
from localspec.engine.drafters import Proposal

GPU = {1: 1.0, 4: 1.01, 8: 1.02, 16: 1.04, 32: 1.08, 64: 1.15, 128: 1.3, 256: 1.6}


def _model_tree() -> Proposal:
    #   10 - 11
    #   20
    return Proposal(source="model", tokens=[10, 20, 11], confidences=[0.8, 0.1, 0.7],
                    parents=[-1, -1, 0])


def _paths(prop: Proposal) -> set[tuple[int, ...]]:
    return {tuple(prop.tokens[i] for i in prop.path_to(n)) for n in range(len(prop.tokens))}


def test_a_graft_shares_equal_beginnings_and_tags_new_nodes() -> None:
    prop = _model_tree()
    lookup = Proposal(source="lookup", tokens=[10, 11, 12, 30], confidences=[1.0] * 4,
                      parents=[-1, 0, 1, -1])
    assert prop.graft(lookup, max_nodes=16, max_branches=8) == 2
    assert _paths(prop) == {(10,), (20,), (10, 11), (10, 11, 12), (30,)}
    assert prop.is_mixed and not prop.is_chain
    assert [prop.source_of(i) for i in range(len(prop.tokens))] == [
        "model", "model", "model", "lookup", "lookup"]
    assert prop.counts_by_source([0, 2, 3]) == {"model": (3, 2), "lookup": (2, 1)}


def test_a_graft_stays_within_the_targets_nodes_and_branches() -> None:
    lookup = Proposal(source="lookup", tokens=[10, 11, 12, 30, 31], confidences=[1.0] * 5,
                      parents=[-1, 0, 1, -1, 3])
    # Two leaves already (11 and 20): extending 11 adds none, a new root would add one.
    narrow = _model_tree()
    assert narrow.graft(lookup, max_nodes=16, max_branches=2) == 1
    assert _paths(narrow) == {(10,), (20,), (10, 11), (10, 11, 12)}
    small = _model_tree()
    assert small.graft(lookup, max_nodes=4, max_branches=8) == 1
    assert len(small.tokens) == 4
    # A node left out takes its children with it: 31 does not hang from nowhere.
    skipped = _model_tree()
    assert skipped.graft(Proposal(source="lookup", tokens=[30, 31], parents=[-1, 0]),
                         max_nodes=16, max_branches=2) == 0
    assert _paths(skipped) == {(10,), (20,), (10, 11)} and not skipped.is_mixed


def test_a_chain_grafted_onto_a_chain_is_a_mixed_chain_and_trimming_unmixes() -> None:
    prop = Proposal(source="model", tokens=[10, 11], confidences=[0.9, 0.8])
    assert prop.graft(Proposal(source="lookup", tokens=[10, 11, 12, 13]), 16, 8) == 2
    assert prop.is_chain and prop.is_mixed and prop.tokens == [10, 11, 12, 13]
    prop.keep_nodes([0, 1])
    assert not prop.is_mixed and prop.node_sources == []
    again = Proposal(source="model", tokens=[10, 11], confidences=[0.9, 0.8])
    again.graft(Proposal(source="lookup", tokens=[10, 11, 12]), 16, 8)
    again.truncate(2)
    assert not again.is_mixed


def test_sampled_drafts_take_no_grafts() -> None:
    prop = _model_tree()
    prop.dists = []
    assert prop.graft(Proposal(source="lookup", tokens=[30]), 16, 8) == 0
    assert not prop.is_mixed


def _controller() -> DraftController:
    points = {n: 0.02 * r for n, r in GPU.items()}
    costs = CostModel.from_measurements(points, 12, 0.001)
    acc = {"model": AcceptanceModel(prior_rate=0.7), "lookup": AcceptanceModel(prior_rate=0.3)}
    return DraftController(costs, 12, acceptance=acc, model="model")


def test_grafted_nodes_are_priced_by_their_own_drafter_and_teach_no_one() -> None:
    ctl = _controller()
    prop = _model_tree()
    prop.graft(Proposal(source="lookup", tokens=[30], confidences=[1.0]), 16, 8)
    ctl.acceptance["lookup"].observe([1.0], 0)  # lookup's own bins: it was wrong once
    est = ctl.tree_estimates(prop)
    assert est[3] == pytest.approx(ctl.acceptance["lookup"].request_estimate(1.0))
    assert est[3] < ctl.model_acc.estimate(1.0)
    assert est[:3] == [ctl.model_acc.estimate(c) for c in (0.8, 0.1, 0.7)]
    lookup_before = ctl.acceptance["lookup"].rate
    first_before = ctl.model_acc.rates[0]
    # The target chose 30, the grafted root: the model's first guess was wrong (lookup's 1.0
    # confidence must not make 30 count as the model's first guess); lookup's rate stays what
    # its own proposals taught it (a graft is where it differed from the model: biased).
    ctl.observe_tree(prop, [3], [30, 99])
    assert ctl.model_acc.rates[0] < first_before
    assert ctl.acceptance["lookup"].rate == lookup_before
