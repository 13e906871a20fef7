"""Argument groups shared by the subcommands that load models."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..engine.llama_backend import ModelSettings
from ..errors import LocalspecError, ModelNotFoundError
from ..loading import EngineSpec, spec_from_pair
from ..models.names import resolve_model


def add_model_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("models")
    g.add_argument("--target", metavar="MODEL", help="target model: .gguf path or Ollama name")
    g.add_argument("--draft", metavar="MODEL", help="draft model: .gguf path or Ollama name")
    g.add_argument("--ctx", type=int, default=4096, help="context size in tokens (default 4096)")
    g.add_argument("--gpu-layers", type=int, default=-1,
                   help="target layers to offload to the GPU (-1 all, 0 none; default -1)")
    g.add_argument("--draft-gpu-layers", type=int, default=-1,
                   help="draft layers to offload to the GPU (default -1)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads (default: cores)")


def add_sampling_options(parser: argparse.ArgumentParser, default_temperature: float = 0.0) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", "--temp", type=float, default=default_temperature,
                   help=f"0 is greedy: the target's exact text (default {default_temperature})")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    g.add_argument("--max-tokens", "-n", type=int, default=256, help="new tokens at most")


def _k_value(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("K must be 'auto' or a whole number") from None
    if not 0 <= k <= 32:
        raise argparse.ArgumentTypeError("K must be between 0 and 32")
    return k


def add_draft_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("drafting")
    g.add_argument("--draft-mode", choices=("model", "lookup", "none"), default=None,
                   help="model: the draft model (with prompt lookup as a fallback); lookup: "
                        "n-gram prompt lookup only; none: plain decoding (default: the pair's "
                        "recommendation, else model when a draft is given)")
    g.add_argument("-k", "--draft-k", type=_k_value, default=None, metavar="K|auto",
                   help="tokens drafted per step; auto (default) chooses each step")
    g.add_argument("--k-max", type=int, default=12, help="largest K auto may choose (default 12)")
    g.add_argument("--accept-rule", choices=("rejection", "match"), default="rejection",
                   help="sampling only: rejection sampling (min(1, p/q), default) or "
                        "sample-and-match (llama-cpp-python's draft_model rule)")


def model_settings(args: argparse.Namespace) -> tuple[ModelSettings, ModelSettings]:
    target = ModelSettings(n_gpu_layers=args.gpu_layers, n_ctx=args.ctx, n_threads=args.threads)
    draft = ModelSettings(n_gpu_layers=args.draft_gpu_layers, n_ctx=args.ctx,
                          n_threads=args.threads)
    return target, draft


def engine_spec(args: argparse.Namespace, pair: str | None) -> EngineSpec:
    """Build the EngineSpec from --target/--draft or a pair name."""
    ts, ds = model_settings(args)
    if args.target:
        if pair:
            raise LocalspecError("give either a pair name or --target/--draft, not both")
        mode = args.draft_mode or ("model" if args.draft else "lookup")
        if mode == "model" and not args.draft:
            raise LocalspecError("--draft-mode model needs --draft (or use --draft-mode lookup)")
        return EngineSpec(target=args.target, draft=args.draft, target_settings=ts,
                          draft_settings=ds, draft_mode=mode)
    if not pair:
        raise LocalspecError("name a pair (see `localspec list`) or give --target and --draft")
    try:
        spec = spec_from_pair(pair, ts, ds)
    except ModelNotFoundError as not_a_pair:
        # A single model by name (an Ollama name or a .gguf path) runs with prompt lookup.
        try:
            resolve_model(pair)
        except LocalspecError:
            raise not_a_pair from None
        return EngineSpec(target=pair, draft=None, target_settings=ts, draft_settings=ds,
                          draft_mode=args.draft_mode or "lookup")
    if args.draft_mode:
        spec = EngineSpec(target=spec.target, draft=spec.draft, target_settings=ts,
                          draft_settings=ds, pair_name=spec.pair_name, draft_mode=args.draft_mode)
    return spec


def read_prompt_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise LocalspecError(f"cannot read prompt file {path}: {exc.strerror}") from exc


def stdin_text() -> str | None:
    if sys.stdin is None or sys.stdin.isatty():
        return None
    return sys.stdin.read()
