"""Token trees against chains at fixed node budgets, and the speedup each would give per regime.

    .venv/bin/python benchmarks/tree_budget.py --target T.gguf --draft D.gguf [--json OUT]
    .venv/bin/python benchmarks/tree_budget.py --demo      # the tiny demo pair (a smoke run)

For each node budget B (1, 4, 8, 16, 32, 64, 128) and each built-in prompt, greedy decoding runs
with the real pair twice: the draft proposes a chain of B tokens, or a tree of at most B nodes
(best first by the draft's probability of each path, above a floor steered so the tree fills B;
at most 4 children a node, one draft pass per level), and the target verifies it in one pass.
Acceptance is a property of the pair and the text, not of the machine: the script records
accepted tokens per target pass, and then prices each budget with three verification cost
curves, as a multiple of a one-token pass:

* ``here``: measured on this machine now, on this target (one pass at each width);
* ``gpu``: a target fully on a GPU, where a pass is bound by reading the weights: stated shape
  (flat to 16 tokens, then slowly rising), an assumption until benchmarks/gpu_check.sh measures
  one; replace it with ``--curve gpu=FILE`` (a JSON object width -> seconds or ratio);
* ``offload``: half the layers on a CPU, where a pass is bound by moving weights and the CPU
  half's memory: stated shape (near flat to 64), an assumption likewise (``--curve offload=``).

Drafting is priced as a draft token's cost over a target pass times the same curve for a
level's width: for ``here`` the ratio measured on this pair now, for the stated regimes
``--draft-ratio`` (0.05: a 0.5B draft beside a 7B target, the case those regimes stand for).
Expected speedup over plain decoding = tokens per pass / (verify(B + 1) + drafting) with
verify(1) = 1.

Greedy only (no sampling): the accepted branch is then the target's own text by construction.
It decodes many tokens per budget: on a shared 2-core machine run it on the tiny pair only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from localspec.benchmarking import BUILTIN_PROMPTS
from localspec.engine import LlamaRunner, ModelSettings, SamplingParams
from localspec.engine.drafters import DraftContext, ModelDrafter, TreeRequest
from localspec.engine.sampling import greedy_children, greedy_pick

BUDGETS = (1, 4, 8, 16, 32, 64, 128)
WIDTH = 4
# Stated shapes (see the docstring): verification over n tokens / one-token verification.
GPU = {1: 1.0, 16: 1.03, 32: 1.08, 64: 1.18, 128: 1.45, 256: 2.1}
OFFLOAD = {1: 1.0, 16: 1.01, 32: 1.02, 64: 1.05, 128: 1.15, 256: 1.4}


def _ratio(curve: dict[int, float], n: int) -> float:
    ns = sorted(curve)
    return float(np.interp(n, ns, [curve[m] for m in ns]))


def _one_pass(runner: LlamaRunner, prompt: list[int]) -> float:
    """The best of three one-token passes after ``prompt`` (seconds)."""
    runner.sync(prompt, 1)
    base = len(runner.tokens)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        runner.decode([prompt[-1]], 1)
        best = min(best, time.perf_counter() - t0)
        runner.truncate(base)
    return best


def _measure_here(target: LlamaRunner, prompt: list[int]) -> dict[int, float]:
    target.sync(prompt, 1)
    base = len(target.tokens)
    points = {}
    for n in (1, 2, 5, 9, 17, 33, 65, 129):
        if base + n >= target.n_ctx or n > target.n_batch:
            break
        best = float("inf")
        for _ in range(3):  # the first pass of a new width also builds its graph
            t0 = time.perf_counter()
            target.decode([prompt[-1]] * n, n)
            best = min(best, time.perf_counter() - t0)
            target.truncate(base)
        points[n] = best
    return {n: t / points[1] for n, t in points.items()}


class _Floor:
    """The least path probability a tree node needs, steered step by step so the tree fills
    its budget: drafted a level at a time, a tree with no floor spends it on the first level's
    unlikely siblings before a likely path can go deeper (the engine's planner sets the floor
    from its expected rates instead)."""

    def __init__(self) -> None:
        self.value = 0.05

    def update(self, nodes: int, budget: int) -> None:
        self.value = self.value * 1.25 if nodes >= budget else self.value * 0.5


def _step(target: LlamaRunner, drafter: ModelDrafter, seq: list[int], budget: int, tree: bool,
          sp: SamplingParams, floor: _Floor) -> tuple[list[int], list[int]]:
    """One draft-and-verify step; returns (accepted + the target's token, level widths)."""
    if tree:
        req = TreeRequest(nodes=budget, depth=budget, branches=target.branches, width=WIDTH,
                          floor=floor.value, estimate=lambda c: c,
                          children=lambda lg, h, d, n: greedy_children(lg, h, sp, n))
        prop = drafter.propose_tree(DraftContext(seq), req)
        floor.update(len(prop.tokens), budget)
    else:
        pick = lambda lg, h, j: (*greedy_pick(lg, h, sp), None)  # noqa: E731
        prop = drafter.propose(DraftContext(seq, pick), budget)
    parents = prop.parent_list()
    keep = target.common_prefix(seq[:-1])
    target.truncate(keep)
    if keep < len(seq) - 1:
        target.decode(seq[keep:-1], 1)
    logits = target.decode_tree([seq[-1], *prop.tokens], [-1] + [p + 1 for p in parents])
    kids = prop.children()
    node, path, out = -1, [], []
    while True:
        tok = int(np.argmax(logits[node + 1]))
        out.append(tok)
        nxt = next((c for c in kids[node] if prop.tokens[c] == tok), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    target.keep_branch([0, *(i + 1 for i in path)])
    levels: dict[int, int] = {}
    for d in prop.depths():
        levels[d] = levels.get(d, 0) + 1
    return out, [levels[d] for d in sorted(levels)]


def run(target_path: Path, draft_path: Path, max_tokens: int, n_prompts: int) -> dict[str, object]:
    settings = ModelSettings(n_ctx=2048, n_batch=256)
    sp = SamplingParams()
    with LlamaRunner(target_path, settings, branches=64) as target, \
            LlamaRunner(draft_path, settings, branches=64) as draft:
        prompts = [target.tokenize(p.text, add_bos=True) for p in BUILTIN_PROMPTS[:n_prompts]]
        here = _measure_here(target, prompts[0])
        draft_ratio_here = _one_pass(draft, prompts[0]) / _one_pass(target, prompts[0])
        drafter = ModelDrafter(draft)
        rows = []
        for budget in BUDGETS:
            for tree in (False, True):
                passes = tokens = 0
                widths: list[list[int]] = []
                floor = _Floor()
                for prompt in prompts:
                    target.reset()
                    draft.reset()
                    first = int(np.argmax(target.sync(prompt, 1)[0]))
                    seq = [*prompt, first]
                    while len(seq) - len(prompt) < max_tokens:
                        out, levels = _step(target, drafter, seq, budget, tree, sp, floor)
                        seq.extend(out)
                        passes += 1
                        tokens += len(out)
                        widths.append(levels)
                rows.append({"budget": budget, "shape": "tree" if tree else "chain",
                             "tokens_per_pass": tokens / passes,
                             "levels": float(np.mean([len(w) for w in widths])),
                             "mean_level_widths": [float(np.mean([w[i] for w in widths
                                                                  if len(w) > i]))
                                                   for i in range(max(map(len, widths)))]})
                print(f"B={budget:3d} {rows[-1]['shape']:5s} "
                      f"{rows[-1]['tokens_per_pass']:.2f} tokens/pass", file=sys.stderr)
    return {"here": here, "draft_ratio_here": draft_ratio_here, "rows": rows}


def speedups(rows: list[dict], curves: dict[str, dict[int, float]],
             draft_ratios: dict[str, float]) -> list[dict[str, object]]:
    out = []
    for row in rows:
        b = int(row["budget"])
        entry: dict[str, object] = {"budget": b, "shape": row["shape"],
                                    "tokens_per_pass": round(float(row["tokens_per_pass"]), 3)}
        for name, curve in curves.items():
            widths = row["mean_level_widths"]
            # The first level costs a draft token; each further level one pass of its width.
            drafting = draft_ratios[name] * (1.0 + sum(_ratio(curve, max(1, round(w)))
                                                for w in widths[:-1]))
            cost = _ratio(curve, b + 1) + drafting
            entry[f"speedup_{name}"] = round(float(row["tokens_per_pass"]) / cost, 3)
        out.append(entry)
    return out


def _curve(spec: str) -> tuple[str, dict[int, float]]:
    name, _, path = spec.partition("=")
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    points = {int(k): float(v) for k, v in data.items()}
    one = points[min(points)]
    return name, {n: t / one for n, t in points.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path)
    ap.add_argument("--draft", type=Path)
    ap.add_argument("--demo", action="store_true", help="the tiny demo pair (built on the spot)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=len(BUILTIN_PROMPTS))
    ap.add_argument("--draft-ratio", type=float, default=0.05)
    ap.add_argument("--curve", action="append", default=[], metavar="NAME=FILE")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.demo:
        from localspec.models.tiny import build_demo_pair

        args.target, args.draft = build_demo_pair(Path(tempfile.gettempdir()) / "localspec-demo")
    if args.target is None or args.draft is None:
        ap.error("give --target and --draft, or --demo")
    result = run(args.target, args.draft, args.max_tokens, args.prompts)
    curves = {"here": result["here"], "gpu": GPU, "offload": OFFLOAD}
    curves.update(dict(_curve(c) for c in args.curve))
    ratios = {name: args.draft_ratio for name in curves}
    ratios["here"] = float(result["draft_ratio_here"])  # type: ignore[arg-type]
    table = speedups(result["rows"], curves, ratios)  # type: ignore[arg-type]
    report = {"target": str(args.target), "draft": str(args.draft), "curves": curves,
              "draft_ratios": ratios, "results": table, "raw": result["rows"]}
    for e in table:
        print(" ".join(f"{k}={v}" for k, v in e.items()))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
