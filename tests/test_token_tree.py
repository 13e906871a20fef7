"""LlamaRunner decodes a token tree in one batch and keeps one branch of it, on F32, Q8_0 and
Q4_K_M: each node's logits are its path's decoded as a chain, and the cache afterwards holds
exactly the kept path (the next decode matches a fresh chain's)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from localspec.engine import ModelSettings
from localspec.engine.llama_backend import LlamaRunner

# Two branches below one root, a second root, one branch cut short:
#   0 - 1 - 3
#     \ 2 - 4
#   5
TOKENS = (5, 6, 7, 8, 9, 10)
PARENTS = (-1, 0, 0, 1, 2, -1)
NEXT = 11
# A tree's batch and a chain's differ in shape, which float32 kernels may round differently
# (7.6e-6 logits at most on F32 here, 0 on Q8_0 and Q4_K_M); a wrong attention mask moves
# logits by whole units.
TOL = 1e-3
SETTINGS = ModelSettings(n_ctx=256)


def _path(node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = PARENTS[node]
    return out[::-1]


@pytest.fixture
def runners(pair: tuple[Path, Path]) -> Iterator[tuple[LlamaRunner, LlamaRunner, list[int]]]:
    """A runner for trees (room for 4 branches), one for chains, and a prompt cached in both."""
    with LlamaRunner(pair[0], SETTINGS, branches=4) as tree, LlamaRunner(pair[0],
                                                                        SETTINGS) as chain:
        prompt = tree.tokenize("the model and the draft", add_bos=True)
        tree.sync(prompt)
        chain.sync(prompt)
        yield tree, chain, prompt


def _chain_logits(chain: LlamaRunner, prompt: list[int], tokens: Sequence[int]) -> np.ndarray:
    return chain.sync(prompt + list(tokens), len(tokens)).copy()


def test_each_nodes_logits_are_its_path_decoded_as_a_chain(
        runners: tuple[LlamaRunner, LlamaRunner, list[int]]) -> None:
    tree, chain, prompt = runners
    logits = tree.decode_tree(TOKENS, PARENTS).copy()
    assert logits.shape == (len(TOKENS), tree.n_vocab)
    for node in range(len(TOKENS)):
        path = [TOKENS[i] for i in _path(node)]
        expected = _chain_logits(chain, prompt, path)[-1]
        assert np.abs(logits[node] - expected).max() <= TOL, node
    # Siblings differ: a node does not see its sibling's branch.
    assert np.abs(logits[3] - logits[4]).max() > 100 * TOL


@pytest.mark.parametrize("kept", [_path(3), _path(4), _path(2), _path(5), []],
                         ids=["leaf-3", "leaf-4", "inner-2", "root-5", "none"])
def test_keeping_a_branch_leaves_exactly_it_in_the_cache(
        runners: tuple[LlamaRunner, LlamaRunner, list[int]], kept: list[int]) -> None:
    tree, chain, prompt = runners
    tree.decode_tree(TOKENS, PARENTS)
    tree.keep_branch(kept)
    path = [TOKENS[i] for i in kept]
    assert tree.tokens == prompt + path
    # Any other node left in the cache would be attended to by the next token.
    after = tree.decode([NEXT], 1).copy()
    expected = _chain_logits(chain, prompt, [*path, NEXT])[-1]
    assert np.abs(after - expected).max() <= TOL
    # And the runner goes on as a chain runner: a rollback and a second tree work too.
    tree.truncate(len(prompt))
    again = tree.decode_tree(TOKENS, PARENTS).copy()
    assert np.abs(again[4] - _chain_logits(chain, prompt, [TOKENS[i] for i in _path(4)])[-1]
                  ).max() <= TOL


def test_a_tree_left_pending_is_dropped_by_the_next_decode(
        runners: tuple[LlamaRunner, LlamaRunner, list[int]]) -> None:
    tree, chain, prompt = runners
    tree.decode_tree(TOKENS, PARENTS)
    got = tree.sync(prompt + [NEXT], 1).copy()
    assert tree.tokens == prompt + [NEXT]
    assert np.abs(got - _chain_logits(chain, prompt, [NEXT])).max() <= TOL


def test_chains_are_unchanged(runners: tuple[LlamaRunner, LlamaRunner, list[int]]) -> None:
    """A chain given as a tree decodes as the chain does, and a runner made for trees decodes
    chains exactly as one made for chains only."""
    tree, chain, prompt = runners
    as_tree = tree.decode_tree(TOKENS[:4], (-1, 0, 1, 2)).copy()
    tree.keep_branch([0, 1, 2, 3])
    assert np.array_equal(as_tree, _chain_logits(chain, prompt, TOKENS[:4]))
    tree.truncate(len(prompt))
    assert np.array_equal(tree.decode(list(TOKENS), len(TOKENS)),
                          _chain_logits(chain, prompt, TOKENS))


def test_trees_the_runner_cannot_hold_are_refused(
        runners: tuple[LlamaRunner, LlamaRunner, list[int]]) -> None:
    tree, chain, prompt = runners
    five_leaves = (1, 2, 3, 4, 5)
    with pytest.raises(ValueError, match="5 branches needs a runner made with branches >= 5"):
        tree.decode_tree(five_leaves, (-1,) * 5)
    with pytest.raises(ValueError, match="1 branches needs"):
        chain.decode_tree((1,), (-1,))
    with pytest.raises(ValueError, match="not an earlier node"):
        tree.decode_tree((1, 2), (-1, 1))
    with pytest.raises(ValueError, match="decoded first"):
        tree.keep_branch([0])
    tree.decode_tree(TOKENS, PARENTS)
    with pytest.raises(ValueError, match="not a path from a root"):
        tree.keep_branch([0, 2, 3])
    assert tree.tokens == prompt  # refusals leave the cache as it was
    tree.keep_branch([5])
    assert tree.tokens == prompt + [TOKENS[5]]
