"""Every parameter a user can set, defined once: its type, range, default and meaning.

The CLI's flags, ``config.toml``, the chat app's settings screen and the server's request fields
all validate through :data:`PARAMS`, so a value is accepted or refused the same way everywhere,
and a refusal always names the parameter, the value and the allowed range. This module also turns
settings into the engine's parameter objects (``ModelSettings``, ``SamplingParams``,
``DraftSettings``): there is one default for each (one ``max_tokens`` default, not five).

Precedence: a CLI flag beats ``config.toml`` (``[chat]``), which beats the defaults here. ``run``,
``serve`` and the chat app read ``config.toml``; ``bench`` does not (a benchmark is reproducible
from its command line alone), and ``demo`` uses its own fixed settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .engine.drafters import DraftMode, draft_modes
from .errors import LocalspecError

if TYPE_CHECKING:
    from .engine.decoder import DraftSettings
    from .engine.llama_backend import ModelSettings
    from .engine.sampling import SamplingParams

Kind = Literal["int", "float", "bool", "str", "choice", "k"]
# The registered drafters' names and "none" (DraftSettings checks against the registry as it
# is then, so a drafter registered later is a mode there too).
DRAFT_MODES: tuple[DraftMode, ...] = draft_modes()
ACCEPT_RULES = ("auto", "coupled", "rejection", "match")
REPACK_MODES = ("auto", "on", "off")

DEFAULT_MAX_TOKENS = 1024  # run, the chat app and the server (a request without max_tokens)
BENCH_MAX_TOKENS = 128  # bench: tokens per measured run
DEMO_MAX_TOKENS = 200  # demo: the tiny pair's comparison
MAX_K = 32


class InvalidOptionError(LocalspecError, ValueError):
    """A parameter value outside its range. The CLI exits with 2 (a usage error), the server
    answers 400, the chat app shows a modal."""

    title = "Invalid setting"
    exit_code = 2

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter. ``low``/``high`` bound numbers (inclusive unless ``low_open``); ``optional``
    admits None (meaning "decide automatically"); ``k`` is an int or ``auto`` (None)."""

    name: str
    kind: Kind
    default: Any
    meaning: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] = ()
    optional: bool = False
    flag: str | None = None  # the CLI flag, when it is not --name-with-dashes

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def allowed(self) -> str:
        """The allowed values, as a phrase for error messages."""
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "bool":
            return "true or false"
        if self.kind == "str":
            return "text"
        what = "a whole number" if self.kind in ("int", "k") else "a finite number"
        lo = "" if self.low is None else f"{'>' if self.low_open else '>='} {_num(self.low)}"
        hi = "" if self.high is None else f"<= {_num(self.high)}"
        bounds = " and ".join(b for b in (lo, hi) if b)
        if self.kind == "k":
            return f"auto or {what} {bounds}".rstrip()
        return f"{what} {bounds}".rstrip() + (" (or empty for automatic)" if self.optional else "")

    def check(self, value: Any, label: str | None = None) -> Any:
        """``value`` if it is valid for this parameter, else InvalidOptionError naming it."""
        label = label or self.name
        if value is None and (self.optional or self.kind == "k"):
            return None
        ok = self._valid(value)
        if not ok:
            raise InvalidOptionError(f"{label} must be {self.allowed()}, got {value!r}",
                                     self.name)
        return float(value) if self.kind == "float" else value

    def _valid(self, value: Any) -> bool:
        if self.kind == "choice":
            return isinstance(value, str) and value in self.choices
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "str":
            return isinstance(value, str)
        if isinstance(value, bool):
            return False
        if self.kind in ("int", "k"):
            if not isinstance(value, int):
                return False
        elif not isinstance(value, int | float) or not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def parse(self, text: str, label: str | None = None) -> Any:
        """A value typed by a user (a CLI argument, a settings field) checked against the range."""
        label = label or self.name
        raw = text.strip()
        if raw == "" and self.optional:
            return None
        if self.kind == "k" and raw.lower() == "auto":
            return None
        value: Any = raw
        try:
            if self.kind in ("int", "k"):
                value = int(raw)
            elif self.kind == "float":
                value = float(raw)
            elif self.kind == "bool":
                value = {"true": True, "yes": True, "on": True, "1": True, "false": False,
                         "no": False, "off": False, "0": False}[raw.lower()]
        except (ValueError, KeyError):
            raise InvalidOptionError(f"{label} must be {self.allowed()}, got {text!r}",
                                     self.name) from None
        return self.check(value, label)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _p(*args: Any, **kw: Any) -> Param:
    return Param(*args, **kw)


PARAMS: dict[str, Param] = {p.name: p for p in (
    # models
    _p("ctx", "int", 4096, "context size in tokens (both models)", 64, 1 << 20),
    _p("gpu_layers", "int", -1, "target layers offloaded to the GPU (-1 all, 0 none)", -1, 1 << 16),
    _p("draft_gpu_layers", "int", -1, "draft layers offloaded to the GPU (-1 all, 0 none)",
       -1, 1 << 16),
    _p("threads", "int", None, "CPU threads (empty: the physical cores)", 1, 1024, optional=True),
    _p("repack", "choice", "auto", "llama.cpp's repacked CPU kernels for quantized models: "
       "auto (on where this machine's self-test passes), on, off", choices=REPACK_MODES),
    # drafting
    _p("draft_mode", "choice", "model", "model: the draft model (prompt lookup when there is "
       "none); lookup: n-gram prompt lookup only; none: plain decoding", choices=DRAFT_MODES),
    _p("k", "k", None, "tokens drafted per step: auto, or a fixed K like llama.cpp's --draft",
       0, MAX_K, flag="--draft-k"),
    _p("k_max", "int", 12, "the longest draft auto may choose", 1, MAX_K),
    _p("accept_rule", "choice", "auto", "sampling only: coupled (Gumbel-max, reproducible with "
       "a seed whatever is drafted), rejection (min(1, p/q)), match (sample and compare); auto: "
       "coupled", choices=ACCEPT_RULES),
    _p("exact", "bool", False, "auto drafting only where batched and one-token logits agree "
       "(plain decoding of quantized CPU targets)"),
    # sampling
    _p("temperature", "float", 0.0, "0 is greedy: the target's exact text", 0, 2),
    _p("top_k", "int", 40, "keep the K most likely tokens (0: off)", 0, 1 << 20),
    _p("top_p", "float", 0.95, "keep the most likely tokens up to this probability mass", 0, 1,
       low_open=True),
    _p("min_p", "float", 0.05, "drop tokens below this fraction of the best one's probability",
       0, 0.999),
    _p("repeat_penalty", "float", 1.0, "penalise repeating the last 64 tokens (1: off)",
       0, 10, low_open=True),
    _p("repeat_last_n", "int", 64, "tokens the repetition penalties look back over", 0, 1 << 20),
    _p("frequency_penalty", "float", 0.0, "OpenAI's frequency penalty", -2, 2),
    _p("presence_penalty", "float", 0.0, "OpenAI's presence penalty", -2, 2),
    _p("seed", "int", None, "random seed: the same seed gives the same text", -(1 << 63),
       (1 << 64) - 1, optional=True),
    _p("max_tokens", "int", DEFAULT_MAX_TOKENS, "new tokens at most", 1, 1 << 20),
    # the chat app
    _p("system_prompt", "str", "You are a helpful assistant.", "the chat app's system prompt"),
    _p("last_pair", "str", None, "the pair the chat app opens with", optional=True),
    # serving
    _p("port", "int", 8080, "TCP port to listen on (0: any free port)", 0, 65535),
)}


def param(name: str) -> Param:
    return PARAMS[name]


def check(name: str, value: Any, label: str | None = None) -> Any:
    return PARAMS[name].check(value, label)


# -- settings: the values of all parameters ------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Settings:
    """A full set of parameter values (defaults from :data:`PARAMS`).

    What ``config.toml``'s ``[chat]`` table holds and the chat app's settings screen edits; the
    CLI starts from it and applies its flags."""

    ctx: int = PARAMS["ctx"].default
    gpu_layers: int = PARAMS["gpu_layers"].default
    draft_gpu_layers: int = PARAMS["draft_gpu_layers"].default
    threads: int | None = PARAMS["threads"].default
    repack: str = PARAMS["repack"].default
    draft_mode: str = PARAMS["draft_mode"].default
    k: int | None = PARAMS["k"].default
    k_max: int = PARAMS["k_max"].default
    accept_rule: str = PARAMS["accept_rule"].default
    exact: bool = PARAMS["exact"].default
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
    """(target, draft) loading settings."""
    from .engine.llama_backend import ModelSettings

    def one(layers: int) -> ModelSettings:
        return ModelSettings(n_gpu_layers=layers, n_ctx=s.ctx, n_threads=s.threads,
                             repack=s.repack)  # type: ignore[arg-type]

    return one(s.gpu_layers), one(s.draft_gpu_layers)


def sampling_params(s: Settings) -> SamplingParams:
    from .engine.sampling import SamplingParams

    return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                          min_p=s.min_p, repeat_penalty=s.repeat_penalty, seed=s.seed)


def draft_settings(s: Settings, has_draft_model: bool) -> DraftSettings:
    """How to draft: the draft model when one is loaded (else prompt lookup), or as chosen."""
    from .engine.decoder import DraftSettings

    mode = s.draft_mode
    if mode == "model" and not has_draft_model:
        mode = "lookup"
    return DraftSettings(mode=mode, k=s.k, k_max=s.k_max,  # type: ignore[arg-type]
                         rule=s.accept_rule, exact=s.exact)  # type: ignore[arg-type]


def check_sampling(sp: SamplingParams) -> None:
    """The engine's own check of a SamplingParams (NaN and infinity included)."""
    for name in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                 "frequency_penalty", "presence_penalty", "seed"):
        PARAMS[name].check(getattr(sp, name))


# -- the CLI ---------------------------------------------------------------------------------------
def cli_type(name: str) -> Callable[[str], Any]:
    """An argparse ``type=`` that validates through the parameter's range."""
    p = PARAMS[name]

    def convert(text: str) -> Any:
        try:
            return p.parse(text, label=p.cli_flag)
        except InvalidOptionError:
            # argparse names the flag itself ("argument --port: ..."), so the rest is the rule.
            raise argparse.ArgumentTypeError(f"must be {p.allowed()}, got {text}") from None

    convert.__name__ = name  # argparse names the type in some messages
    return convert


def add_argument(group: Any, name: str, *aliases: str, help_extra: str = "") -> None:
    """Add ``--name`` for a parameter. Its default is None: "not given, use the settings"."""
    p = PARAMS[name]
    flags = [p.cli_flag, *aliases]
    kwargs: dict[str, Any] = {"dest": name, "default": None}
    if p.kind == "bool":
        group.add_argument(*flags, action="store_const", const=True,
                           help=p.meaning + help_extra, **kwargs)
        return
    if p.kind == "choice":
        kwargs["choices"] = p.choices
    else:
        kwargs["type"] = cli_type(name)
    metavar = {"k": "K|auto"}.get(p.kind)
    default = "auto" if p.kind == "k" and p.default is None else p.default
    shown = f" (default {default})" if default not in (None, "") else ""
    group.add_argument(*flags, metavar=metavar, help=p.meaning + shown + help_extra, **kwargs)


def apply_args(base: Settings, args: argparse.Namespace) -> Settings:
    """``base`` with every parameter flag the user gave (None means not given)."""
    changes = {name: getattr(args, name) for name in SETTINGS_FIELDS
               if getattr(args, name, None) is not None}
    return dataclasses.replace(base, **changes).validate()


def settings_from_mapping(data: Mapping[str, Any], where: Callable[[str], str]) -> Settings:
    """Settings from a mapping (a TOML table). ``where(key)`` labels errors (file and line)."""
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in PARAMS or key not in SETTINGS_FIELDS:
            raise InvalidOptionError(f"{where(key)}: unknown setting {key!r}", key)
        p = PARAMS[key]
        if p.kind == "float" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if p.kind == "k" and isinstance(value, str) and value.lower() == "auto":
            value = None
        try:
            values[key] = p.check(value)
        except InvalidOptionError as exc:
            raise InvalidOptionError(f"{where(key)}: {exc.message}", key) from None
    return Settings(**values)
