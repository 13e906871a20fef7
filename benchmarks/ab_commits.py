"""Two commits' `bench` side by side, interleaved, so a machine that speeds up or slows down
for minutes moves both alike.

One `bench` run of each commit per round (repeats 1 inside), alternating A, B, B, A, A, B, ...
for ``--rounds`` rounds; each commit runs from its own `git worktree` with this checkout's venv
(llama-cpp-python is the same). Reported per prompt and overall: each commit's median speedup
over the rounds, and the median of the per-round B/A ratios (the paired figure to trust).

  .venv/bin/python benchmarks/ab_commits.py --a 65ac510 --b HEAD --rounds 3 \\
      --target T.gguf --draft D.gguf [--json OUT] [-- extra bench options]

``--json`` is replaced whole (atomically) after every round (``rounds_done``, ``complete``),
so a run cut off partway keeps the rounds it finished.

Two settings of one commit pair the same way: ``--a HEAD --b HEAD --a-args="--tree off"``
(``--a-args``/``--b-args``: bench options for that side only).

Every run starts from an empty ``LOCALSPEC_HOME`` (``--keep-caches``: the user's caches), so
each measures this machine's costs anew, as a first run does: a cached calibration would make
every round of a side repeat its first run's timings, noise included.

Why: two back-to-back runs of the same bench on these 2-core machines differed by 25% in the
target alone's tokens/s (benchmarks/README.md), more than the changes they were meant to judge.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from localspec.files import atomic_write

ROOT = Path(__file__).resolve().parent.parent


def _worktree(commit: str, where: Path) -> Path:
    path = where / commit.replace("/", "_")  # the caller gives each side its own ``where``
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit],
                   check=True, capture_output=True)
    return path


def _bench(tree: Path, args: argparse.Namespace, side: str) -> dict[str, Any]:
    own = shlex.split(getattr(args, f"{side}_args"))
    cmd = [str(ROOT / ".venv" / "bin" / "python"), "-m", "localspec", "bench",
           "--target", str(args.target), "--draft", str(args.draft), "--repeats", "1",
           "--json", *args.extra, *own]
    env = {**os.environ, "PYTHONPATH": str(tree)}  # this commit's localspec, not the venv's
    with tempfile.TemporaryDirectory(prefix="ab-home-") as home:
        if not args.keep_caches:
            env["LOCALSPEC_HOME"] = home
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                              check=False)
    if proc.returncode != 0:
        raise SystemExit(f"bench at {tree} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="the commit before")
    ap.add_argument("--b", default="HEAD", help="the commit after")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--a-args", default="", help="bench options for A only (one string)")
    ap.add_argument("--b-args", default="", help="bench options for B only (one string)")
    ap.add_argument("--keep-caches", action="store_true",
                    help="use the user's cached calibration instead of measuring each run anew")
    ap.add_argument("extra", nargs="*", help="after --: more bench options for both")
    args = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory(prefix="ab-commits-") as tmp:
        trees = {side: _worktree(getattr(args, side), Path(tmp) / side) for side in "ab"}
        try:
            for r in range(args.rounds):
                for side in (("a", "b") if r % 2 == 0 else ("b", "a")):
                    runs[side].append(_bench(trees[side], args, side))
                    print(f"round {r + 1}: {side} {runs[side][-1]['speedup']:.3f}x",
                          file=sys.stderr)
                # Each round is kept as it ends: a run cut off after 40 minutes keeps what
                # it measured, marked as the rounds it holds.
                if args.json:
                    atomic_write(args.json, json.dumps({**summarize(args, runs), "runs": runs},
                                                       indent=2))
        finally:
            for t in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(t)],
                               check=False, capture_output=True)
    report = summarize(args, runs)
    for row in report["prompts"]:
        print(f"{row['prompt']:10s} a {row['a_median']:.2f}x  b {row['b_median']:.2f}x  "
              f"b/a {row['b_over_a_paired']:.2f}  identical {row['identical']}")
    if args.json:
        atomic_write(args.json, json.dumps({**report, "runs": runs}, indent=2))
    return 0


def summarize(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per prompt and paired B/A ratios over the rounds both sides finished."""
    done = min(len(runs["a"]), len(runs["b"]))

    def speedups(side: str, i: int | None) -> list[float]:
        return [run["speedup"] if i is None else run["prompts"][i]["speedup"]
                for run in runs[side][:done]]

    report: dict[str, Any] = {"a": args.a, "b": args.b, "a_args": args.a_args,
                              "b_args": args.b_args, "keep_caches": args.keep_caches,
                              "rounds": args.rounds, "rounds_done": done,
                              "complete": done == args.rounds, "prompts": []}
    if not done:
        return report
    names = [p["name"] for p in runs["a"][0]["prompts"]]
    for i, name in enumerate([*names, None]):
        j = None if name is None else i
        a, b = speedups("a", j), speedups("b", j)
        report["prompts"].append({
            "prompt": name or "all", "a_median": statistics.median(a),
            "b_median": statistics.median(b),
            "b_over_a_paired": statistics.median(y / x for x, y in zip(a, b, strict=True)),
            "identical": all((run["all_identical"] if j is None else run["prompts"][j]["identical"])
                             for side in runs.values() for run in side[:done])})
    return report


if __name__ == "__main__":
    raise SystemExit(main())
