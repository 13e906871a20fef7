"""``localspec bench``: the target alone vs the engine, same prompts, one process."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from ..errors import LocalspecError
from ..params import BENCH_MAX_TOKENS, MAX_K
from .common import (
    add_draft_options,
    add_model_options,
    add_sampling_options,
    engine_spec,
    read_prompt_file,
    settings_from,
)

if TYPE_CHECKING:  # the engine (and llama_cpp) load only when a command runs
    from ..engine import SpeculativeEngine

def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="speculative vs target alone: tokens/s, speedup, acceptance",
                       description="Runs the same prompts through the target alone and through "
                                   "the engine in one process and prints them side by side. "
                                   "Reads no config.toml: a benchmark is its command line.")
    p.add_argument("pair", nargs="?", help="pair name (or use --target/--draft)")
    add_model_options(p)
    add_draft_options(p)
    add_sampling_options(p)
    # History off unless asked: a run would draft from the runs before it. On, it is this
    # process's memory only (a benchmark is its command line, not the user's history).
    p.set_defaults(max_tokens=BENCH_MAX_TOKENS, history="off")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", type=_prompt,
                   help="a prompt of your own (repeatable); replaces the built-in set")
    p.add_argument("--prompt-file", action="append", default=[], metavar="FILE",
                   help="a file whose whole text is one prompt (repeatable)")
    p.add_argument("--kind", action="append", default=[], choices=("code", "prose", "edit"),
                   help="only built-in prompts of this kind (repeatable)")
    p.add_argument("--repeats", type=_positive, default=1,
                   help="runs per prompt; medians are shown")
    p.add_argument("--baseline", choices=("llama-cpp-python", "engine"),
                   default="llama-cpp-python",
                   help="the target alone: llama-cpp-python's own Llama.generate on the same "
                        "file (default; what a library user runs), or this engine with "
                        "drafting off")
    p.add_argument("--sweep-k", type=_k_list, default=(), metavar="K,K,...",
                   help="also run each fixed K beside auto, and compare auto with the best")
    p.add_argument("--tree", choices=("on", "off"), default="on",
                   help="auto may draft token trees where the measured costs make them pay "
                        "(default on); off: always a chain")
    p.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    r = p.add_argument_group("remote (any OpenAI-compatible server)")
    r.add_argument("--url", help="benchmark this server instead of loading models here")
    r.add_argument("--baseline-url",
                   help="the same target served without drafting, for the speedup column")
    r.add_argument("--api-key", default=None, help="Bearer key for --url/--baseline-url")
    r.add_argument("--model", default=None, help="model name to request (default: the first)")
    p.set_defaults(func=run)


def _prompt(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("--prompt must not be empty")
    return text


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--repeats must be a whole number >= 1, got {text!r}")
    return n


def _k_list(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        ks = ()
    if not ks or not all(1 <= k <= MAX_K for k in ks):
        raise argparse.ArgumentTypeError(
            f"--sweep-k must be whole numbers in 1..{MAX_K} separated by commas, got {text!r}")
    return ks


def _prompts(args: argparse.Namespace) -> list[Any]:
    from ..benchmarking import BUILTIN_PROMPTS, BenchPrompt

    own = [BenchPrompt(f"prompt{i + 1}", "user", t) for i, t in enumerate(args.prompt)]
    for f in args.prompt_file:
        text = read_prompt_file(f)
        if not text.strip():
            raise LocalspecError(f"prompt file {f} is empty")
        own.append(BenchPrompt(f, "user", text))
    if own:
        return own
    if args.kind:
        return [p for p in BUILTIN_PROMPTS if p.kind in args.kind]
    return list(BUILTIN_PROMPTS)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ..benchmarking import BenchConfig, run_bench
    from ..loading import load_engine
    from ..options import sampling_params
    from ..requests import draft_from_settings, fit_draft

    prompts = _prompts(args)
    if not prompts:
        raise LocalspecError("no prompts selected")
    settings = settings_from(args, read_config=False)
    if args.url:
        return _run_remote(args, prompts, settings)
    from dataclasses import replace

    from ..history import scope_for

    spec = replace(engine_spec(args, args.pair, settings), history=scope_for("bench", settings))
    if settings.repack == "auto":
        from ..engine import repack
        from ..loading import resolve_files

        # A bad file is reported before the self-test's seconds, not after.
        resolve_files(spec)
        repack.settle_before_measuring()
    err = Console(stderr=True)
    with load_engine(spec) as engine:
        cfg = BenchConfig(
            max_tokens=settings.max_tokens, repeats=args.repeats, raw=args.raw,
            sampling=sampling_params(settings),
            draft=replace(fit_draft(draft_from_settings(settings, spec.draft_mode),
                                    engine.draft is not None), tree=args.tree == "on"),
            baseline=args.baseline, sweep=args.sweep_k)
        llama = _baseline_llama(engine) if args.baseline == "llama-cpp-python" else None
        n_runs = len(prompts) * args.repeats * (2 + len(cfg.sweep) + (llama is not None))
        try:
            with Progress(TextColumn("{task.description}"), BarColumn(),
                          TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                          console=err, transient=True) as progress:
                task = progress.add_task("bench", total=n_runs)
                result = run_bench(engine, prompts, cfg, llama=llama,
                                   on_step=lambda d: progress.update(task, advance=1,
                                                                     description=d))
        finally:
            if llama is not None:
                llama.close()
    _remember_plain_rate(spec.display_name, result)
    _output(result, args)
    return 0


def _baseline_llama(engine: SpeculativeEngine) -> Any:
    """llama-cpp-python's Llama on the same target file with the same settings."""
    from ..engine.llama_backend import open_llama

    return open_llama(engine.target.path, engine.target.settings)


def _remember_plain_rate(pair: str, result: dict[str, Any]) -> None:
    """The chat app shows plain decoding's rate beside the live one once it has been measured."""
    from ..chat_store import ChatStore
    from ..errors import ChatStoreError

    rates = [p["plain_decode_tokens_per_second"] for p in result["prompts"]]
    if not rates:
        return
    try:
        store = ChatStore()
    except ChatStoreError:
        return  # a damaged chat history is the chat app's to repair; the bench result stands
    try:
        store.record_rate(pair, "plain", sum(rates) / len(rates))
    finally:
        store.close()


def _run_remote(args: argparse.Namespace, prompts: list[Any], settings: Any) -> int:
    from ..benchmarking import BenchConfig, run_remote_bench
    from ..options import sampling_params
    from ..remote import RemoteEngine

    cfg = BenchConfig(max_tokens=settings.max_tokens, repeats=args.repeats, raw=args.raw,
                      sampling=sampling_params(settings))
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


def _output(result: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_table(result)


def _spread(ratios: list[float | None]) -> str:
    """The lowest and highest of a prompt's per-repeat ratios ("-" without any)."""
    known = [r for r in ratios if r is not None]
    return f"{min(known):.2f}-{max(known):.2f}" if known else "-"


def _per_pass(p: dict[str, Any]) -> str:
    """Tokens per target pass, and the mean nodes a drafting round verified and the rounds a
    near-tie stopped ("-": none)."""
    tpp = p.get("tokens_per_target_pass")
    if not tpp:
        return "-"
    size = p.get("mean_tree_size") or 0.0
    trees = p.get("tree_rounds") or 0
    ties = p.get("tie_stops") or 0
    return (f"{tpp:.2f} ({size:.1f}{', trees' if trees else ''}"
            f"{f', {ties} at near-ties' if ties else ''})")


def _drafters_line(drafters: dict[str, Any]) -> str:
    """Per drafter: accepted of drafted, over the prompt's runs."""
    return ", ".join(f"{name} {d['accepted']}/{d['drafted']} accepted "
                     f"({d['acceptance_rate']:.0%})" for name, d in drafters.items()
                     if d.get("drafted"))


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    remote = result.get("remote")
    where = "remote" if remote else (
        f"{result['draft_mode']}, K={result['k']}, tree {'on' if result.get('tree') else 'off'}"
        f", history {'on' if result.get('history') else 'off'}")
    base = "baseline" if remote else result["baseline"]
    t = Table(title=f"localspec bench ({where}, temperature {result['temperature']}, "
                    f"target alone = {base})")
    sweep = result.get("sweep")
    columns = ["prompt", "kind", "tokens", "alone tok/s", "spec tok/s", "speedup",
               "decode speedup", "acceptance", "mean K", "tokens/pass (nodes)",
               "TTFT alone/spec ms"]
    if not remote:
        columns.append("host ms token/pass/step/draft")
    if sweep:
        columns.append("auto/best K (runs)")
    columns.append("identical")
    for col in columns:
        t.add_column(col, justify="left" if col in ("prompt", "kind") else "right")

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    def yes(x: bool | None) -> str:
        return "-" if x is None else ("yes" if x else "NO")

    for p in result["prompts"]:
        row = [p["name"], p["kind"], str(p["tokens"]), f"{p['plain_tokens_per_second']:.1f}",
               f"{p['spec_tokens_per_second']:.1f}", ratio(p["speedup"]),
               ratio(p["decode_speedup"]), f"{p['acceptance_rate']:.0%}", f"{p['mean_k']:.2f}",
               _per_pass(p),
               f"{p['plain_ttft_seconds'] * 1000:.0f}/{p['spec_ttft_seconds'] * 1000:.0f}"]
        if not remote:
            row.append(f"{p.get('spec_host_ms_per_token', 0.0):.2f}/"
                       f"{p['spec_host_ms_per_step']:.2f}/"
                       f"{p.get('spec_host_ms_per_decode', 0.0):.2f}/"
                       f"{p.get('host_ms_per_draft_token', 0.0):.2f}")
        if sweep:
            row.append(f"{ratio(p['sweep']['auto_vs_best'])} ({p['sweep']['best']}; "
                       f"{_spread(p['sweep']['auto_vs_best_runs'])})")
        row.append(yes(p["identical"]))
        t.add_row(*row)
    # Wide enough for every column even when piped (rich assumes 80 columns off a terminal).
    # The sweep's cell ("1.02x (K=5; 0.98-1.04)") needs 20 more.
    Console(width=None if sys.stdout.isatty() else 215 if sweep else 195).print(t)
    for p in result["prompts"]:
        line = _drafters_line(p.get("drafters") or {})
        if line:
            print(f"{p['name']}: {line}")
    for p in result["prompts"]:
        diff = p.get("first_difference")
        if diff:
            kind = "a numerical near-tie" if diff["near_tie"] else "NOT a near-tie: a bug?"
            print(f"{p['name']}: outputs part at token {diff['position']}, where the target's "
                  f"top-2 margin is {diff['top2_margin']:.4f} (guard {diff['tie_margin']:.4f}): "
                  f"{kind}")
    if result["speedup"] is None:
        print(f"overall: {result['spec_tokens_per_second']:.1f} tok/s "
              "(no --baseline-url, so no speedup)")
        return
    same = {True: "yes", False: "NO",
            None: "n/a (sampled: only seeded coupled runs against the engine must match)"}[
        result["all_identical"]]
    print(f"overall: {result['plain_tokens_per_second']:.1f} -> "
          f"{result['spec_tokens_per_second']:.1f} tok/s, speedup {result['speedup']:.2f}x, "
          f"identical output: {same}")
    if result.get("engine_plain_vs_baseline") is not None:
        print(f"localspec's own plain decoding runs at {result['engine_plain_vs_baseline']:.2f}x "
              f"{result['baseline']}'s tokens/s")
    if sweep:
        print(f"auto vs the best fixed K in hindsight: {sweep['auto_vs_best_overall']:.2f}x "
              f"overall, {sweep['auto_vs_best_min']:.2f}x on its worst prompt")
        print("auto vs one fixed K for every prompt: " + ", ".join(
            f"{name} {r:.2f}x" for name, r in sweep["auto_vs_each_k_overall"].items()
            if r is not None))
