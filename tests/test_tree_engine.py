"""Token trees end to end, on F32, Q8_0 and Q4_K_M: greedy output is the target's own (with
prompt lookup's branches grafted into the draft model's trees too), seeded coupled text is the
same whether drafted as a tree, a chain or not at all (up to a numerical near-tie in the
target's own one-token pass), and after every step the target's KV cache holds exactly the
accepted branch (rollbacks past n_batch too).

This CPU's verification cost climbs steeply, where the planner keeps chains; trees are
exercised by deciding with a memory-bound device's costs (``use_calibration(learn=False)``,
the engine's what-if), never by a switch for tests."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from localspec.benchmarking import first_difference
from localspec.engine import ModelSettings, SamplingParams, SpeculativeEngine
from localspec.engine.calibration import Calibration
from localspec.engine.drafters import DraftContext, PromptLookupDrafter, TreeRequest
from localspec.engine.llama_backend import LlamaRunner

from .engine_helpers import PROMPTS, run

# A memory-bound device's costs (verifying 64 tokens costs 1.25 one-token passes), with the
# draft 20x cheaper than the target: where the planner drafts wide trees. A pass of 100 ms (a
# target partly in system RAM): the planner weighs each tree node's host work, learned on this
# CPU, against a pass, and beside a fast GPU's pass it would rightly plan smaller trees.
_SHAPE = {1: 1.0, **{n: 1.0 + 0.005 * n for n in range(2, 14)}, 16: 1.09, 32: 1.15, 64: 1.25,
          128: 1.4, 256: 1.8}
FLAT = Calibration({n: 0.1 * r for n, r in _SHAPE.items()}, 0.005, 0.0)
SETTINGS = ModelSettings(n_ctx=1024)


@pytest.fixture
def engine(pair: tuple[Path, Path]) -> Iterator[SpeculativeEngine]:
    with SpeculativeEngine.load(*pair, SETTINGS) as eng:
        # The what-if replaces the costs only: the near-tie guard keeps this build's measured
        # drift on this file, as a user's engine would (FLAT's own drift is 0.0).
        run(eng, PROMPTS[0], max_tokens=4, cold=True)  # measures it after the first token
        assert eng.calibration is not None
        eng.use_calibration(replace(FLAT, drift=eng.calibration.drift), learn=False)
        yield eng


def _cache_holds_exactly(runner: LlamaRunner, tokens: list[int]) -> None:
    """Sequence 0 holds positions 0 .. len - 1 and no branch sequence holds any cell (reads
    llama.cpp's memory API through the runner's handles: the test's only look inside)."""
    lib, mem = runner._lib, runner._mem
    assert runner.tokens == tokens
    assert lib.llama_memory_seq_pos_min(mem, 0) == (0 if tokens else -1)
    assert lib.llama_memory_seq_pos_max(mem, 0) == len(tokens) - 1
    for seq_id in range(1, runner.branches + 1):
        assert lib.llama_memory_seq_pos_max(mem, seq_id) == -1, seq_id


def test_greedy_trees_are_the_targets_output(engine: SpeculativeEngine) -> None:
    trees = merged = 0
    for prompt in PROMPTS:
        plain = run(engine, prompt, mode="none", cold=True)
        tree = run(engine, prompt, cold=True)
        assert tree.tokens == plain.tokens, prompt
        assert tree.text == plain.text
        trees += tree.stats.tree_rounds
        merged += tree.stats.merged_rounds
        if tree.stats.tree_rounds:
            # A tree's accepted branch is one path: fewer target passes than tokens, and more
            # nodes verified per round than tokens accepted.
            assert tree.stats.target_passes < tree.stats.completion_tokens
            assert tree.stats.mean_tree_size > tree.stats.mean_accepted_length
    assert trees > 0  # on these costs the planner drafts trees
    assert merged > 0  # and prompt lookup's continuations join the draft model's trees


def test_tree_off_and_fixed_k_draft_chains(engine: SpeculativeEngine) -> None:
    from localspec.engine import DraftSettings, GenerationRequest

    tokens = engine.tokenize(PROMPTS[0], chat=False)
    off = engine.generate(GenerationRequest(tokens, 32, draft=DraftSettings(tree=False)))
    fixed = run(engine, PROMPTS[0], k=4, max_tokens=32)
    on = run(engine, PROMPTS[0], max_tokens=32)
    assert off.stats.tree_rounds == 0 and off.stats.drafted > 0
    assert fixed.stats.tree_rounds == 0 and fixed.stats.k_counts[4] > 0
    assert on.stats.tree_rounds > 0
    assert off.tokens == fixed.tokens == on.tokens


def _same_up_to_a_near_tie(engine: SpeculativeEngine, prompt: str, plain: tuple[int, ...],
                           drafted: tuple[int, ...], sp: SamplingParams) -> bool:
    """The same text, or texts that part where the target's own one-token pass puts its two
    best Gumbel scores within the near-tie guard: a numerical near-tie, which batched kernels
    may decide either way (a quantized target's repacked kernels, seen once in CI here)."""
    if plain == drafted:
        return True
    where = first_difference(engine, engine.tokenize(prompt, chat=False), plain, drafted, sp)
    return where is not None and bool(where["near_tie"])


def test_seeded_coupled_text_is_the_same_drafted_any_way(engine: SpeculativeEngine) -> None:
    """Coupled sampling's noise depends on the seed and the position only: a tree's accepted
    branch is what the target samples, whatever else the tree held."""
    trees = 0
    for seed in (1, 2):
        sp = SamplingParams(temperature=0.9, seed=seed)
        for prompt in PROMPTS[:4]:
            plain = run(engine, prompt, mode="none", sampling=sp, cold=True)
            chain = run(engine, prompt, k=3, sampling=sp, cold=True)
            tree = run(engine, prompt, sampling=sp, cold=True)
            for drafted in (chain, tree):
                assert _same_up_to_a_near_tie(engine, prompt, plain.tokens, drafted.tokens,
                                              sp), (seed, prompt, engine.tie_margin)
            trees += tree.stats.tree_rounds
    assert trees > 0


@pytest.mark.parametrize("n_batch", [16, 512])
def test_the_cache_holds_exactly_the_accepted_branch_after_every_step(
        pair: tuple[Path, Path], n_batch: int) -> None:
    """A spy on keep_branch (the real one still runs) checks the KV cache after every tree
    step; n_batch 16 makes prefill and rollbacks cross batch boundaries."""
    small = ModelSettings(n_ctx=1024, n_batch=n_batch)
    with SpeculativeEngine.load(*pair, small, small) as eng:
        eng.use_calibration(FLAT, learn=False)
        target = eng.target
        after: list[list[int]] = []
        real_keep = target.keep_branch

        def keep_branch(path: Any) -> None:
            real_keep(path)
            _cache_holds_exactly(target, list(target.tokens))
            after.append(list(target.tokens))

        target.keep_branch = keep_branch  # type: ignore[method-assign]
        long_prompt = " ".join(PROMPTS * 3)
        plain = run(eng, long_prompt, mode="none", max_tokens=200, cold=True)
        tree = run(eng, long_prompt, max_tokens=200, cold=True)
        assert tree.tokens == plain.tokens
        assert tree.stats.tree_rounds > 0 and len(after) == tree.stats.tree_rounds
        full = list(eng.tokenize(long_prompt, chat=False)) + list(tree.tokens)
        for cached in after:  # each step kept a prefix of the final text, and it grew
            assert cached == full[:len(cached)]
        assert [len(c) for c in after] == sorted(len(c) for c in after)
        # A second request that shares only part of the prompt rolls the cache back first.
        again = run(eng, " ".join(PROMPTS[:2]), max_tokens=40)
        assert again.tokens == run(eng, " ".join(PROMPTS[:2]), mode="none", max_tokens=40,
                                   cold=True).tokens


def test_drafting_trees_keeps_the_draft_tokens_price_measured(pair: tuple[Path, Path]) -> None:
    """Each tree level is one draft pass whose time teaches the cost model (as a chain's
    one-token decodes do): a draft price far below what this machine takes rises toward it."""
    with SpeculativeEngine.load(*pair, SETTINGS) as eng:
        run(eng, PROMPTS[0], max_tokens=4, cold=True)
        assert eng.calibration is not None
        cheap = replace(FLAT, draft_token=FLAT.draft_token / 1000, drift=eng.calibration.drift)
        eng.use_calibration(cheap, learn=True)
        res = run(eng, PROMPTS[1], max_tokens=48)
        assert res.stats.tree_rounds > 0
        assert eng._costs.draft_token > 2 * cheap.draft_token


def test_a_what_if_keeps_the_device_costs_and_learns_this_cpus_host_work(
        engine: SpeculativeEngine) -> None:
    """Under ``learn=False`` (the what-if the emulated regimes run) the stated curve and draft
    price stay as stated through drafting, trees included, while the host work per tree node,
    this CPU's, is learned from the drafting it sees."""
    from localspec.engine import DraftSettings, GenerationRequest

    stated = copy.deepcopy(engine._costs)
    assert stated.node_host() == 0.0
    # Chains first: their host work per token stands in for a tree node's until a tree.
    tokens = engine.tokenize(PROMPTS[1], chat=False)
    chains = engine.generate(GenerationRequest(tokens, 24, draft=DraftSettings(tree=False)))
    assert chains.stats.drafted > 0
    assert engine._costs.node_host() > 0.0 and not engine._costs.tree_host_seen
    res = run(engine, PROMPTS[1], max_tokens=48)
    assert res.stats.tree_rounds > 0 and res.stats.draft_rounds > 0
    costs = engine._costs
    assert (costs.target, costs.wide, costs.draft_token) == (stated.target, stated.wide,
                                                             stated.draft_token)
    assert (costs.draft_first, costs.catch_up_token) == (stated.draft_first,
                                                         stated.catch_up_token)
    assert costs.tree_host_seen and costs.node_host() > 0.0


def test_grafts_stay_within_the_widths_measured(pair: tuple[Path, Path]) -> None:
    """Calibrated only to 13 tokens, no tree (grafted branches included) is wider than 12
    nodes: past the widths measured a pass's price is a guess."""
    narrow = Calibration({n: t for n, t in FLAT.target_points.items() if n <= 13},
                         FLAT.draft_token, 0.0)
    with SpeculativeEngine.load(*pair, SETTINGS) as eng:
        run(eng, PROMPTS[0], max_tokens=4, cold=True)
        assert eng.calibration is not None
        eng.use_calibration(replace(narrow, drift=eng.calibration.drift), learn=False)
        widest = 0
        for prompt in PROMPTS:
            res = run(eng, prompt, max_tokens=32)
            widest = max(widest, *res.stats.k_counts)
        assert 0 < widest <= 12


def test_a_steep_cost_curve_keeps_chains(pair: tuple[Path, Path]) -> None:
    """Costs as a compute-bound CPU target (each verified token costs a step): no trees."""
    steep = Calibration({1: 0.01, 2: 0.02, 13: 0.13, 64: 0.64, 256: 2.56}, 0.002, 0.0)
    with SpeculativeEngine.load(*pair, SETTINGS) as eng:
        eng.use_calibration(steep, learn=False)
        for prompt in PROMPTS[:3]:
            assert run(eng, prompt, max_tokens=32).stats.tree_rounds == 0


def test_extend_tree_matches_the_whole_tree_decoded_at_once(
        pair: tuple[Path, Path]) -> None:
    """Growing a tree a level at a time (as the draft does) gives every node the logits of the
    tree decoded in one batch, and keeps a branch as exactly."""
    tokens, parents = (5, 6, 7, 8, 9, 10, 11), (-1, 0, 0, 1, 1, 2, -1)
    with LlamaRunner(pair[0], ModelSettings(n_ctx=256), branches=8) as runner:
        prompt = runner.tokenize("the model and the draft", add_bos=True)
        runner.sync(prompt)
        whole = runner.decode_tree(tokens, parents).copy()
        runner.keep_branch([])
        level = [runner.decode_tree(tokens[:1], parents[:1]).copy(),
                 runner.extend_tree(tokens[1:3], parents[1:3]).copy(),
                 runner.extend_tree(tokens[3:], parents[3:]).copy()]
        assert np.abs(np.concatenate(level) - whole).max() <= 1e-3
        runner.keep_branch([0, 1, 4])
        _cache_holds_exactly(runner, prompt + [5, 6, 9])
        after = runner.decode([12], 1).copy()
        runner.truncate(len(prompt))
        expected = runner.decode([5, 6, 9, 12], 1).copy()
        assert np.abs(after - expected).max() <= 1e-3


def test_prompt_lookup_offers_its_recent_continuations_as_branches() -> None:
    seq = [1, 2, 3, 10, 11, 1, 2, 3, 20, 21, 1, 2, 3, 10, 12, 9, 1, 2, 3]
    drafter = PromptLookupDrafter(ngram_max=3, ngram_min=2)
    request = TreeRequest(nodes=8, depth=2, branches=4, width=4, floor=0.0,
                          estimate=lambda c: c)
    prop = drafter.propose_tree(DraftContext(seq), request)
    paths = {tuple(prop.tokens[i] for i in prop.path_to(n)) for n in range(len(prop.tokens))}
    # The three continuations of "1 2 3", most recent first; "10" shared by two of them.
    assert paths == {(10,), (10, 12), (20,), (20, 21), (10, 11)}
    assert prop.tokens[0] == 10 and len(prop.tokens) == 5
    # A chain drafter's budget is a chain: the most recent continuation.
    assert drafter.propose(DraftContext(seq), 2).tokens == [10, 12]
    narrow = drafter.propose_tree(DraftContext(seq),
                                  TreeRequest(8, 2, 1, 4, 0.0, lambda c: c))
    assert narrow.is_chain and narrow.tokens == [10, 12]
