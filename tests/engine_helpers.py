"""Helpers for engine tests."""

from __future__ import annotations

from localspec.engine import (
    DraftSettings,
    Finished,
    GenerationRequest,
    SamplingParams,
    SpeculativeEngine,
)
from localspec.engine.controller import AcceptanceModel

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
    decoding needs (``SpeculativeEngine.clear_caches``: with llama.cpp's repacked Q4_K kernels
    on AVX2 a reused prefix moved a 0.004 top-2 margin on a tiny model, no drafting at all)."""
    if cold:
        engine.clear_caches()
    tokens = engine.tokenize(prompt, chat=False)
    req = GenerationRequest(prompt_tokens=tokens, max_tokens=max_tokens, sampling=sampling,
                            stop=stop, draft=DraftSettings(mode=mode, k=k, exact=exact,  # type: ignore[arg-type]
                                                           rule=rule))  # type: ignore[arg-type]
    return engine.generate(req)


def trust(acc: AcceptanceModel) -> None:
    """Make ``acc`` trusted as requests do: TRUSTED_AFTER requests whose first EARLY checked
    tokens were all accepted (at a confidence of 1.0, so only that bin learns)."""
    for _ in range(acc.TRUSTED_AFTER):
        acc.start_request()
        acc.observe([1.0] * acc.EARLY, acc.EARLY)
        acc.end_request()
    acc.start_request()
    assert acc.trusted and not acc.unproven
