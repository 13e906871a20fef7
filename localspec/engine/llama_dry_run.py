"""llama.cpp's own account of a load: the buffers it allocates (or would), by device.

With ``llama_model_params.no_alloc`` llama.cpp reads a model's metadata and simulates every
allocation (common/fit.cpp's ``--fit`` works this way): :func:`dry_run`. No weight is read, so a
70B file costs as little as a 1B one, and a header whose data region is a sparse hole is enough.
A real load reports the same lines; :func:`llama_log_lines` and :func:`parse_buffers` read them
there too. They come from llama.cpp's log because its breakdown API
(``llama_get_memory_breakdown``) is C++ only. They check the estimates of ``placement.py``:
against the CPU in the test suite, against a GPU in benchmarks/gpu_check.py. Checked against
llama-cpp-python 0.3.36 (in a dry run, the model and KV buffers read 0; the KV cache's size
comes from its own summary line).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ModelLoadError
from .llama_backend import route_llama_logs_to_logging

_llama_log = logging.getLogger("localspec.llama_cpp")
_MIB = 1 << 20
# "load_tensors:        CUDA0 model buffer size =  1234.56 MiB"
_MODEL = re.compile(r"(\S+) model buffer size =\s*([\d.]+) MiB")
# "llama_kv_cache:      CUDA0 KV buffer size =   160.00 MiB"
_KV_BUFFER = re.compile(r"(\S+) KV buffer size =\s*([\d.]+) MiB")
# "sched_reserve:      CUDA0 compute buffer size =   608.01 MiB"
_COMPUTE = re.compile(r"(\S+) compute buffer size =\s*([\d.]+) MiB")
# "llama_kv_cache: size =  160.00 MiB (  4096 cells,  16 layers,  1/1 seqs), K (f16): ..."
_KV = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells")
# "load_tensors: layer  12 assigned to device CUDA0, is_swa = 0" (a DEBUG line)
_LAYER = re.compile(r"layer\s+(\d+) assigned to device (\S+?),")
# "load_tensors: offloaded 37/81 layers to GPU"
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")


@dataclass(frozen=True, slots=True)
class Buffers:
    """What llama.cpp said it allocated (or would), by buffer name ("CUDA0", "CPU_Mapped").
    Sizes come from its log in MiB with two decimals, so they are exact to about 5 KiB.
    ``layer_devices`` maps llama.cpp's slot (``n_layer`` is the output layer) to its device;
    ``offloaded`` is its "k/n layers" count (None on a build without GPU support)."""

    model_bytes: dict[str, int] = field(default_factory=dict)
    kv_buffer_bytes: dict[str, int] = field(default_factory=dict)
    compute_bytes: dict[str, int] = field(default_factory=dict)
    kv_bytes: int = 0
    kv_cells: int = 0
    layer_devices: dict[int, str] = field(default_factory=dict)
    offloaded: tuple[int, int] | None = None

    def on(self, device: str) -> dict[str, int]:
        """The model, KV and compute bytes in buffers named ``device`` (e.g. "CUDA0")."""
        return {"model": self.model_bytes.get(device, 0),
                "kv": self.kv_buffer_bytes.get(device, 0),
                "compute": self.compute_bytes.get(device, 0)}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def llama_log_lines() -> Iterator[list[str]]:
    """llama.cpp's log lines while the block runs, DEBUG included, kept from other handlers
    (the logger's level, handlers and propagation are restored afterwards)."""
    route_llama_logs_to_logging()
    handler = _Lines()
    level, propagate = _llama_log.level, _llama_log.propagate
    _llama_log.addHandler(handler)
    _llama_log.setLevel(logging.DEBUG)
    _llama_log.propagate = False
    try:
        yield handler.lines
    finally:
        _llama_log.removeHandler(handler)
        _llama_log.setLevel(level)
        _llama_log.propagate = propagate


def dry_run(path: str | Path, n_gpu_layers: int, n_ctx: int, *, n_batch: int = 512,
            flash_attn: bool = False, extra_bufts: bool = False, branches: int = 0) -> Buffers:
    """Dry-run loading ``path`` as ``LlamaRunner`` loads it: the micro-batch equal to the
    batch, and with ``branches`` (the engine's runners have ``TREE_BRANCHES``) one unified
    cache for that many sequences besides the main one. Raises ModelLoadError when llama.cpp
    refuses."""
    import llama_cpp as lib  # deferred: loads llama.cpp's shared library

    params = lib.llama_model_default_params()
    params.n_gpu_layers = 0x7FFFFFFF if n_gpu_layers < 0 else n_gpu_layers
    params.no_alloc = True
    params.load_mode = 0  # LLAMA_LOAD_MODE_NONE: a dry run cannot map the file (fit.cpp's way)
    params.use_extra_bufts = extra_bufts
    with llama_log_lines() as lines:
        lib.llama_backend_init()
        model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise ModelLoadError(f"{path}: llama.cpp's dry run could not load it")
        try:
            cparams = lib.llama_context_default_params()
            cparams.n_ctx = n_ctx
            cparams.n_batch = n_batch
            cparams.n_ubatch = n_batch
            cparams.n_seq_max = 1 + branches
            cparams.kv_unified = branches > 0
            cparams.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                       else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
            ctx = lib.llama_init_from_model(model, cparams)
            if not ctx:
                raise ModelLoadError(f"{path}: llama.cpp's dry run could not create a "
                                     f"{n_ctx}-token context")
            lib.llama_free(ctx)
        finally:
            lib.llama_model_free(model)
    return parse_buffers(lines)


def parse_buffers(lines: list[str]) -> Buffers:
    """The buffers named in llama.cpp's log lines of one load (model and context)."""
    out = Buffers()
    kv_bytes = kv_cells = 0
    offloaded: tuple[int, int] | None = None
    for line in lines:
        if m := _MODEL.search(line):
            _add(out.model_bytes, m)
        elif m := _KV_BUFFER.search(line):
            out.kv_buffer_bytes[m.group(1)] = _bytes(m)
        elif m := _COMPUTE.search(line):
            out.compute_bytes[m.group(1)] = _bytes(m)  # the last reservation is what stays
        elif m := _KV.search(line):
            kv_bytes, kv_cells = int(float(m.group(1)) * _MIB), int(m.group(2))
        elif m := _LAYER.search(line):
            out.layer_devices[int(m.group(1))] = m.group(2)
        elif m := _OFFLOADED.search(line):
            offloaded = (int(m.group(1)), int(m.group(2)))
    return Buffers(out.model_bytes, out.kv_buffer_bytes, out.compute_bytes, kv_bytes, kv_cells,
                   out.layer_devices, offloaded)


def _bytes(m: re.Match[str]) -> int:
    return int(float(m.group(2)) * _MIB)


def _add(into: dict[str, int], m: re.Match[str]) -> None:
    # A model split over several buffers of one type (mapped file ranges) reports each.
    into[m.group(1)] = into.get(m.group(1), 0) + _bytes(m)
