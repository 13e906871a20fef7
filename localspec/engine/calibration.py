"""What speculation costs on this machine, measured once per pair and settings, then cached.

Two numbers decide whether drafting pays and whether it keeps the target's greedy output:

* the **cost curve**: seconds for the target to decode n tokens in one batch (n = 1 .. K+1) and
  for the draft to decode one token. On a memory-bound target (a GPU, an F16 model on a CPU) a
  batch of 6 costs little more than 1 token; on a compute-bound one (a quantized model on a small
  CPU) it costs nearly 6.
* the **drift**: how far llama.cpp's batched logits stray from one-token logits. llama.cpp
  computes a batch with other kernels than a single token; where the target's top-2 margin is
  within that drift, a batched verification could choose differently from plain decoding.

Both are measured on real text (the target's own continuation of the first request's prompt), at
every width verification uses: measured on 6 arbitrary token ids
at the start of the context, the drift of an F16 target came out 2.5x smaller than on real text at
width 6+ (0.0065 vs 0.0163 logits; ``benchmarks/drift.py``), too small to guard the near-ties
that then differed.

Measuring takes seconds on a CPU (about 10 s for an F16 1.5B target on 2 cores: three passes
at each chain width, one at each tree width), milliseconds on a GPU. It happens after the first
token of the first request that drafts (so it never delays a first token), and the result is
cached per (target file, draft file, llama.cpp build and CPU, loading settings); the engine
keeps refining the cost curve online.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .. import paths
from ..files import atomic_write
from .llama_backend import LlamaRunner

log = logging.getLogger(__name__)

# 5: target passes wider than a chain (WIDE_WIDTHS) are measured too, for token trees.
# 6: each chain width is the median of NARROW_ROUNDS timings.
# 7: wide widths are measured while their tokens get cheaper (WIDE_GAIN), not to 6 passes.
# 8: ... cheaper than in a pass half as wide, not than in the widest chain width.
CALIBRATION_VERSION = 8
# Rounds over the chain widths, each width's median kept. Timed once, a width came out 10-20%
# off on these 2-core machines (a 5-token F16 pass at 1.66 one-token passes in one
# measurement, 1.40 in the next, same machine): enough to flip auto's first decision to plain
# decoding, where it then stayed for a whole request (benchmarks/README.md, 2026-12-02 A/B).
NARROW_ROUNDS = 3
# Token trees' and long copies' widths: a handful up to 256 nodes, each timed once. Measuring
# stops at the first width whose tokens are not at least WIDE_GAIN cheaper each than in a pass
# half as wide (the widest timed at or under half): two such passes then verify as many tokens
# for about as little, and a wide pass of a large model on a CPU takes seconds to time. (It
# stopped at the first width over 6 one-token passes, taken as one no draft could repay; but a
# copy accepted whole yields every token it holds: on Q4_K_M here 16 tokens cost 8.2 passes, 32
# 11.9 and 64 17.9, and the chats that copied their last answer whole stopped at 2.4x for want
# of the wider passes. Then it compared 16 with the widest chain width, 13 on F16 here, which a
# 23% wider pass beats by 10% only by chance: on an AMX machine 25.8 ms a token against 28.4
# stopped it, and the agent trace's copies were cut at 15 tokens.)
WIDE_WIDTHS = (16, 32, 64, 128, 256)
WIDE_GAIN = 0.1


@dataclass(frozen=True, slots=True)
class Calibration:
    """Measured costs (seconds per target decode of n tokens, per draft token) and drift.
    ``target_points`` also holds the widths measured for token trees (see WIDE_WIDTHS)."""

    target_points: dict[int, float]
    draft_token: float
    drift: float
    seconds: float = 0.0  # what measuring took

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_points"] = {str(k): v for k, v in self.target_points.items()}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Calibration:
        """Back from ``to_json``; anything but numbers where numbers belong is a ValueError."""
        return cls(target_points={int(k): _number(v) for k, v in d["target_points"].items()},
                   draft_token=_number(d["draft_token"]), drift=_number(d["drift"]),
                   seconds=_number(d.get("seconds", 0.0)))

    def problem(self) -> str | None:
        """What makes these figures unfit to decide with (None: nothing). The engine and the
        demo read the one-token cost, divide by costs, and weigh drafting by the draft token's
        cost and the drift: a missing, zero, negative or non-finite figure breaks them or
        skews auto's every decision."""
        points = self.target_points
        if 1 not in points:
            return "no one-token target cost"
        if any(n < 1 for n in points):
            return f"a target width below 1 ({min(points)})"
        if not all(math.isfinite(t) and t > 0 for t in points.values()):
            return "a target cost that is not a positive number of seconds"
        for name, value in (("draft token", self.draft_token), ("drift", self.drift),
                            ("measuring time", self.seconds)):
            if not (math.isfinite(value) and value >= 0):
                return f"a {name} of {value}"
        return None


def _number(value: Any) -> float:
    """A JSON number as a float: text, true/false or null in its place are damage."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"not a number: {value!r}")
    return float(value)


def measure(target: LlamaRunner, draft: LlamaRunner | None, k_max: int,
            start: int) -> Calibration:
    """Time the target's decodes and the draft's step, and measure the drift, on real text.

    Runs on top of whatever the target's KV cache holds (the engine calls it right after a
    request's prefill, so the depth is a real prompt's) and restores it afterwards. The text is
    the target's own greedy continuation from ``start`` (the token it just chose): what
    verification will see, with no tokenizer involved (tokenizing arbitrary text aborts llama.cpp
    on vocabularies without byte fallback)."""
    t_start = time.perf_counter()
    base = len(target.tokens)
    room = target.n_ctx - base - 1
    # Every width verification can use is timed: the curve is a staircase, not a line (F16 on
    # a CPU here: 1-4 tokens 135-170 ms, 5-8 tokens 245-305 ms, 9+ 450-510 ms), and auto never
    # learns online what a width it does not use would cost. Interpolating from widths 2 and 5
    # priced 4 tokens at 250 ms instead of 170, and auto settled on drafting 2.
    widths = tuple(range(2, min(k_max + 1, target.n_batch, room) + 1))
    if not widths:
        # No room to measure: assume verifying costs as much as decoding one by one, so auto
        # does not draft until a later load measures it.
        return Calibration({1: 1.0, 2: 2.0}, 1.0, 0.0, 0.0)
    # Path differences can also depend on the position (seen on a tiny Q4_K model: none before
    # position 33, up to 0.08 logits after), which the engine covers with a floor under the
    # near-tie margin of quantized targets rather than with a costly longer stretch here.
    span = max(widths)
    seq: list[int] = [start]
    singles: list[np.ndarray] = []
    t_single: list[float] = []
    while len(singles) < span:
        t0 = time.perf_counter()
        logits = target.decode([seq[-1]], 1)[0]
        t_single.append(time.perf_counter() - t0)
        singles.append(logits.copy())
        seq.append(int(np.argmax(logits)))
    # The first single decode of a new context allocates graphs: the median ignores it.
    points = {1: float(np.median(t_single[1:] or t_single))}
    drift = 0.0

    # No warm-up per width: once the context has decoded, a new batch shape costs no more the
    # first time than the next (measured on F16, widths 1-13).
    def timed(w: int) -> float:
        nonlocal drift
        target.truncate(base)
        t0 = time.perf_counter()
        batched = target.decode(seq[:w], w)
        seconds = time.perf_counter() - t0
        drift = max(drift, max(float(np.abs(singles[i] - batched[i]).max()) for i in range(w)))
        return seconds

    points.update(median_times(timed, widths, NARROW_ROUNDS))
    target.truncate(base)
    _measure_wide(target, points, seq, min(target.n_batch, room))
    draft_token = 0.0
    if draft is not None:
        keep = len(draft.tokens)
        ts = []
        for tok in seq[:4]:
            t0 = time.perf_counter()
            draft.decode([tok], 1)
            ts.append(time.perf_counter() - t0)
        draft.truncate(keep)
        draft_token = float(np.median(ts[1:]))
    cal = Calibration(points, draft_token, drift, time.perf_counter() - t_start)
    log.info("calibration in %.2fs: target %s; draft %.4fs/token; drift %.4f", cal.seconds,
             {n: round(t, 4) for n, t in sorted(points.items())}, draft_token, drift)
    return cal


def median_times(time_width: Callable[[int], float], widths: Sequence[int],
                 rounds: int) -> dict[int, float]:
    """Each width's median seconds over ``rounds`` rounds of ``time_width``, every width once
    a round: a machine that slows for a moment moves one round of each width, never all of
    one width's."""
    times: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(max(rounds, 1)):
        for w in widths:
            times[w].append(time_width(w))
    return {w: float(np.median(ts)) for w, ts in times.items()}


def cheaper_per_token(points: dict[int, float], width: int) -> bool:
    """Whether a token costs at least WIDE_GAIN less in a pass of ``width`` (timed, in
    ``points``) than in a pass half as wide (the widest timed at or under half): else wider
    passes are not worth timing."""
    before = max(n for n in points if n <= width // 2)
    return points[width] / width <= (1.0 - WIDE_GAIN) * points[before] / before


def _measure_wide(target: LlamaRunner, points: dict[int, float], seq: list[int],
                  limit: int) -> None:
    """Time one pass at each of WIDE_WIDTHS that fits (``limit``), narrowest first, until a
    token costs not WIDE_GAIN less in it than in a pass half as wide. Its tokens are the text's,
    repeated: what a pass costs does not depend on which tokens it holds."""
    base = len(target.tokens)
    for w in WIDE_WIDTHS:
        if w > limit or w in points:
            continue
        t0 = time.perf_counter()
        # Logits for every row, as a tree's verification asks: on a large vocabulary the
        # output layer is a real share of a wide pass.
        target.decode((seq * (w // len(seq) + 1))[:w], w)
        points[w] = time.perf_counter() - t0
        target.truncate(base)
        if not cheaper_per_token(points, w):
            break


# -- the cache -----------------------------------------------------------------------------------
def _settings_key(runner: LlamaRunner) -> str:
    # The RAM kept for saved prompts changes no cost: a new size must not measure again.
    return repr(replace(runner.settings, prompt_cache_mib=0))


def cache_key(target: LlamaRunner, draft: LlamaRunner | None, k_max: int) -> str:
    from ..gguf_meta import file_identity
    from .repack import build_key

    parts = [f"v{CALIBRATION_VERSION}", build_key(), file_identity(target.path),
             _settings_key(target), str(target.repack.use_extra_bufts), str(k_max)]
    if draft is not None:
        parts += [file_identity(draft.path), _settings_key(draft),
                  str(draft.repack.use_extra_bufts)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _path(key: str) -> Path:
    return paths.cache_dir() / "calibration" / f"{key[:40]}.json"


def load_cached(key: str) -> Calibration | None:
    """A cached calibration for exactly this key. A stale, foreign, corrupt or damaged file
    (one that parses but holds figures unfit to decide with) is no cache: the engine then
    measures again and overwrites it."""
    path = _path(key)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("key") != key:
            log.debug("ignoring the calibration cache %s: written for another key", path)
            return None
        cal = Calibration.from_json(data["calibration"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.debug("ignoring the calibration cache %s: unreadable (%r)", path, exc)
        return None
    problem = cal.problem()
    if problem is not None:
        log.debug("ignoring the calibration cache %s: damaged (%s)", path, problem)
        return None
    return cal


def store(key: str, cal: Calibration) -> None:
    try:
        atomic_write(_path(key), json.dumps({"key": key, "calibration": cal.to_json()}))
    except OSError as exc:  # an unwritable cache costs a calibration per load, nothing worse
        log.info("cannot cache the calibration: %s", exc)


