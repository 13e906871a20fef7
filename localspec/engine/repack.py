"""Whether to load a model with llama.cpp's extra buffer types, decided by measuring them here.

llama.cpp's "extra buffer types" (``use_extra_bufts``; ``--no-repack`` turns them off) move
weights at load into layouts for its fastest CPU kernels: the AVX2/AVX-512/NEON repack of
quantized weights and, on CPUs with AMX, the AMX kernels (which take F16 weights too). What they
do depends on the CPU:

* on AVX2/AVX-512 they verify quantized batches much faster (measured here: Q4_K_M 2-3x);
* on an AMX machine with llama-cpp-python 0.3.36 every quantized model dies with SIGSEGV on its
  first batched decode; and an F16 model gets a second, AMX copy of its weights: 7 s more load
  and 2.5 GB more memory for a 1.5B pair, with *slower* verification.

So a self-test (a child process, ``repack_selftest.py``: it may crash) loads tiny models per
weight kind (F16 for unquantized, Q4_K_M for quantized, plus crash tests of Q4_0, Q8_0 and
Q4_K_M) with extra buffer types off and on, and measures load time, memory growth and one
batched verification. :func:`decide_kind` turns those measurements into the setting per kind
(a pure function, so tests inject measurements). The verdict is cached per llama.cpp build and
CPU in a versioned file, so only the first run pays (a second or two, in the background).
``--repack on|off`` (or ``repack`` in config.toml) overrides it.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from .. import paths
from ..files import atomic_write
from ..formatting import human_bytes
from ..signals import signal_name

log = logging.getLogger(__name__)

RepackMode = Literal["auto", "on", "off"]
WeightKind = Literal["quantized", "unquantized"]
WEIGHT_KINDS: tuple[WeightKind, ...] = ("quantized", "unquantized")
KIND_LABELS = {"quantized": "quantized weights", "unquantized": "F16/BF16/F32 weights"}
# Weight types that are not quantized (the self-test's ``start`` lines name types).
_UNQUANTIZED_TYPES = {"F16", "BF16", "F32"}
# Bump when the self-test changes what it exercises or the cache's shape: older cached verdicts
# are then measured again. 2: measurements per weight kind.
SELFTEST_VERSION = 2
SELFTEST_TIMEOUT = 180.0
# The signals a child dies of when its own code crashes (a bad access, an illegal instruction,
# GGML_ABORT, a trap): a verdict on the kernels it was running. Any other signal came from
# outside (the OOM killer, a shutdown, Ctrl-C, a kill) and says nothing about them.
_CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGILL, signal.SIGBUS, signal.SIGFPE,
                            signal.SIGABRT, signal.SIGTRAP})

# -- the rule -------------------------------------------------------------------------------------
# On wins outright when it verifies this much faster: verification is most of a run's time, so
# a clear gain there pays for a slower load (repacking quantized weights costs some).
CLEAR_GAIN = 1.25
# Below that, on must cost nothing: a load or a verification this much slower (and at least
# _SLOWER_LOAD_S more, against timer noise), or this much more memory than off, turns it off.
SLOWER = 1.25
_SLOWER_LOAD_S = 0.005
MORE_MEMORY = 0.10  # of the weights' size; and at least _MORE_MEMORY_MIN, against RSS noise
_MORE_MEMORY_MIN = 1 << 20


@dataclass(frozen=True, slots=True)
class Measurement:
    """One tiny model loaded with extra buffer types on or off (best of the child's rounds)."""

    load_s: float  # load and a first batch decoded: the wait before a first token
    verify_s: float  # one batched verification of 16 positions, warm
    rss_bytes: int  # resident memory the load and the decodes added (peak where known)


@dataclass(frozen=True, slots=True)
class KindTrial:
    """What the self-test found for one weight kind. ``crashed`` is set when the child died
    with this kind's extra buffer types on (the signal and what it was doing)."""

    model: str = ""  # the weight type measured (F16, Q4_K_M)
    weights_bytes: int = 0
    off: Measurement | None = None
    on: Measurement | None = None
    crashed: str | None = None


@dataclass(frozen=True, slots=True)
class KindVerdict:
    use_extra_bufts: bool
    reason: str


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (1.0 if a <= 0 else float("inf"))


def decide_kind(trial: KindTrial | None, crash: str | None = None) -> KindVerdict:
    """Extra buffer types on or off for one weight kind, from what they did here.

    Off when on crashes; on when it verifies clearly faster (``CLEAR_GAIN``); otherwise off when
    on costs load time, verification time or memory, and on (llama.cpp's default) when the two
    measure the same. ``crash`` is the self-test's crash, if any: a kind it never reached is off.
    """
    if trial is not None and trial.crashed:
        return KindVerdict(False, f"on crashes here ({trial.crashed})")
    if trial is None or trial.on is None or trial.off is None:
        if crash:
            return KindVerdict(False, f"not measured: the self-test died first ({crash})")
        return KindVerdict(True, "not measured; llama.cpp's default")
    on, off = trial.on, trial.off
    gain = _ratio(off.verify_s, on.verify_s)
    extra = on.rss_bytes - off.rss_bytes
    weights = max(trial.weights_bytes, 1)
    memory = (f"{'+' if extra >= 0 else '-'}{human_bytes(abs(extra))} memory "
              f"({abs(extra) / weights:.1f}x the weights)")
    if gain >= CLEAR_GAIN:
        return KindVerdict(True, f"on verifies {gain:.1f}x faster ({memory}, "
                                 f"{_ratio(on.load_s, off.load_s):.1f}x the load time)")
    costs = []
    if extra > max(MORE_MEMORY * weights, _MORE_MEMORY_MIN):
        costs.append(memory)
    load = _ratio(on.load_s, off.load_s)
    if load >= SLOWER and on.load_s - off.load_s >= _SLOWER_LOAD_S:
        costs.append(f"{load:.1f}x the load time")
    if gain <= 1 / SLOWER:
        costs.append(f"{1 / gain:.1f}x the verification time")
    if costs:
        return KindVerdict(False, f"on costs {', '.join(costs)} with {trial.model}")
    return KindVerdict(True, f"on and off measure the same with {trial.model}; "
                             "llama.cpp's default")


@dataclass(frozen=True, slots=True)
class SelfTestResult:
    """What the child process found. ``definitive`` results are cached; others are retried.

    ``repack_works``: nothing crashed with extra buffer types on (``detail`` says what did).
    ``trials``: the measurements per weight kind (see :func:`decide_kind`)."""

    repack_works: bool
    detail: str
    seconds: float
    definitive: bool
    trials: Mapping[str, KindTrial] = field(default_factory=dict)

    def verdict(self, kind: WeightKind) -> KindVerdict:
        return decide_kind(self.trials.get(kind), None if self.repack_works else self.detail)


@dataclass(frozen=True, slots=True)
class RepackDecision:
    """Whether to load with llama.cpp's extra buffer types, and why (shown by doctor, -v)."""

    use_extra_bufts: bool
    source: Literal["forced", "self-test", "cached self-test", "pending self-test"]
    reason: str
    kind: WeightKind | None = None

    def describe(self) -> str:
        state = "on" if self.use_extra_bufts else "off"
        what = f" for {KIND_LABELS[self.kind]}" if self.kind else ""
        return f"llama.cpp's extra buffer types (repacked CPU kernels) {state}{what} " \
               f"({self.source}: {self.reason})"


def weight_kind(quantized: bool) -> WeightKind:
    return "quantized" if quantized else "unquantized"


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
    """A digest of llama-cpp-python's version and library files, and the CPU's features (the
    self-test's own version is in its cache file, so a new self-test leaves other caches keyed
    by this build, such as calibrations, valid)."""
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    h = hashlib.sha256(f"{version}|{cpu_description()}".encode())
    for f in _library_files():
        st = f.stat()
        h.update(f"|{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def cache_file() -> Path:
    return paths.cache_dir() / "repack-selftest.json"


def _measurement(data: Any) -> Measurement | None:
    if data is None:
        return None
    return Measurement(load_s=float(data["load_s"]), verify_s=float(data["verify_s"]),
                       rss_bytes=int(data["rss_bytes"]))


def _trial(data: Any) -> KindTrial:
    crashed = data.get("crashed")
    return KindTrial(model=str(data.get("model", "")),
                     weights_bytes=int(data.get("weights_bytes", 0)),
                     off=_measurement(data.get("off")), on=_measurement(data.get("on")),
                     crashed=None if crashed is None else str(crashed))


def _cached_version(path: Path) -> int | None:
    try:
        version = json.loads(path.read_text(encoding="utf-8")).get("version")
    except (OSError, ValueError, AttributeError):
        return None
    return version if isinstance(version, int) else None


def is_crash_signal(signum: int) -> bool:
    """Whether a child dead of ``signum`` crashed by itself (see ``_CRASH_SIGNALS``)."""
    return signum in _CRASH_SIGNALS


def _killed_from_outside(detail: str) -> bool:
    """Whether a crash ``detail`` (``SIGTERM while ...``) names a signal sent from outside:
    earlier versions cached those as crashes."""
    try:
        return not is_crash_signal(signal.Signals[detail.split(" ", 1)[0]])
    except KeyError:
        return False


def read_cached(path: Path, key: str) -> SelfTestResult | None:
    """The cached verdict for ``key``; a stale, foreign, older-version or corrupt file is
    ignored (the self-test then measures again), and so is a self-test that was killed from
    outside but cached as a crash."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("version") != SELFTEST_VERSION or data.get("key") != key:
            return None
        trials = {kind: _trial(t) for kind, t in data["trials"].items() if kind in WEIGHT_KINDS}
        result = SelfTestResult(repack_works=bool(data["repack_works"]),
                                detail=str(data["detail"]), seconds=float(data["seconds"]),
                                definitive=True, trials=trials)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not result.repack_works and _killed_from_outside(result.detail):
        log.debug("ignoring the cached repack self-test in %s: it was killed from outside "
                  "(%s), not a crash", path, result.detail)
        return None
    return result


def write_cached(path: Path, key: str, result: SelfTestResult) -> None:
    """Cache a verdict. A file written by a newer localspec is left alone (it may be shared
    with that version, which could not read ours back)."""
    found = _cached_version(path)
    if found is not None and found > SELFTEST_VERSION:
        log.info("not caching the repack self-test: %s is from a newer localspec (version %d)",
                 path, found)
        return
    data = {"version": SELFTEST_VERSION, "key": key, **asdict(result),
            "trials": {kind: asdict(t) for kind, t in result.trials.items()}}
    try:
        atomic_write(path, json.dumps(data, indent=1))
    except OSError as exc:  # an unwritable cache costs a self-test per run, nothing worse
        log.info("could not cache the repack self-test in %s: %s", path, exc)


# -- the self-test -------------------------------------------------------------------------------
def selftest_command(models_dir: Path) -> list[str]:
    return [sys.executable, "-m", "localspec.engine.repack_selftest", str(models_dir)]


def _kind_of(weight_type: str) -> WeightKind:
    return "unquantized" if weight_type.upper() in _UNQUANTIZED_TYPES else "quantized"


def parse_selftest_output(stdout: str) -> tuple[dict[str, KindTrial], str | None]:
    """The child's measurements per kind, and the last thing it started (``Q4_K_M on``)."""
    trials: dict[str, KindTrial] = {}
    started: str | None = None
    for line in stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word == "start":
            started = rest
        elif word == "measure":
            kind, setting, payload = (rest.split(" ", 2) + ["", ""])[:3]
            try:
                data = json.loads(payload)
                found = _measurement(data)
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            if kind not in WEIGHT_KINDS or setting not in ("on", "off"):
                continue
            trial = trials.get(kind) or KindTrial(str(data.get("model", "")),
                                                  int(data.get("weights_bytes", 0)))
            trials[kind] = (replace(trial, on=found) if setting == "on"
                            else replace(trial, off=found))
    return trials, started


def _doing(started: str | None) -> str:
    if not started:
        return ""
    weight_type, _, setting = started.partition(" ")
    return f" while decoding with a {weight_type} model" + (
        f" (extra buffer types {setting})" if setting else "")


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
    trials, started = parse_selftest_output(proc.stdout)
    doing = _doing(started)
    if proc.returncode < 0 and not is_crash_signal(-proc.returncode):
        # Killed from outside: nothing learned about the kernels, so measured again next time.
        return SelfTestResult(False, f"the self-test was stopped by "
                              f"{signal_name(-proc.returncode)}{doing}, not a crash", seconds,
                              definitive=False, trials=trials)
    if proc.returncode < 0:
        detail = f"{signal_name(-proc.returncode)}{doing}"
        if started:  # the kind it was loading when it died crashes with extra buffer types on
            kind = _kind_of(started.split(" ", 1)[0])
            trials[kind] = replace(trials.get(kind) or KindTrial(), crashed=detail)
        return SelfTestResult(False, detail, seconds, definitive=True, trials=trials)
    if proc.returncode == 0 and "done" in proc.stdout.splitlines():
        tested = [ln.split(" ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith("ok ")]
        measured = [t.model for t in trials.values() if t.on and t.off]
        detail = ", ".join(tested) + " batches decoded" if tested else "no crash"
        if measured:
            detail += f"; {' and '.join(measured)} measured"
        return SelfTestResult(True, detail, seconds, definitive=True, trials=trials)
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return SelfTestResult(False, f"the self-test failed (exit {proc.returncode}{doing}: {last})",
                          seconds, definitive=False, trials=trials)


def _decision(result: SelfTestResult, kind: WeightKind,
              source: Literal["self-test", "cached self-test"]) -> RepackDecision:
    verdict = result.verdict(kind)
    return RepackDecision(verdict.use_extra_bufts, source, verdict.reason, kind)


def decide_auto(cache: Path, run: Callable[[], SelfTestResult] = run_selftest,
                quantized: bool = True) -> RepackDecision:
    """The ``auto`` decision, answered now: the cached verdict for this build and CPU, or a fresh
    self-test (``doctor``, and the first load when ``wait`` is asked for)."""
    key = build_key()
    kind = weight_kind(quantized)
    cached = read_cached(cache, key)
    if cached is not None:
        _announce_once(cache, key, cached)
        return _decision(cached, kind, "cached self-test")
    result = run()
    if result.definitive:
        write_cached(cache, key, result)
        _announce_once(cache, key, result)
    return _decision(result, kind, "self-test")


def _announce_once(cache: Path, key: str, result: SelfTestResult) -> None:
    """Say once per machine and build that extra buffer types crash here (later runs: doctor,
    -v, logs). Off because they cost more than they give is no news worth a warning."""
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
    first run never waits for it (that run loads with extra buffer types off, always safe)."""
    cmd = [sys.executable, "-m", "localspec.engine.repack", "--write-cache", str(cache),
           str(cache.parent / "selftest-models")]
    try:
        subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        log.info("could not start the repack self-test: %s", exc)


def settle_before_measuring() -> None:
    """Have this machine's verdict before timing anything: run the self-test now where none is
    cached. A background self-test shares the cores with what is being measured (on 2 cores it
    made the demo's first calibration 100x off), so ``demo`` and ``bench`` wait for it instead."""
    cache = cache_file()
    if read_cached(cache, build_key()) is None:
        log.warning("measuring llama.cpp's extra buffer types on this machine first (once per "
                    "build and CPU, a few seconds)")
        decide_auto(cache)


_decided: dict[tuple[str, WeightKind], RepackDecision] = {}
_started: set[str] = set()


def repack_decision(mode: RepackMode = "auto", quantized: bool = True) -> RepackDecision:
    """Whether to load a model with extra buffer types: forced by ``mode``, else this machine's
    verdict for the model's weight kind (``quantized``: any quantized tensor).

    In ``auto`` mode without a verdict for this build and CPU yet, the answer is "off for now"
    (always safe, and on an AMX machine the faster for F16) and a background self-test decides
    for the next runs."""
    kind = weight_kind(quantized)
    if mode == "on":
        return RepackDecision(True, "forced", "--repack on", kind)
    if mode == "off":
        return RepackDecision(False, "forced", "--repack off", kind)
    key = build_key()
    if (key, kind) in _decided:
        return _decided[(key, kind)]
    cache = cache_file()
    cached = read_cached(cache, key)
    if cached is None:
        if key not in _started:
            _started.add(key)
            start_background_selftest(cache)
        return RepackDecision(False, "pending self-test", "first run with this llama.cpp "
                              "build on this CPU: off until a background self-test has "
                              "measured them", kind)
    _announce_once(cache, key, cached)
    _decided[(key, kind)] = _decision(cached, kind, "cached self-test")
    return _decided[(key, kind)]


def _main(argv: list[str]) -> None:
    """``python -m localspec.engine.repack --write-cache FILE MODELS_DIR``: run the self-test
    in a child and cache the verdict (the background self-test)."""
    if len(argv) != 3 or argv[0] != "--write-cache":
        raise SystemExit("usage: python -m localspec.engine.repack --write-cache FILE MODELS_DIR")
    logging.basicConfig(level=logging.ERROR)
    cache = Path(argv[1])
    key = build_key()
    result = run_selftest(selftest_command(Path(argv[2])))
    if result.definitive:
        write_cached(cache, key, result)


if __name__ == "__main__":
    _main(sys.argv[1:])
