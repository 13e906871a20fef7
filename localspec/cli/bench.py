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
    r = p.add_argument_group("remote (any OpenAI-compatible server)")
    r.add_argument("--url", help="benchmark this server instead of loading models here")
    r.add_argument("--baseline-url",
                   help="the same target served without drafting, for the speedup column")
    r.add_argument("--api-key", default=None, help="Bearer key for --url/--baseline-url")
    r.add_argument("--model", default=None, help="model name to request (default: the first)")
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
    from ..engine import DraftSettings
    from ..errors import LocalspecError
    from ..loading import load_engine

    if args.repeats < 1:
        raise LocalspecError("--repeats must be at least 1")
    prompts = _prompts(args)
    if not prompts:
        raise LocalspecError("no prompts selected")
    if args.url:
        return _run_remote(args, prompts)
    spec = engine_spec(args, args.pair)
    cfg = BenchConfig(
        max_tokens=args.max_tokens, repeats=args.repeats, raw=args.raw,
        sampling=_sampling(args),
        draft=DraftSettings(mode=spec.draft_mode, k=args.draft_k,  # type: ignore[arg-type]
                            k_max=args.k_max, rule=args.accept_rule),
    )
    err = Console(stderr=True)
    with load_engine(spec) as engine, Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=err, transient=True,
    ) as progress:
        task = progress.add_task("bench", total=len(prompts) * args.repeats * 2)
        result = run_bench(engine, prompts, cfg,
                           on_step=lambda d: progress.update(task, advance=1, description=d))
    _remember_plain_rate(spec.display_name, result)
    _output(result, args)
    return 0


def _remember_plain_rate(pair: str, result: dict) -> None:  # type: ignore[type-arg]
    """The chat app shows plain decoding's rate beside the live one once it has been measured."""
    from ..chat_store import ChatStore

    rates = [p["plain_decode_tokens_per_second"] for p in result["prompts"]]
    if not rates:
        return
    store = ChatStore()
    try:
        store.record_rate(pair, "plain", sum(rates) / len(rates))
    finally:
        store.close()


def _sampling(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from ..engine import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed)


def _run_remote(args: argparse.Namespace, prompts) -> int:  # type: ignore[no-untyped-def]
    from ..benchmarking import BenchConfig, run_remote_bench
    from ..remote import RemoteEngine

    cfg = BenchConfig(max_tokens=args.max_tokens, repeats=args.repeats, raw=args.raw,
                      sampling=_sampling(args))
    with RemoteEngine(args.url, args.api_key, args.model) as remote:
        baseline = (RemoteEngine(args.baseline_url, args.api_key, args.model)
                    if args.baseline_url else None)
        try:
            result = run_remote_bench(remote, prompts, cfg, baseline)
        finally:
            if baseline is not None:
                baseline.close()
    _output(result, args)
    return 0


def _output(result: dict, args: argparse.Namespace) -> None:  # type: ignore[type-arg]
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_table(result)


def _print_table(result: dict) -> None:  # type: ignore[type-arg]
    from rich.console import Console
    from rich.table import Table

    where = "remote" if result.get("remote") else f"{result['draft_mode']}, K={result['k']}"
    t = Table(title=f"localspec bench ({where}, temperature {result['temperature']})")
    for col in ("prompt", "kind", "tokens", "plain tok/s", "spec tok/s", "speedup",
                "decode speedup", "acceptance", "mean K", "TTFT plain/spec ms", "identical"):
        t.add_column(col, justify="left" if col in ("prompt", "kind") else "right")
    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    def yes(x: bool | None) -> str:
        return "-" if x is None else ("yes" if x else "NO")

    for p in result["prompts"]:
        t.add_row(p["name"], p["kind"], str(p["tokens"]), f"{p['plain_tokens_per_second']:.1f}",
                  f"{p['spec_tokens_per_second']:.1f}", ratio(p["speedup"]),
                  ratio(p["decode_speedup"]), f"{p['acceptance_rate']:.0%}",
                  f"{p['mean_k']:.2f}",
                  f"{p['plain_ttft_seconds'] * 1000:.0f}/{p['spec_ttft_seconds'] * 1000:.0f}",
                  yes(p["identical"]))
    # Wide enough for every column even when piped (rich assumes 80 columns off a terminal).
    Console(width=None if sys.stdout.isatty() else 150).print(t)
    if result["speedup"] is None:
        print(f"overall: {result['spec_tokens_per_second']:.1f} tok/s "
              "(no --baseline-url, so no speedup)")
        return
    print(f"overall: {result['plain_tokens_per_second']:.1f} -> "
          f"{result['spec_tokens_per_second']:.1f} tok/s, speedup {result['speedup']:.2f}x, "
          f"identical output: {'yes' if result['all_identical'] else 'NO'}")
