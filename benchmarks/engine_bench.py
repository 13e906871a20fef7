"""The engine benchmark, on the real pair from ../shared/models/fetch.sh.

Everything is a ratio measured in one run: the speculative engine vs the same target alone, same
prompts, same settings, greedy unless said otherwise. Run on an otherwise idle machine:

    ../shared/models/fetch.sh            # once; prints the model paths
    .venv/bin/python benchmarks/engine_bench.py [--models DIR] [--repeats 3] [--max-tokens 128]

Writes benchmarks/results/engine-<timestamp>.json and prints a Markdown summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DRAFT = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
TARGETS = {
    "F16": "qwen2.5-coder-1.5b-instruct-f16.gguf",
    "Q8_0": "qwen2.5-coder-1.5b-instruct-q8_0.gguf",
    "Q4_K_M": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
}
CLI = [sys.executable, "-m", "localspec"]


def _bench(target: Path, draft: Path, args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    cmd = [*CLI, "bench", "--target", str(target), "--draft", str(draft), "--json",
           "--repeats", str(args.repeats), "--max-tokens", str(args.max_tokens),
           "--ctx", "4096", *extra]
    print("$", " ".join(cmd[2:]), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def _peak_rss_mb(cmd: list[str]) -> float:
    """Peak resident memory of a child process (ru_maxrss, KiB on Linux)."""
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"memory probe failed: {' '.join(cmd)}")
    return usage.ru_maxrss / 1024


def _memory(target: Path, draft: Path) -> dict[str, float]:
    prompt = "Write a Python function that reverses a linked list."
    run = [*CLI, "run", "--ctx", "4096", "-n", "48", prompt]
    return {
        "target_alone_mb": _peak_rss_mb([*run, "--target", str(target), "--draft-mode", "none"]),
        "draft_alone_mb": _peak_rss_mb([*run, "--target", str(draft), "--draft-mode", "none"]),
        "speculative_mb": _peak_rss_mb([*run, "--target", str(target), "--draft", str(draft)]),
    }


def _kind_speedup(result: dict[str, Any], kind: str) -> float:
    rows = [p for p in result["prompts"] if p["kind"] == kind]
    plain = sum(p["tokens"] / p["plain_tokens_per_second"] for p in rows)
    spec = sum(p["tokens"] / p["spec_tokens_per_second"] for p in rows)
    return plain / spec


def _repack_works(target: Path) -> bool:
    """Whether llama.cpp's repacked kernels run this target here (a real run, in a child)."""
    cmd = [*CLI, "run", "--target", str(target), "--draft-mode", "none", "--repack", "on",
           "--raw", "-n", "4", "def"]
    return subprocess.run(cmd, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL).returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=Path(os.environ.get(
        "LOCALSPEC_BENCH_MODELS", Path.home() / ".cache" / "localspec-bench")))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--only", choices=list(TARGETS), action="append")
    ap.add_argument("--sweep-k", default="1,2,3,5,8", help="fixed K beside auto on F16")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-greedy", action="store_true", help="only sampling and memory")
    ap.add_argument("--skip-sampling", action="store_true")
    args = ap.parse_args()
    draft = args.models / DRAFT
    missing = [p for p in [draft, *(args.models / t for t in TARGETS.values())] if not p.exists()]
    if missing:
        raise SystemExit(f"missing {missing[0]}: run ../shared/models/fetch.sh first")

    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "repeats": args.repeats, "max_tokens": args.max_tokens,
                              "greedy": {}, "repack_on": {}}
    out = Path(__file__).parent / "results" / f"engine-{time.strftime('%Y%m%d-%H%M%S')}.json"

    def save() -> None:  # after every part: a long run cut short keeps what it measured
        out.write_text(json.dumps(report, indent=2))

    for name, file in TARGETS.items():
        if args.skip_greedy or (args.only and name not in args.only):
            continue
        extra = ["--sweep-k", args.sweep_k] if name == "F16" and args.sweep_k else []
        report["greedy"][name] = _bench(args.models / file, draft, args,
                                        "--baseline", "llama-cpp-python", "--repack", "off",
                                        *extra)
        save()
        if name != "F16":  # llama.cpp repacks quantized weights only
            works = _repack_works(args.models / file) and _repack_works(draft)
            try:
                report["repack_on"][name] = (_bench(args.models / file, draft, args,
                                                    "--baseline", "llama-cpp-python",
                                                    "--repack", "on")
                                             if works else "crashes on this CPU")
            except subprocess.CalledProcessError as exc:  # a short run passed, the bench did not
                last = (exc.stderr or "").strip().splitlines()[-1:] or [f"exit {exc.returncode}"]
                report["repack_on"][name] = f"crashes on this CPU: {last[0]}"
            save()
    f16 = args.models / TARGETS["F16"]
    if not args.skip_sampling:
        report["sampling"] = {
            rule: _bench(f16, draft, args, "--kind", "code", "--kind", "prose",
                         "--temperature", "0.8", "--seed", "7", "--accept-rule", rule,
                         "--baseline", "engine")
            for rule in ("coupled", "rejection", "match")
        }
        save()
    if not args.skip_memory:
        report["memory"] = _memory(f16, draft)
    save()
    print(summary(report))
    print(f"\nfull results: {out}", file=sys.stderr)
    return 0


def _row(name: str, kind: str, rows: list[dict[str, Any]], res: dict[str, Any]) -> str:
    tp = sum(p["plain_tokens_per_second"] for p in rows) / len(rows)
    ts = sum(p["spec_tokens_per_second"] for p in rows) / len(rows)
    dec = sum(p["decode_speedup"] or 0 for p in rows) / len(rows)
    acc = sum(p["acceptance_rate"] for p in rows) / len(rows)
    ttft = sum(p["spec_ttft_seconds"] / p["plain_ttft_seconds"] for p in rows) / len(rows)
    host = "/".join(f"{sum(p.get(f'spec_host_ms_per_{unit}', 0.0) for p in rows) / len(rows):.2f}"
                    for unit in ("token", "step", "decode"))
    ident = all(p["identical"] for p in rows)
    return (f"| {name} | {kind} | {tp:.1f} | {ts:.1f} | {_kind_speedup(res, kind):.2f}x | "
            f"{dec:.2f}x | {acc:.0%} | {ttft:.2f} | {host} | {'yes' if ident else 'NO'} |")


def summary(report: dict[str, Any]) -> str:
    lines = ["| target | kind | llama-cpp-python tok/s | localspec tok/s | speedup | decode "
             "speedup | acceptance | TTFT ratio | host ms per token/pass/model step | "
             "identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, res in report["greedy"].items():
        for kind in ("code", "prose", "edit"):
            rows = [p for p in res["prompts"] if p["kind"] == kind]
            if rows:
                lines.append(_row(name, kind, rows, res))
        lines.append(f"| {name} | **all** | {res['plain_tokens_per_second']:.1f} | "
                     f"{res['spec_tokens_per_second']:.1f} | **{res['speedup']:.2f}x** | | | | | "
                     f"{'yes' if res['all_identical'] else 'NO'} |")
    for name, res in report["greedy"].items():
        lines.append(f"{name}: localspec's plain decoding at {res['engine_plain_vs_baseline']}x "
                     "llama-cpp-python's tokens/s")
        if "sweep" in res:
            sw = res["sweep"]
            lines.append(f"{name}: auto vs the best fixed K ({sw['k']}): "
                         f"{sw['auto_vs_best_overall']:.2f}x overall, "
                         f"{sw['auto_vs_best_min']:.2f}x on the worst prompt")
            for p in res["prompts"]:
                runs = ", ".join(f"{x:.2f}" for x in p["sweep"]["auto_vs_best_runs"])
                lines.append(f"  {p['name']}: {p['sweep']['auto_vs_best']:.2f}x "
                             f"{p['sweep']['best']} (repeat by repeat: {runs})")
            lines.append(f"{name}: auto vs one fixed K for every prompt: " + ", ".join(
                f"{k} {r:.2f}x" for k, r in sw["auto_vs_each_k_overall"].items()
                if r is not None))
        for p in res["prompts"]:
            if p.get("first_difference"):
                d = p["first_difference"]
                lines.append(f"{name} {p['name']}: differs at token {d['position']}, top-2 "
                             f"margin {d['top2_margin']} (guard {d['tie_margin']}, near tie: "
                             f"{d['near_tie']})")
    speedups = [p["speedup"] for r in report["greedy"].values() for p in r["prompts"]]
    if speedups:
        lines.append(f"worst single prompt: {min(speedups):.2f}x")
    for name, res in report.get("repack_on", {}).items():
        if isinstance(res, str):
            lines.append(f"{name} with repacking on: {res}")
        else:
            lines.append(f"{name} with repacking on: {res['speedup']:.2f}x, plain "
                         f"{res['plain_tokens_per_second']:.1f} tok/s")
    if "sampling" in report:
        for rule, res in report["sampling"].items():
            for kind in ("code", "prose"):
                rows = [p for p in res["prompts"] if p["kind"] == kind]
                acc = sum(p["acceptance_rate"] for p in rows) / len(rows)
                host = [p["spec_host_ms_per_token"] for p in rows]
                same = {True: "yes", False: "NO", None: "not compared"}[
                    all(p["identical"] for p in rows) if res["all_identical"] is not None
                    else None]
                lines.append(f"temperature 0.8, F16, {kind}, {rule}: acceptance {acc:.0%}, "
                             f"speedup {_kind_speedup(res, kind):.2f}x over plain sampling, "
                             f"host {min(host):.2f}-{max(host):.2f} ms per token, "
                             f"identical: {same}")
    if "memory" in report:
        m = report["memory"]
        budget = m["target_alone_mb"] + m["draft_alone_mb"] + 100
        lines.append(f"peak RSS at 4096 context: target alone {m['target_alone_mb']:.0f} MB, "
                     f"draft alone {m['draft_alone_mb']:.0f} MB, speculative "
                     f"{m['speculative_mb']:.0f} MB (budget {budget:.0f} MB: "
                     f"{'ok' if m['speculative_mb'] <= budget else 'OVER'})")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
