"""Choosing the token tree to draft: how many nodes, in what shape, from the measured costs.

A step that verifies a tree yields its accepted branch plus the target's own next token, so it
yields ``1 + sum(P(node))`` tokens on average, P(node) being the probability that the path from
the root to that node is accepted (every node on it equals the target's choice). It costs one
target pass over all nodes, plus one draft pass per level but the last, plus the host work of
drafting each node (which no device pass prices: at GPU speed it decides how wide). Where a
target pass over many tokens costs about what one costs (a GPU, an offloaded model), the best
use of the pass is a wide tree; where it climbs steeply (a small CPU), a short chain or nothing.

Nodes are chosen best first by P (SpecInfer, Sequoia, EAGLE-2 choose the same way): a child's P
is its parent's times its own chance of matching given the parent matched, so best-first order
always lists a parent before its children, and every prefix of it is a tree. The plan is the
prefix with the most expected tokens per second, zero nodes (plain decoding) included.

Pure: no llama.cpp, no engine state; the controller feeds it acceptance rates and costs.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


class TreeCosts(Protocol):
    """The seconds a plan weighs (``controller.CostModel`` is one)."""

    def verify(self, n: int) -> float:
        """One target pass over ``n`` tokens."""

    def verify_floor(self, n: int) -> float:
        """The least one target pass over ``n`` tokens or more may cost."""

    def draft_pass(self, width: int) -> float:
        """One draft pass over ``width`` tree nodes (one level)."""

    def draft_start(self) -> float:
        """The draft's first pass of a step (catching up on the tokens the last step added)."""

    def node_host(self) -> float:
        """Host work per node drafted (ranking its children, bookkeeping): no pass prices it."""


@dataclass(frozen=True, slots=True)
class TreePlan:
    """A tree to draft: ``nodes`` tokens in ``depth`` levels with ``branches`` leaves, at most
    ``width`` children per node; ``floor``: the least path probability among its nodes."""

    nodes: int
    depth: int
    width: int
    branches: int
    expected: float  # tokens a step yields on average (accepted + the target's own)
    seconds: float  # a step's expected seconds: drafting and verification
    floor: float

    @property
    def rate(self) -> float:
        return self.expected / self.seconds if self.seconds > 0 else 0.0

    @property
    def is_chain(self) -> bool:
        return self.width <= 1


def plan(depth_rates: Sequence[float], sibling_rates: Sequence[float], costs: TreeCosts, *,
         max_nodes: int, max_branches: int, max_width: int | None = None,
         tie: float = 0.0) -> TreePlan:
    """The best tree by expected tokens per second.

    ``depth_rates[d]``: P(the draft's first guess at depth d matches | its parent matched),
    what a chain sees; ``sibling_rates[r - 1]``: the same for its r-th other guess (rank r).
    ``tie``: the chance a verified position is a near-tie the guard leaves undecided (it
    yields what a rejection does, then costs a one-token pass). ``max_width`` 1 asks for the
    best chain."""
    width_cap = 1 + len(sibling_rates) if max_width is None else min(max_width,
                                                                     1 + len(sibling_rates))
    plain = TreePlan(0, 0, 0, 0, 1.0, costs.verify(1) * (1.0 + tie), 1.0)
    if max_nodes <= 0 or not depth_rates or width_cap <= 0:
        return plain
    keep = 1.0 - tie
    # Each cost is looked up once per width: a plan walks up to a few hundred nodes, every
    # step, and re-summing the levels' draft passes per node made it O(nodes x depth) calls.
    verify = _Memo(costs.verify)
    draft_pass = _Memo(costs.draft_pass)
    floor = _Memo(costs.verify_floor)
    one_pass = verify(1)
    start = costs.draft_start()
    host = costs.node_host()
    # Candidates: (-P, order, parent, depth, rank). ``order`` breaks ties first come first.
    heap: list[tuple[float, int, int, int, int]] = [(-keep * depth_rates[0], 0, -1, 0, 0)]
    order = 1
    node_p: list[float] = []
    n_children: list[int] = []
    level: list[int] = []  # nodes per depth
    inner = 0.0  # draft passes of every level but the last (the last is never drafted from)
    roots, leaves, widest, total = 0, 0, 0, 0.0
    best, best_rate = plain, plain.rate
    # No tree yields more than every node of the unbounded tree would: once a pass over the
    # nodes so far, and any wider one, costs more than that is worth at the best rate found,
    # no wider plan can win (on a steep CPU curve that ends the walk after a few nodes).
    most = 1.0 + _full_mass(depth_rates, sibling_rates[:width_cap - 1], keep)
    # The host bound below takes the best candidate as worth at least any node after it: true
    # where no rate exceeds 1 and each sibling rank is at most the one before (a rank pushed
    # later could otherwise outweigh every candidate). Learned ranks can come out of order.
    ranks = sibling_rates[:width_cap - 1]
    bounded = (max(depth_rates, default=0.0) <= 1.0 and max(ranks, default=0.0) <= 1.0
               and all(a >= b for a, b in zip(ranks, ranks[1:], strict=False)))
    while heap and len(node_p) < max_nodes:
        neg_p, _, parent, depth, rank = heapq.heappop(heap)
        p = -neg_p
        # A root, or a second child of a node, is a new leaf; a first child replaces one.
        if (parent < 0 or n_children[parent] > 0) and leaves >= max_branches:
            continue
        node_p.append(p)
        n_children.append(0)
        if parent < 0:
            leaves += 1
            roots += 1
            widest = max(widest, roots)
        else:
            leaves += 1 if n_children[parent] else 0
            n_children[parent] += 1
            widest = max(widest, n_children[parent])
        if depth == len(level):
            if level:  # the level that was last is now drafted from
                inner += draft_pass(level[-1])
            level.append(0)
        elif depth < len(level) - 1:
            inner += draft_pass(level[depth] + 1) - draft_pass(level[depth])
        level[depth] += 1
        total += p
        expected = 1.0 + total
        seconds = (verify(len(node_p) + 1) + tie * one_pass * expected + start + inner
                   + host * len(node_p))
        if expected / seconds > best_rate:
            best = TreePlan(len(node_p), len(level), widest, leaves, expected, seconds, p)
            best_rate = best.rate
        least = floor(len(node_p) + 2) + start + host * (len(node_p) + 1)
        if most <= best_rate * least:
            break
        # Its first child, and its own next sibling (the next rank under the same parent).
        if depth + 1 < len(depth_rates):
            heapq.heappush(heap, (-p * keep * depth_rates[depth + 1], order, len(node_p) - 1,
                                  depth + 1, 0))
            order += 1
        if rank + 1 < width_cap:
            parent_p = node_p[parent] if parent >= 0 else 1.0
            heapq.heappush(heap, (-parent_p * keep * sibling_rates[rank], order, parent, depth,
                                  rank + 1))
            order += 1
        # Nor can one whose every further node is worth at most the best candidate's P (a
        # child's P is at most its parent's): m more nodes add at most m * P tokens and
        # m * host seconds, so once one more does not pay and P is under what a node's host
        # work costs at the best rate, no number of them does. Where host work is a fair
        # share of a pass (a GPU) this ends the walk long before the node limit.
        if host > 0 and heap and bounded:
            top = -heap[0][0]
            if top <= best_rate * host and expected + top <= best_rate * least:
                break
    return best


def _full_mass(depth_rates: Sequence[float], sibling_rates: Sequence[float],
               keep: float) -> float:
    """The sum of P over every node of the tree with no node or branch limit: each node's
    children (its first guess and each sibling rank) carry its P times their rates."""
    siblings = sum(sibling_rates)
    below = 0.0  # the mass under a node at the deepest level, relative to its own P
    for r in reversed(depth_rates[1:]):
        below = keep * (r + siblings) * (1.0 + below)
    return keep * (depth_rates[0] + siblings) * (1.0 + below)


class _Memo:
    """A cost function's values, each computed once."""

    __slots__ = ("fn", "values")

    def __init__(self, fn: Callable[[int], float]) -> None:
        self.fn = fn
        self.values: dict[int, float] = {}

    def __call__(self, n: int) -> float:
        v = self.values.get(n)
        if v is None:
            v = self.values[n] = self.fn(n)
        return v


def path_probabilities(estimates: Sequence[float], parents: Sequence[int]) -> list[float]:
    """Each node's P(its path is accepted): the product of the estimates along it."""
    out: list[float] = []
    for est, parent in zip(estimates, parents, strict=True):
        out.append(est * (out[parent] if parent >= 0 else 1.0))
    return out


def select(path_p: Sequence[float], parents: Sequence[int], costs: TreeCosts, price: float,
           tie: float = 0.0) -> list[int]:
    """The nodes of a drafted tree worth verifying, its drafting already paid for: the best
    first prefix by path probability whose expected tokens less its verification seconds at
    ``price`` (tokens a second is worth) is largest. Nodes come back in node order."""
    ranked = sorted(range(len(path_p)), key=lambda i: (-path_p[i], i))
    kept: set[int] = set()
    chosen: list[int] = []
    total = 0.0
    best_value = 1.0 - price * costs.verify(1) * (1.0 + tie)
    best_n = 0
    keep = 1.0 - tie
    for i in ranked:
        if parents[i] >= 0 and parents[i] not in kept:
            continue  # an estimate above its parent's (a rounding): wait for the parent
        kept.add(i)
        chosen.append(i)
        total += keep * path_p[i]
        expected = 1.0 + total
        value = expected - price * (costs.verify(len(chosen) + 1)
                                    + tie * costs.verify(1) * expected)
        if value > best_value:
            best_value, best_n = value, len(chosen)
    return sorted(chosen[:best_n])
