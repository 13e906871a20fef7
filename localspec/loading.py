"""From what a user names (a pair, an Ollama name, a .gguf path) to a loaded engine.

Shared by every front end (CLI run/bench/demo, the server, the TUI) so they resolve and validate
models the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from .engine.llama_backend import ModelSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What to load. ``target``/``draft`` are model references (path or Ollama name)."""

    target: str
    draft: str | None = None
    target_settings: ModelSettings = field(default_factory=ModelSettings)
    draft_settings: ModelSettings | None = None
    pair_name: str | None = None
    draft_mode: str = "model"
    # The history the engine keeps (localspec.history's scopes: chat, serve, process); None:
    # none, so the history drafter never drafts and nothing is written.
    history: str | None = None

    @property
    def display_name(self) -> str:
        return self.pair_name or self.target


def spec_from_pair(pair_name: str, target_settings: ModelSettings = ModelSettings(),
                   draft_settings: ModelSettings | None = None) -> EngineSpec:
    """An EngineSpec for a catalogue or user pair."""
    from .models.catalogue import find_pair

    pair = find_pair(pair_name)
    return EngineSpec(target=pair.target, draft=pair.draft, target_settings=target_settings,
                      draft_settings=draft_settings, pair_name=pair.name,
                      draft_mode=pair.draft_mode)


def resolve_paths(spec: EngineSpec) -> tuple[Path, Path | None]:
    """The files the spec names (the draft only where it drafts with it), not yet validated."""
    from .models.names import resolve_model

    target = resolve_model(spec.target)
    draft = resolve_model(spec.draft) if spec.draft and spec.draft_mode == "model" else None
    return target, draft


def resolve_files(spec: EngineSpec) -> tuple[Path, Path | None]:
    """The pair's files, validated (each file, and the pair rule) before any llama.cpp sees
    them: a bad file is one line here, not a crash in a process that loads it."""
    from .gguf_meta import read_gguf_info, validate_pair

    target, draft = resolve_paths(spec)
    if draft is not None:
        validate_pair(target, draft)
    else:
        read_gguf_info(target)
    return target, draft


def load_engine(spec: EngineSpec):  # type: ignore[no-untyped-def]
    """Resolve and load (``SpeculativeEngine.load`` validates the files and the pair, once).
    Returns a SpeculativeEngine."""
    from .engine import SpeculativeEngine

    target, draft = resolve_paths(spec)
    log.info("loading target %s, draft %s", target, draft)
    store = None
    if spec.history is not None:
        from .history import open_store

        store = open_store(spec.history, target)
    from .errors import ModelLoadError
    from .placing import allocation_error, machine_budget, model_label, resolve_layers

    # --gpu-layers auto becomes numbers here, where the files are known (never raises).
    ts, ds, plan = resolve_layers(target, draft, spec.target_settings, spec.draft_settings,
                                  machine_budget(), target_label=model_label(spec.target),
                                  draft_label=model_label(spec.draft) if spec.draft else None)
    try:
        engine = SpeculativeEngine.load(target, draft, ts, ds, history=store)
    except ModelLoadError as exc:
        if store is not None:
            store.close()
        raise allocation_error(exc, plan, target, draft, machine_budget()) from None
    except BaseException:
        if store is not None:
            store.close()
        raise
    engine.placement = plan.describe() if plan is not None else None
    if store is not None and store.fresh and spec.history == "chat":
        from .history import seed_from_chats

        seed_from_chats(store, engine)  # a new or rebuilt chat index starts from the chats
    return engine
