"""What a drafter proposes: drafted tokens, as a chain or as a token tree."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from ..sampling import Candidates

# The parent of a tree's roots: the last accepted token, which the drafted tokens continue.
ROOT = -1


def chain(n: int) -> list[int]:
    """The parents of a chain of ``n`` nodes: each node continues the one before."""
    return list(range(-1, n - 1))


def check_tree(parents: list[int], n: int) -> None:
    """Refuse parents that are not a tree over ``n`` nodes listed parents first."""
    if len(parents) != n:
        raise ValueError(f"a tree of {n} tokens needs {n} parents, got {len(parents)}")
    for i, p in enumerate(parents):
        if not ROOT <= p < i:
            raise ValueError(f"node {i}'s parent {p} is not an earlier node or {ROOT}")


# children(logits, history, depth, n) -> up to n (token, confidence) pairs, best first: the
# draft's guesses at the target's choice after ``history`` (the first is what a chain drafts).
Children = Callable[["np.ndarray", list[int], int, int], list[tuple[int, float]]]


@dataclass(frozen=True, slots=True)
class TreeRequest:
    """What the planner asks of a drafter that can propose a token tree: at most ``nodes``
    tokens in at most ``depth`` levels and ``branches`` leaves, each node's path accepted with
    probability at least ``floor`` (by ``estimate``, the calibrated acceptance of a drafted
    token of that confidence), at most ``width`` children per node."""

    nodes: int
    depth: int
    branches: int
    width: int
    floor: float
    estimate: Callable[[float], float]
    children: Children | None = None


@dataclass(slots=True)
class Proposal:
    """Drafted tokens, the distributions they were drawn from (None: deterministic) and the
    drafter's confidence in each.

    ``parents`` makes the tokens a tree: node i continues node ``parents[i]`` (ROOT: the last
    accepted token), parents listed before their children. Empty, as for every chain, means
    each node continues the one before; a drafter that proposes a chain never sets it.
    Confidences left out are 1.0 each: the drafter has no opinion, and the acceptance model
    learns its acceptance by depth all the same."""

    source: str
    tokens: list[int] = field(default_factory=list)
    dists: list[Candidates] | None = None
    confidences: list[float] = field(default_factory=list)
    seconds: float = 0.0
    catch_up_tokens: int = 0
    # Seconds of each one-token draft decode after the first (which also catches up).
    step_seconds: list[float] = field(default_factory=list)
    # A drafted tree's passes after the first, one per level: (nodes decoded, seconds), and
    # the seconds of its first pass (which also catches up).
    level_passes: list[tuple[int, float]] = field(default_factory=list)
    first_seconds: float = 0.0
    # The controller's acceptance estimate per drafted token (filled as it decides).
    estimates: list[float] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    # Seconds of those decodes inside llama.cpp: the rest of ``seconds`` is host time.
    decode_seconds: float = 0.0
    # Each node's drafter where another's branches were grafted in (``graft``); empty: every
    # node is ``source``'s.
    node_sources: list[str] = field(default_factory=list)
    # A chain's marks from the history index (``history_index.MARK_*``), one per drafted
    # token and one for the position after the last: what the target's choice there was when
    # it wrote these tokens before (a near-tie, or clear). Empty: not known.
    marks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.tokens and not self.confidences:
            self.confidences = [1.0] * len(self.tokens)
        if self.parents:
            check_tree(self.parents, len(self.tokens))

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def parent_list(self) -> list[int]:
        """Every node's parent, spelled out for a chain too."""
        return list(self.parents) if self.parents else chain(len(self.tokens))

    def path_to(self, node: int) -> list[int]:
        """The nodes from a root down to ``node``, inclusive."""
        if not 0 <= node < len(self.tokens):
            raise ValueError(f"no node {node} in a proposal of {len(self.tokens)} tokens")
        if not self.parents:
            return list(range(node + 1))
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` drafted tokens (with their confidences and distributions).
        A tree's first ``n`` nodes are a tree: parents come before their children."""
        del self.tokens[n:]
        del self.confidences[n:]
        del self.estimates[n:]
        del self.parents[n:]
        del self.node_sources[n:]
        del self.marks[n + 1:]
        if self.dists is not None:
            del self.dists[n:]
        self._drop_single_source()

    def depths(self) -> list[int]:
        """Each node's depth (a root's is 0)."""
        out: list[int] = []
        for p in self.parent_list():
            out.append(out[p] + 1 if p >= 0 else 0)
        return out

    def children(self) -> list[list[int]]:
        """Each node's children, and last (index -1) the roots, in node order."""
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parent_list()):
            kids[p].append(i)
        return kids

    def keep_nodes(self, keep: Sequence[int]) -> None:
        """Keep only the nodes ``keep`` (each one's parent kept too), in node order."""
        kept = sorted(set(keep))
        if len(kept) == len(self.tokens):
            return
        new_index = {old: new for new, old in enumerate(kept)}
        parents = self.parent_list()
        if len(self.estimates) == len(self.tokens):
            self.estimates = [self.estimates[i] for i in kept]
        else:
            self.estimates = []
        self.parents = [new_index[parents[i]] if parents[i] >= 0 else ROOT for i in kept]
        self.tokens = [self.tokens[i] for i in kept]
        self.confidences = [self.confidences[i] for i in kept]
        if self.node_sources:
            self.node_sources = [self.node_sources[i] for i in kept]
        if self.dists is not None:
            self.dists = [self.dists[i] for i in kept]
        if self.is_chain:
            self.parents = []
        self._drop_single_source()

    # -- branches from other drafters -------------------------------------------------------
    @property
    def is_mixed(self) -> bool:
        """Whether some node is another drafter's (grafted in)."""
        return any(s != self.source for s in self.node_sources)

    def source_of(self, node: int) -> str:
        return self.node_sources[node] if self.node_sources else self.source

    def _drop_single_source(self) -> None:
        if not self.is_mixed:
            self.node_sources = []

    def graft(self, other: Proposal, max_nodes: int, max_branches: int) -> int:
        """Add ``other``'s paths to this tree as branches (its tokens where they equal a
        node's are that node, so no node has two children with one token), within
        ``max_nodes`` nodes and ``max_branches`` leaves; return how many nodes were added.
        Sampled drafts (``dists``) are chains of one drafter and take no grafts."""
        if self.dists is not None or other.dists is not None or not other.tokens:
            return 0
        sources = self.node_sources or [self.source] * len(self.tokens)
        parents = self.parent_list()
        child = {(p, t): i for i, (p, t) in enumerate(zip(parents, self.tokens, strict=True))}
        has_kids = {p for p in parents if p >= 0}
        leaves = len(self.tokens) - len(has_kids)
        where: dict[int, int] = {}  # other's node -> this tree's
        added = 0
        for j, (p, tok) in enumerate(zip(other.parent_list(), other.tokens, strict=True)):
            if p >= 0 and p not in where:
                continue  # its parent was left out: so is it
            parent = where[p] if p >= 0 else ROOT
            node = child.get((parent, tok))
            if node is None:
                new_leaf = parent < 0 or parent in has_kids
                if len(self.tokens) >= max_nodes or (new_leaf and leaves >= max_branches):
                    continue
                leaves += new_leaf
                node = child[(parent, tok)] = len(self.tokens)
                self.tokens.append(tok)
                self.confidences.append(other.confidences[j])
                parents.append(parent)
                sources.append(other.source)
                if parent >= 0:
                    has_kids.add(parent)
                added += 1
            where[j] = node
        if added:
            del self.estimates[len(self.tokens) - added:]  # they covered the old nodes only
            self.parents = parents
            self.node_sources = sources
            if self.is_chain:
                self.parents = []
            self._drop_single_source()  # a tree grafted into an empty one of its drafter's
        return added

    def counts_by_source(self, path: Sequence[int]) -> dict[str, tuple[int, int]]:
        """Per drafter: its nodes in this proposal and those of them on the accepted ``path``."""
        on_path = set(path)
        out: dict[str, tuple[int, int]] = {}
        for i in range(len(self.tokens)):
            name = self.source_of(i)
            drafted, accepted = out.get(name, (0, 0))
            out[name] = (drafted + 1, accepted + (i in on_path))
        return out
