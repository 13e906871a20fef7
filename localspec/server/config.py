"""Server settings: what the CLI decides once and passes down (no starlette import here)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..engine.decoder import DraftSettings
from ..engine.sampling import SamplingParams
from ..params import DEFAULT_MAX_TOKENS

# OpenAI's defaults for the OpenAI fields (temperature 1, top_p 1), llama.cpp's for the fields
# OpenAI does not have (top_k 40, min_p 0.05), so an unchanged OpenAI client samples as it expects.
OPENAI_DEFAULT_SAMPLING = SamplingParams(temperature=1.0, top_p=1.0)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """How the server answers.

    ``model_id`` is the name listed by ``/v1/models``; ``aliases`` are other names a request may
    use (the target's GGUF name and file stem are added when the engine is loaded).
    """

    model_id: str
    aliases: tuple[str, ...] = ()
    api_key: str | None = None
    queue_size: int = 16
    max_tokens_limit: int = 4096
    # max_tokens of a request that names none (capped by the context and the limit above).
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_body_bytes: int = 1 << 20
    max_stop_strings: int = 16
    draft: DraftSettings = DraftSettings()
    default_sampling: SamplingParams = field(default=OPENAI_DEFAULT_SAMPLING)
    owned_by: str = "localspec"

    @classmethod
    def private(cls, model_id: str) -> ServerConfig:
        """The chat app's own engine process: its one client is the app, whose max_tokens
        setting (checked where it is set) is the only limit a request needs."""
        from ..params import PARAMS

        return cls(model_id=model_id, max_tokens_limit=int(PARAMS["max_tokens"].high or 1))

    def validate(self) -> None:
        """Raise ValueError naming the first unusable setting."""
        if self.queue_size < 0:
            raise ValueError("queue size must be >= 0")
        if self.max_tokens_limit < 1:
            raise ValueError("max tokens limit must be >= 1")
        if self.max_body_bytes < 1024:
            raise ValueError("max body bytes must be >= 1024")

    def to_json(self) -> dict[str, Any]:
        """Every setting as JSON values (how an engine process is told what to serve)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServerConfig:
        """:meth:`to_json`'s inverse (a setting it does not name keeps its default)."""
        values = dict(data)
        if "aliases" in values:
            values["aliases"] = tuple(values["aliases"])
        if "draft" in values:
            values["draft"] = DraftSettings(**values["draft"])
        if "default_sampling" in values:
            values["default_sampling"] = SamplingParams(**values["default_sampling"])
        return cls(**values)
