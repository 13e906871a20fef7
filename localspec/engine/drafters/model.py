"""Drafting with a small model that shares the target's vocabulary."""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...errors import LocalspecError
from .. import activity
from .base import DraftContext, Drafter
from .proposal import Proposal, TreeRequest

if TYPE_CHECKING:
    import numpy as np

    from ..llama_backend import LlamaRunner
    from .base import DraftSettings


class ModelDrafter(Drafter):
    """Drafts with a small model that shares the target's vocabulary. Its KV cache follows the
    accepted sequence lazily: tokens it missed (plain or lookup steps) are decoded in one batch
    the next time it drafts."""

    name = "model"
    title = "the draft model"
    prior_rate = 0.6
    costly = True
    needs_draft_model = True

    def __init__(self, runner: LlamaRunner) -> None:
        self.runner = runner

    @classmethod
    def create(cls, settings: DraftSettings, draft_model: LlamaRunner | None) -> ModelDrafter:
        if draft_model is None:  # DraftSettings.validate says so first, in the user's words
            raise LocalspecError("draft mode 'model' needs a draft model")
        return cls(draft_model)

    def behind(self, seq: Sequence[int]) -> int:
        """Tokens of ``seq`` the draft has not processed (it follows the target lazily)."""
        return len(seq) - self.runner.common_prefix(seq)

    def propose(self, ctx: DraftContext, budget: int) -> Proposal:
        """Draft up to ``budget`` tokens after ``ctx.seq``; ``ctx.pick`` turns the draft's
        logits at the j-th drafted position into (token, confidence, distribution or None)."""
        prop = Proposal(source=self.name)
        if budget <= 0:
            return prop
        pick, keep_going, seq = ctx.pick, ctx.keep_going, ctx.seq
        if pick is None:
            raise ValueError("a model drafter needs DraftContext.pick")
        t0 = time.perf_counter()
        decoded_before = self.runner.decode_seconds
        prop.catch_up_tokens = self.behind(seq)
        activity.report("drafting", self.runner.path)
        logits = self.runner.sync(seq, 1)[0]
        history = list(seq)
        while True:
            tok, conf, dist = pick(logits, history, len(prop.tokens))
            if dist is not None:
                if prop.dists is None:
                    prop.dists = []
                prop.dists.append(dist)
            prop.tokens.append(tok)
            prop.confidences.append(conf)
            history.append(tok)
            if len(prop.tokens) >= budget or not keep_going(len(prop.tokens), prop):
                break
            t_step = time.perf_counter()
            logits = self.runner.decode([tok], 1)[0]
            prop.step_seconds.append(time.perf_counter() - t_step)
        prop.decode_seconds = self.runner.decode_seconds - decoded_before
        prop.seconds = time.perf_counter() - t0
        return prop

    def propose_tree(self, ctx: DraftContext, request: TreeRequest) -> Proposal:
        """A token tree, best first by each node's calibrated chance that its path is accepted
        (``request.estimate`` of its confidence, times its parent's), one draft pass per
        level: every candidate at or above ``request.floor`` joins the tree within its budget,
        and the new nodes are decoded together to give the next candidates."""
        children = request.children
        if children is None:
            raise ValueError("a model drafter's tree needs TreeRequest.children")
        prop = Proposal(source=self.name)
        if request.nodes <= 0 or request.depth <= 0:
            return prop
        t0 = time.perf_counter()
        decoded_before = self.runner.decode_seconds
        seq = list(ctx.seq)
        prop.catch_up_tokens = self.behind(seq)
        activity.report("drafting", self.runner.path)
        path_p: list[float] = []
        depth: list[int] = []
        n_children: list[int] = []
        # Candidates: (-P, order, parent, token, confidence, depth); order: first come first.
        heap: list[tuple[float, int, int, int, float, int]] = []
        order = 0

        def expand(rows: Sequence[np.ndarray], nodes: list[int]) -> None:
            nonlocal order
            for row, node in zip(rows, nodes, strict=True):
                d = depth[node] + 1 if node >= 0 else 0
                history = (seq + [prop.tokens[i] for i in _path(prop.parents, node)]
                           if node >= 0 else seq)
                base = path_p[node] if node >= 0 else 1.0
                for tok, conf in children(row, history, d, request.width):
                    heapq.heappush(heap, (-base * request.estimate(conf), order, node, tok,
                                          conf, d))
                    order += 1

        t_first = time.perf_counter()
        first = self.runner.sync(seq, 1)[0]
        prop.first_seconds = time.perf_counter() - t_first
        expand([first], [-1])
        leaves = 0
        while heap and len(prop.tokens) < request.nodes:
            new: list[int] = []
            while heap and len(prop.tokens) < request.nodes:
                neg_p, _, parent, tok, conf, d = heap[0]
                if -neg_p < request.floor and prop.tokens:
                    break
                heapq.heappop(heap)
                # A root, or a second child, is a new branch: the target holds so many.
                new_leaf = parent < 0 or n_children[parent] > 0
                if new_leaf and leaves >= request.branches:
                    continue
                leaves += new_leaf
                if parent >= 0:
                    n_children[parent] += 1
                new.append(len(prop.tokens))
                prop.tokens.append(tok)
                prop.confidences.append(conf)
                prop.parents.append(parent)
                path_p.append(-neg_p)
                depth.append(d)
                n_children.append(0)
            grow = [i for i in new if depth[i] + 1 < request.depth]
            if not grow or len(prop.tokens) >= request.nodes:
                break
            # One draft pass for the level: the new nodes, each attending to its own path.
            t_level = time.perf_counter()
            rows = self.runner.extend_tree([prop.tokens[i] for i in new],
                                           [prop.parents[i] for i in new])
            prop.level_passes.append((len(new), time.perf_counter() - t_level))
            expand([rows[new.index(i)] for i in grow], grow)
        if prop.is_chain:
            prop.parents = []
        prop.decode_seconds = self.runner.decode_seconds - decoded_before
        prop.seconds = time.perf_counter() - t0
        return prop


def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]
