"""Helpers for engine tests."""

from __future__ import annotations

from localspec.engine import (
    DraftSettings,
    Finished,
    GenerationRequest,
    SamplingParams,
    SpeculativeEngine,
)

PROMPTS = (
    "the model and the draft",
    "def fast(value): return value",
    "import data from the list",
    "token speed is the target of this test",
    "a",
    "print print print print",
    "while it is not local",
    "class model self if else",
)


def run(engine: SpeculativeEngine, prompt: str, *, max_tokens: int = 48, mode: str = "model",
        k: int | None = None, sampling: SamplingParams = SamplingParams(),
        stop: tuple[str, ...] = (), exact: bool = False, rule: str = "auto",
        cold: bool = False) -> Finished:
    """One request. ``cold``: from empty KV caches, as a comparison of drafting against plain
    decoding needs. Otherwise the request reuses the prefix the previous one left, and the
    prompt's last token is then decoded alone rather than in the prompt's batch: with some
    kernels (llama.cpp's repacked Q4_K ones on AVX2) that moves a later near-tie (a top-2
    margin of 0.004 on a tiny model) with no drafting at all."""
    if cold:
        engine.target.reset()
        if engine.draft is not None:
            engine.draft.reset()
    tokens = engine.tokenize(prompt, chat=False)
    req = GenerationRequest(prompt_tokens=tokens, max_tokens=max_tokens, sampling=sampling,
                            stop=stop, draft=DraftSettings(mode=mode, k=k, exact=exact,  # type: ignore[arg-type]
                                                           rule=rule))  # type: ignore[arg-type]
    return engine.generate(req)
