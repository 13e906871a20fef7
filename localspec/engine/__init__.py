"""The speculative decoding engine. Imports nothing from any front end."""

from .decoder import (
    DraftSettings,
    Finished,
    GenerationRequest,
    SpeculativeEngine,
    StreamEvent,
)
from .drafters import DraftContext, Drafter, Proposal
from .llama_backend import LlamaRunner, ModelSettings
from .sampling import SamplingParams
from .stats import GenerationStats
from .text import TextChunk

__all__ = [
    "DraftContext",
    "DraftSettings",
    "Drafter",
    "Finished",
    "GenerationRequest",
    "GenerationStats",
    "LlamaRunner",
    "ModelSettings",
    "Proposal",
    "SamplingParams",
    "SpeculativeEngine",
    "StreamEvent",
    "TextChunk",
]
