"""What a user needs to know before filing a bug or buying a GPU (``localspec doctor``).

Each check returns a :class:`Check`: a status, a one-line summary, a one-line fix when something
is wrong, and details for ``--json``. Nothing here prints; ``cli/doctor.py`` renders. A check
never raises: a check that breaks is reported as a warning naming its error.

No model is loaded. llama.cpp is probed in a child process, because a broken build (a library that
does not load, or one built for another CPU that dies with SIGILL) is exactly what doctor is run
to find, and it must be reported rather than take doctor down with it. The repack self-test also
runs in a child (``engine/repack.py``), once per llama.cpp build and CPU; later runs read its
cached verdict, so a doctor run is well under a second.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from .formatting import human_bytes
from .signals import signal_name

if TYPE_CHECKING:  # the engine package imports numpy: only when a check needs it
    from .engine.llama_devices import Device
    from .engine.repack import SelfTestResult

log = logging.getLogger(__name__)

Status = Literal["ok", "info", "warn", "fail"]
# "fail" is the only status that blocks `localspec run`; the exit code follows it.
STATUSES: tuple[Status, ...] = ("ok", "info", "warn", "fail")
CHECK_NAMES = ("localspec", "llama-cpp-python", "cpu", "repack", "gpu", "placement", "ollama",
               "config", "paths")
LLAMA_DIST = "llama-cpp-python"
PROBE_TIMEOUT = 60.0  # importing a CUDA build initialises every device: seconds, not minutes


@dataclass(frozen=True, slots=True)
class Check:
    """One finding. ``fix`` is one line, given for every ``warn`` and ``fail``."""

    name: str
    status: Status
    summary: str
    fix: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "summary": self.summary,
                "fix": self.fix, "details": self.details}


def all_ok(checks: list[Check]) -> bool:
    """True when nothing blocks ``localspec run`` (no check failed)."""
    return not any(c.status == "fail" for c in checks)


# -- commands named in fixes ---------------------------------------------------------------------
def pip_command() -> str:
    """This interpreter's pip: ``<venv>/bin/pip`` when there is one, else ``python -m pip``.

    ``sys.executable`` is kept as is, not resolved: in a venv it is a symlink to the system
    Python, and resolving it would name a pip that installs outside the venv.
    """
    exe = Path(sys.executable)
    pip = exe.with_name("pip.exe" if exe.suffix == ".exe" else "pip")
    if pip.is_file():
        return shlex.quote(str(pip))
    return f"{shlex.quote(sys.executable)} -m pip"


def _installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def required_llama_version() -> str | None:
    """The llama-cpp-python version localspec pins (from its installed metadata)."""
    try:
        requires = importlib.metadata.requires("localspec") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for req in requires:
        match = re.fullmatch(r"llama[-_.]cpp[-_.]python\s*==\s*([^\s;,]+)", req.strip(),
                             flags=re.IGNORECASE)
        if match:
            return match.group(1)
    return None


def _llama_spec(version: str | None) -> str:
    return f"{LLAMA_DIST}=={version}" if version else LLAMA_DIST


def cuda_rebuild_command(version: str | None = None) -> str:
    """The command that rebuilds llama-cpp-python with CUDA (the README's Install section has the
    same one). ``--no-cache-dir``: pip would otherwise reinstall its cached CPU-only wheel."""
    version = version or _installed_version(LLAMA_DIST) or required_llama_version()
    return (f'CMAKE_ARGS="-DGGML_CUDA=on" {pip_command()} install --force-reinstall '
            f"--no-cache-dir --no-deps {_llama_spec(version)}")


def reinstall_command(version: str | None, *, deps: bool = True) -> str:
    """Rebuild llama-cpp-python from source for this machine (default CMake flags)."""
    no_deps = "" if deps else " --no-deps"
    return (f"{pip_command()} install --force-reinstall --no-cache-dir{no_deps} "
            f"{_llama_spec(version)}")


# -- 1. localspec and Python ---------------------------------------------------------------------
def check_localspec() -> Check:
    from . import __version__

    py = platform.python_version()
    impl = platform.python_implementation()
    package = Path(__file__).resolve().parent
    details = {"version": __version__, "package": str(package), "python": py,
               "implementation": impl, "executable": sys.executable,
               "venv": sys.prefix != sys.base_prefix, "platform": platform.platform()}
    return Check("localspec", "ok",
                 f"{__version__} from {_show(package)}; {impl} {py} at {_show(sys.executable)}",
                 None, details)


# -- 2. llama-cpp-python -------------------------------------------------------------------------
# Shared libraries llama.cpp ships per backend (libggml-cuda.so, ggml-cuda.dll, ...).
_GPU_LIBRARIES = (("cuda", "CUDA"), ("metal", "Metal"), ("vulkan", "Vulkan"),
                  ("hip", "ROCm (HIP)"), ("sycl", "SYCL"), ("opencl", "OpenCL"),
                  ("musa", "MUSA"), ("cann", "CANN"))

# Run in a child: imports llama_cpp (loads the shared libraries) and asks what they can do.
_PROBE = """\
import dataclasses, json, llama_cpp
info = llama_cpp.llama_print_system_info()
try:
    from localspec.engine.llama_devices import offload_devices
    devices = [dataclasses.asdict(d) for d in offload_devices()]
except Exception:  # another Python without localspec: placement asks NVML
    devices = []
print(json.dumps({
    "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
    "system_info": info.decode("utf-8", "replace") if isinstance(info, bytes) else str(info),
    "devices": devices,
}))
"""


@dataclass(frozen=True, slots=True)
class LlamaBuild:
    """What llama-cpp-python is here: version, whether it imports, what it was built with."""

    version: str | None
    imports: bool
    error: str | None = None  # why it does not import, one line
    gpu_backends: tuple[str, ...] = ()  # from the shared libraries it ships
    gpu_offload: bool | None = None  # llama_supports_gpu_offload(): a GPU device was found
    system_info: str = ""  # llama_print_system_info(): the CPU features it was built for
    lib_dir: str | None = None
    devices: tuple[Device, ...] = ()  # the GPUs it offloads to, with their memory

    @property
    def backend(self) -> str:
        """"CPU" for a CPU-only build, else the GPU backends it was built with."""
        if self.gpu_backends:
            return " + ".join(self.gpu_backends)
        return "GPU (unknown kind)" if self.gpu_offload else "CPU"

    @property
    def cpu_features(self) -> tuple[str, ...]:
        """The features llama.cpp's CPU backend was built to use (``AVX2 = 1`` ...)."""
        return tuple(name for name, value in re.findall(r"(\w+) = (\w+)", self.system_info)
                     if value == "1")


def _library_dir() -> Path | None:
    try:
        spec = importlib.util.find_spec("llama_cpp")  # finds the package without importing it
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    return lib if lib.is_dir() else None


def probe_llama(python: str | None = None, timeout: float = PROBE_TIMEOUT) -> LlamaBuild:
    """Probe llama-cpp-python in a child process (see the module docstring for why)."""
    version = _installed_version(LLAMA_DIST)
    lib = _library_dir()
    names = [p.name.lower() for p in lib.iterdir()] if lib else []
    backends = tuple(label for key, label in _GPU_LIBRARIES
                     if any(n.startswith((f"libggml-{key}", f"ggml-{key}")) for n in names))
    found = LlamaBuild(version, imports=False, gpu_backends=backends,
                       lib_dir=str(lib) if lib else None)
    if version is None and lib is None:
        return replace(found, error="llama-cpp-python is not installed")
    try:
        proc = subprocess.run([python or sys.executable, "-c", _PROBE], capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return replace(found, error=f"importing llama_cpp took over {timeout:.0f} s")
    except OSError as exc:
        return replace(found, error=f"could not start Python ({exc})")
    try:
        data = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        data = None
    if not isinstance(data, dict):
        if proc.returncode < 0:
            return replace(found, error=f"importing llama_cpp kills Python "
                                        f"({signal_name(-proc.returncode)})")
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return replace(found, error=f"import llama_cpp failed: {last}")
    # Answered, so it imports; a crash at exit after that is noted, not held against it.
    late = None if proc.returncode == 0 else f"the probe exited with {proc.returncode}"
    return replace(found, imports=True, error=late, gpu_offload=bool(data.get("gpu_offload")),
                   system_info=str(data.get("system_info", "")).strip(),
                   devices=_probed_devices(data.get("devices")))


def _probed_devices(value: Any) -> tuple[Device, ...]:
    """The probe's device list; what does not read as one (a probe of another version) is
    none, and placement falls back to NVML."""
    from .engine.llama_devices import Device

    try:
        return tuple(Device(str(d["description"]), int(d["free_bytes"]), int(d["total_bytes"]))
                     for d in value or ())
    except (TypeError, KeyError, ValueError):
        return ()


def check_llama(build: LlamaBuild) -> Check:
    required = required_llama_version()
    details = {"version": build.version, "imports": build.imports, "backend": build.backend,
               "gpu_backends": list(build.gpu_backends), "gpu_offload": build.gpu_offload,
               "system_info": build.system_info, "lib_dir": build.lib_dir,
               "required": required, "error": build.error}
    if not build.imports:
        summary = f"{build.version}: {build.error}" if build.version else str(build.error)
        return Check("llama-cpp-python", "fail", summary,
                     reinstall_command(build.version or required), details)
    offload = "yes" if build.gpu_offload else "no"
    built = "CPU only" if build.backend == "CPU" else f"built with {build.backend}"
    summary = f"{build.version}, {built}; GPU offload possible: {offload}"
    if required and build.version and build.version != required:
        # The engine calls llama.cpp's C API through these bindings; they change between versions.
        return Check("llama-cpp-python", "warn",
                     f"{summary}; localspec is built and tested against {required}",
                     reinstall_command(required), details)
    return Check("llama-cpp-python", "ok", summary, None, details)


# -- 3. CPU --------------------------------------------------------------------------------------
# /proc/cpuinfo flags (x86 "flags", Arm "Features") that decide llama.cpp's CPU kernel paths:
# (label, flag, refinements shown in brackets).
_CPU_FEATURES: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    ("AVX", "avx", ()), ("AVX2", "avx2", ()), ("FMA", "fma", ()), ("F16C", "f16c", ()),
    ("AVX-VNNI", "avx_vnni", ()),
    ("AVX-512", "avx512f", (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"))),
    ("AMX", "amx_tile", (("amx_int8", "INT8"), ("amx_bf16", "BF16"))),
    ("NEON", "asimd", ()), ("DOTPROD", "asimddp", ()), ("I8MM", "i8mm", ()), ("SVE", "sve", ()),
    ("SVE2", "sve2", ()),
)
_IMPLIED_BY_AVX2 = {"avx", "fma", "f16c"}  # not worth a word on a CPU that has AVX2


def _cpu_features(flags: set[str]) -> tuple[list[str], list[str]]:
    """(the relevant flags this CPU has, the same said briefly: ``AVX-512 (VNNI, BF16)``)."""
    have, said = [], []
    for label, flag, refinements in _CPU_FEATURES:
        if flag not in flags:
            continue
        subs = [name for sub, name in refinements if sub in flags]
        have += [flag, *(sub for sub, _ in refinements if sub in flags)]
        if not ("avx2" in flags and flag in _IMPLIED_BY_AVX2
                or flag == "avx_vnni" and "avx512_vnni" in flags):
            said.append(f"{label} ({', '.join(subs)})" if subs else label)
    return have, said


def _cpu_fields() -> dict[str, str]:
    from .engine.repack import cpu_description

    # "model name: X | flags: a b c" (or the platform's name where there is no /proc/cpuinfo).
    fields: dict[str, str] = {}
    for part in cpu_description().split(" | "):
        key, sep, value = part.partition(": ")
        if sep:
            fields[key] = value
    return fields


def check_cpu(build: LlamaBuild) -> Check:
    fields = _cpu_fields()
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    model = fields.get("model name") or platform.processor() or platform.machine()
    try:
        import psutil

        physical, logical = psutil.cpu_count(logical=False), psutil.cpu_count()
    except Exception:  # psutil cannot count on some containers
        physical, logical = None, os.cpu_count()
    have, said = _cpu_features(flags)
    details = {"model": model, "physical_cores": physical, "logical_cores": logical,
               "features": have, "llama_cpp_features": list(build.cpu_features),
               "machine": platform.machine()}
    if flags and platform.machine().lower() in ("x86_64", "amd64") and "avx2" not in flags:
        said.append("no AVX2: slow kernels")
    summary = (f"{model}, {physical or '?'} cores ({logical or '?'} threads): "
               f"{', '.join(said) or 'features unknown'}")
    if "avx2" in flags and build.system_info and "AVX2" not in build.cpu_features:
        # A build for a generic x86 target: every matrix product takes the slow path.
        return Check("cpu", "warn", f"{summary}; llama.cpp was built without AVX2",
                     reinstall_command(build.version, deps=False), details)
    return Check("cpu", "ok", summary, None, details)


# -- 4. the repack self-test ---------------------------------------------------------------------
def check_repack(build: LlamaBuild, *, fresh: bool = False, cache: Path | None = None,
                 run: Callable[[], SelfTestResult] | None = None) -> Check:
    """The cached verdict for this build and CPU, else (or with ``fresh``) a new self-test.

    Uses ``repack``'s parts rather than ``decide_auto``: doctor reports the time and whether the
    result was definitive, and says the verdict itself instead of logging a warning.
    """
    from .engine import repack

    cache = cache or repack.cache_file()
    if not build.imports:
        return Check("repack", "info", "not run: llama-cpp-python does not import", None,
                     {"cache": str(cache)})
    key = repack.build_key()
    cached = None if fresh else repack.read_cached(cache, key)
    if cached is not None:
        result = cached
    else:
        result = (run or repack.run_selftest)()
        if result.definitive:  # the rule decide_auto follows: retry what was not definitive
            repack.write_cached(cache, key, result)
    when = "cached" if cached else f"self-test: {result.seconds:.2f} s"
    verdicts = {kind: result.verdict(kind) for kind in repack.WEIGHT_KINDS}
    settings = "; ".join(f"{'on' if v.use_extra_bufts else 'off'} for {repack.KIND_LABELS[k]} "
                         f"({v.reason})" for k, v in verdicts.items())
    details = {"repack_works": result.repack_works, "detail": result.detail,
               "seconds": round(result.seconds, 3), "cached": cached is not None,
               "definitive": result.definitive, "cache": str(cache),
               "extra_buffer_types": {k: {"on": v.use_extra_bufts, "why": v.reason}
                                      for k, v in verdicts.items()},
               "measurements": {k: asdict(t) for k, t in result.trials.items()}}
    if result.repack_works:
        return Check("repack", "ok", f"llama.cpp's extra buffer types (repacked CPU kernels): "
                                     f"{settings} ({when})", None, details)
    if result.definitive:
        # localspec loads with them off here: this does not block `run`.
        return Check("repack", "warn",
                     f"repacked CPU kernels crash on this CPU: {result.detail}; {settings} "
                     f"({when})",
                     "nothing needed: models load with repacking off where it crashes "
                     "(`--repack on` forces it, at your own risk)", details)
    return Check("repack", "warn",
                 f"self-test inconclusive ({result.detail}); repacking stays off until it passes",
                 "run `localspec doctor --selftest` again; if it persists, report this output",
                 details)


# -- 5. NVIDIA GPUs ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class NvidiaGpu:
    index: int
    name: str | None
    memory_total: int | None
    memory_free: int | None


@dataclass(frozen=True, slots=True)
class NvidiaReport:
    """What NVML says. ``driver_found`` False: no NVIDIA driver (``note`` says NVML's reason)."""

    driver_found: bool
    note: str | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    gpus: tuple[NvidiaGpu, ...] = ()


def probe_nvidia(nvml: ModuleType | None = None) -> NvidiaReport:
    """Driver, CUDA driver version and each GPU's name and memory from NVML; never raises.

    ``nvml`` is the module to use (tests pass a fake); by default ``pynvml`` (nvidia-ml-py).
    """
    from .monitor import Nvml, nvml_text

    nv = Nvml(nvml)
    why = nv.open()
    if why is not None:
        return NvidiaReport(False, note=why)
    try:
        cuda = nv.query("nvmlSystemGetCudaDriverVersion")
        gpus = []
        for index, handle in nv.handles():
            mem = nv.query("nvmlDeviceGetMemoryInfo", handle)
            gpus.append(NvidiaGpu(index, nvml_text(nv.query("nvmlDeviceGetName", handle)),
                                  getattr(mem, "total", None), getattr(mem, "free", None)))
        return NvidiaReport(
            True,
            driver_version=nvml_text(nv.query("nvmlSystemGetDriverVersion")),
            cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None,
            gpus=tuple(gpus))
    finally:
        nv.close()


def _gpu_line(report: NvidiaReport) -> str:
    gpus = "; ".join(f"{g.name or f'GPU {g.index}'} ({human_bytes(g.memory_free)} free of "
                     f"{human_bytes(g.memory_total)})" for g in report.gpus)
    count = len(report.gpus)
    driver = f"driver {report.driver_version or '?'}, CUDA {report.cuda_version or '?'}"
    return f"{count} NVIDIA GPU{'s' if count > 1 else ''}: {gpus}; {driver}"


def check_gpu(build: LlamaBuild, nvml: ModuleType | None = None) -> Check:
    """NVIDIA GPUs (NVML) against what llama.cpp was built with. A GPU llama.cpp cannot use is a
    warning, not a failure: everything still runs on the CPU."""
    report = probe_nvidia(nvml)
    nvcc = shutil.which("nvcc")
    details: dict[str, Any] = {
        "driver_found": report.driver_found, "note": report.note,
        "driver_version": report.driver_version, "cuda_version": report.cuda_version,
        "gpus": [{"index": g.index, "name": g.name, "memory_total": g.memory_total,
                  "memory_free": g.memory_free} for g in report.gpus],
        "llama_backend": build.backend, "nvcc": nvcc,
        "llama_devices": [asdict(d) for d in build.devices]}
    cuda_build = "CUDA" in build.gpu_backends
    if not report.driver_found and build.gpu_offload and build.devices:
        # llama.cpp has a GPU NVML cannot see (Metal, ROCm, a container without NVML): it
        # offloads, and placement reads the memory from llama.cpp; only the gauges go without.
        return Check("gpu", "ok", f"llama.cpp offloads with {build.backend} to "
                     f"{_device_line(build.devices)}; no NVML ({report.note}), so the chat "
                     "app's gauges show no GPU", None, details)
    if not report.driver_found:
        if cuda_build:
            return Check("gpu", "warn",
                         f"llama.cpp is built with CUDA but there is no NVIDIA driver "
                         f"({report.note})",
                         "install the NVIDIA driver (`nvidia-smi` must work), or reinstall the "
                         f"CPU build: {reinstall_command(build.version, deps=False)}", details)
        return Check("gpu", "info", f"no NVIDIA driver (NVML: {report.note})", None, details)
    if not report.gpus:
        return Check("gpu", "info",
                     f"NVIDIA driver {report.driver_version or '?'}, but no NVIDIA GPU found",
                     None, details)
    line = _gpu_line(report)
    if cuda_build and build.gpu_offload:
        return Check("gpu", "ok", f"{line}; llama.cpp offloads with CUDA", None, details)
    if cuda_build:
        return Check("gpu", "warn", f"{line}; llama.cpp's CUDA build finds no device",
                     "check that the driver supports the CUDA version llama.cpp was built with "
                     "(`nvidia-smi` shows the highest it supports)", details)
    if build.gpu_offload:  # Vulkan, say: it drives NVIDIA GPUs too
        return Check("gpu", "ok", f"{line}; llama.cpp offloads with {build.backend}", None,
                     details)
    toolkit = "" if nvcc else ("install the CUDA toolkit first (nvcc is not on PATH, and the "
                               "CUDA build needs it), then: ")
    return Check("gpu", "warn", f"{line}; llama.cpp is built without CUDA, so they sit idle",
                 toolkit + cuda_rebuild_command(build.version), details)


def _device_line(devices: tuple[Device, ...]) -> str:
    first = devices[0]
    memory = (f" ({human_bytes(first.free_bytes)} free of {human_bytes(first.total_bytes)})"
              if first.total_bytes > 0 else "")
    more = f" and {len(devices) - 1} more" if len(devices) > 1 else ""
    return f"{first.description or 'a GPU'}{memory}{more}"


# -- 5b. placement: where --gpu-layers auto puts the last pair's layers --------------------------
def check_placement(build: LlamaBuild, nvml: ModuleType | None = None) -> Check:
    """The placement of the chat app's last pair (header reads only), else the machine's: "no
    GPU" and why, or the VRAM free for models."""
    from .monitor import SystemMonitor
    from .placing import machine_budget

    budget = machine_budget(SystemMonitor(nvml), gpu_offload=bool(build.gpu_offload),
                            devices=build.devices)
    details: dict[str, Any] = {"free_bytes": budget.free_bytes, "gpus": budget.n_gpus,
                               "note": budget.note}
    plan = _last_pair_plan(budget)
    if plan is not None:
        details.update(pair=plan[0], target_layers=plan[1].target.n_gpu_layers,
                       draft_layers=plan[1].draft.n_gpu_layers if plan[1].draft else None,
                       gpu_bytes=plan[1].used_bytes, left_bytes=plan[1].left_bytes)
        status: Status = "ok" if plan[1].fits else "warn"
        # The chat app's plan: its settings are config.toml's, not flags.
        fix = None if plan[1].fits else (
            "the chat app places it with config.toml's [chat] settings (F4 in the app): set a "
            "smaller ctx, or draft_gpu_layers / gpu_layers to fewer layers (0: on the CPU); "
            "`localspec run` takes the same as --ctx, --draft-gpu-layers, --gpu-layers")
        return Check("placement", status, f"{plan[0]}: {plan[1].describe()}", fix, details)
    if budget.free_bytes is None:
        return Check("placement", "info", f"no GPU ({budget.note}): every model runs on the CPU",
                     None, details)
    more = (f"; {budget.n_gpus} GPUs found: placement counts GPU 0 only"
            if budget.n_gpus > 1 else "")
    return Check("placement", "info", f"{budget.name or 'GPU 0'}: "
                 f"{human_bytes(budget.free_bytes)} free for models (auto places the draft "
                 f"first, then the target){more}", None, details)


def _last_pair_plan(budget: Any) -> tuple[str, Any] | None:
    """(pair, plan) for config.toml's last pair with its settings, when its files are here."""
    from .config import load_settings
    from .errors import LocalspecError
    from .loading import resolve_paths, spec_from_pair
    from .options import model_settings
    from .placing import model_label, plan_files

    try:
        settings = load_settings()
        if not settings.last_pair:
            return None
        ts, ds = model_settings(settings)
        spec = spec_from_pair(settings.last_pair, ts, ds)
        target, draft = resolve_paths(spec)
        return spec.display_name, plan_files(
            target, draft, ts, ds, budget, target_label=model_label(spec.target),
            draft_label=model_label(spec.draft) if spec.draft else None)
    except LocalspecError:  # not pulled, or a bad file: other checks say so
        log.debug("no placement for the last pair", exc_info=True)
        return None


# -- 6. Ollama -----------------------------------------------------------------------------------
def _show(path: Path | str) -> str:
    """A path for a summary line: the home folder as ``~`` (details keep the full path)."""
    text, home = str(path), str(Path.home())
    return "~" + text[len(home):] if text == home or text.startswith(home + os.sep) else text


def _writable(path: Path) -> bool:
    """Whether ``path`` can be written, or created (its nearest existing parent is writable)."""
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)


def check_ollama() -> Check:
    from .errors import ConfigError
    from .models import ollama_store
    from .models.pull import daemon_available, daemon_url

    stores = ollama_store.store_dirs()
    entries = ollama_store.list_store()
    try:
        url = daemon_url()
    except ConfigError as exc:  # OLLAMA_HOST names no address: the machine's to fix, said so
        return Check("ollama", "warn", exc.message,
                     "set OLLAMA_HOST to host[:port] (the daemon's address), or unset it",
                     {"error": exc.message})
    daemon = daemon_available(url)
    store_details: list[dict[str, Any]] = []
    for store in stores:
        mine = [e for e in entries if e.store == store]
        store_details.append({"path": str(store), "exists": store.is_dir(),
                              "writable": _writable(store),
                              "models": sum(1 for e in mine if not e.damaged),
                              "damaged": sum(1 for e in mine if e.damaged)})
    damaged = [e for e in entries if e.damaged]
    details = {"stores": store_details, "daemon_url": url, "daemon": daemon,
               "damaged": [{"name": e.name, "problem": e.problem} for e in damaged]}
    whole = len(entries) - len(damaged)
    summary = (f"{whole} model{'' if whole == 1 else 's'}"
               + (f" ({len(damaged)} damaged)" if damaged else "")
               + f" in {', '.join(_show(store) for store in stores)}; "
               + (f"daemon at {url}" if daemon else
                  f"no daemon at {url} (pulls use the registry)"))
    if damaged:
        names = " ".join(e.name for e in damaged[:3])
        more = f" and {len(damaged) - 3} more" if len(damaged) > 3 else ""
        return Check("ollama", "warn", summary,
                     f"run `localspec pull NAME` for each damaged model: {names}{more}", details)
    if not daemon and not _writable(stores[0]):  # pulls without a daemon write the first store
        return Check("ollama", "warn", f"{summary}; {_show(stores[0])} is not writable",
                     "make it writable, set OLLAMA_MODELS to a folder you can write, or start "
                     "the Ollama daemon (`ollama serve`)", details)
    return Check("ollama", "ok" if daemon else "info", summary, None, details)


# -- 7. config and paths -------------------------------------------------------------------------
def check_config() -> Check:
    from .config import config_path, load_settings
    from .errors import ConfigError
    from .history import load_config as load_history_config
    from .models.catalogue import user_pairs, user_pairs_path

    path, pairs_path = config_path(), user_pairs_path()
    details: dict[str, Any] = {"config_file": str(path), "config_exists": path.is_file(),
                               "pairs_file": str(pairs_path), "pairs_exists": pairs_path.is_file()}
    # A file localspec cannot read stops the commands that read it: the chat app (settings, and
    # `run PAIR` without a prompt opens it) and every command given a pair name (your pairs).
    fixes = {path: f"edit {path.name} as said, or move it away to use the default settings",
             pairs_path: f"edit {pairs_path.name} as said, or move it away (your pairs go with "
                         "it)"}
    loaders: tuple[tuple[Path, Callable[[], Any]], ...] = (
        (path, load_settings), (path, load_history_config), (pairs_path, user_pairs))
    for file, load in loaders:
        try:
            loaded = load()
        except ConfigError as exc:
            problem = exc.message
        else:
            if file == pairs_path:
                details["user_pairs"] = len(loaded)
            continue
        details["problem"] = problem
        return Check("config", "fail", problem, fixes[file], details)
    config_state = "read" if details["config_exists"] else "absent, defaults"
    pairs = details["user_pairs"]
    return Check("config", "ok",
                 f"{_show(path)} ({config_state}); your pairs: {pairs} in {pairs_path.name}",
                 None, details)


def _folder_size(folder: Path) -> tuple[int, int]:
    total = files = 0
    for root, _dirs, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
                files += 1
            except OSError:
                continue
    return total, files


# Below this much free space localspec's own writes start failing: saved chats, the calibration
# and GGUF caches, the self-test's models (~100 MB) and the demo's. A warning, not a failure:
# `run` itself writes nothing it needs.
LOW_SPACE_BYTES = 1 << 30
DiskUsage = Callable[[Path], Any]  # shutil.disk_usage's shape: .total, .used, .free in bytes


def free_bytes(folder: Path, usage: DiskUsage | None = None) -> int | None:
    """Free space on the file system that holds ``folder`` (or would: its nearest existing
    parent); None when it cannot be asked."""
    probe = folder
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        return int((usage or shutil.disk_usage)(probe).free)
    except (OSError, AttributeError, TypeError, ValueError):
        return None


def low_space(free: dict[str, int | None], threshold: int = LOW_SPACE_BYTES) -> str | None:
    """One phrase naming the folders (by label) with less than ``threshold`` free, or None.
    Folders on one file system share a figure, so they are said together."""
    by_free: dict[int, list[str]] = {}
    for label, n in free.items():
        if n is not None and n < threshold:
            by_free.setdefault(n, []).append(label)
    if not by_free:
        return None
    parts = [f"{'no space' if n == 0 else 'only ' + human_bytes(n)} left for "
             f"{', '.join(labels)}" for n, labels in sorted(by_free.items())]
    return "; ".join(parts)


def check_paths(usage: DiskUsage | None = None, threshold: int = LOW_SPACE_BYTES) -> Check:
    """localspec's folders: where, writable, how big the cache is, and free space (``usage``
    asks the file system, ``shutil.disk_usage`` by default)."""
    from . import paths

    folders = {"config": paths.config_dir(), "data": paths.data_dir(), "cache": paths.cache_dir()}
    details: dict[str, Any] = {"home_override": os.environ.get("LOCALSPEC_HOME")}
    free: dict[str, int | None] = {}
    for label, folder in folders.items():
        details[f"{label}_dir"] = str(folder)
        details[f"{label}_writable"] = _writable(folder)
        free[label] = details[f"{label}_free_bytes"] = free_bytes(folder, usage)
    size, files = _folder_size(folders["cache"])
    details.update(cache_bytes=size, cache_files=files, low_space_bytes=threshold)
    summary = (f"data {_show(folders['data'])}, cache {_show(folders['cache'])} "
               f"({human_bytes(size)} in {files} file{'' if files == 1 else 's'})")
    problems = []
    stuck = [_show(f) for label, f in folders.items() if not details[f"{label}_writable"]]
    if stuck:
        problems.append(f"not writable: {', '.join(stuck)}")
    short = low_space(free, threshold)
    if short:
        problems.append(short)
    if problems:
        # Not blocking: an unwritable or full cache costs a self-test per run, an unwritable
        # data dir loses saved chats; `run` itself still works.
        todo = " and ".join(([f"make {'them' if len(stuck) > 1 else 'it'} writable"]
                             if stuck else [])
                            + (["free some space there"] if short else []))
        fix = f"{todo}, or set LOCALSPEC_HOME to a folder you can write on a disk with room"
        return Check("paths", "warn", f"{summary}; {'; '.join(problems)}", fix, details)
    return Check("paths", "ok", summary, None, details)


# -- all of them ---------------------------------------------------------------------------------
def _guarded(name: str, check: Callable[..., Check], *args: Any, **kwargs: Any) -> Check:
    # A check that breaks is a bug in doctor, not in the machine: say so, and go on.
    try:
        return check(*args, **kwargs)
    except Exception as exc:
        log.debug("doctor check %s failed", name, exc_info=True)
        return Check(name, "warn", f"the check itself failed ({type(exc).__name__}: {exc})",
                     "report this with the output of `localspec doctor --json`",
                     {"error": repr(exc)})


def run_checks(*, fresh_selftest: bool = False, nvml: ModuleType | None = None) -> list[Check]:
    """Every check, in the order shown. ``fresh_selftest`` ignores and rewrites the cached
    repack verdict; ``nvml`` is the NVML module to use (tests pass a fake)."""
    try:
        build = probe_llama()
    except Exception as exc:  # never expected: probe_llama reports its own failures
        log.debug("llama.cpp probe failed", exc_info=True)
        build = LlamaBuild(_installed_version(LLAMA_DIST), False, f"probe failed ({exc})")
    return [
        _guarded("localspec", check_localspec),
        _guarded("llama-cpp-python", check_llama, build),
        _guarded("cpu", check_cpu, build),
        _guarded("repack", check_repack, build, fresh=fresh_selftest),
        _guarded("gpu", check_gpu, build, nvml),
        _guarded("placement", check_placement, build, nvml),
        _guarded("ollama", check_ollama),
        _guarded("config", check_config),
        _guarded("paths", check_paths),
    ]
