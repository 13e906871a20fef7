"""What the machine is doing: GPU memory and load from NVML, system memory and CPU from psutil.

Modelled on nvitop: NVML is initialised lazily on the first sample and shut down at exit, each
sample is one batched read, and nothing here raises — a value NVML or psutil cannot give is None.
Without an NVIDIA driver or GPU the sample says why once (``gpu_note``) and carries psutil's
figures, which are always sampled.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One NVIDIA GPU. Memory in bytes, utilisation in percent; None where NVML has no answer."""

    index: int
    name: str | None
    memory_used: int | None
    memory_total: int | None
    utilization: int | None
    process_memory: int | None  # this process's VRAM; None where NVML does not report it

    @property
    def memory_free(self) -> int | None:
        if self.memory_used is None or self.memory_total is None:
            return None
        return max(0, self.memory_total - self.memory_used)


@dataclass(frozen=True, slots=True)
class MachineSample:
    """One reading of the machine."""

    gpus: tuple[GpuSample, ...] = ()
    gpu_note: str | None = None  # why there are no GPU figures, when there are none
    ram_used: int | None = None
    ram_total: int | None = None
    ram_available: int | None = None
    cpu_percent: float | None = None
    process_rss: int | None = None

    def free_memory_for_models(self) -> tuple[int | None, str]:
        """Free VRAM of the first GPU if there is one, else available RAM, and which it is."""
        if self.gpus and self.gpus[0].memory_free is not None:
            return self.gpus[0].memory_free, "VRAM"
        return self.ram_available, "RAM"


class Monitor(Protocol):
    """Anything the TUI can sample twice a second."""

    def sample(self) -> MachineSample: ...

    def watch(self, pid: int | None) -> None:
        """Sample process ``pid`` as "this process" (None: none)."""
        ...

    def close(self) -> None: ...


def _call(fn: Callable[..., T], *args: Any) -> T | None:
    # nvitop's nvmlQuery(..., default=NA): a failing query is a missing value, never an error.
    try:
        return fn(*args)
    except Exception:  # NVMLError and its NotSupported/NoPermission kinds, driver quirks
        return None


def nvml_text(value: Any) -> str | None:
    """An NVML string (bytes in older nvidia-ml-py) as text."""
    if value is None:
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class Nvml:
    """NVML, the one wrapper (the monitor's samples and doctor's report): ``open`` initialises
    it, ``close`` lets it go, and a query NVML (or an older nvidia-ml-py) cannot answer is None,
    never an error. ``module`` is the NVML module to use (tests pass a fake); by default
    ``pynvml`` (nvidia-ml-py), imported on ``open``."""

    def __init__(self, module: ModuleType | None = None) -> None:
        self._module = module
        self.ready = False

    def open(self) -> str | None:
        """Initialise NVML: None once it is ready, else why it is not (NVML's reason)."""
        try:
            if self._module is None:
                import pynvml  # deferred: loads libnvidia-ml, absent on most CPU machines

                self._module = pynvml
            self._module.nvmlInit()
        except Exception as exc:
            return nvml_text(exc) or type(exc).__name__
        self.ready = True
        return None

    def query(self, name: str, *args: Any) -> Any:
        """NVML's function ``name`` called with ``args``, or None where it has no answer."""
        fn = getattr(self._module, name, None) if self.ready else None
        return _call(fn, *args) if fn is not None else None

    def handles(self) -> list[tuple[int, Any]]:
        """(index, handle) of every GPU NVML can reach."""
        count = self.query("nvmlDeviceGetCount") or 0
        return [(i, h) for i in range(count)
                if (h := self.query("nvmlDeviceGetHandleByIndex", i)) is not None]

    def close(self) -> None:
        """Let NVML go (idempotent)."""
        if self.ready:
            self.query("nvmlShutdown")
            self.ready = False


class SystemMonitor:
    """Samples NVML (``pynvml`` from nvidia-ml-py) and psutil.

    ``nvml`` is the module to use, for tests; by default ``pynvml`` is imported on first use.
    """

    def __init__(self, nvml: ModuleType | None = None, pid: int | None = None) -> None:
        self._nvml = Nvml(nvml)
        # "This process": the one holding the models, which the chat app runs apart from
        # itself (see ``watch``); this one until told.
        self._pid: int | None = pid if pid is not None else os.getpid()
        self._state = "new"  # new -> ready | unavailable -> closed
        self._note: str | None = None
        self._handles: list[tuple[int, Any]] = []
        self._lock = threading.Lock()
        self._process: Any = None

    # -- NVML lifecycle -----------------------------------------------------------------------
    def _init_nvml(self) -> None:
        why = self._nvml.open()
        if why is not None:
            self._state = "unavailable"
            self._note = f"No NVIDIA driver ({why})"
            log.info("NVML unavailable: %s", why)
            return
        atexit.register(self.close)
        self._handles = self._nvml.handles()
        if not self._handles:
            self._note = "No NVIDIA GPU found"
        self._state = "ready"

    def close(self) -> None:
        """Shut NVML down (idempotent; also registered with atexit)."""
        with self._lock:
            if self._state == "ready":
                self._nvml.close()
            self._state = "closed"
            self._handles = []

    def watch(self, pid: int | None) -> None:
        with self._lock:
            if pid != self._pid:
                self._pid, self._process = pid, None

    # -- sampling -----------------------------------------------------------------------------
    def _gpu(self, index: int, handle: Any) -> GpuSample:
        nv = self._nvml
        mem = nv.query("nvmlDeviceGetMemoryInfo", handle)
        util = nv.query("nvmlDeviceGetUtilizationRates", handle)
        procs: list[Any] = []
        for query in ("nvmlDeviceGetComputeRunningProcesses",
                      "nvmlDeviceGetGraphicsRunningProcesses"):
            procs += nv.query(query, handle) or []
        mine = [getattr(p, "usedGpuMemory", None) for p in procs
                if self._pid is not None and getattr(p, "pid", None) == self._pid]
        known = [m for m in mine if isinstance(m, int)]
        return GpuSample(
            index=index,
            name=nvml_text(nv.query("nvmlDeviceGetName", handle)),
            memory_used=getattr(mem, "used", None),
            memory_total=getattr(mem, "total", None),
            utilization=getattr(util, "gpu", None),
            process_memory=sum(known) if known else None,
        )

    def _system(self) -> dict[str, Any]:
        try:
            import psutil

            if self._process is None and self._pid is not None:
                self._process = _call(psutil.Process, self._pid)  # None: it has just ended
            process = self._process
            vm = psutil.virtual_memory()
            return {
                "ram_used": int(vm.total - vm.available), "ram_total": int(vm.total),
                "ram_available": int(vm.available),
                "cpu_percent": float(psutil.cpu_percent(interval=None)),
                "process_rss": (_call(lambda: int(process.memory_info().rss))
                                if process is not None else None),
            }
        except Exception as exc:
            log.debug("psutil sample failed: %s", exc)
            return {}

    def sample(self) -> MachineSample:
        """One reading; never raises."""
        with self._lock:
            if self._state == "new":
                self._init_nvml()
            gpus: tuple[GpuSample, ...] = ()
            if self._state == "ready":
                gpus = tuple(self._gpu(i, h) for i, h in self._handles)
            return MachineSample(gpus=gpus, gpu_note=self._note, **self._system())

