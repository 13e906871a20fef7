"""A prompt asked again: what drafting from history gives when the index holds the exact answer.

The best case of issue #28 ("the same again", an agent resending a request): every token the
target will write is in the index, so the history drafter's proposals are right to the end.
What is left between that and a large speedup is the machine: the cost curve of wide passes,
and how often batched verification meets a near-tie it may not decide (the engine's guard).

    .venv/bin/python benchmarks/exact_repeat.py --target T.gguf [--target T2.gguf ...] \
        [--draft D.gguf] [--prompt fib --prompt sql] [--rounds 3] [--json OUT]

Per target and prompt: the engine's plain decoding answers once (not timed) and the answer is
recorded into a fresh in-memory index as the prompt's earlier answer; auto then answers once
(not timed), recording its answer with the near-ties it met (``history_index``'s marks; the
same document where its text is plain decoding's); then, ``--rounds`` times,
plain decoding and auto with the history on run in turn (each round starting with the other),
from an empty KV cache, with the index frozen (a run never drafts from the one before it).
Reported: tokens/s of each, the paired speedup per round and its median, target passes,
tokens drafted and accepted per drafter, and whether the text is plain decoding's.

``--tie-margin X`` replaces the engine's near-tie margin (exploration only: under twice the
drift the engine measured at load, recorded as ``drift``, the text may part from plain decoding;
``identical`` says whether it did).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from localspec.benchmarking import (
    BUILTIN_PROMPTS,
    BenchConfig,
    EngineContender,
    paired_speedups,
    repeat_order,
)
from localspec.engine import DraftSettings, repack
from localspec.errors import LocalspecError
from localspec.loading import EngineSpec, load_engine
from localspec.requests import prompt_tokens


def _one_target(target: str, draft: str | None, prompts: list[str], rounds: int,
                max_tokens: int, tie_margin: float | None) -> dict[str, Any]:
    from localspec.engine import decoder

    if tie_margin is not None:  # exploration: the guard set by hand for this process
        decoder.SpeculativeEngine.tie_margin = property(  # type: ignore[method-assign,assignment]
            lambda _self: tie_margin)
    out: dict[str, Any] = {}
    spec = EngineSpec(target=target, draft=draft, history="process")
    with load_engine(spec) as engine:
        if engine.history is None:
            raise LocalspecError("the engine kept no history index")
        cfg = BenchConfig(max_tokens=max_tokens)
        plain = EngineContender("plain", engine, cfg, DraftSettings(mode="none"))
        auto = EngineContender("auto", engine, cfg, DraftSettings())
        for name in prompts:
            bp = next(p for p in BUILTIN_PROMPTS if p.name == name)
            toks = prompt_tokens(engine, [{"role": "user", "content": bp.text}])
            with engine.frozen_history():
                answer = plain.run(toks).tokens
            engine.history.record(toks, answer)
            # Not counted: auto calibrates once and first graphs are built. It records its
            # answer, the same one where it did not part from plain decoding, with the marks
            # of the near-ties it met, as a request served with the history on would.
            auto.run(toks)
            runs: dict[str, list[Any]] = {"plain": [], "auto": []}
            for r in range(rounds):
                for c in repeat_order([plain, auto], r):
                    with engine.frozen_history():
                        runs[c.name].append(c.run(toks))
            paired = paired_speedups(runs["auto"], runs["plain"])
            out[name] = {
                "tokens": len(answer),
                "plain_tokens_per_second": [round(x.stats.tokens_per_second, 2)
                                            for x in runs["plain"]],
                "auto_tokens_per_second": [round(x.stats.tokens_per_second, 2)
                                           for x in runs["auto"]],
                "speedup_runs": paired,
                "speedup": statistics.median(x or 0.0 for x in paired),
                "auto_target_passes": [x.stats.target_passes for x in runs["auto"]],
                "drafters": [{n: [d.drafted, d.accepted] for n, d in x.stats.drafters.items()}
                             for x in runs["auto"]],
                "identical": all(x.tokens == answer for x in runs["auto"]),
            }
            print(f"{Path(target).name} {name}: {out[name]['speedup']:.2f}x "
                  f"(runs {paired}), passes {out[name]['auto_target_passes']} for "
                  f"{len(answer)} tokens, identical {out[name]['identical']}", file=sys.stderr)
        out["tie_margin"] = round(engine.tie_margin, 4)  # known once auto has calibrated
        out["drift"] = (round(engine.calibration.drift, 4)
                        if engine.calibration is not None else None)
        out["repack"] = engine.target.repack.describe()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="append", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--prompt", action="append", choices=[p.name for p in BUILTIN_PROMPTS],
                    help="built-in prompts (repeatable; default fib and sql)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tie-margin", type=float, help="exploration: the near-tie margin by hand")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.max_tokens < 1:
        ap.error("--rounds and --max-tokens must be at least 1")
    if args.tie_margin is not None and not (math.isfinite(args.tie_margin)
                                            and args.tie_margin >= 0):
        ap.error("--tie-margin must be a number of logits, 0 or more")
    if args.json and not args.json.parent.is_dir():
        ap.error(f"--json: no folder {args.json.parent}")
    result: dict[str, Any] = {}
    # A fresh home: no saved calibration, history or prompt states from earlier runs.
    with tempfile.TemporaryDirectory() as home:
        os.environ["LOCALSPEC_HOME"] = home
        # This machine's repack verdict first: a background self-test would share the cores
        # with auto's calibration and the timed runs (as bench and demo wait for it too).
        repack.settle_before_measuring()
        try:
            for target in args.target:
                t0 = time.perf_counter()
                result[Path(target).name] = _one_target(
                    target, args.draft, args.prompt or ["fib", "sql"], args.rounds,
                    args.max_tokens, args.tie_margin)
                result[Path(target).name]["seconds"] = round(time.perf_counter() - t0, 1)
        except LocalspecError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        try:
            args.json.write_text(text + "\n")
        except OSError as exc:
            print(f"error: could not write {args.json}: {exc.strerror}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
