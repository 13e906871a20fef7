"""What llama.cpp's CPU kernel settings do to a one-token pass and to wide verification passes.

    .venv/bin/python benchmarks/kernel_settings.py --target T.gguf [--depth 600] [--rounds 3]
        [--widths 1,8,16,32,64] [--tiled-off] [--json OUT]

llama.cpp's own tools default to repacked CPU kernels (``--repack``: extra buffer types) and
flash attention ("auto": on where the backend has it); localspec loads with flash attention off
and repacking as its self-test decides. Both change two costs in opposite directions: a
one-token pass (plain decoding, and the target alone) and a pass over many tokens (what
speculation verifies). This times both, for each of the four combinations, each in its own
process (repacking is decided at load), the combinations interleaved over rounds:

* a real context of ``--depth`` tokens (the built-in prompts' text) is decoded first;
* then passes of 1, 8, 16, 32 and 64 tokens after it (``--widths``), with logits for every
  token as verification asks (up to 64), five times each; the median per width and round, then
  the median over rounds.

``--tiled-off`` adds a fifth combination: repacking and flash attention off, and llama.cpp's
tiled K-quant matrix multiplication off too (``GGML_CPU_TILED_MM=0``, read once per process).
llama.cpp 0.3.36's CPU backend takes that path for K-quant weights (Q4_K, Q6_K, ...) from 8
tokens a pass up (``ggml-cpu/tiled``); on a 2-core AVX2 EPYC a pass of 8 tokens costs twice one
of 7 there, and it is what makes the Q4_K_M curve jump at 8.

Reported per combination: the one-token pass (ms, and tokens/s of plain decoding by it) and
each width's pass as a multiple of the one-token pass of the *same* combination and in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WIDTHS = (1, 8, 16, 32, 64)
MAX_LOGITS = 64  # a wider pass is a prompt's prefill: logits for its last 64 tokens only
CHILD_TIMEOUT = 900.0  # seconds for one combination: an F16 1.5B takes ~60 s here
Combination = tuple[bool, bool, bool]  # (repack, flash attention, tiled K-quant matmul)
COMBINATIONS: tuple[Combination, ...] = (
    (False, False, True), (True, False, True), (False, True, True), (True, True, True))
TILED_OFF: Combination = (False, False, False)


def _child(target: str, repack: bool, flash_attn: bool, depth: int,
           widths: tuple[int, ...]) -> dict[str, float]:
    """One combination in this process: the median ms of a pass at each width."""
    from localspec.benchmarking import BUILTIN_PROMPTS
    from localspec.engine import LlamaRunner, ModelSettings
    from localspec.engine.calibration import median_times

    runner = LlamaRunner(target, ModelSettings(n_ctx=max(2048, depth + 2 * max(widths)),
                                               flash_attn=flash_attn), extra_bufts=repack)
    text = "\n\n".join(p.text for p in BUILTIN_PROMPTS)
    tokens = list(runner.tokenize(text, add_bos=False))
    while len(tokens) < depth + max(widths):
        tokens += tokens
    context, tail = tokens[:depth], tokens[depth:depth + max(widths)]
    runner.decode(context, 1)

    def timed(w: int) -> float:
        t0 = time.perf_counter()
        runner.decode(tail[:w], min(w, MAX_LOGITS))
        seconds = time.perf_counter() - t0
        runner.truncate(depth)
        return seconds

    medians = median_times(timed, widths, 5)
    runner.close()
    return {str(w): seconds * 1000 for w, seconds in medians.items()}


def _label(repack: bool, flash_attn: bool, tiled: bool = True) -> str:
    label = f"repack {'on' if repack else 'off'}, flash attention {'on' if flash_attn else 'off'}"
    return label if tiled else label + ", tiled off"


def _widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(sorted({int(w) for w in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of widths: {text!r}") from None
    if not widths or widths[0] < 1 or widths[-1] > 512:
        raise argparse.ArgumentTypeError("widths must be 1 to 512")
    if widths[0] != 1:
        widths = (1, *widths)  # every width is reported against the one-token pass
    return widths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--depth", type=int, default=600, help="context tokens before the passes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--widths", type=_widths, default=WIDTHS,
                    help="comma-separated pass widths (default 1,8,16,32,64)")
    ap.add_argument("--tiled-off", action="store_true",
                    help="also time repack and flash attention off with GGML_CPU_TILED_MM=0")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", nargs=2, metavar=("REPACK", "FA"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.depth < 1 or args.rounds < 1:
        ap.error("--depth and --rounds must be at least 1")
    if args.child:
        repack, fa = (v == "1" for v in args.child)
        print(json.dumps(_child(args.target, repack, fa, args.depth, args.widths)))
        return 0
    if not Path(args.target).is_file():
        ap.error(f"no such file: {args.target}")
    widths: tuple[int, ...] = args.widths
    combos = COMBINATIONS + ((TILED_OFF,) if args.tiled_off else ())
    runs: dict[Combination, list[dict[str, float]]] = {c: [] for c in combos}
    for r in range(args.rounds):
        for repack, fa, tiled in combos:
            cmd = [sys.executable, __file__, "--target", args.target, "--depth", str(args.depth),
                   "--widths", ",".join(map(str, widths)), "--child", str(int(repack)),
                   str(int(fa))]
            env = dict(os.environ, GGML_CPU_TILED_MM="1" if tiled else "0")
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT,
                                      env=env)
                if done.returncode != 0:
                    raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[-1])
                lines = done.stdout.strip().splitlines()
                runs[(repack, fa, tiled)].append(json.loads(lines[-1] if lines else ""))
            except (subprocess.TimeoutExpired, RuntimeError, ValueError) as exc:
                print(f"kernel_settings.py: {_label(repack, fa, tiled)} failed: {exc}",
                      file=sys.stderr)
                return 1
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    out: dict[str, dict[str, Any]] = {}
    for combo, rs in runs.items():
        ms = {w: statistics.median(r[str(w)] for r in rs) for w in widths}
        out[_label(*combo)] = {"one_token_ms": round(ms[1], 1),
                               "plain_tokens_per_second": round(1000 / ms[1], 1),
                               "pass_ms": {str(w): round(ms[w], 1) for w in widths},
                               "in_one_token_passes": {str(w): round(ms[w] / ms[1], 2)
                                                       for w in widths}}
    print(f"{'':<52}{'1 token':>10}" + "".join(f"{f'{w} tokens':>16}" for w in widths[1:]))
    for label, row in out.items():
        cells = "".join(f"{row['pass_ms'][str(w)]:>8.0f} ms "
                        f"{row['in_one_token_passes'][str(w)]:>4.1f}x" for w in widths[1:])
        print(f"{label:<52}{row['one_token_ms']:>7.1f} ms{cells}")
    if args.json:
        from localspec.files import atomic_write

        atomic_write(args.json, json.dumps({"target": args.target, "depth": args.depth,
                                            "widths": list(widths), "rounds": args.rounds,
                                            "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
