"""What llama.cpp's CPU kernel settings do to a one-token pass and to wide verification passes.

    .venv/bin/python benchmarks/kernel_settings.py --target T.gguf [--depth 600] [--rounds 3]
        [--json OUT]

llama.cpp's own tools default to repacked CPU kernels (``--repack``: extra buffer types) and
flash attention ("auto": on where the backend has it); localspec loads with flash attention off
and repacking as its self-test decides. Both change two costs in opposite directions: a
one-token pass (plain decoding, and the target alone) and a pass over many tokens (what
speculation verifies). This times both, for each of the four combinations, each in its own
process (repacking is decided at load), the combinations interleaved over rounds:

* a real context of ``--depth`` tokens (the built-in prompts' text) is decoded first;
* then passes of 1, 8, 16, 32 and 64 tokens after it, with logits for every token as
  verification asks, five times each; the median per width and round, then the median over
  rounds.

Reported per combination: the one-token pass (ms, and tokens/s of plain decoding by it) and
each width's pass as a multiple of the one-token pass of the *same* combination and in ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WIDTHS = (1, 8, 16, 32, 64)
CHILD_TIMEOUT = 900.0  # seconds for one combination: an F16 1.5B takes ~60 s here
COMBINATIONS = ((False, False), (True, False), (False, True), (True, True))  # (repack, fa)


def _child(target: str, repack: bool, flash_attn: bool, depth: int) -> dict[str, float]:
    """One combination in this process: the median ms of a pass at each width."""
    from localspec.benchmarking import BUILTIN_PROMPTS
    from localspec.engine import LlamaRunner, ModelSettings
    from localspec.engine.calibration import median_times

    runner = LlamaRunner(target, ModelSettings(n_ctx=max(2048, depth + 2 * max(WIDTHS)),
                                               flash_attn=flash_attn), extra_bufts=repack)
    text = "\n\n".join(p.text for p in BUILTIN_PROMPTS)
    tokens = list(runner.tokenize(text, add_bos=False))
    while len(tokens) < depth + max(WIDTHS):
        tokens += tokens
    context, tail = tokens[:depth], tokens[depth:depth + max(WIDTHS)]
    runner.decode(context, 1)

    def timed(w: int) -> float:
        t0 = time.perf_counter()
        runner.decode(tail[:w], w)
        seconds = time.perf_counter() - t0
        runner.truncate(depth)
        return seconds

    medians = median_times(timed, WIDTHS, 5)
    runner.close()
    return {str(w): seconds * 1000 for w, seconds in medians.items()}


def _label(repack: bool, flash_attn: bool) -> str:
    return f"repack {'on' if repack else 'off'}, flash attention {'on' if flash_attn else 'off'}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--depth", type=int, default=600, help="context tokens before the passes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", nargs=2, metavar=("REPACK", "FA"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.depth < 1 or args.rounds < 1:
        ap.error("--depth and --rounds must be at least 1")
    if args.child:
        repack, fa = (v == "1" for v in args.child)
        print(json.dumps(_child(args.target, repack, fa, args.depth)))
        return 0
    if not Path(args.target).is_file():
        ap.error(f"no such file: {args.target}")
    runs: dict[tuple[bool, bool], list[dict[str, float]]] = {c: [] for c in COMBINATIONS}
    for r in range(args.rounds):
        for repack, fa in COMBINATIONS:
            cmd = [sys.executable, __file__, "--target", args.target, "--depth", str(args.depth),
                   "--child", str(int(repack)), str(int(fa))]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
                if done.returncode != 0:
                    raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[-1])
                lines = done.stdout.strip().splitlines()
                runs[(repack, fa)].append(json.loads(lines[-1] if lines else ""))
            except (subprocess.TimeoutExpired, RuntimeError, ValueError) as exc:
                print(f"kernel_settings.py: {_label(repack, fa)} failed: {exc}",
                      file=sys.stderr)
                return 1
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    out: dict[str, dict[str, Any]] = {}
    for combo, rs in runs.items():
        ms = {w: statistics.median(r[str(w)] for r in rs) for w in WIDTHS}
        out[_label(*combo)] = {"one_token_ms": round(ms[1], 1),
                               "plain_tokens_per_second": round(1000 / ms[1], 1),
                               "pass_ms": {str(w): round(ms[w], 1) for w in WIDTHS},
                               "in_one_token_passes": {str(w): round(ms[w] / ms[1], 2)
                                                       for w in WIDTHS}}
    print(f"{'':<40}{'1 token':>10}" + "".join(f"{f'{w} tokens':>16}" for w in WIDTHS[1:]))
    for label, row in out.items():
        cells = "".join(f"{row['pass_ms'][str(w)]:>8.0f} ms "
                        f"{row['in_one_token_passes'][str(w)]:>4.1f}x" for w in WIDTHS[1:])
        print(f"{label:<40}{row['one_token_ms']:>7.1f} ms{cells}")
    if args.json:
        from localspec.files import atomic_write

        atomic_write(args.json, json.dumps({"target": args.target, "depth": args.depth,
                                            "rounds": args.rounds, "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
