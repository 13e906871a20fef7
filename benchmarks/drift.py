"""How far llama.cpp's batched logits stray from one-token logits, by context depth and width.

Greedy speculative decoding keeps the target's output only where the target's top-2 logit margin
exceeds this drift (the engine's near-tie guard). The engine measures the drift at load; this
script asks whether a short measurement at the start of the context is representative of real
contexts (deeper positions, other batch widths), on real text rather than arbitrary token ids.

    .venv/bin/python benchmarks/drift.py --target T.gguf [--target T2.gguf ...] [--json OUT]

For each target: a real prompt and the target's own greedy continuation give a realistic context;
at several depths, the next W tokens are decoded once as one batch of W and once one token at a
time, and the largest |batched - single| logit difference is recorded per (depth, width).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from localspec.benchmarking import BUILTIN_PROMPTS
from localspec.engine import LlamaRunner, ModelSettings, SpeculativeEngine

WIDTHS = (2, 4, 6, 9, 13)
DEPTHS = (8, 64, 256, 512)


def _context(engine: SpeculativeEngine, n: int) -> list[int]:
    """A prompt and the target's greedy continuation, at least ``n`` tokens long."""
    text = " ".join(p.text for p in BUILTIN_PROMPTS)
    toks = list(engine.tokenize(engine.chat_prompt([{"role": "user", "content": text}]),
                                chat=True))
    runner = engine.target
    logits = runner.sync(toks, 1)
    while len(toks) < n:
        toks.append(int(np.argmax(logits[0])))
        logits = runner.decode([toks[-1]], 1)
    return toks


def measure(engine: SpeculativeEngine, seq: list[int], depth: int, width: int) -> float:
    runner = engine.target
    head, tail = seq[:depth], seq[depth:depth + width]
    runner.reset()
    runner.sync(head, 1)
    single = [runner.decode([t], 1)[0].copy() for t in tail]
    runner.truncate(depth)
    batched = runner.decode(tail, width)
    return max(float(np.abs(single[i] - batched[i]).max()) for i in range(width))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", action="append", required=True)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = {}
    for path in args.target:
        t0 = time.perf_counter()
        with SpeculativeEngine(LlamaRunner(path, ModelSettings(n_ctx=2048)), None,
                               calibrate=False) as e:
            seq = _context(e, max(DEPTHS) + max(WIDTHS) + 1)
            table = {f"{d}x{w}": round(measure(e, seq, d, w), 4)
                     for d in DEPTHS for w in WIDTHS}
            # What the engine measured at load until now: 6 arbitrary ids at depth 6.
            vocab = e.target.n_vocab
            ids = [(vocab // 3 + 7919 * i) % vocab for i in range(12)]
            random_ids = round(measure(e, ids, 6, 6), 4)
        out[Path(path).name] = {"drift": table, "load_time_measure": random_ids,
                                "seconds": round(time.perf_counter() - t0, 1)}
        print(Path(path).name, file=sys.stderr)
        print("depth \\ width " + " ".join(f"{w:>7}" for w in WIDTHS), file=sys.stderr)
        for d in DEPTHS:
            print(f"{d:>13} " + " ".join(f"{table[f'{d}x{w}']:7.4f}" for w in WIDTHS),
                  file=sys.stderr)
    text = json.dumps(out, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
