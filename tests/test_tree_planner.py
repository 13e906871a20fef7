"""The tree planner on hand-built cost tables: a chain (or nothing) where verification climbs
steeply, a wide tree where a pass over many tokens costs about what one costs; the controller's
use of it and what a verified tree teaches the acceptance model."""

from __future__ import annotations

import pytest

from localspec.engine import tree_planner
from localspec.engine.controller import (
    AcceptanceModel,
    CostModel,
    DraftController,
    TreePauses,
    confidence_bin,
)
from localspec.engine.drafters import Proposal

# Verification as a multiple of a one-token pass, as measured for the issue (2-core CPU) and as
# a memory-bound GPU (flat to 64 tokens, a 7% step at each doubling after).
CPU_F16 = {1: 1.0, 4: 1.30, 8: 1.72, 16: 2.47, 32: 3.95, 64: 7.43}
CPU_Q4 = {1: 1.0, 4: 2.47, 8: 2.92, 16: 3.13, 32: 4.60, 64: 8.0}
LINEAR = {n: float(n) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
# Q4_K_M on a 2-core AVX-512 CPU (benchmarks/README.md, 2026-12-03): 8 tokens cost 7.8 passes.
CPU_Q4_AVX512 = {1: 1.0, 2: 1.9, 4: 3.6, 8: 7.77, 16: 8.17, 32: 11.9, 64: 17.9, 128: 27.4,
                 256: 58.2}
GPU = {1: 1.0, 4: 1.01, 8: 1.02, 16: 1.04, 32: 1.08, 64: 1.15, 128: 1.3, 256: 1.6}
DEPTH = [0.7] * 32
SIBLINGS = [0.15, 0.07, 0.03]


def _costs(curve: dict[int, float], draft: float = 0.05, t1: float = 0.02) -> CostModel:
    """A cost model from a curve in one-token passes (t1 seconds each); a draft token costs
    ``draft`` of a target pass, as a 0.5B draft beside a 7B target."""
    points = {n: t1 * r for n, r in curve.items()}
    table = {n: t1 * _interp(curve, n) for n in range(1, 14)}
    return CostModel.from_measurements({**table, **points}, 12, draft * t1)


def _interp(curve: dict[int, float], n: int) -> float:
    ns = sorted(curve)
    lo = max(m for m in ns if m <= n)
    hi = min((m for m in ns if m >= n), default=lo)
    return curve[lo] if hi == lo else curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)


def _plan(curve: dict[int, float], **kw: object) -> tree_planner.TreePlan:
    args: dict[str, object] = {"max_nodes": 255, "max_branches": 32, **kw}
    return tree_planner.plan(DEPTH, SIBLINGS, _costs(curve), **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("curve", [CPU_F16, CPU_Q4], ids=["cpu-f16", "cpu-q4_k_m"])
def test_a_steep_curve_gets_a_short_chain(curve: dict[int, float]) -> None:
    plan = _plan(curve)
    assert plan.is_chain and 1 <= plan.nodes <= 4
    assert plan.rate == pytest.approx(_plan(curve, max_width=1).rate)
    assert plan.rate * _costs(curve).verify(1) > 1.0  # it beats plain decoding


def test_a_linear_curve_decodes_plainly() -> None:
    """Each verified token costing a pass: no draft can pay, plain decoding is the plan."""
    plan = _plan(LINEAR)
    assert plan.nodes == 0 and plan.is_chain


def test_a_flat_curve_gets_a_wide_tree() -> None:
    tree, chain = _plan(GPU), _plan(GPU, max_width=1)
    assert not tree.is_chain and tree.width > 1 and tree.branches > 4
    assert tree.nodes > 4 * chain.nodes // 3 and tree.depth > 2
    assert tree.rate > 1.1 * chain.rate
    # Expected tokens per step: one plus the path probabilities, each at most 1.
    assert 1.0 < tree.expected <= 1.0 + tree.nodes
    assert 0.0 < tree.floor < 0.7


def test_plans_stay_within_what_a_pass_holds() -> None:
    for nodes, branches in ((8, 2), (40, 3), (255, 1)):
        plan = _plan(GPU, max_nodes=nodes, max_branches=branches)
        assert plan.nodes <= nodes and plan.branches <= branches
    assert _plan(GPU, max_branches=1).is_chain


def test_near_ties_make_trees_smaller() -> None:
    assert _plan(GPU, tie=0.3).expected < _plan(GPU).expected


def test_select_keeps_a_best_first_prefix_that_is_a_tree() -> None:
    #     0 (0.9) - 1 (0.8) - 3 (0.7)
    #             \ 2 (0.05)
    #   4 (0.04)
    parents = [-1, 0, 0, 1, -1]
    path_p = tree_planner.path_probabilities([0.9, 0.89, 0.055, 0.875, 0.04], parents)
    assert path_p[3] == pytest.approx(0.9 * 0.89 * 0.875)
    # A GPU's pass: a node is worth verifying if it adds more than its seconds cost.
    costs = _costs(GPU)
    price = 2.0 / costs.verify(1)
    assert tree_planner.select(path_p, parents, costs, price) == [0, 1, 2, 3, 4]
    steep = _costs(LINEAR)
    # Each node costs a pass: at half a token per pass's seconds, nodes below 0.5 do not pay.
    kept = tree_planner.select(path_p, parents, steep, 0.5 / steep.verify(1))
    assert kept == [0, 1, 3]  # the unlikely ones are dropped, a parent is never
    assert tree_planner.select(path_p, parents, steep, 100.0 / steep.verify(1)) == []


def test_cost_model_prices_wide_passes_between_measurements() -> None:
    costs = _costs(GPU)
    assert costs.widest == 256
    assert costs.verify(13) == pytest.approx(0.02 * _interp(GPU, 13))
    assert costs.verify(48) == pytest.approx(0.02 * (1.08 + (1.15 - 1.08) * 16 / 32))
    assert costs.verify(300) > costs.verify(256)  # past the widest, along the last slope
    assert costs.draft_pass(1) == costs.draft_token
    assert costs.draft_pass(64) == pytest.approx(costs.draft_token * 1.15)


def test_a_tree_levels_draft_pass_teaches_the_draft_tokens_price() -> None:
    """A level of 64 nodes that took 1.15 draft tokens' time on GPU scaling says the draft
    token is still what it was; one that took twice that says it costs twice as much."""
    costs = _costs(GPU)
    token = costs.draft_token
    costs.observe_draft_pass(64, token * 1.15)
    assert costs.draft_token == pytest.approx(token)
    costs.smoothing = 1.0
    costs.observe_draft_pass(64, 2 * token * 1.15)
    assert costs.draft_token == pytest.approx(2 * token)
    assert costs.draft_pass(64) == pytest.approx(2 * token * 1.15)


def _controller(curve: dict[int, float]) -> DraftController:
    acc = {"model": AcceptanceModel(prior_rate=0.7)}
    return DraftController(_costs(curve), 12, acceptance=acc, model="model")


def test_the_controller_asks_for_trees_only_where_they_pay() -> None:
    assert _controller(CPU_Q4).tree_plan(room=100, max_nodes=255, branches=32) is None
    plan = _controller(GPU).tree_plan(room=100, max_nodes=255, branches=32)
    assert plan is not None and not plan.is_chain
    # A fixed K is a chain; so is a runner that holds one branch; the path fits the room.
    fixed = DraftController(_costs(GPU), 4, fixed_k=4, model="model")
    assert fixed.tree_plan(room=100, max_nodes=255, branches=32) is None
    assert _controller(GPU).tree_plan(room=100, max_nodes=255, branches=1) is None
    short = _controller(GPU).tree_plan(room=2, max_nodes=255, branches=32)
    assert short is None or short.depth <= 2
    # Only measured widths are priced: a calibration up to 13 tokens plans at most 12 nodes.
    narrow = DraftController(CostModel.from_measurements({1: 0.02, 13: 0.021}, 12, 0.001),
                             12, acceptance={"model": AcceptanceModel(0.7)}, model="model")
    small = narrow.tree_plan(room=100, max_nodes=255, branches=32)
    assert small is not None and small.nodes <= 12


def test_host_work_per_node_narrows_the_tree_where_a_pass_is_short() -> None:
    """No device pass prices a node's host work (ranking its children, the branch
    bookkeeping). Where it is a fair share of a pass (a GPU's 12 ms pass against 0.36 ms a
    node measured here) the plan is a smaller tree that still beats plain decoding; where a
    pass takes far longer (a target partly in system RAM: 250 ms) it stays a wide tree."""
    def plan(host_share: float) -> tree_planner.TreePlan:
        costs = _costs(GPU)
        costs.tree_node_host = host_share * costs.verify(1)
        return tree_planner.plan(DEPTH, SIBLINGS, costs, max_nodes=255, max_branches=32)

    free, dear, cheap = plan(0.0), plan(0.03), plan(0.0014)
    assert not free.is_chain and free.nodes > 40
    assert 2 <= dear.nodes < free.nodes / 2
    assert dear.rate * _costs(GPU).verify(1) > 1.0
    assert not cheap.is_chain and cheap.nodes > 40
    # The controller's free drafters (history, lookup) rank no children: no host per node.
    ctl = DraftController(_costs(GPU), 12)
    ctl.costs.tree_node_host = 0.03 * ctl.costs.verify(1)
    for name in ("history", "model"):
        ctl.acceptance[name].rate = 0.7
    free_plan = ctl.tree_plan(room=100, max_nodes=255, branches=32, source="history")
    model_plan = ctl.tree_plan(room=100, max_nodes=255, branches=32, source="model")
    assert free_plan is not None
    assert model_plan is None or model_plan.nodes < free_plan.nodes
    # A plan made before the host work was learned is not reused after it.
    fresh = DraftController(_costs(GPU), 12)
    fresh.acceptance["model"].rate = 0.7
    before = fresh.tree_plan(room=100, max_nodes=255, branches=32)
    assert before is not None and before.nodes > 40
    fresh.costs.observe_draft_host(10, 10 * 0.03 * fresh.costs.verify(1), tree=True)
    after = fresh.tree_plan(room=100, max_nodes=255, branches=32)
    assert after is None or after.nodes < before.nodes / 2


class _Counted:
    """A cost model that counts the widths it is asked to price; ``floor`` False: it claims
    a wider pass may cost nothing, which leaves the planner nothing to stop its walk on."""

    def __init__(self, costs: CostModel, floor: bool = True) -> None:
        self.costs, self.floor, self.priced = costs, floor, 0

    def verify(self, n: int) -> float:
        self.priced += 1
        return self.costs.verify(n)

    def verify_floor(self, n: int) -> float:
        return self.costs.verify_floor(n) if self.floor else 0.0

    def draft_pass(self, width: int) -> float:
        return self.costs.draft_pass(width)

    def draft_start(self) -> float:
        return self.costs.draft_start()

    def node_host(self) -> float:
        return self.costs.node_host()


class _HostFolded(_Counted):
    """A cost model with no host work per node and no floor, its verification carrying the
    host work instead: the same seconds for every plan, and nothing to stop a walk early."""

    def __init__(self, costs: CostModel) -> None:
        super().__init__(costs, floor=False)

    def verify(self, n: int) -> float:
        return super().verify(n) + self.costs.node_host() * (n - 1)

    def node_host(self) -> float:
        return 0.0


def test_the_walk_stops_where_no_wider_plan_can_win() -> None:
    # On a steep curve the answer (a short chain or nothing) is known after a few nodes: the
    # planner runs at every step, so walking all 255 cost milliseconds a token.
    costs = _Counted(_costs(CPU_Q4_AVX512))
    steep = tree_planner.plan(DEPTH, SIBLINGS, costs, max_nodes=255, max_branches=32)
    assert steep.nodes <= 4
    everything = _Counted(_costs(CPU_Q4_AVX512), floor=False)
    assert tree_planner.plan(DEPTH, SIBLINGS, everything, max_nodes=255,
                             max_branches=32) == steep
    assert everything.priced > 200
    assert costs.priced < everything.priced / 3
    # Prose on that target (a draft right 60% of the time, a fifth of positions near-ties):
    # plain decoding, known within a few nodes.
    prose = _Counted(_costs(CPU_Q4_AVX512))
    assert tree_planner.plan([0.6] * 32, SIBLINGS, prose, max_nodes=255, max_branches=32,
                             tie=0.2).nodes == 0
    assert prose.priced < 20
    # A GPU's short pass with host work per node: the walk ends where another node's worth
    # falls under what its host work costs, not at the node limit.
    gpu = _costs(GPU)
    gpu.tree_node_host = 0.03 * gpu.verify(1)
    rates = [0.8] * 32  # a deep unbounded tree: the mass bound alone walks every node
    short, whole = _Counted(gpu), _HostFolded(gpu)
    plan = tree_planner.plan(rates, SIBLINGS, short, max_nodes=255, max_branches=32)
    assert plan.nodes == tree_planner.plan(rates, SIBLINGS, whole, max_nodes=255,
                                           max_branches=32).nodes
    assert whole.priced > 200
    assert short.priced < whole.priced / 3


@pytest.mark.parametrize("seed", range(4))
def test_stopping_early_never_changes_the_plan(seed: int) -> None:
    import random

    rng = random.Random(seed)
    for _ in range(150):
        # Measured curves need not climb (noise, a faster wide kernel): 0.85 allows a dip.
        points = {1: 0.02}
        for n in (2, 3, 5, 9, 17, 33, 65, 129, 257):
            points[n] = points[max(points)] * rng.uniform(0.85, 2.2)
        costs = CostModel.from_measurements(points, 12, rng.choice([0.0, 0.002, 0.01]))
        top = rng.uniform(0.3, 0.99)
        depth = [rng.uniform(0.1, top) for _ in range(rng.randint(1, 33))]
        siblings = [rng.uniform(0.0, 0.3) for _ in range(rng.randint(0, 3))]
        kw: dict[str, object] = {"max_nodes": rng.choice([2, 8, 64, 255]),
                                 "max_branches": rng.choice([1, 4, 32]),
                                 "tie": rng.choice([0.0, 0.05, 0.3]),
                                 "max_width": rng.choice([None, 1, 2])}
        fast = tree_planner.plan(depth, siblings, _Counted(costs), **kw)  # type: ignore[arg-type]
        full = tree_planner.plan(depth, siblings, _Counted(costs, floor=False),
                                 **kw)  # type: ignore[arg-type]
        assert fast == full
        # With host work per node (a GPU's short pass), against a walk that cannot stop early:
        # the same seconds, the host work folded into its verification instead.
        costs.tree_node_host = costs.verify(1) * rng.choice([0.001, 0.01, 0.03, 0.1])
        fast = tree_planner.plan(depth, siblings, _Counted(costs), **kw)  # type: ignore[arg-type]
        full = tree_planner.plan(depth, siblings, _HostFolded(costs),
                                 **kw)  # type: ignore[arg-type]
        assert (fast.nodes, fast.depth, fast.width) == (full.nodes, full.depth, full.width)
        assert fast.rate == pytest.approx(full.rate, rel=1e-12)


def test_sibling_ranks_out_of_order_do_not_end_the_walk_early() -> None:
    # A third guess learned likelier than the second: it is pushed only once the second is
    # in the tree, so the best candidate then does not bound every node still to come.
    costs = CostModel.from_measurements({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}, 4, 0.0)
    costs.tree_node_host = 0.1
    fast = tree_planner.plan([0.9], [0.01, 0.9], costs, max_nodes=4, max_branches=4)
    full = tree_planner.plan([0.9], [0.01, 0.9], _HostFolded(costs), max_nodes=4,
                             max_branches=4)
    assert fast.nodes == full.nodes == 3
    assert fast.rate == pytest.approx(full.rate)


def test_verify_floor_is_the_least_of_any_wider_pass() -> None:
    costs = CostModel.from_measurements({1: 1.0, 5: 4.0, 9: 3.0, 17: 5.0, 33: 4.5, 65: 9.0},
                                        12, 0.1)
    for n in range(1, 100):
        assert costs.verify_floor(n) == pytest.approx(min(costs.verify(m)
                                                          for m in range(n, 300)))


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """The planner's walks, each by its ``max_width`` (None: a tree, 1: the best chain)."""
    made: list[int | None] = []
    real = tree_planner.plan

    def counted(*args: object, **kw: object) -> tree_planner.TreePlan:
        made.append(kw.get("max_width"))  # type: ignore[arg-type]
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(tree_planner, "plan", counted)
    return made


def test_the_controller_keeps_plans_while_drafters_take_turns(walks: list[int | None]) -> None:
    # The model and a free drafter plan at alternate steps: one remembered plan was replanned
    # at every step (two walks of up to 255 nodes each time).
    ctl = _controller(GPU)
    ctl.acceptance["lookup"] = AcceptanceModel(prior_rate=0.5)
    first = [ctl.tree_plan(room=100, max_nodes=255, branches=32, source=s)
             for s in ("model", "lookup")]
    assert len(walks) == 4  # a tree and a chain for each
    for _ in range(5):
        again = [ctl.tree_plan(room=100, max_nodes=255, branches=32, source=s)
                 for s in ("model", "lookup")]
        assert again == first
    assert len(walks) == 4
    ctl.acceptance["model"].rate = 0.3  # a rate that moved plans anew
    ctl.tree_plan(room=100, max_nodes=255, branches=32, source="model")
    assert len(walks) == 6


def test_a_repeated_chain_verdict_pauses_planning(walks: list[int | None]) -> None:
    """At a GPU's step a plan's millisecond counts: a chain verdict that keeps repeating stands
    for 1, 2, 4, then 8 plans; a tree found ends the pause, and trees are planned each step."""
    pauses = TreePauses()
    acc = {"model": AcceptanceModel(prior_rate=0.7)}
    steep = DraftController(_costs(CPU_Q4_AVX512), 12, acceptance=acc, model="model",
                            tree_pauses=pauses)
    planned = []
    for i in range(30):  # rates that move at every step: no plan is kept for the next
        acc["model"].rate = 0.4 + 0.02 * i
        before = len(walks)
        assert steep.tree_plan(room=100, max_nodes=255, branches=32) is None
        if len(walks) > before:
            planned.append(i + 1)
    # Planned at calls 1-4 (the verdict repeating), then after pauses of 1, 2, 4 and 8; a
    # chain verdict walks no second plan for the best chain.
    assert planned == [1, 2, 3, 4, 6, 9, 14, 23]
    assert walks == [None] * 8
    # The next request finds the device flat (the pause carries over, as the rates do):
    # within the longest pause the planner sees it, and from the first tree on it plans
    # every step, a tree and the best chain beside it.
    flat = DraftController(_costs(GPU), 12, acceptance=acc, model="model", tree_pauses=pauses)
    after = [flat.tree_plan(room=100, max_nodes=255, branches=32) for _ in range(20)]
    first_tree = next(i for i, p in enumerate(after) if p is not None)
    assert 0 < first_tree <= TreePauses.MOST
    assert all(p is not None and not p.is_chain for p in after[first_tree:])
    assert walks[8:10] == [None, 1]
    # Another drafter's verdicts are its own.
    assert not pauses.skip("history")


def test_chain_verdicts_at_a_requests_end_hold_the_pause_where_it_is(
        walks: list[int | None]) -> None:
    """Near a request's end a tree has no room to pay, so its chain verdicts say nothing of
    the device: they keep the pause at its length instead of lengthening it for the next
    request."""
    pauses = TreePauses()
    acc = {"model": AcceptanceModel(prior_rate=0.7)}
    steep = DraftController(_costs(CPU_Q4_AVX512), 12, acceptance=acc, model="model",
                            tree_pauses=pauses)

    moves = iter(range(100))

    def calls_planned(room: int, calls: int) -> list[int]:
        planned = []
        for i in range(calls):
            acc["model"].rate = 0.3 + 0.02 * next(moves)  # no plan is kept for the next
            before = len(walks)
            assert steep.tree_plan(room=room, max_nodes=255, branches=32) is None
            if len(walks) > before:
                planned.append(i + 1)
        return planned

    assert calls_planned(room=100, calls=4) == [1, 2, 3, 4]  # the pause is now 1 plan
    # The request's last steps: every other call plans, the pause staying at one plan.
    assert calls_planned(room=6, calls=8) == [2, 4, 6, 8]
    # The next request goes on from there: pauses of 2, 4, 8, not of 8 from the start.
    assert calls_planned(room=100, calls=12) == [2, 5, 10]
    # A tree found at the end still ends the pause.
    flat = DraftController(_costs(GPU), 12, acceptance=acc, model="model", tree_pauses=pauses)
    assert [flat.tree_plan(room=6, max_nodes=255, branches=32) is None
            for _ in range(TreePauses.MOST + 2)].count(False) >= 1
    assert not pauses.skip("model")


def test_a_verified_tree_teaches_depths_siblings_and_bins() -> None:
    #   0 (first guess) - 2
    #   1 (second guess, conf 0.25)
    prop = Proposal(source="model", tokens=[10, 11, 12], confidences=[0.6, 0.25, 0.9],
                    parents=[-1, -1, 0])
    ctl = _controller(GPU)
    acc = ctl.model_acc
    before_sib, before_depth = acc.sibling_rates[0], acc.rates[0]
    # The target chose 11 (the second guess), then something else: the first guess was
    # rejected at depth 0 as a chain would have been; the second guess was right.
    ctl.observe_tree(prop, [1], [11, 99])
    assert acc.sibling_rates[0] > before_sib
    assert acc.rates[0] < before_depth
    b = confidence_bin(0.25)
    assert acc.seen[b] == 1 and acc.hits[b] == 1
    # Accepted along the first guesses, then a near-tie: the tie is neither outcome.
    ctl.observe_tree(prop, [0, 2], [10, 12, None])
    assert acc.seen[confidence_bin(0.9)] == 1 and acc.hits[confidence_bin(0.9)] == 1
