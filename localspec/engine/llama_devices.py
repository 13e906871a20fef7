"""The GPUs llama.cpp itself would offload to, with their free memory, as ggml sees them.

NVML reads NVIDIA cards only, numbers them its own way, and is missing in many containers;
llama.cpp's device list is what a load actually uses: it honours ``CUDA_VISIBLE_DEVICES``, and it
covers Metal, ROCm, Vulkan and SYCL. So placement asks llama.cpp first, and NVML only where
llama.cpp gives no memory figure.

ggml's device API (``ggml-backend.h``: ``ggml_backend_dev_count``, ``_get``, ``_type``,
``_description``, ``_memory``) is public C but not bound by llama-cpp-python (0.3.36 checked):
it is bound here, on ``llama_cpp._ggml.libggml``. Asking a CUDA device for its memory creates a
CUDA context on it in this process, so only the process that loads the models asks (and doctor's
probe child).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# enum ggml_backend_dev_type (ggml-backend.h)
_TYPE_GPU = 1
_TYPE_IGPU = 2


@dataclass(frozen=True, slots=True)
class Device:
    """One GPU llama.cpp offloads to. ``total_bytes`` 0: the backend gave no memory figure."""

    description: str
    free_bytes: int
    total_bytes: int


def offload_devices() -> list[Device]:
    """The devices a load offloads to, in llama.cpp's order: the discrete GPUs, or where there
    are none the integrated ones (``llama_model_load``'s choice). Empty for a CPU-only build,
    and wherever the device API cannot be had (never raises)."""
    try:
        from .llama_backend import _init_backend

        lib = _init_backend()
        lib.llama_supports_gpu_offload()  # loads the backends of a build that loads them late
        import llama_cpp._ggml as ggml

        return _devices(_bind(ggml.libggml))
    except Exception:  # noqa: BLE001 - no device list is "no GPU known to llama.cpp"
        log.debug("could not list llama.cpp's devices", exc_info=True)
        return []


def _bind(lib: Any) -> Any:
    lib.ggml_backend_dev_count.argtypes = []
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_description.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_description.restype = ctypes.c_char_p
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_dev_memory.restype = None
    return lib


def _devices(lib: Any) -> list[Device]:
    kinds: dict[int, list[Any]] = {_TYPE_GPU: [], _TYPE_IGPU: []}
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        kind = int(lib.ggml_backend_dev_type(dev))
        if dev and kind in kinds:
            kinds[kind].append(dev)
    chosen = kinds[_TYPE_GPU] or kinds[_TYPE_IGPU]
    return [_device(lib, dev) for dev in chosen]


def _device(lib: Any, dev: Any) -> Device:
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    text = lib.ggml_backend_dev_description(dev) or b""
    return Device(text.decode("utf-8", "replace"), int(free.value), int(total.value))
