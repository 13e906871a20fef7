"""``localspec bench``: the target alone vs the engine, same prompts, one process."""

from __future__ import annotations

import argparse
import json
import sys

from .common import (
    add_draft_options,
    add_model_options,
    add_sampling_options,
    engine_spec,
    read_prompt_file,
)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="speculative vs target alone: tokens/s, speedup, acceptance",
                       description="Runs the same prompts through the target alone and through "
                                   "the engine in one process and prints them side by side.")
    p.add_argument("pair", nargs="?", help="pair name (or use --target/--draft)")
    add_model_options(p)
    add_draft_options(p)
    add_sampling_options(p)
    p.set_defaults(max_tokens=128)
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt of your own (repeatable); replaces the built-in set")
    p.add_argument("--prompt-file", action="append", default=[], metavar="FILE",
                   help="a file whose whole text is one prompt (repeatable)")
    p.add_argument("--kind", action="append", default=[],
                   help="only built-in prompts of this kind: code, prose, edit (repeatable)")
    p.add_argument("--repeats", type=int, default=1, help="runs per prompt; medians are shown")
    p.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(func=run)


def _prompts(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from ..benchmarking import BUILTIN_PROMPTS, BenchPrompt

    own = [BenchPrompt(f"prompt{i + 1}", "user", t) for i, t in enumerate(args.prompt)]
    own += [BenchPrompt(f, "user", read_prompt_file(f)) for f in args.prompt_file]
    if own:
        return own
    if args.kind:
        return [p for p in BUILTIN_PROMPTS if p.kind in args.kind]
    return list(BUILTIN_PROMPTS)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ..benchmarking import BenchConfig, run_bench
    from ..engine import DraftSettings, SamplingParams
    from ..errors import LocalspecError
    from ..loading import load_engine

    if args.repeats < 1:
        raise LocalspecError("--repeats must be at least 1")
    spec = engine_spec(args, args.pair)
    prompts = _prompts(args)
    if not prompts:
        raise LocalspecError("no prompts selected")
    cfg = BenchConfig(
        max_tokens=args.max_tokens, repeats=args.repeats, raw=args.raw,
        sampling=SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                                seed=args.seed),
        draft=DraftSettings(mode=spec.draft_mode, k=args.draft_k,  # type: ignore[arg-type]
                            k_max=args.k_max),
    )
    err = Console(stderr=True)
    with load_engine(spec) as engine, Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=err, transient=True,
    ) as progress:
        task = progress.add_task("bench", total=len(prompts) * args.repeats * 2)
        result = run_bench(engine, prompts, cfg,
                           on_step=lambda d: progress.update(task, advance=1, description=d))
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_table(result)
    return 0


def _print_table(result: dict) -> None:  # type: ignore[type-arg]
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"localspec bench ({result['draft_mode']}, K={result['k']}, "
                    f"temperature {result['temperature']})")
    for col in ("prompt", "kind", "tokens", "plain tok/s", "spec tok/s", "speedup",
                "decode speedup", "acceptance", "mean K", "TTFT plain/spec ms", "identical"):
        t.add_column(col, justify="left" if col in ("prompt", "kind") else "right")
    for p in result["prompts"]:
        t.add_row(p["name"], p["kind"], str(p["tokens"]), f"{p['plain_tokens_per_second']:.1f}",
                  f"{p['spec_tokens_per_second']:.1f}", f"{p['speedup']:.2f}x",
                  f"{p['decode_speedup']:.2f}x", f"{p['acceptance_rate']:.0%}",
                  f"{p['mean_k']:.2f}",
                  f"{p['plain_ttft_seconds'] * 1000:.0f}/{p['spec_ttft_seconds'] * 1000:.0f}",
                  "yes" if p["identical"] else "NO")
    # Wide enough for every column even when piped (rich assumes 80 columns off a terminal).
    Console(width=None if sys.stdout.isatty() else 150).print(t)
    print(f"overall: {result['plain_tokens_per_second']:.1f} -> "
          f"{result['spec_tokens_per_second']:.1f} tok/s, speedup {result['speedup']:.2f}x, "
          f"identical output: {'yes' if result['all_identical'] else 'NO'}")
