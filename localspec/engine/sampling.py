"""Turning logits into the token that is emitted: greedy choice, the processed distribution, the
coupled (Gumbel-max) choice that makes seeded sampling independent of drafting, and the classic
acceptance rules.

The processed distribution follows llama-cpp-python's sampler chain (penalties, top-k, top-p,
min-p, temperature) so that localspec and plain llama-cpp-python mean the same thing by the same
settings. It is computed over its *candidates* only (the tokens that survive the cut-offs: usually
a few dozen of a 152k vocabulary): on a GPU a target step takes a few milliseconds, and a sort or
a float64 copy of the whole vocabulary per token would cost a visible share of it.

Coupling (``rule="coupled"``): the token at output position ``i`` is
``argmax_j(logit_j / T + G(seed, i, j))`` over the candidates, with Gumbel noise ``G`` drawn from a
counter-based hash of (seed, position, token id). That is an exact sample of the processed
distribution (the Gumbel-max trick), and because the noise depends only on the position, the text
is a function of (weights, prompt, settings, seed) whatever was drafted. The draft proposes with
the same noise, so it guesses the target's token whenever their distributions agree enough
("drafter-invariant speculative decoding", Daliri, Musco and Suresh, 2024).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

AcceptRule = Literal["coupled", "rejection", "match"]

# -- passes over the vocabulary ------------------------------------------------------------------
# Each pass over a 152k vocabulary right after a decode reads logits that are not in this core's
# cache yet; later passes are cheap if they allocate nothing. So comparisons write into one
# reused mask (per thread: front ends may run engines from several threads).
_scratch = threading.local()

# Candidate sets up to this size are handled with Python numbers, not numpy: right after a
# decode each numpy call costs ~20 us more than warm (see confidence), and a coupled choice
# made ~25 of them to hash and score a handful of tokens. Larger sets (top-k off, a flat
# distribution) stay vectorised.
_FEW = 64


def _at_least(x: np.ndarray, threshold: float) -> np.ndarray:
    """``x >= threshold`` in a reused buffer (valid until the next call on this thread)."""
    mask: np.ndarray | None = getattr(_scratch, "mask", None)
    if mask is None or mask.shape != x.shape:
        mask = np.empty(x.shape, dtype=bool)
        _scratch.mask = mask
    np.greater_equal(x, threshold, out=mask)
    return mask


def _ids_at_least(x: np.ndarray, threshold: float) -> np.ndarray:
    return np.flatnonzero(_at_least(x, threshold))


# The top-k search views the vocabulary as a grid of this many rows (see _top_k_ids).
_GRID_ROWS = 64


@functools.lru_cache(maxsize=8)
def _row_starts(cols: int) -> np.ndarray:
    return (np.arange(_GRID_ROWS, dtype=np.intp) * cols)[:, None]


def _top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """The ids of the ``k`` largest logits, in no particular order, in one pass over the
    vocabulary.

    Partitioning a 152k vocabulary costs ~0.4 ms. Instead view it as a grid of _GRID_ROWS rows
    and take each column's maximum (one vectorised pass, the only one). The top k lie in the k
    columns with the largest maxima (or the ragged tail): a token outside them is at most its
    column's maximum, which each chosen column's maximum matches or beats, so the chosen
    columns hold k tokens at least as large. Partitioning their 64 x k tokens is cheap."""
    n = x.shape[0]
    if k >= n:
        return np.arange(n)
    cols = n // _GRID_ROWS
    if cols < 4 * k:  # a small vocabulary: partitioning it all is cheap
        return np.argpartition(x, -k)[-k:]
    main = cols * _GRID_ROWS
    best_cols = np.argpartition(x[:main].reshape(_GRID_ROWS, cols).max(axis=0), -k)[-k:]
    pool = (_row_starts(cols) + best_cols).ravel()
    if main < n:
        pool = np.concatenate((pool, np.arange(main, n)))
    return pool[np.argpartition(x[pool], -k)[-k:]]


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
        """Raise ValueError naming the first out-of-range setting (NaN and infinity too)."""
        from ..params import check_sampling

        check_sampling(self)


# -- candidates and the processed distribution ---------------------------------------------------
@dataclass(frozen=True, slots=True)
class Candidates:
    """The tokens a position may be sampled from, best first, with their penalized logits
    (before temperature) and their final probabilities (after temperature)."""

    ids: np.ndarray  # int64
    logits: np.ndarray  # float64
    probs: np.ndarray  # float64, sums to 1

    def prob_of(self, token: int) -> float:
        if self.ids.size <= _FEW:  # see _FEW
            ids = self.ids.tolist()
            return float(self.probs[ids.index(token)]) if token in ids else 0.0
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[0]]) if hit.size else 0.0

    def probs_at(self, ids: np.ndarray) -> np.ndarray:
        """Probabilities of ``ids`` (0 for tokens that are not candidates)."""
        order = np.argsort(self.ids)
        sorted_ids = self.ids[order]
        pos = np.clip(np.searchsorted(sorted_ids, ids), 0, max(0, sorted_ids.size - 1))
        found = sorted_ids[pos] == ids
        return np.where(found, self.probs[order][pos], 0.0)


def apply_penalties(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> np.ndarray:
    """llama.cpp's repetition, frequency and presence penalties over the last N tokens.

    Returns ``logits`` itself when there is nothing to penalise (no copy), else a copy."""
    if not p.has_penalties or p.repeat_last_n == 0 or not history:
        return logits
    window = np.asarray(history[-p.repeat_last_n:], dtype=np.int64)
    ids, counts = np.unique(window, return_counts=True)
    out = np.array(logits, dtype=np.float32, copy=True)
    vals = out[ids].astype(np.float64)
    if p.repeat_penalty != 1.0:
        vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    vals = vals - counts * p.frequency_penalty - p.presence_penalty
    out[ids] = vals
    return out


def candidates(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> Candidates:
    """The processed distribution of one position, over its candidates only.

    With top-k, one pass over the vocabulary (see _top_k_ids); without it, a few (its best
    logit, then the tokens within a band below it). The rest works on a few dozen tokens.
    Without top-k, top-p normalises over the tokens within _BAND of the best: each one left out
    weighs less than exp(-_BAND) of the best one."""
    x = apply_penalties(logits, history, p)
    n = x.shape[0]
    top_k = p.top_k if 0 < p.top_k < n else 0
    total = 0.0  # top-p's normaliser (the mass it takes its share of), relative to the best
    if top_k:
        ids = _top_k_ids(x, top_k)
        vals = x[ids].astype(np.float64)
        best = float(vals.max())  # the top k hold the best: no pass over the vocabulary for it
        floor = _min_p_floor(best, p)
        if p.top_p < 1.0:
            total = float(np.exp(vals - best).sum())
        # min-p keeps a best-first prefix, so it may cut before top-p does.
        above = vals >= floor
        ids, vals = ids[above], vals[above]
    else:
        best = float(x.max())
        floor = _min_p_floor(best, p)
        if p.top_p < 1.0:
            band_ids = _ids_at_least(x, best - _BAND)
            total = float(np.exp(x[band_ids] - np.float32(best)).sum(dtype=np.float64))
        if floor >= best - _BAND:
            ids = _ids_at_least(x, floor)
        elif p.top_p < 1.0:
            ids = band_ids  # _top_p sorts everything if this is short
        else:
            ids = np.arange(n)
        vals = x[ids].astype(np.float64)
    order = np.argsort(-vals, kind="stable")
    ids, vals = ids[order], vals[order]
    if p.top_p < 1.0:
        ids, vals = _top_p(x, ids, vals, best, total, top_k, p)
    keep = vals >= floor
    ids, vals = ids[keep], vals[keep]
    scaled = vals / p.temperature if p.temperature > 0 else vals
    e = np.exp(scaled - scaled.max())
    return Candidates(ids.astype(np.int64), vals, e / e.sum())


_BAND = 24.0


def _min_p_floor(best: float, p: SamplingParams) -> float:
    """The lowest logit min-p keeps: a probability of at least min_p times the best's."""
    return best + math.log(p.min_p) if p.min_p > 0.0 else -math.inf


def _top_p(x: np.ndarray, ids: np.ndarray, vals: np.ndarray, best: float, total: float,
           top_k: int, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Keep the shortest best-first prefix whose probability (at temperature 1, ``total`` being
    the mass of what top-k kept, or without top-k of the tokens within _BAND of the best) reaches
    ``top_p``."""
    cdf = np.cumsum(np.exp(vals - best)) / total
    cut = int(np.searchsorted(cdf, p.top_p) + 1)
    if cut > ids.size and ids.size < x.shape[0] and p.min_p <= 0.0 and not top_k:
        # The band was too narrow for this flat distribution: sort everything.
        all_ids = np.argsort(-x, kind="stable")
        all_vals = x[all_ids].astype(np.float64)
        cdf = np.cumsum(np.exp(all_vals - best)) / total
        cut = int(np.searchsorted(cdf, p.top_p) + 1)
        return all_ids[:cut], all_vals[:cut]
    return ids[:cut], vals[:cut]


def distribution(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> np.ndarray:
    """The processed distribution as a dense vector (for tests and small vocabularies)."""
    c = candidates(logits, history, p)
    out = np.zeros(logits.shape[0], dtype=np.float64)
    out[c.ids] = c.probs
    return out


# -- choosing a token ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Choice:
    """A chosen token and how decisively it won: the gap to the runner-up in logit units
    (infinite when there was no runner-up). Small gaps are numerical near-ties."""

    token: int
    margin: float


def greedy_token(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> int:
    return int(np.argmax(apply_penalties(logits, history, p)))


def greedy_choice(logits: np.ndarray, history: Sequence[int], p: SamplingParams,
                  tie_margin: float) -> Choice:
    """The argmax, with its margin resolved only as far as the near-tie guard needs: a margin of
    0 means "within ``tie_margin``", ``inf`` means "clear" (a full top-2 costs a partition)."""
    x = apply_penalties(logits, history, p)
    tok = int(np.argmax(x))
    if tie_margin <= 0.0:
        return Choice(tok, math.inf)
    close = np.count_nonzero(_at_least(x, float(x[tok]) - tie_margin))
    return Choice(tok, 0.0 if close > 1 else math.inf)


_MASK64 = (1 << 64) - 1
_GOLDEN_INT = 0x9E3779B97F4A7C15
_GOLDEN = np.uint64(_GOLDEN_INT)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
_TO_UNIT = 1.0 / 9007199254740992.0  # 2**-53


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective, well-mixing hash of 64-bit words."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def _mix_int(z: int) -> int:
    """_mix on one Python integer (the same bits)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _noise_key(seed: int, position: int) -> int:
    key = _mix_int(seed & _MASK64)
    return _mix_int(key ^ ((position * _GOLDEN_INT + _GOLDEN_INT) & _MASK64))


def gumbel_noise(seed: int, position: int, ids: np.ndarray) -> np.ndarray:
    """Standard Gumbel noise for (seed, position, token id): the same numbers for the same key,
    in any process, whatever else was computed before (a counter-based generator)."""
    with np.errstate(over="ignore"):
        z = _mix(ids.astype(np.uint64) * _GOLDEN + np.uint64(_noise_key(seed, position)))
    u = ((z >> _S11).astype(np.float64) + 0.5) * _TO_UNIT  # (0, 1)
    return -np.log(-np.log(u))


def _gumbel_of(key: int, token: int) -> float:
    """gumbel_noise for one token, with Python numbers (see _FEW). math.log and numpy's log
    may differ in the last bit on some CPUs; only a score tie at that precision could tell,
    and the near-tie guard is far wider."""
    z = _mix_int((token * _GOLDEN_INT + key) & _MASK64)
    return -math.log(-math.log((float(z >> 11) + 0.5) * _TO_UNIT))


def coupled_choice(c: Candidates, temperature: float, seed: int, position: int) -> Choice:
    """The Gumbel-max sample of ``c`` under the noise of (seed, position)."""
    if c.ids.size > _FEW:
        scores = c.logits / temperature + gumbel_noise(seed, position, c.ids)
        top2 = np.partition(scores, -2)[-2:]
        return Choice(int(c.ids[int(np.argmax(scores))]),
                      float(top2[1] - top2[0]) * temperature)
    key = _noise_key(seed, position)
    ids = c.ids.tolist()
    best, second, token = -math.inf, -math.inf, ids[0]
    for tok, logit in zip(ids, c.logits.tolist(), strict=True):
        score = logit / temperature + _gumbel_of(key, tok)
        if score > best:
            best, second, token = score, best, tok
        elif score > second:
            second = score
    return Choice(token, (best - second) * temperature)


# Tokens further than this below the best leave the confidence out: each weighs less than
# 3.4e-4 of the best one. It is a proxy, binned (controller.BIN_EDGES) and calibrated online.
# Gathering the band is the cost (a draft model's 152k vocabulary: ~6,000 tokens within 10
# logits, 120 us here; ~1,600 within 8, 35 us), and at a top token of 8% the narrower band
# reads 8.5%: the same bin.
CONFIDENCE_BAND = 8.0


def confidence(logits: np.ndarray, best: float | None = None) -> float:
    """The model's probability of its own top token (temperature 1): a cheap acceptance proxy.
    ``best`` (the top logit, when the caller already has it) saves a pass over the vocabulary.

    Right after a decode each numpy call costs ~25 us more than warm (the decode evicted the
    interpreter's and numpy's code and data from this core's caches), so this makes as few
    calls as it can: in place, in float32 (the band holds at most a few thousand terms, each
    at most 1)."""
    top = np.float32(logits.max() if best is None else best)
    near = np.compress(_at_least(logits, float(top) - CONFIDENCE_BAND), logits)
    near -= top
    return 1.0 / float(np.exp(near, out=near).sum())


def greedy_pick(logits: np.ndarray, history: Sequence[int],
                p: SamplingParams) -> tuple[int, float]:
    """A greedy draft's token and its confidence, in two passes over the vocabulary."""
    x = apply_penalties(logits, history, p)
    tok = int(np.argmax(x))
    return tok, confidence(x, float(x[tok]))


def sample(c: Candidates, rng: np.random.Generator) -> int:
    """Inverse-CDF sampling over the candidates."""
    cdf = np.cumsum(c.probs)
    r = rng.random() * cdf[-1]
    return int(c.ids[min(int(np.searchsorted(cdf, r, side="right")), c.ids.size - 1)])


def residual(p: Candidates, q: Candidates) -> Candidates:
    """normalise(max(0, p - q)): where to sample from after rejecting a drafted token."""
    r = np.maximum(p.probs - q.probs_at(p.ids), 0.0)
    s = r.sum()
    if s <= 0.0:  # p == q: rejection had probability 0, any p-sample is correct
        return p
    return Candidates(p.ids, p.logits, r / s)


def point_mass(token: int) -> Candidates:
    """The proposal distribution of a deterministic drafter (prompt lookup, greedy draft)."""
    return Candidates(np.array([token], dtype=np.int64), np.zeros(1), np.ones(1))


# -- a token tree's children --------------------------------------------------------------------
def greedy_children(logits: np.ndarray, history: Sequence[int], p: SamplingParams,
                    n: int) -> list[tuple[int, float]]:
    """A greedy draft's ``n`` best guesses, best first, each with its probability (temperature
    1): its top token (what ``greedy_pick`` drafts, with the same confidence), then the next.
    One top-k pass and the confidence's band; the logits are never copied without penalties."""
    x = apply_penalties(logits, history, p)
    ids = _top_k_ids(x, n)
    vals = x[ids]
    order = np.argsort(-vals, kind="stable")
    ids, vals = ids[order], vals[order]
    top = int(np.argmax(x))  # the argmax itself: ties resolved as greedy_pick resolves them
    if int(ids[0]) != top:
        ids = np.concatenate(([top], ids[ids != top]))[:n]
        vals = x[ids]
    p_top = confidence(x, float(x[top]))
    rel = np.exp(vals.astype(np.float64) - float(x[top]))
    return [(int(t), float(p_top * r)) for t, r in zip(ids.tolist(), rel.tolist(), strict=True)]


def coupled_children(c: Candidates, temperature: float, seed: int, position: int,
                     n: int) -> list[tuple[int, float]]:
    """A coupled draft's ``n`` best guesses at the target's Gumbel-max choice at ``position``,
    best first by the same noisy score (the first is ``coupled_choice``'s token), each with
    its probability under ``c``."""
    first = coupled_choice(c, temperature, seed, position).token
    if n <= 1 or c.ids.size <= 1:
        return [(first, c.prob_of(first))]
    scores = c.logits / temperature + gumbel_noise(seed, position, c.ids)
    order = np.argsort(-scores, kind="stable")[:n + 1]
    out = [(first, c.prob_of(first))]
    for i in order.tolist():
        tok = int(c.ids[i])
        if tok != first and len(out) < n:
            out.append((tok, float(c.probs[i])))
    return out
