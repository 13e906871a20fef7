"""User settings: typed, frozen, loaded once from ``config.toml`` and passed down.

Nothing here runs at import; front ends call :func:`load_settings` and hand the value to whoever
needs it (the TUI's settings screen saves a new value with :func:`save_settings`).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from . import paths
from .errors import ConfigError
from .files import atomic_write

DraftChoice = Literal["auto", "fixed", "lookup", "off"]
DRAFT_CHOICES: tuple[str, ...] = ("auto", "fixed", "lookup", "off")


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything a user may set for chatting. Model-loading fields apply on the next load."""

    draft_mode: DraftChoice = "auto"
    k: int = 4
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    max_tokens: int = 1024
    gpu_layers_target: int = -1
    gpu_layers_draft: int = -1
    ctx: int = 4096
    threads: int | None = None
    system_prompt: str = "You are a helpful assistant."
    last_pair: str | None = None

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field."""
        problems = {
            "draft_mode": self.draft_mode not in DRAFT_CHOICES,
            "k": not 0 <= self.k <= 32,
            "temperature": self.temperature < 0,
            "top_k": self.top_k < 0,
            "top_p": not 0.0 < self.top_p <= 1.0,
            "min_p": not 0.0 <= self.min_p < 1.0,
            "repeat_penalty": self.repeat_penalty <= 0,
            "max_tokens": self.max_tokens < 1,
            "ctx": self.ctx < 64,
            "threads": self.threads is not None and self.threads < 1,
        }
        for name, bad in problems.items():
            if bad:
                raise ConfigError(f"setting {name} = {getattr(self, name)!r} is out of range")


def config_path() -> Path:
    return paths.config_dir() / "config.toml"


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def _coerce(name: str, value: Any, where: str) -> Any:
    default = _FIELDS[name].default
    if name in ("threads", "last_pair"):
        if value in (None, "", 0) and name == "threads":
            return None
        return int(value) if name == "threads" else str(value)
    kind = type(default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != isinstance(default, bool):
        raise ConfigError(f"{where}: {name} must be {kind.__name__}, not {value!r}")
    return value


def settings_from_dict(data: dict[str, Any], where: str = "settings") -> Settings:
    """Build Settings from a TOML table; unknown keys are an error (a typo would pass silently)."""
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in _FIELDS:
            raise ConfigError(f"{where}: unknown setting {key!r}")
        values[key] = _coerce(key, value, where)
    settings = Settings(**values)
    try:
        settings.validate()
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc.message}") from None
    return settings


def load_settings(path: Path | None = None) -> Settings:
    """Read settings; a missing file means defaults; malformed → ConfigError naming file, line."""
    path = path or config_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Settings()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib's message already ends with "(at line N, column M)".
        raise ConfigError(f"{path}: {exc}") from None
    table = data.get("chat", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [chat] must be a table")
    return settings_from_dict(table, where=f"{path} [chat]")


def save_settings(settings: Settings, path: Path | None = None) -> Path:
    """Write settings as TOML (atomically: a crash never leaves half a file)."""
    import tomli_w  # deferred: only the settings screen writes

    path = path or config_path()
    settings.validate()
    table = {k: v for k, v in dataclasses.asdict(settings).items() if v is not None}
    atomic_write(path, tomli_w.dumps({"chat": table}))
    return path


# -- what the settings mean to the engine (imported lazily: config is read before any model) ------
def sampling_params(settings: Settings) -> Any:
    """The engine's SamplingParams for these settings."""
    from .engine import SamplingParams

    return SamplingParams(temperature=settings.temperature, top_k=settings.top_k,
                          top_p=settings.top_p, min_p=settings.min_p,
                          repeat_penalty=settings.repeat_penalty)


def draft_settings(settings: Settings, has_draft_model: bool) -> Any:
    """The engine's DraftSettings: auto/fixed use the draft model when there is one, else lookup."""
    from .engine import DraftSettings

    if settings.draft_mode == "off":
        return DraftSettings(mode="none")
    if settings.draft_mode == "lookup" or not has_draft_model:
        k = settings.k if settings.draft_mode == "fixed" else None
        return DraftSettings(mode="lookup", k=k)
    return DraftSettings(mode="model", k=settings.k if settings.draft_mode == "fixed" else None)


def model_settings(settings: Settings) -> tuple[Any, Any]:
    """(target, draft) ModelSettings for loading."""
    from .engine import ModelSettings

    return (ModelSettings(n_gpu_layers=settings.gpu_layers_target, n_ctx=settings.ctx,
                          n_threads=settings.threads),
            ModelSettings(n_gpu_layers=settings.gpu_layers_draft, n_ctx=settings.ctx,
                          n_threads=settings.threads))
