"""The repack self-test's child process: ``python -m localspec.engine.repack_selftest MODELS_DIR``.

It may die (that is what it is for), so it only prints what it does, one line at a time, and
``repack.run_selftest`` reads the lines back:

* ``start WHAT`` before each load or decode that could crash (``WHAT`` is the weight type, then
  ``on``/``off`` for a measurement), ``ok WHAT`` after a crash test;
* ``measure KIND on|off {json}``: one weight kind loaded with llama.cpp's extra buffer types on or
  off, best of a few rounds (see :class:`repack.Measurement`);
* ``done`` at the end.

The order puts each kind's measurements before anything that could kill the process for the
other kind: the unquantized (F16) model first, then the quantized crash tests, then the quantized
measurements.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..models.tiny import TinyModelSpec
    from .llama_backend import ModelSettings

# Tiny models with every crash-prone kernel path (built once with llama.cpp's own quantizer).
SELFTEST_QUANTS = ("Q4_0", "Q8_0", "Q4_K_M")
ROUNDS = 3  # loads: off, on, off, on, ...: the best time of each, against a busy machine
VERIFY_REPEATS = 3  # verifications per load
BATCH = 16  # positions in one verification (K = 15), and in the first "prompt"


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _return_freed_memory() -> None:
    """Make glibc hand large freed blocks back to the kernel every time. By default it raises
    its mmap threshold to the largest block freed so far, so a model's buffers would be served
    again from memory the process already holds, and every round after the first would show
    no growth at all. (Elsewhere the rounds' largest growth still counts.)"""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None:
            libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: fixed, glibc's initial value
    except (OSError, AttributeError):
        pass


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark for this process (Linux: ``clear_refs`` 5), so that the
    peak of one load can be read on its own; False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5", encoding="ascii")
        return True
    except OSError:
        return False


def _peak_rss() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def measure_spec() -> TinyModelSpec:
    """The measured model's shape, in F16 (unquantized: the type llama.cpp's AMX buffer type
    takes over) and Q4_K_M (what Ollama ships). Big enough that a second copy of the weights
    (25 MB in F16) stands out of the allocator's noise, small enough to build in seconds and
    load in milliseconds; row widths are multiples of 256 for Q4_K."""
    # Deferred, like every models/ import in the engine: only this child builds models.
    from ..models.tiny import TinyModelSpec

    return TinyModelSpec(seed=5, n_embd=512, n_head=8, n_head_kv=4, n_ff=1536, n_layer=4,
                         name="repack-measure")


def _settings() -> ModelSettings:
    from .llama_backend import ModelSettings

    return ModelSettings(n_ctx=128, n_batch=32)


def _prompt() -> list[int]:
    return list(range(3, 3 + BATCH))


def measure_once(path: Path, extra_bufts: bool) -> tuple[float, float, int]:
    """Load ``path`` and decode a first batch (the wait before a first token), then time one
    batched verification: the two times, and how much resident memory it all took.

    One model at a time: llama.cpp's worker threads keep spinning a while after each decode,
    so a second loaded model would be timed against the first one's threads."""
    import numpy as np

    from .llama_backend import LlamaRunner

    before = _rss()
    peak_known = _reset_peak_rss()
    t0 = time.perf_counter()
    with LlamaRunner(path, _settings(), extra_bufts=extra_bufts) as r:
        logits = r.decode(_prompt(), n_logits=BATCH)
        load_s = time.perf_counter() - t0
        if not np.isfinite(logits).all():
            raise SystemExit(f"{path.name}: non-finite logits (extra buffer types "
                             f"{'on' if extra_bufts else 'off'})")
        verify_s = r.time_decode(BATCH, repeats=VERIFY_REPEATS)
        now = _rss()
        peak = _peak_rss() if peak_known else None
    return load_s, verify_s, max(now, peak or 0) - before


def measure_kind(kind: str, quant: str, models_dir: Path) -> None:
    """Both settings, alternating, ``ROUNDS`` times, after a load that is not counted (the
    first load in a process pays for thread pools and heap growth). Times are the best round
    (noise only ever adds time), memory the largest (memory held from an earlier round only
    ever hides growth)."""
    from ..models.tiny import quantized_model

    path = quantized_model(models_dir, quant, measure_spec())
    print(f"start {quant} off", flush=True)
    measure_once(path, False)
    runs: dict[str, list[tuple[float, float, int]]] = {"off": [], "on": []}
    for _ in range(ROUNDS):
        for setting in ("off", "on"):
            print(f"start {quant} {setting}", flush=True)
            runs[setting].append(measure_once(path, setting == "on"))
    for setting, found in runs.items():
        best = {"load_s": min(r[0] for r in found), "verify_s": min(r[1] for r in found),
                "rss_bytes": max(r[2] for r in found),
                "weights_bytes": path.stat().st_size, "model": quant}
        print(f"measure {kind} {setting} {json.dumps(best)}", flush=True)


def crash_tests(models_dir: Path) -> None:
    """Each tiny quantized model with repacking on: a batch, then one token."""
    import numpy as np

    from ..models.tiny import quantized_model
    from .llama_backend import LlamaRunner

    for quant in SELFTEST_QUANTS:
        path = quantized_model(models_dir, quant)
        print(f"start {quant}", flush=True)
        with LlamaRunner(path, _settings(), extra_bufts=True) as r:
            batch = r.decode(_prompt(), n_logits=BATCH)
            one = r.decode([5], n_logits=1)
            if not (np.isfinite(batch).all() and np.isfinite(one).all()):
                raise SystemExit(f"{quant}: non-finite logits with repacking on")
        print(f"ok {quant}", flush=True)


def selftest(models_dir: Path) -> None:
    _return_freed_memory()
    measure_kind("unquantized", "F16", models_dir)
    crash_tests(models_dir)
    measure_kind("quantized", "Q4_K_M", models_dir)
    print("done", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    selftest(Path(sys.argv[1]))
