"""Every parameter a user can set, defined once: its type, range, default and meaning (a leaf).

The CLI's flags, ``config.toml``, the chat app's settings screen, the server's request fields and
the engine's own checks all validate through :data:`PARAMS`, so a value is accepted or refused the
same way everywhere, and a refusal always names the parameter, the value and the allowed range.

This module imports nothing of localspec but ``errors``: the engine checks its settings here, and
the front ends (``options``: settings to the engine's objects; ``cli.params``: flags) build on it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from .errors import LocalspecError

# "k": a whole number or auto (None), as K and the GPU layer counts are.
Kind = Literal["int", "float", "bool", "str", "choice", "k"]
ACCEPT_RULES = ("auto", "coupled", "rejection", "match")
REPACK_MODES = ("auto", "on", "off")

DEFAULT_MAX_TOKENS = 1024  # run, the chat app and the server (a request without max_tokens)
BENCH_MAX_TOKENS = 128  # bench: tokens per measured run
DEMO_MAX_TOKENS = 200  # demo: the tiny pair's comparison
MAX_K = 32

# The fields of the engine's SamplingParams, each a parameter here.
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                   "frequency_penalty", "presence_penalty", "seed")


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
    _p("gpu_layers", "k", None, "target layers offloaded to the GPU: auto (what fits in the free "
       "VRAM after the draft), or a number (-1 all, 0 none)", -1, 1 << 16),
    _p("draft_gpu_layers", "k", None, "draft layers offloaded to the GPU: auto (all when it "
       "fits, placed before the target), or a number (-1 all, 0 none)", -1, 1 << 16),
    _p("threads", "int", None, "CPU threads (empty: the physical cores)", 1, 1024, optional=True),
    _p("prompt_cache", "int", 1024, "MiB of RAM per model for the KV states of earlier "
       "prompts: a request that resends a long prefix after other requests (a chat's "
       "history, an agent's file) skips its prefill (0: off)", 0, 1 << 20),
    _p("repack", "choice", "auto", "llama.cpp's repacked CPU kernels for quantized models: "
       "auto (on where this machine's self-test passes), on, off", choices=REPACK_MODES),
    # drafting. draft_mode's choices are the engine's drafter registry's: set_choices below.
    _p("draft_mode", "choice", "model", "model: the draft model (prompt lookup when there is "
       "none); lookup: n-gram prompt lookup; history: earlier requests only; none: plain "
       "decoding. Under auto K the history (--history) drafts beside model and lookup",
       choices=("none",)),
    _p("k", "k", None, "tokens drafted per step: auto, or a fixed K like llama.cpp's --draft",
       0, MAX_K, flag="--draft-k"),
    _p("k_max", "int", 12, "the longest draft model chain auto may choose (a copy from the "
       "prompt or the history may run to the widest pass measured, 64 at most)", 1, MAX_K),
    _p("accept_rule", "choice", "auto", "sampling only: coupled (Gumbel-max, reproducible with "
       "a seed whatever is drafted), rejection (min(1, p/q)), match (sample and compare); auto: "
       "coupled", choices=ACCEPT_RULES),
    _p("exact", "bool", False, "auto drafting only where batched and one-token logits agree "
       "(plain decoding of quantized CPU targets)"),
    _p("history", "choice", "on", "draft from an index of earlier requests and saved chats "
       "(suffix decoding), and add this request to it; off: neither", choices=("on", "off")),
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


def check_sampling(sp: object) -> None:
    """The engine's check of a SamplingParams: each field by its parameter (NaN and infinity
    included)."""
    for name in SAMPLING_FIELDS:
        PARAMS[name].check(getattr(sp, name))


def set_choices(name: str, choices: tuple[str, ...]) -> None:
    """Replace a choice parameter's allowed values.

    For values another layer owns: the draft modes are the drafter registry's (a drafter module
    registers its name), and this leaf cannot import the engine, so the registry calls this each
    time it changes. Every front end then offers and checks the modes as they are now."""
    PARAMS[name] = dataclasses.replace(PARAMS[name], choices=choices)
