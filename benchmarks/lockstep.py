"""The engine against llama-cpp-python's own generation in lockstep, with the engine's own plain
decoding raced beside them on a second engine (which `bench` cannot do: its runs share one
context). All in one process, advanced a step at a time, the one behind in text first, each
timed on its own clock (``localspec.benchmarking.race``), so the machine's drift (10-25% over
minutes on a 2-core VM) falls on all alike.

    LOCALSPEC_HOME=$(mktemp -d) .venv/bin/python benchmarks/lockstep.py \
        --target T.gguf --draft D.gguf [--history on|off] [--draft-mode none] [--plain] \
        [--repeats 3] [--max-tokens 128] [--prompt NAME ...] [--json OUT]

Greedy. A fresh LOCALSPEC_HOME gives a cold history index; as in `bench`, each prompt's answer
joins the index after its repeats, so later prompts may draft from earlier ones. Each repeat
rotates which side processes its prompt first; "all repeats' time" sums every repeat, so with
repeats a multiple of the sides each went first equally often.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from localspec.benchmarking import (
    BUILTIN_PROMPTS,
    BenchConfig,
    Contender,
    EngineContender,
    LlamaCppPythonContender,
    RunResult,
    paired_speedups,
    race,
    repeat_order,
    run_alone,
)
from localspec.cli import parse
from localspec.cli.common import engine_spec, settings_from
from localspec.engine import DraftSettings, SpeculativeEngine
from localspec.engine.llama_backend import open_llama
from localspec.files import atomic_write
from localspec.history import scope_for
from localspec.loading import load_engine
from localspec.options import sampling_params
from localspec.requests import draft_from_settings, fit_draft, prompt_tokens

BASELINE = "llama-cpp-python"


def _contenders(args: argparse.Namespace, stack: ExitStack) -> tuple[SpeculativeEngine,
                                                                      list[Contender]]:
    argv = ["bench", "--target", args.target, "--max-tokens", str(args.max_tokens),
            "--temperature", "0", "--history", args.history]
    argv += ["--draft", args.draft] if args.draft else []
    argv += ["--draft-mode", args.draft_mode] if args.draft_mode else []
    bargs = parse(argv)
    settings = settings_from(bargs, read_config=False)
    spec = replace(engine_spec(bargs, None, settings), history=scope_for("bench", settings))
    engine = stack.enter_context(load_engine(spec))
    cfg = BenchConfig(max_tokens=args.max_tokens, sampling=sampling_params(settings))
    draft = fit_draft(draft_from_settings(settings, spec.draft_mode), engine.draft is not None)
    llm = open_llama(engine.target.path, engine.target.settings)
    stack.callback(llm.close)
    eos = frozenset(t for t in range(engine.target.n_vocab) if engine.target.is_eog(t))
    sides: list[Contender] = [EngineContender("engine", engine, cfg, draft),
                              LlamaCppPythonContender(llm, cfg, eos, name=BASELINE)]
    if args.plain:  # a second engine: no draft, no history
        plain = stack.enter_context(load_engine(replace(spec, draft=None, draft_mode="none",
                                                        history=None)))
        sides.insert(1, EngineContender("plain", plain, cfg, DraftSettings(mode="none")))
    return engine, sides


def _repeat(sides: list[Contender], engine: SpeculativeEngine, tokens: tuple[int, ...],
            rep: int) -> dict[str, RunResult]:
    order = repeat_order(sides, rep)
    with engine.frozen_history():
        done = race([s.steps(tokens) for s in order])
    return {s.name: r for s, r in zip(order, done, strict=True)}


def _median(ratios: list[float | None]) -> float | None:
    known = [x for x in ratios if x is not None]  # None: a one-token answer's decode rate
    return statistics.median(known) if known else None


def _row(name: str, runs: list[dict[str, RunResult]]) -> dict[str, Any]:
    sides, base = [r[name] for r in runs], [r[BASELINE] for r in runs]
    ratios = paired_speedups(sides, base)
    decode = paired_speedups(sides, base, "decode_tokens_per_second")
    per = [{"tps": round(x.stats.tokens_per_second, 3), "ratio": ratio, "decode_ratio": dec,
            "ttft": round(x.stats.ttft_seconds, 4), "baseline_ttft": round(b.stats.ttft_seconds, 4),
            "identical": x.tokens == b.tokens}
           for x, b, ratio, dec in zip(sides, base, ratios, decode, strict=True)]
    return {"ratio": _median(ratios), "decode_ratio": _median(decode),
            "time_ratio": round(sum(b.stats.total_seconds for b in base)
                                / sum(x.stats.total_seconds for x in sides), 4),
            "identical": all(x["identical"] for x in per), "runs": per}


def run(args: argparse.Namespace) -> dict[str, Any]:
    prompts = [p for p in BUILTIN_PROMPTS if not args.prompt or p.name in args.prompt]
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        engine, sides = _contenders(args, stack)
        names = [s.name for s in sides if s.name != BASELINE]
        for i, prompt in enumerate(prompts):
            tokens = prompt_tokens(engine, [{"role": "user", "content": prompt.text}])
            if i == 0:  # untimed: graph allocation, and auto's calibration
                for s in sides:
                    with engine.frozen_history():
                        run_alone(s, tokens)
            runs = [_repeat(sides, engine, tokens, rep) for rep in range(args.repeats)]
            for rep, r in enumerate(runs):
                print(f"{prompt.name} #{rep + 1}: " + ", ".join(
                    f"{n} {x.stats.tokens_per_second:.2f} tok/s" for n, x in r.items()),
                    file=sys.stderr, flush=True)
            answer = runs[-1]["engine"].tokens
            if engine.history is not None and not isinstance(answer, str):
                engine.history.record(tokens, answer)
            rows.append({"name": prompt.name, "kind": prompt.kind,
                         **{n: _row(n, runs) for n in names}})
    return {"target": args.target, "draft": args.draft, "history": args.history,
            "draft_mode": args.draft_mode or "auto", "repeats": args.repeats,
            "max_tokens": args.max_tokens, "sides": names, "prompts": rows,
            "min_time_ratio": {n: min(r[n]["time_ratio"] for r in rows) for n in names}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--history", choices=("on", "off"), default="on")
    ap.add_argument("--draft-mode", choices=("model", "lookup", "history", "none"))
    ap.add_argument("--plain", action="store_true",
                    help="also the engine's own plain decoding (a second engine, no draft)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt", action="append", choices=[p.name for p in BUILTIN_PROMPTS],
                    help="a built-in prompt by name (repeatable; default all)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    result = run(args)
    print("| prompt | side | all repeats' time | median | decode only | per repeat | identical |")
    print("|---|---|---|---|---|---|---|")
    for r in result["prompts"]:
        for name in result["sides"]:
            x = r[name]
            per = ", ".join(f"{run['ratio']}" for run in x["runs"])
            print(f"| {r['name']} | {name} | {x['time_ratio']:.3f}x | {x['ratio']}x | "
                  f"{x['decode_ratio']}x | {per} | {'yes' if x['identical'] else 'no'} |")
    if args.json:
        atomic_write(Path(args.json), json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
