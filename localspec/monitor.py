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

    def close(self) -> None: ...


def _call(fn: Callable[..., T], *args: Any) -> T | None:
    # nvitop's nvmlQuery(..., default=NA): a failing query is a missing value, never an error.
    try:
        return fn(*args)
    except Exception:  # NVMLError and its NotSupported/NoPermission kinds, driver quirks
        return None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class SystemMonitor:
    """Samples NVML (``pynvml`` from nvidia-ml-py) and psutil.

    ``nvml`` is the module to use, for tests; by default ``pynvml`` is imported on first use.
    """

    def __init__(self, nvml: ModuleType | None = None, pid: int | None = None) -> None:
        self._nvml = nvml
        self._pid = pid if pid is not None else os.getpid()
        self._state = "new"  # new -> ready | unavailable -> closed
        self._note: str | None = None
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        self._process: Any = None

    # -- NVML lifecycle -----------------------------------------------------------------------
    def _init_nvml(self) -> None:
        try:
            if self._nvml is None:
                import pynvml  # deferred: loads libnvidia-ml, absent on most CPU machines

                self._nvml = pynvml
            self._nvml.nvmlInit()
        except Exception as exc:
            self._state = "unavailable"
            self._note = f"No NVIDIA driver ({_text(exc) or type(exc).__name__})"
            log.info("NVML unavailable: %s", exc)
            return
        atexit.register(self.close)
        count = _call(self._nvml.nvmlDeviceGetCount) or 0
        self._handles = [h for i in range(count)
                         if (h := _call(self._nvml.nvmlDeviceGetHandleByIndex, i)) is not None]
        if not self._handles:
            self._note = "No NVIDIA GPU found"
        self._state = "ready"

    def close(self) -> None:
        """Shut NVML down (idempotent; also registered with atexit)."""
        with self._lock:
            if self._state == "ready" and self._nvml is not None:
                _call(self._nvml.nvmlShutdown)
            self._state = "closed"
            self._handles = []

    # -- sampling -----------------------------------------------------------------------------
    def _gpu(self, index: int, handle: Any) -> GpuSample:
        nv = self._nvml
        assert nv is not None
        mem = _call(nv.nvmlDeviceGetMemoryInfo, handle)
        util = _call(nv.nvmlDeviceGetUtilizationRates, handle)
        procs: list[Any] = []
        for query in ("nvmlDeviceGetComputeRunningProcesses",
                      "nvmlDeviceGetGraphicsRunningProcesses"):
            fn = getattr(nv, query, None)
            procs += (_call(fn, handle) or []) if fn is not None else []
        mine = [getattr(p, "usedGpuMemory", None) for p in procs
                if getattr(p, "pid", None) == self._pid]
        known = [m for m in mine if isinstance(m, int)]
        return GpuSample(
            index=index,
            name=_text(_call(nv.nvmlDeviceGetName, handle)),
            memory_used=getattr(mem, "used", None),
            memory_total=getattr(mem, "total", None),
            utilization=getattr(util, "gpu", None),
            process_memory=sum(known) if known else None,
        )

    def _system(self) -> dict[str, Any]:
        try:
            import psutil

            if self._process is None:
                self._process = psutil.Process(self._pid)
            vm = psutil.virtual_memory()
            return {
                "ram_used": int(vm.total - vm.available), "ram_total": int(vm.total),
                "ram_available": int(vm.available),
                "cpu_percent": float(psutil.cpu_percent(interval=None)),
                "process_rss": _call(lambda: int(self._process.memory_info().rss)),
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
                gpus = tuple(self._gpu(i, h) for i, h in enumerate(self._handles))
            return MachineSample(gpus=gpus, gpu_note=self._note, **self._system())

