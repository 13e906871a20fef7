"""Turning logits into the distribution a token is drawn from, and the acceptance rules.

The order follows llama-cpp-python's sampler chain (penalties, top-k, top-p, min-p, temperature)
so that ``localspec`` and plain llama-cpp-python mean the same thing by the same settings.
The speculative rules need the processed distributions themselves, not just a sampled token,
which is why this is numpy rather than llama.cpp's sampler objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings. ``temperature == 0`` is greedy decoding (argmax)."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range setting."""
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError("min_p must be in [0, 1)")
        if self.repeat_penalty <= 0:
            raise ValueError("repeat_penalty must be > 0")
        if self.repeat_last_n < 0:
            raise ValueError("repeat_last_n must be >= 0")


def apply_penalties(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> np.ndarray:
    """llama.cpp's repetition, frequency and presence penalties over the last N tokens."""
    if not p.has_penalties or p.repeat_last_n == 0 or not history:
        return logits
    window = np.asarray(history[-p.repeat_last_n:], dtype=np.int64)
    ids, counts = np.unique(window, return_counts=True)
    out = logits.copy()
    vals = out[ids]
    if p.repeat_penalty != 1.0:
        vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    vals = vals - counts * p.frequency_penalty - p.presence_penalty
    out[ids] = vals
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def distribution(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> np.ndarray:
    """The dense probability vector (float64) that a token is sampled from at this position."""
    x = apply_penalties(np.asarray(logits, dtype=np.float64), history, p)
    n = x.shape[0]
    keep = np.arange(n)
    if 0 < p.top_k < n:
        keep = np.argpartition(-x, p.top_k - 1)[: p.top_k]
    vals = x[keep]
    order = np.argsort(-vals, kind="stable")
    keep, vals = keep[order], vals[order]
    probs = _softmax(vals)
    if p.top_p < 1.0:
        cut = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
        keep, vals, probs = keep[:cut], vals[:cut], probs[:cut]
    if p.min_p > 0.0:
        mask = probs >= p.min_p * probs[0]
        keep, vals = keep[mask], vals[mask]
    out = np.zeros(n, dtype=np.float64)
    out[keep] = _softmax(vals / p.temperature)
    return out


def greedy_token(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> int:
    return int(np.argmax(apply_penalties(logits, history, p)))


def confidence(logits: np.ndarray) -> float:
    """The model's probability of its own top token (temperature 1): a cheap acceptance proxy."""
    m = float(logits.max())
    return 1.0 / float(np.exp(logits.astype(np.float64) - m).sum())


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    # Inverse-CDF on the cumulative sum: exact for float64 probabilities, and O(n) without the
    # per-call setup of rng.choice.
    cdf = np.cumsum(probs)
    r = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, r, side="right"), probs.shape[0] - 1))


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """normalise(max(0, p - q)): where to sample from after rejecting a drafted token."""
    r = np.maximum(p - q, 0.0)
    s = r.sum()
    if s <= 0.0:  # p == q: rejection had probability 0, any p-sample is correct
        return p
    return r / s


def one_hot(n: int, token: int) -> np.ndarray:
    """The proposal distribution of a deterministic drafter (prompt lookup, greedy draft)."""
    q = np.zeros(n, dtype=np.float64)
    q[token] = 1.0
    return q
