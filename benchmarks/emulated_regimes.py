"""auto's own decisions under cost curves this machine does not have, run end to end on the real
pair: token trees against chains where a target pass costs about the same for 1 or 64 tokens.

    LOCALSPEC_HOME=$(mktemp -d) .venv/bin/python benchmarks/emulated_regimes.py \
        --target T.gguf --draft D.gguf [--regime gpu --regime offload] [--history off|on] \
        [--max-tokens 128] [--prompt NAME ...] [--json OUT]

On a 2-core CPU verification climbs steeply, so auto drafts short chains and the tree planner
almost never runs (`bench` here cannot show what trees do). ``tree_budget.py`` prices fixed
budgets with stated curves; ``trace_model.py`` prices the passes the engine chose for *this*
machine. This runs the engine itself deciding for the stated curve: each engine is told the
curve as its costs (``SpeculativeEngine.use_calibration(learn=False)``, the engine's what-if,
with this build's measured near-tie drift) and then generates for real, on this CPU, so the
planner, the trees, the KV cache's branches and the near-tie guard all run as they would on that
machine, and the text is checked against the target alone's.

Time is then priced, not measured: every llama_decode is recorded by width, and a target pass of
n tokens costs ``curve(n)`` one-token passes (``trace_model.pass_cost``), a draft pass
``--draft-ratio`` times that. The device's costs are fixed and acceptance does not depend on
the machine; the one time measured here that enters a decision is the host work per tree node
(the planner prices it against the stated pass), so a run depends on this CPU only through
that, and repeats up to it and to a near-tie the batched kernels decide differently. The host
work (Python outside llama_decode) is also reported beside, at the regime's stated one-token
pass (``--unit-ms``), as the share a machine with this CPU would add.

Per regime, three contenders, each its own engine learning across the prompts as a user's would:
the target alone (the engine's plain decoding), auto with trees (the default) and auto with
chains (``--tree off``). The prompt's prefill is left out on every side (the same for all).
Acceptance is this pair's: a regime stands for a larger target (a 7B on a GPU, a 70B partly in
system RAM), whose acceptance of a 0.5B draft may differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from localspec.benchmarking import (
    BUILTIN_PROMPTS,
    BenchConfig,
    EngineContender,
    first_difference,
    run_alone,
)
from localspec.cli import parse
from localspec.cli.common import engine_spec, settings_from
from localspec.engine import DraftSettings, SpeculativeEngine
from localspec.engine.calibration import WIDE_WIDTHS, Calibration
from localspec.engine.llama_backend import LlamaRunner
from localspec.files import atomic_write
from localspec.history import scope_for
from localspec.loading import load_engine
from localspec.options import sampling_params
from localspec.requests import draft_from_settings, fit_draft, prompt_tokens

sys.path.insert(0, str(Path(__file__).parent))
from trace_model import Curve, pass_cost  # noqa: E402
from tree_budget import GPU, OFFLOAD  # noqa: E402

# The stated regimes: tree_budget.py's shapes, a draft pass 0.05 of a target pass (a 0.5B draft
# beside a 7B target), and a one-token pass of a Q4_K_M 7-8B model on a mid-range RTX card
# (~80 tok/s) and of a 70B with half its layers in system RAM (~4 tok/s). Assumptions, stated;
# benchmarks/gpu_check.sh measures real curves where a GPU is lent.
REGIMES: dict[str, tuple[Curve, float]] = {"gpu": (GPU, 12.0), "offload": (OFFLOAD, 250.0)}
SIDES = ("alone", "trees", "chains")


class _PassLog:
    """A runner's llama.cpp handle that records the width of every llama_decode it makes."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.widths: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def llama_decode(self, ctx: Any, batch: Any) -> Any:
        self.widths.append(int(batch.n_tokens))
        return self._lib.llama_decode(ctx, batch)


def _log_passes(runner: LlamaRunner) -> _PassLog:
    log = _PassLog(runner._lib)
    runner._lib = log
    return log


def stated_calibration(curve: Curve, unit: float, draft_ratio: float, k_max: int,
                       drift: float) -> Calibration:
    """The costs an engine on that machine would measure: every width calibration times."""
    widths = [*range(1, k_max + 2), *WIDE_WIDTHS]
    return Calibration({w: unit * pass_cost(curve, w) for w in widths}, unit * draft_ratio,
                       drift)


def split_prefill(widths: list[int], prompt: int) -> tuple[list[int], list[int]]:
    """The passes that decoded the first ``prompt`` tokens and the rest. A pass that took in
    the prompt's end and more (the draft catching up on the prompt and the tokens since, in
    one batch) is split: its tokens past the prompt are priced as a pass of their own, which
    charges the drafting side a little more than the one wider pass would cost."""
    done = 0
    for i, w in enumerate(widths):
        if done >= prompt:
            return widths[:i], widths[i:]
        if done + w > prompt:
            return [*widths[:i], prompt - done], [done + w - prompt, *widths[i + 1:]]
        done += w
    return widths, []


def target_prefill(widths: list[int], prompt: int, cached: int) -> tuple[list[int], list[int]]:
    """The target's passes split at its prompt, less the ``cached`` tokens it reused: its
    prefill is batches of the prompt alone, so anything else means the split is wrong."""
    prefill, rest = split_prefill(widths, prompt - cached)
    if sum(widths[:len(prefill)]) != prompt - cached:
        raise SystemExit(f"emulated_regimes.py: the target's first passes {widths[:4]} are "
                         f"not its {prompt - cached} uncached prompt tokens")
    return prefill, rest


@dataclass
class Side:
    """One contender on its own engine, with the passes its runners have made."""

    name: str
    engine: SpeculativeEngine
    contender: EngineContender
    target_log: _PassLog
    draft_log: _PassLog | None


def _priced_run(side: Side, tokens: tuple[int, ...], curve: Curve, ratio: float,
                unit_s: float) -> dict[str, Any]:
    t0, d0 = len(side.target_log.widths), len(side.draft_log.widths) if side.draft_log else 0
    res = run_alone(side.contender, tokens)
    _, target = target_prefill(side.target_log.widths[t0:], len(tokens),
                               res.stats.prompt_cached_tokens)
    # The draft takes in the prompt when it first drafts (its cache emptied with the
    # target's): priced out like the target's.
    _, drafts = split_prefill(side.draft_log.widths[d0:] if side.draft_log else [], len(tokens))
    units = (sum(pass_cost(curve, w) for w in target)
             + ratio * sum(pass_cost(curve, w) for w in drafts))
    s = res.stats
    return {"tokens": list(res.tokens), "target_passes": len(target),
            "draft_passes": len(drafts), "units": round(units, 3),
            "host_s": round(s.host_seconds, 4),
            "tree_rounds": s.tree_rounds, "draft_rounds": s.draft_rounds,
            "mean_tree_size": round(s.mean_tree_size, 2), "drafted": s.drafted,
            "accepted": s.accepted, "tie_stops": s.tie_stops,
            "host_ms_per_draft_token": round(s.host_ms_per_draft_token, 4),
            "emulated_s": round(units * unit_s + s.host_seconds, 3)}


def _load_side(name: str, args: argparse.Namespace, stack: ExitStack, curve: Curve,
               unit_s: float) -> Side:
    argv = ["bench", "--target", args.target, "--draft", args.draft, "--max-tokens",
            str(args.max_tokens), "--temperature", "0", "--history", args.history]
    bargs = parse(argv)
    settings = settings_from(bargs, read_config=False)
    spec = engine_spec(bargs, None, settings)
    spec = replace(spec, history=scope_for("bench", settings) if args.history == "on" else None)
    engine = stack.enter_context(load_engine(spec))
    cfg = BenchConfig(max_tokens=args.max_tokens, sampling=sampling_params(settings))
    draft = fit_draft(draft_from_settings(settings, spec.draft_mode), engine.draft is not None)
    contender = EngineContender(name, engine, cfg, draft)
    if name == "alone":
        contender.draft = DraftSettings(mode="none", history=False)
    else:
        if name == "chains":
            contender.draft = replace(draft, tree=False)
        if engine.calibration is None:  # one short request measures this build's drift
            hello = prompt_tokens(engine, [{"role": "user", "content": "Say hello."}])
            with engine.separate_learning():
                run_alone(replace(contender, cfg=replace(cfg, max_tokens=4)), hello)
        if engine.calibration is None:
            raise SystemExit("emulated_regimes.py: the engine measured no calibration")
        engine.use_calibration(stated_calibration(curve, unit_s, args.draft_ratio,
                                                  engine.k_max, engine.calibration.drift),
                               learn=False)
    draft_log = _log_passes(engine.draft) if engine.draft is not None else None
    return Side(name, engine, contender, _log_passes(engine.target), draft_log)


def run_regime(args: argparse.Namespace, regime: str) -> dict[str, Any]:
    curve, unit_ms = REGIMES[regime]
    unit_ms = args.unit_ms or unit_ms
    unit_s = unit_ms / 1000.0
    prompts = [p for p in BUILTIN_PROMPTS if not args.prompt or p.name in args.prompt]
    out: list[dict[str, Any]] = []
    with ExitStack() as stack:
        sides = [_load_side(name, args, stack, curve, unit_s) for name in SIDES]
        for p in prompts:
            tokens = prompt_tokens(sides[0].engine, [{"role": "user", "content": p.text}])
            row: dict[str, Any] = {"name": p.name, "kind": p.kind}
            for side in sides:
                row[side.name] = _priced_run(side, tokens, curve, args.draft_ratio, unit_s)
            alone = row["alone"]
            for side in sides[1:]:
                x = row[side.name]
                # Tokens per pass: the target alone's one-token passes (its stop token's too)
                # that each of this side's passes stands for.
                x["tokens_per_pass"] = round(alone["target_passes"] / max(1, x["target_passes"]),
                                             3)
                x["identical"] = x["tokens"] == alone["tokens"]
                if not x["identical"]:  # where, and how near a tie (by its engine's guard)
                    x["first_difference"] = first_difference(
                        side.engine, tokens, alone["tokens"], x["tokens"],
                        side.contender.cfg.sampling)
                x["speedup"] = round(alone["units"] / x["units"], 3)
                x["speedup_with_host"] = round(alone["emulated_s"] / x["emulated_s"], 3)
            row["trees_over_chains"] = round(row["chains"]["units"] / row["trees"]["units"], 3)
            for side in sides:
                row[side.name].pop("tokens")
            print(f"{regime} {p.name}: trees {row['trees']['speedup']}x "
                  f"({row['trees']['tokens_per_pass']} tok/pass), chains "
                  f"{row['chains']['speedup']}x ({row['chains']['tokens_per_pass']} tok/pass)",
                  file=sys.stderr, flush=True)
            out.append(row)
    total = {name: sum(r[name]["units"] for r in out) for name in SIDES}
    emulated = {name: sum(r[name]["emulated_s"] for r in out) for name in SIDES}
    return {"curve": {str(k): v for k, v in curve.items()}, "unit_ms": unit_ms,
            "draft_ratio": args.draft_ratio, "prompts": out,
            "speedup": {n: round(total["alone"] / total[n], 3) for n in SIDES[1:]},
            "speedup_with_host": {n: round(emulated["alone"] / emulated[n], 3)
                                  for n in SIDES[1:]},
            "trees_over_chains": round(total["chains"] / total["trees"], 3),
            "min_trees_over_chains": min(r["trees_over_chains"] for r in out),
            "identical": all(r[n]["identical"] for r in out for n in SIDES[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--regime", action="append", choices=sorted(REGIMES),
                    help="a stated regime (repeatable; default all)")
    ap.add_argument("--history", choices=("on", "off"), default="off")
    ap.add_argument("--draft-ratio", type=float, default=0.05,
                    help="a draft pass's cost over the target's at the same width")
    ap.add_argument("--unit-ms", type=float, help="the one-token target pass (default: stated)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt", action="append", choices=[p.name for p in BUILTIN_PROMPTS],
                    help="a built-in prompt by name (repeatable; default all)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    result = {"target": args.target, "draft": args.draft, "history": args.history,
              "max_tokens": args.max_tokens,
              "regimes": {r: run_regime(args, r) for r in args.regime or sorted(REGIMES)}}
    for regime, r in result["regimes"].items():
        print(f"\n{regime} (one-token pass {r['unit_ms']} ms, draft ratio {r['draft_ratio']})")
        print("| prompt | trees | chains | trees / chains | tokens per pass: trees, chains | "
              "mean tree size | identical |")
        print("|---|---|---|---|---|---|---|")
        for p in r["prompts"]:
            t, c = p["trees"], p["chains"]
            print(f"| {p['name']} | {t['speedup']}x | {c['speedup']}x | "
                  f"{p['trees_over_chains']} | {t['tokens_per_pass']}, {c['tokens_per_pass']} | "
                  f"{t['mean_tree_size']} | "
                  f"{'yes' if t['identical'] and c['identical'] else 'no'} |")
        print(f"| **all** | {r['speedup']['trees']}x | {r['speedup']['chains']}x | "
              f"{r['trees_over_chains']} | | | {'yes' if r['identical'] else 'no'} |")
        print(f"with this CPU's host time at {r['unit_ms']} ms a pass: trees "
              f"{r['speedup_with_host']['trees']}x, chains {r['speedup_with_host']['chains']}x")
    if args.json:
        atomic_write(Path(args.json), json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
