"""``--gpu-layers auto`` for a spec: the placement plan made where the files are known.

:mod:`localspec.engine.placement` is the arithmetic; this module feeds it the machine (llama.cpp's
build and its devices' free memory, or the monitor's NVML sample) and the spec's files, and turns
the plan into the layer counts the models load with. It never raises for the machine's sake: no
GPU, no driver or a CPU-only llama.cpp is ``GpuBudget.none`` and the plan says so.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .engine.placement import GpuBudget, ModelMemory, Placement, plan_placement
from .errors import LocalspecError, ModelLoadError

if TYPE_CHECKING:
    from .engine.llama_backend import ModelSettings
    from .engine.llama_devices import Device
    from .monitor import SystemMonitor

log = logging.getLogger(__name__)

NO_GPU_BUILD = "llama.cpp is built without GPU support"


def llama_offloads() -> bool:
    """Whether this process's llama.cpp can offload (``llama_supports_gpu_offload``). Deferred
    import: llama_cpp loads its shared libraries on import."""
    try:
        from .engine.llama_backend import _init_backend

        return bool(_init_backend().llama_supports_gpu_offload())
    except Exception:  # noqa: BLE001 - a broken build offloads nothing; loading will say why
        log.debug("llama_supports_gpu_offload failed", exc_info=True)
        return False


def machine_budget(monitor: SystemMonitor | None = None, gpu_offload: bool | None = None,
                   devices: Sequence[Device] | None = None) -> GpuBudget:
    """The GPU memory placement may use: the first GPU's free memory as llama.cpp sees it
    (``devices``; None asks this process's llama.cpp), else as NVML sees it, or none (with
    why) when llama.cpp cannot offload. ``gpu_offload`` None asks this process's llama.cpp.
    Never raises."""
    offload = llama_offloads() if gpu_offload is None else gpu_offload
    if not offload:
        return GpuBudget.none(NO_GPU_BUILD)
    if devices is None:
        from .engine.llama_devices import offload_devices

        devices = offload_devices()
    budget = GpuBudget.from_devices(devices)
    if budget is not None:
        return budget
    from .monitor import SystemMonitor

    own = monitor is None
    mon = monitor or SystemMonitor()
    try:
        return GpuBudget.from_sample(mon.sample())
    finally:
        if own:
            mon.close()


def plan_files(target: Path, draft: Path | None, ts: ModelSettings, ds: ModelSettings | None,
               budget: GpuBudget, *, target_label: str | None = None,
               draft_label: str | None = None) -> Placement:
    """The plan for these files and settings (``n_gpu_layers`` None is auto). GGUFError when a
    header cannot be read."""
    t = ModelMemory.from_gguf(target, label=target_label)
    d = ModelMemory.from_gguf(draft, label=draft_label) if draft is not None else None
    return plan_placement(t, d, budget, n_ctx=ts.n_ctx, n_batch=ts.n_batch,
                          flash_attn=ts.flash_attn, target_layers=ts.n_gpu_layers,
                          draft_layers=ds.n_gpu_layers if ds is not None and d is not None
                          else None)


def resolve_layers(target: Path, draft: Path | None, ts: ModelSettings,
                   ds: ModelSettings | None, budget: GpuBudget, *,
                   target_label: str | None = None, draft_label: str | None = None,
                   ) -> tuple[ModelSettings, ModelSettings | None, Placement | None]:
    """Settings with numbers for auto layers, and the plan (None when a header cannot be read:
    auto then offloads nothing, and loading reports the bad file)."""
    try:
        plan = plan_files(target, draft, ts, ds, budget, target_label=target_label,
                          draft_label=draft_label)
    except LocalspecError:
        log.debug("no placement plan for %s", target, exc_info=True)
        return _or_zero(ts), _or_zero(ds) if ds is not None else None, None
    t_layers, d_layers = plan.settings_layers()
    if plan.budget.free_bytes is None:  # no GPU: an explicit number is passed on as given
        t_layers = ts.n_gpu_layers if ts.n_gpu_layers is not None else 0
        if ds is not None:
            d_layers = ds.n_gpu_layers if ds.n_gpu_layers is not None else 0
    new_ts = dataclasses.replace(ts, n_gpu_layers=t_layers)
    new_ds = ds
    if ds is not None:
        new_ds = dataclasses.replace(ds, n_gpu_layers=d_layers if d_layers is not None
                                     else (ds.n_gpu_layers or 0))
    log.info("placement: %s", plan.describe())
    return new_ts, new_ds, plan


def model_label(ref: str) -> str:
    """How a model is named in placement lines: a file by its name, an Ollama model as given."""
    return Path(ref).name if ref.lower().endswith(".gguf") else ref


def _or_zero(s: ModelSettings) -> ModelSettings:
    return s if s.n_gpu_layers is not None else dataclasses.replace(s, n_gpu_layers=0)


def allocation_error(exc: ModelLoadError, plan: Placement | None, target: Path,
                     draft: Path | None, budget_after: GpuBudget) -> ModelLoadError:
    """A load that failed with GPU layers as one line (the model, what was asked, what was free
    and the fix); ``exc`` itself when it was not an offloading load."""
    from .engine.placement import allocation_error_line

    if plan is None or plan.budget.free_bytes is None:
        return exc
    text = str(exc)
    roles = [(plan.target, target, "--gpu-layers", plan.draft),
             (plan.draft, draft, "--draft-gpu-layers", plan.target)]
    for p, path, flag, other in roles:
        if p is None or path is None or p.n_gpu_layers <= 0 or not text.startswith(str(path)):
            continue
        try:
            m = ModelMemory.from_gguf(path, label=p.label)
        except LocalspecError:
            return exc
        # The other model needs its share too (the failed load freed both before the reading).
        line = allocation_error_line(m, p.n_gpu_layers, p.n_ctx, budget_after.free_bytes,
                                     other_gpu_bytes=other.gpu_bytes if other else 0,
                                     flag=flag)
        return ModelLoadError(f"{line} (llama.cpp: {text.removeprefix(str(path) + ': ')})")
    return exc
