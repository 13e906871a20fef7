"""The models a front end can offer: catalogue pairs, local Ollama models, pulls, estimates.

One seam over catalogue.py, ollama_store.py, pull.py and gguf_meta.py so the TUI receives a single
collaborator (and its tests a single fake). Every method may block (file reads, network): callers
run them in workers. Imports are deferred so the TUI starts before any of them is needed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..loading import EngineSpec


@dataclass(frozen=True, slots=True)
class PairStatus:
    """A pair as the picker shows it: presence, size and compatibility, when known."""

    name: str
    target: str
    draft: str | None
    draft_mode: str
    why: str = ""
    source: str = "catalogue"
    present: bool | None = None  # None: not checked yet
    size: int | None = None  # target + draft bytes, when both are present
    compatible: bool | None = None
    problem: str | None = None  # why missing, damaged or incompatible
    damaged: bool = False  # a model's blob is missing or the wrong size: not present


@dataclass(frozen=True, slots=True)
class LocalModel:
    """A model in the store. A damaged one has ``problem`` set: its path is its manifest and its
    size is unknown (0); it cannot be loaded until pulled again."""

    name: str
    path: Path
    size: int
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Weights plus KV cache of a pair against the memory it would load into."""

    weights: int
    kv_cache: int
    free: int | None
    where: str  # "VRAM" or "RAM"

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache

    @property
    def fits(self) -> bool | None:
        return None if self.free is None else self.total <= self.free


class ModelLibrary(Protocol):
    """What the TUI's pair picker and model manager need. All calls may block."""

    def pairs(self) -> list[PairStatus]: ...

    def check_pair(self, pair: PairStatus) -> PairStatus: ...

    def local_models(self) -> list[LocalModel]: ...

    def pull(self, name: str, progress: Callable[[Any], None],
             cancel: threading.Event) -> LocalModel: ...

    def delete(self, name: str) -> None: ...

    def inspect(self, ref: str) -> dict[str, Any]: ...

    def suggest_drafts(self, target: str) -> list[str]: ...

    def estimate(self, spec: EngineSpec, free: int | None, where: str) -> MemoryEstimate: ...


def kv_cache_bytes(path: Path, n_ctx: int, bytes_per_value: int = 2) -> int:
    """K and V for every layer at ``n_ctx`` (f16), from the GGUF's attention shape."""
    from ..gguf_meta import read_gguf_info

    return read_gguf_info(path).kv_cache_bytes(n_ctx, bytes_per_value)


class DefaultLibrary:
    """The real thing: the shipped catalogue, the Ollama store, the registry."""

    def __init__(self, registry: str | None = None, insecure: bool = False) -> None:
        self.registry = registry
        self.insecure = insecure

    def pairs(self) -> list[PairStatus]:
        from .catalogue import load_pairs

        return [PairStatus(name=p.name, target=p.target, draft=p.draft,
                           draft_mode=p.draft_mode or "model", why=p.why, source=p.source)
                for p in load_pairs().values()]

    def check_pair(self, pair: PairStatus) -> PairStatus:
        from dataclasses import replace

        from .catalogue import Pair, pair_status

        st = pair_status(Pair(pair.name, pair.target, pair.draft or pair.target,
                              pair.draft_mode, pair.why))
        if st.target_path is None or st.draft_path is None:
            models = [(pair.target, st.target_path, st.target_damage)]
            if pair.draft and pair.draft != pair.target:
                models.append((pair.draft, st.draft_path, st.draft_damage))
            missing = [str(ref) for ref, path, damage in models if path is None and not damage]
            damage = [d for _, _, d in models if d]
            problems = damage + ([f"not in the Ollama store: {', '.join(missing)}"]
                                 if missing else [])
            return replace(pair, present=False, damaged=bool(damage),
                           problem="; ".join(problems))
        size = st.target_path.stat().st_size + st.draft_path.stat().st_size
        return replace(pair, present=True, size=size, compatible=st.compatible,
                       problem="; ".join(st.problems) or None)

    def local_models(self) -> list[LocalModel]:
        from .ollama_store import list_store

        models = []
        for entry in list_store():
            if entry.model is None:  # damaged: listed, never as something that can load
                models.append(LocalModel(entry.name, entry.manifest_path, 0,
                                         f"{entry.problem}; pull {entry.name} again to repair it"))
            else:
                models.append(LocalModel(entry.model.name, Path(entry.model.gguf_path),
                                         int(entry.model.size)))
        return models

    def pull(self, name: str, progress: Callable[[Any], None],
             cancel: threading.Event) -> LocalModel:
        from .pull import pull

        m = pull(name, registry=self.registry, insecure=self.insecure, progress=progress,
                 cancel=cancel)
        return LocalModel(m.name, Path(m.gguf_path), int(m.size))

    def delete(self, name: str) -> None:
        from .ollama_store import delete

        delete(name)

    def inspect(self, ref: str) -> dict[str, Any]:
        from ..gguf_meta import read_gguf_info
        from .names import resolve_model

        return read_gguf_info(resolve_model(ref)).to_json()

    def suggest_drafts(self, target: str) -> list[str]:
        from .catalogue import suggest_drafts

        return [f"{s.name} — {s.size_ratio:.1f}× smaller, {s.quantization or '?'}"
                for s in suggest_drafts(target)]

    def estimate(self, spec: EngineSpec, free: int | None, where: str) -> MemoryEstimate:
        from .names import resolve_model

        refs = [spec.target] + ([spec.draft] if spec.draft and spec.draft_mode == "model" else [])
        weights = kv = 0
        for i, ref in enumerate(refs):
            path = resolve_model(ref)
            settings = spec.target_settings if i == 0 else (spec.draft_settings
                                                            or spec.target_settings)
            weights += path.stat().st_size
            kv += kv_cache_bytes(path, settings.n_ctx)
        return MemoryEstimate(weights=weights, kv_cache=kv, free=free, where=where)
