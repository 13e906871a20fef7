"""How far llama.cpp's batched logits stray from one-token logits, by context depth and width.

Greedy speculative decoding keeps the target's output only where the target's top-2 logit margin
exceeds this drift (the engine's near-tie guard). The engine measures the drift at load; this
script asks whether a short measurement at the start of the context is representative of real
contexts (deeper positions, other batch widths), on real text rather than arbitrary token ids.

    .venv/bin/python benchmarks/drift.py --target T.gguf [--target T2.gguf ...] [--json OUT]

For each target: a real prompt and the target's own greedy continuation give a realistic context;
at several depths, the next W tokens are decoded once as one batch of W and once one token at a
time, and per (depth, width) two drifts are recorded:

* ``drift``: the largest |batched - single| logit difference over the whole vocabulary (what the
  engine measures at load; its near-tie margin is twice this, at least 0.2 for quantized
  weights);
* ``margin_drift``: the largest change between batched and single logits of the *margin*
  between the one-token pass's top token and each of its next four, which is what decides
  whether a batched pass could choose otherwise.

And over the one-token passes (each position once), the share of positions whose top-2 margin
is under the engine's rule applied to this script's drift (the engine applies it to the drift
its calibration measured at load, a shorter stretch) and under the largest margin drift seen.
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
from localspec.engine.decoder import QUANTIZED_TIE_FLOOR
from localspec.gguf_meta import has_quantized_weights

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


RIVALS = 4  # the one-token pass's runners-up whose margin to its top token is followed


def _margin_drift(single: np.ndarray, batched: np.ndarray) -> float:
    order = np.argsort(-single)[:RIVALS + 1]
    delta = batched[order] - single[order]
    return float(np.abs(delta[0] - delta[1:]).max())


def measure(engine: SpeculativeEngine, seq: list[int], depth: int,
            width: int) -> tuple[float, float, list[float]]:
    """(vocabulary drift, margin drift, the one-token passes' top-2 margins) of decoding
    ``seq[depth:depth + width]`` after ``seq[:depth]`` as one batch against one token at a time."""
    runner = engine.target
    head, tail = seq[:depth], seq[depth:depth + width]
    runner.reset()
    runner.sync(head, 1)
    single = [runner.decode([t], 1)[0].copy() for t in tail]
    runner.truncate(depth)
    batched = runner.decode(tail, width)
    drift = max(float(np.abs(single[i] - batched[i]).max()) for i in range(width))
    margin = max(_margin_drift(single[i], batched[i]) for i in range(width))
    tops = [float(np.diff(np.sort(s)[-2:])[0]) for s in single]
    return drift, margin, tops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", action="append", required=True)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = {}
    for path in args.target:
        t0 = time.perf_counter()
        with SpeculativeEngine(LlamaRunner(path, ModelSettings(n_ctx=2048)), None,
                               cache_calibration=False) as e:
            seq = _context(e, max(DEPTHS) + max(WIDTHS) + 1)
            runs = {(d, w): measure(e, seq, d, w) for d in DEPTHS for w in WIDTHS}
            quantized = has_quantized_weights(path)
        table = {f"{d}x{w}": round(r[0], 4) for (d, w), r in runs.items()}
        margins = {f"{d}x{w}": round(r[1], 4) for (d, w), r in runs.items()}
        # Each depth's widest run passes over every position the narrower ones do: count
        # each position once.
        tops = np.array([m for (d, w), r in runs.items() if w == max(WIDTHS) for m in r[2]])
        guard = max(2.0 * max(table.values()), QUANTIZED_TIE_FLOOR if quantized else 0.0)
        seen = max(margins.values())
        out[Path(path).name] = {
            "drift": table, "margin_drift": margins, "tie_margin_by_rule": round(guard, 4),
            "positions_under_tie_margin": round(float(np.mean(tops < guard)), 3),
            "positions_under_margin_drift": round(float(np.mean(tops < seen)), 3),
            "seconds": round(time.perf_counter() - t0, 1)}
        print(Path(path).name, file=sys.stderr)
        for name, t in (("drift", table), ("margin drift", margins)):
            print(f"{name:<13} depth \\ width " + " ".join(f"{w:>7}" for w in WIDTHS),
                  file=sys.stderr)
            for d in DEPTHS:
                print(f"{d:>27} " + " ".join(f"{t[f'{d}x{w}']:7.4f}" for w in WIDTHS),
                      file=sys.stderr)
        print(f"near-tie margin by the engine's rule on this drift {guard:.3f}: "
              f"{np.mean(tops < guard):.0%} of {tops.size} positions under "
              f"it; under the largest margin drift ({seen:.3f}): {np.mean(tops < seen):.0%}",
              file=sys.stderr)
    text = json.dumps(out, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
