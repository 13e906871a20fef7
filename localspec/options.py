"""Settings: the values of every parameter, and how they become the engine's objects.

Each value is checked through :data:`localspec.params.PARAMS` (its type, range and meaning, defined
once). This module turns settings into the engine's parameter objects (``ModelSettings``,
``SamplingParams``; the drafting fields become ``DraftSettings`` in ``localspec.requests``, the
one request path): there is one default for each (one ``max_tokens`` default, not five). The
CLI's flags are in ``cli.params``.

Precedence: a CLI flag beats ``config.toml`` (``[chat]``), which beats the defaults in ``params``.
``run``, ``serve`` and the chat app read ``config.toml``; ``bench`` does not (a benchmark is
reproducible from its command line alone), and ``demo`` uses its own fixed settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .engine.drafters import DraftMode, draft_modes
from .params import PARAMS, InvalidOptionError

if TYPE_CHECKING:
    from .engine.llama_backend import ModelSettings
    from .engine.sampling import SamplingParams

# The draft modes when localspec starts: the built-in drafters' names and "none" (a drafter
# registered later is a mode too: params' draft_mode follows the registry).
DRAFT_MODES: tuple[DraftMode, ...] = draft_modes()


# -- settings: the values of all parameters ------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Settings:
    """A full set of parameter values (defaults from :data:`PARAMS`).

    What ``config.toml``'s ``[chat]`` table holds and the chat app's settings screen edits; the
    CLI starts from it and applies its flags."""

    ctx: int = PARAMS["ctx"].default
    gpu_layers: int | None = PARAMS["gpu_layers"].default  # None: auto (localspec.placing)
    draft_gpu_layers: int | None = PARAMS["draft_gpu_layers"].default
    threads: int | None = PARAMS["threads"].default
    repack: str = PARAMS["repack"].default
    prompt_cache: int = PARAMS["prompt_cache"].default
    draft_mode: str = PARAMS["draft_mode"].default
    k: int | None = PARAMS["k"].default
    k_max: int = PARAMS["k_max"].default
    accept_rule: str = PARAMS["accept_rule"].default
    exact: bool = PARAMS["exact"].default
    history: str = PARAMS["history"].default
    temperature: float = PARAMS["temperature"].default
    top_k: int = PARAMS["top_k"].default
    top_p: float = PARAMS["top_p"].default
    min_p: float = PARAMS["min_p"].default
    repeat_penalty: float = PARAMS["repeat_penalty"].default
    seed: int | None = PARAMS["seed"].default
    max_tokens: int = PARAMS["max_tokens"].default
    system_prompt: str = PARAMS["system_prompt"].default
    last_pair: str | None = PARAMS["last_pair"].default

    def validate(self) -> Settings:
        for f in dataclasses.fields(self):
            PARAMS[f.name].check(getattr(self, f.name))
        return self

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes).validate()


SETTINGS_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Settings))


# -- from settings to the engine's parameters -----------------------------------------------------
def model_settings(s: Settings) -> tuple[ModelSettings, ModelSettings]:
    """(target, draft) loading settings; GPU layers None (auto) are resolved where the files are
    known (``loading.load_engine``, by ``localspec.placing``)."""
    from .engine.llama_backend import ModelSettings

    def one(layers: int | None) -> ModelSettings:
        return ModelSettings(n_gpu_layers=layers, n_ctx=s.ctx, n_threads=s.threads,
                             repack=s.repack,  # type: ignore[arg-type]
                             prompt_cache_mib=s.prompt_cache)

    return one(s.gpu_layers), one(s.draft_gpu_layers)


def sampling_params(s: Settings) -> SamplingParams:
    from .engine.sampling import SamplingParams

    return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                          min_p=s.min_p, repeat_penalty=s.repeat_penalty, seed=s.seed)


def settings_from_mapping(data: Mapping[str, Any], where: Callable[[str], str]) -> Settings:
    """Settings from a mapping (a TOML table). ``where(key)`` labels errors (file and line)."""
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in PARAMS or key not in SETTINGS_FIELDS:
            raise InvalidOptionError(f"{where(key)}: unknown setting {key!r}", key)
        p = PARAMS[key]
        if p.kind == "float" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        try:
            if isinstance(value, str) and p.kind not in ("str", "choice"):
                # Text where a number or a switch goes ("auto", "", "4"): read as the same
                # text typed on the command line or in the settings screen would be.
                values[key] = p.parse(value)
            else:
                values[key] = p.check(value)
        except InvalidOptionError as exc:
            raise InvalidOptionError(f"{where(key)}: {exc.message}", key) from None
    return Settings(**values)
