"""localspec: speculative decoding for local LLMs on one workstation.

Library use::

    from localspec import SpeculativeEngine, GenerationRequest
    with SpeculativeEngine.load("target.gguf", "draft.gguf") as engine:
        prompt = engine.tokenize(engine.chat_prompt([{"role": "user", "content": "Hi"}]), chat=True)
        print(engine.generate(GenerationRequest(prompt_tokens=prompt)).text)

The engine names are loaded lazily so that ``import localspec`` (and the CLI's ``--help``) does not
load llama.cpp's shared library.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_ENGINE_NAMES = {
    "DraftSettings", "Finished", "GenerationRequest", "GenerationStats", "LlamaRunner",
    "ModelSettings", "SamplingParams", "SpeculativeEngine", "StreamEvent", "TextChunk",
}


def __getattr__(name: str) -> Any:
    if name in _ENGINE_NAMES:
        from . import engine

        return getattr(engine, name)
    if name == "LlamaDraftModel":
        from .engine.llama_draft_model import LlamaDraftModel

        return LlamaDraftModel
    raise AttributeError(name)


__all__ = sorted(_ENGINE_NAMES | {"LlamaDraftModel"})
