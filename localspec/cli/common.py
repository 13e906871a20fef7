"""Argument groups shared by the subcommands that load models, and what they mean.

Every option here is a parameter of :mod:`localspec.options` (its range, default and help come
from there); an option the user did not give is None and falls back to ``config.toml`` (``run``
and ``serve``) or the defaults (``bench``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import LocalspecError, ModelNotFoundError
from ..loading import EngineSpec, spec_from_pair
from ..options import Settings
from .params import add_argument, apply_args


def add_model_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("models")
    g.add_argument("--target", metavar="MODEL", help="target model: .gguf path or Ollama name")
    g.add_argument("--draft", metavar="MODEL", help="draft model: .gguf path or Ollama name")
    for name in ("ctx", "gpu_layers", "draft_gpu_layers", "threads", "repack", "prompt_cache"):
        add_argument(g, name)


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    add_argument(g, "temperature", "--temp")
    for name in ("top_k", "top_p", "min_p", "repeat_penalty", "seed"):
        add_argument(g, name)
    add_argument(g, "max_tokens", "-n")


def add_draft_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("drafting")
    add_argument(g, "draft_mode", help_extra="; given: also whether the draft model is loaded")
    add_argument(g, "k", "-k")
    for name in ("k_max", "accept_rule", "exact", "history"):
        add_argument(g, name)


def settings_from(args: argparse.Namespace, read_config: bool) -> Settings:
    """The settings a command runs with: config.toml (when it reads it), then the flags."""
    base = Settings()
    if read_config:
        from ..config import load_settings

        base = load_settings()
    return apply_args(base, args)


def engine_spec(args: argparse.Namespace, pair: str | None, settings: Settings) -> EngineSpec:
    """Build the EngineSpec from --target/--draft or a pair name (or one model's name)."""
    from ..options import model_settings
    from ..requests import recommended_mode  # deferred: the engine loads when a command runs

    _check_model_flags(args, pair)
    ts, ds = model_settings(settings)
    if args.target:
        mode = _load_mode(args, recommended_mode(bool(args.draft)), settings)
        if args.draft_mode == "model" and not args.draft:
            raise LocalspecError("--draft-mode model needs --draft (or use --draft-mode lookup)")
        return EngineSpec(target=args.target, draft=args.draft, target_settings=ts,
                          draft_settings=ds, draft_mode=mode)
    if not pair:
        raise LocalspecError("name a pair (see `localspec list`) or give --target and --draft")
    try:
        spec = spec_from_pair(pair, ts, ds)
    except ModelNotFoundError as not_a_pair:
        # A single model by name (an Ollama name or a .gguf path) runs with prompt lookup.
        from ..models.names import resolve_model

        try:
            resolve_model(pair)
        except ModelNotFoundError:
            raise not_a_pair from None  # neither a pair nor a model: say so for the pair
        return EngineSpec(target=pair, draft=None, target_settings=ts, draft_settings=ds,
                          draft_mode=_load_mode(args, recommended_mode(False), settings))
    return EngineSpec(target=spec.target, draft=spec.draft, target_settings=ts,
                      draft_settings=ds, pair_name=spec.pair_name,
                      draft_mode=_load_mode(args, spec.draft_mode, settings))


def _check_model_flags(args: argparse.Namespace, pair: str | None) -> None:
    """Models named twice are refused: a --draft without --target would otherwise be dropped
    silently (the pair's draft, or prompt lookup, running instead of the one asked for)."""
    if args.target and pair:
        raise LocalspecError("give either a pair name or --target/--draft, not both")
    if args.draft and not args.target:
        if pair:
            raise LocalspecError("give either a pair name (or one model) or --target/--draft, "
                                 "not both: --draft needs --target")
        raise LocalspecError("--draft needs --target")


def _load_mode(args: argparse.Namespace, recommended: str, settings: Settings) -> str:
    """What to draft with: the flag; else the settings' choice where it overrides the pair's
    (lookup or none); else what the pair (or the files given) recommend."""
    if args.draft_mode:
        return str(args.draft_mode)
    if settings.draft_mode != "model":
        return settings.draft_mode
    return recommended


def read_prompt_file(path: str) -> str:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise LocalspecError(f"cannot read prompt file {path}: {exc.strerror}") from exc
    return decode_text(data, f"prompt file {path}")


def decode_text(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LocalspecError(f"{what} is not UTF-8 text (byte 0x{data[exc.start]:02x} at "
                             f"offset {exc.start}); convert it to UTF-8") from None


def stdin_text() -> str | None:
    if sys.stdin is None or sys.stdin.isatty():
        return None
    return decode_text(sys.stdin.buffer.read(), "the prompt on stdin")
