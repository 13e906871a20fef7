"""Where drafted tokens come from: a small draft model, or n-gram lookup in the text so far."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from . import activity
from .llama_backend import LlamaRunner
from .sampling import Candidates


@dataclass(slots=True)
class Proposal:
    """Drafted tokens, the distributions they were drawn from (None: deterministic) and the
    drafter's confidence in each."""

    source: str
    tokens: list[int] = field(default_factory=list)
    dists: list[Candidates] | None = None
    confidences: list[float] = field(default_factory=list)
    seconds: float = 0.0
    catch_up_tokens: int = 0
    # Seconds of each one-token draft decode after the first (which also catches up).
    step_seconds: list[float] = field(default_factory=list)
    # The controller's acceptance estimate per drafted token (filled as it decides).
    estimates: list[float] = field(default_factory=list)

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` drafted tokens (with their confidences and distributions)."""
        del self.tokens[n:]
        del self.confidences[n:]
        del self.estimates[n:]
        if self.dists is not None:
            del self.dists[n:]


# keep_going(j, proposal) -> whether to draft token j+1 after j tokens drafted.
KeepGoing = Callable[[int, Proposal], bool]
# pick(logits, history, j) -> (token, confidence, the distribution it was drawn from or None).
Pick = Callable[[np.ndarray, list[int], int], tuple[int, float, "Candidates | None"]]


class PromptLookupDrafter:
    """Proposes the tokens that followed the most recent earlier occurrence of the current
    suffix n-gram (longest n first). Free to run, and strong when the answer copies its prompt."""

    name = "lookup"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed: list[int] = []

    def _extend_index(self, seq: Sequence[int]) -> None:
        # Incremental: only n-grams ending at new positions are added; a different prefix
        # (new request) rebuilds from scratch.
        n_old = len(self._indexed)
        if n_old > len(seq) or list(seq[:n_old]) != self._indexed:
            self._index.clear()
            self._indexed = []
            n_old = 0
        for end in range(max(n_old, 1), len(seq) + 1):
            for n in range(self.ngram_min, self.ngram_max + 1):
                if end - n < 0:
                    break
                # The key is an n-gram ending at `end`; the value is where its continuation starts.
                self._index[tuple(seq[end - n:end])] = end
        self._indexed = list(seq)

    def propose(self, seq: Sequence[int], max_k: int) -> Proposal:
        prop = Proposal(source=self.name)
        if max_k <= 0 or len(seq) < self.ngram_min + 1:
            return prop
        # Index everything but the last position so a suffix never matches itself.
        self._extend_index(seq[:-1])
        for n in range(min(self.ngram_max, len(seq) - 1), self.ngram_min - 1, -1):
            start = self._index.get(tuple(seq[-n:]))
            if start is not None:
                cont = list(seq[start:start + max_k])
                prop.tokens = cont
                prop.confidences = [float(n) / self.ngram_max] * len(cont)
                break
        return prop


class ModelDrafter:
    """Drafts with a small model that shares the target's vocabulary. Its KV cache follows the
    accepted sequence lazily: tokens it missed (plain or lookup steps) are decoded in one batch
    the next time it drafts."""

    name = "model"

    def __init__(self, runner: LlamaRunner) -> None:
        self.runner = runner

    def behind(self, seq: Sequence[int]) -> int:
        """Tokens of ``seq`` the draft has not processed (it follows the target lazily)."""
        return len(seq) - self.runner.common_prefix(seq)

    def propose(self, seq: Sequence[int], max_k: int, pick: Pick,
                keep_going: KeepGoing) -> Proposal:
        """Draft up to ``max_k`` tokens after ``seq``; ``pick`` turns the draft's logits at the
        j-th drafted position into (token, confidence, distribution or None)."""
        prop = Proposal(source=self.name)
        if max_k <= 0:
            return prop
        t0 = time.perf_counter()
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
            if len(prop.tokens) >= max_k or not keep_going(len(prop.tokens), prop):
                break
            t_step = time.perf_counter()
            logits = self.runner.decode([tok], 1)[0]
            prop.step_seconds.append(time.perf_counter() - t_step)
        prop.seconds = time.perf_counter() - t0
        return prop
