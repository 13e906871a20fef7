"""A fake ``pynvml`` module (named as a fake): NVML cannot run on this machine."""

from __future__ import annotations

import types
from dataclasses import dataclass


class NVMLError(Exception):
    pass


@dataclass
class _Mem:
    total: int
    used: int
    free: int


@dataclass
class _Util:
    gpu: int
    memory: int


@dataclass
class _Proc:
    pid: int
    usedGpuMemory: int | None  # noqa: N815 (NVML's field name)


def make_fake_pynvml(*, driver: bool = True, gpus: int = 1, pid: int = 0,
                     process_memory: int | None = 3 * 1024**3,
                     utilization_supported: bool = True) -> types.ModuleType:
    """pynvml's functions that the monitor and doctor use; ``calls`` counts init/shutdown."""
    mod = types.ModuleType("fake_pynvml")
    mod.NVMLError = NVMLError  # type: ignore[attr-defined]
    state = {"init": 0, "shutdown": 0}
    mod.calls = state  # type: ignore[attr-defined]

    def nvmlInit() -> None:  # noqa: N802
        if not driver:
            raise NVMLError("NVML Shared Library Not Found")
        state["init"] += 1

    def nvmlShutdown() -> None:  # noqa: N802
        state["shutdown"] += 1

    def nvmlDeviceGetUtilizationRates(h: int) -> _Util:  # noqa: N802
        if not utilization_supported:
            raise NVMLError("Not Supported")
        return _Util(40 + h, 10)

    mod.nvmlInit = nvmlInit  # type: ignore[attr-defined]
    mod.nvmlShutdown = nvmlShutdown  # type: ignore[attr-defined]
    mod.nvmlSystemGetDriverVersion = lambda: "550.54.15"  # type: ignore[attr-defined]
    mod.nvmlSystemGetCudaDriverVersion = lambda: 12040  # type: ignore[attr-defined]
    mod.nvmlDeviceGetCount = lambda: gpus  # type: ignore[attr-defined]
    mod.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    mod.nvmlDeviceGetName = lambda h: b"Fake GPU %d" % h  # type: ignore[attr-defined]
    mod.nvmlDeviceGetMemoryInfo = (  # type: ignore[attr-defined]
        lambda h: _Mem(80 * 1024**3, (10 + h) * 1024**3, (70 - h) * 1024**3))
    mod.nvmlDeviceGetUtilizationRates = nvmlDeviceGetUtilizationRates  # type: ignore[attr-defined]
    mod.nvmlDeviceGetComputeRunningProcesses = (  # type: ignore[attr-defined]
        lambda h: [_Proc(pid, process_memory), _Proc(pid + 1, 1024)])
    mod.nvmlDeviceGetGraphicsRunningProcesses = lambda h: []  # type: ignore[attr-defined]
    return mod
