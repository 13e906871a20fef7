"""Whether llama.cpp's repacked CPU kernels work on this machine, found out without dying.

llama.cpp repacks quantized weights at load into layouts for its fastest CPU kernels (its "extra
buffer types": the AVX2/AVX-512 repack and, on CPUs with AMX, the AMX kernels). They speed up
prompt processing, but on some CPUs they crash: on an AMX machine with llama-cpp-python 0.3.36,
every quantized model dies with SIGSEGV on its first batched decode (llama.cpp's own tools die
with SIGILL), while single-token decoding and unquantized models work. ``--no-repack``
(``use_extra_bufts = False``) avoids the crash with unchanged output.

So before the first quantized model is loaded with repacking, a child process loads tiny quantized
models (Q4_0, Q8_0, Q4_K_M, built once with llama.cpp's own quantizer) with repacking on and
decodes a batch and a single token with each. If the child dies, repacking stays off on this
machine. The verdict is cached per llama.cpp build and CPU, so only the first run pays for it.
``--repack on|off`` (or ``repack`` in config.toml) overrides the verdict.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from .. import paths
from ..files import atomic_write

log = logging.getLogger(__name__)

RepackMode = Literal["auto", "on", "off"]
SELFTEST_QUANTS = ("Q4_0", "Q8_0", "Q4_K_M")
# Bump when the self-test changes what it exercises: older cached verdicts are then ignored.
SELFTEST_VERSION = 1
SELFTEST_TIMEOUT = 180.0


@dataclass(frozen=True, slots=True)
class SelfTestResult:
    """What the child process found. ``definitive`` results are cached; others are retried."""

    repack_works: bool
    detail: str
    seconds: float
    definitive: bool


@dataclass(frozen=True, slots=True)
class RepackDecision:
    """Whether to load with llama.cpp's extra buffer types, and why (shown by doctor, -v)."""

    use_extra_bufts: bool
    source: Literal["forced", "self-test", "cached self-test", "pending self-test", "not needed"]
    reason: str

    def describe(self) -> str:
        state = "on" if self.use_extra_bufts else "off"
        return f"repacked CPU kernels {state} ({self.source}: {self.reason})"


# -- identity of this llama.cpp build on this CPU ------------------------------------------------
def _library_files() -> list[Path]:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return []
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    return sorted(p for p in lib.glob("*") if p.is_file()) if lib.is_dir() else []


def cpu_description() -> str:
    """The CPU's model name and feature flags (what decides llama.cpp's kernel paths)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags", "Features", "CPU part") and key not in fields:
            fields[key] = value.strip()
    return " | ".join(f"{k}: {v}" for k, v in sorted(fields.items())) or platform.machine()


def build_key() -> str:
    """A digest of llama-cpp-python's version and library files, and the CPU's features."""
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    h = hashlib.sha256(f"v{SELFTEST_VERSION}|{version}|{cpu_description()}".encode())
    for f in _library_files():
        st = f.stat()
        h.update(f"|{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def cache_file() -> Path:
    return paths.cache_dir() / "repack-selftest.json"


def read_cached(path: Path, key: str) -> SelfTestResult | None:
    """The cached verdict for ``key``; a stale, foreign or corrupt file is ignored."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("key") != key:
            return None
        return SelfTestResult(repack_works=bool(data["repack_works"]), detail=str(data["detail"]),
                              seconds=float(data["seconds"]), definitive=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_cached(path: Path, key: str, result: SelfTestResult) -> None:
    try:
        atomic_write(path, json.dumps({"key": key, **asdict(result)}, indent=1))
    except OSError as exc:  # an unwritable cache costs a self-test per run, nothing worse
        log.info("could not cache the repack self-test in %s: %s", path, exc)


# -- the self-test -------------------------------------------------------------------------------
def selftest_command(models_dir: Path) -> list[str]:
    return [sys.executable, "-m", "localspec.engine.repack", str(models_dir)]


def run_selftest(command: Sequence[str] | None = None,
                 timeout: float = SELFTEST_TIMEOUT) -> SelfTestResult:
    """Run the self-test child and classify how it ended."""
    cmd = list(command or selftest_command(paths.cache_dir() / "selftest-models"))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return SelfTestResult(False, f"the self-test did not finish in {timeout:.0f} s",
                              time.perf_counter() - t0, definitive=False)
    except OSError as exc:
        return SelfTestResult(False, f"the self-test could not start ({exc})",
                              time.perf_counter() - t0, definitive=False)
    seconds = time.perf_counter() - t0
    started = [ln.split(" ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith("start ")]
    doing = f" while decoding with a {started[-1]} model" if started else ""
    if proc.returncode < 0:
        return SelfTestResult(False, f"{_signal_name(-proc.returncode)}{doing}", seconds,
                              definitive=True)
    if proc.returncode == 0 and "done" in proc.stdout.splitlines():
        return SelfTestResult(True, f"{', '.join(SELFTEST_QUANTS)} batches decoded", seconds,
                              definitive=True)
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return SelfTestResult(False, f"the self-test failed (exit {proc.returncode}{doing}: {last})",
                          seconds, definitive=False)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def decide_auto(cache: Path,
                run: Callable[[], SelfTestResult] = run_selftest) -> RepackDecision:
    """The ``auto`` decision, answered now: the cached verdict for this build and CPU, or a fresh
    self-test (``doctor``, and the first load when ``wait`` is asked for)."""
    key = build_key()
    cached = read_cached(cache, key)
    if cached is not None:
        _announce_once(cache, key, cached)
        return RepackDecision(cached.repack_works, "cached self-test", cached.detail)
    result = run()
    if result.definitive:
        write_cached(cache, key, result)
        _announce_once(cache, key, result)
    return RepackDecision(result.repack_works, "self-test", result.detail)


def _announce_once(cache: Path, key: str, result: SelfTestResult) -> None:
    """Say once per machine and build that repacking is off (later runs: doctor, -v, logs)."""
    if result.repack_works:
        return
    marker = cache.with_name(cache.name + ".announced")
    try:
        if marker.read_text(encoding="utf-8") == key:
            log.info("repacked CPU kernels off on this machine (%s)", result.detail)
            return
    except OSError:
        pass
    log.warning("llama.cpp's repacked CPU kernels crash on this machine (%s); localspec loads "
                "quantized models with repacking off (`localspec doctor` explains; --repack on "
                "forces it)", result.detail)
    try:
        atomic_write(marker, key)
    except OSError:
        pass


def start_background_selftest(cache: Path) -> None:
    """Run the self-test in a detached child that writes the verdict to ``cache`` itself, so a
    first run never waits for it (that run loads with repacking off, which is always safe)."""
    cmd = [sys.executable, "-m", "localspec.engine.repack", "--write-cache", str(cache),
           str(cache.parent / "selftest-models")]
    try:
        subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        log.info("could not start the repack self-test: %s", exc)


_decided: dict[str, RepackDecision] = {}
_started: set[str] = set()


def repack_decision(mode: RepackMode = "auto", quantized: bool = True) -> RepackDecision:
    """Whether to load a model with repacking. ``quantized=False`` (F32/F16/BF16 weights, which
    llama.cpp does not repack) needs no self-test.

    In ``auto`` mode without a verdict for this build and CPU yet, the answer is "off for now"
    (always safe) and a background self-test decides for the next runs."""
    if mode == "on":
        return RepackDecision(True, "forced", "--repack on")
    if mode == "off":
        return RepackDecision(False, "forced", "--repack off")
    if not quantized:
        return RepackDecision(True, "not needed", "no quantized weights")
    key = build_key()
    if key in _decided:
        return _decided[key]
    cache = cache_file()
    cached = read_cached(cache, key)
    if cached is None:
        if key not in _started:
            _started.add(key)
            start_background_selftest(cache)
        return RepackDecision(False, "pending self-test", "first run with this llama.cpp "
                              "build on this CPU: off until a background self-test has checked")
    _announce_once(cache, key, cached)
    _decided[key] = RepackDecision(cached.repack_works, "cached self-test", cached.detail)
    return _decided[key]


# -- the child's side ------------------------------------------------------------------------------
def _selftest_child(models_dir: Path) -> None:
    """Load each tiny quantized model with repacking on; decode a batch, then one token."""
    import numpy as np

    from ..models.tiny import quantized_model
    from .llama_backend import LlamaRunner, ModelSettings

    for quant in SELFTEST_QUANTS:
        path = quantized_model(models_dir, quant)
        print(f"start {quant}", flush=True)
        with LlamaRunner(path, ModelSettings(n_ctx=128, n_batch=32), extra_bufts=True) as r:
            batch = r.decode(list(range(3, 19)), n_logits=16)
            one = r.decode([5], n_logits=1)
            if not (np.isfinite(batch).all() and np.isfinite(one).all()):
                raise SystemExit(f"{quant}: non-finite logits with repacking on")
        print(f"ok {quant}", flush=True)
    print("done", flush=True)


def _main(argv: list[str]) -> None:
    """``python -m localspec.engine.repack MODELS_DIR``: the self-test itself (it may crash).
    ``--write-cache FILE MODELS_DIR``: run it in a child and cache the verdict (background)."""
    logging.basicConfig(level=logging.ERROR)
    if argv[:1] == ["--write-cache"]:
        cache = Path(argv[1])
        key = build_key()
        result = run_selftest(selftest_command(Path(argv[2])))
        if result.definitive:
            write_cached(cache, key, result)
        return
    _selftest_child(Path(argv[0]))


if __name__ == "__main__":
    _main(sys.argv[1:])
