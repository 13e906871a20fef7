"""Answers held to a JSON Schema (``response_format``), drafted against not drafted.

    .venv/bin/python benchmarks/structured_output.py --target T.gguf --draft D.gguf \\
        [--repeats 3] [--repack off] [--json OUT.json]

In one process, on one engine: each prompt asks for JSON that a schema describes (extraction,
a function's signature, a tool call's arguments, a list), answered greedily under that schema
by the target alone (this engine with drafting off: llama-cpp-python's ``response_format``
masks by its own GBNF grammar, whose whitespace and key order differ, so its text would not
compare) and by auto drafting, each repeat in turn with the
two sides alternating which goes first. The history drafter is off, so no answer drafts from
another. Reported per prompt: tokens/s of each side (median of the repeats), the speedup,
acceptance, whether the two texts are identical, and whether the answer parses as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from localspec.engine import DraftSettings, ModelSettings, SamplingParams, SpeculativeEngine
from localspec.engine.decoder import GenerationRequest
from localspec.engine.structure import OutputFormat

_STR, _INT = {"type": "string"}, {"type": "integer"}
PROMPTS: list[tuple[str, str, dict[str, Any]]] = [
    ("person", "Extract the person as JSON: Ada Lovelace, born 1815 in London, wrote the "
     "first published algorithm and worked with Charles Babbage on the Analytical Engine.",
     {"type": "object", "properties": {"name": _STR, "born": _INT, "city": _STR,
                                       "known_for": {"type": "array", "items": _STR}},
      "required": ["name", "born", "city", "known_for"], "additionalProperties": False}),
    ("signature", "Describe this Python function as JSON (its name, each parameter with its "
     "type, and the return type):\n\ndef parse_config(path: str, strict: bool = False, "
     "encoding: str = 'utf-8') -> dict[str, str]:\n    ...",
     {"type": "object", "properties": {
         "name": _STR, "returns": _STR,
         "parameters": {"type": "array", "items": {
             "type": "object", "properties": {"name": _STR, "type": _STR,
                                              "default": {"type": ["string", "null"]}},
             "required": ["name", "type", "default"], "additionalProperties": False}}},
      "required": ["name", "parameters", "returns"], "additionalProperties": False}),
    ("tool-args", "Call the search tool to find every Python file under src/ that mentions "
     "parse_config, at most 10 results. Answer with the tool's arguments as JSON.",
     {"type": "object", "properties": {"pattern": _STR, "path": _STR,
                                       "file_glob": _STR, "max_results": _INT},
      "required": ["pattern", "path", "file_glob", "max_results"],
      "additionalProperties": False}),
    ("list", "List the steps to create and activate a Python virtual environment on Linux, "
     "as JSON: each step with its shell command and a one-sentence explanation.",
     {"type": "object", "properties": {"steps": {"type": "array", "items": {
         "type": "object", "properties": {"command": _STR, "explanation": _STR},
         "required": ["command", "explanation"], "additionalProperties": False}}},
      "required": ["steps"], "additionalProperties": False}),
]
SIDES = {"alone": DraftSettings(mode="none", history=False), "auto": DraftSettings(history=False)}


def run_once(eng: SpeculativeEngine, prompt: str, schema: dict[str, Any],
             draft: DraftSettings, max_tokens: int) -> dict[str, Any]:
    tokens = eng.tokenize(eng.chat_prompt([{"role": "user", "content": prompt}]), chat=True)
    t0 = time.perf_counter()
    done = eng.generate(GenerationRequest(prompt_tokens=tokens, max_tokens=max_tokens,
                                          sampling=SamplingParams(), draft=draft,
                                          output=OutputFormat(json.dumps(schema))))
    seconds = time.perf_counter() - t0
    s = done.stats
    return {"text": done.text, "tokens": s.completion_tokens, "seconds": seconds,
            "rate": s.completion_tokens / seconds, "finish": done.finish_reason,
            "drafted": s.drafted, "accepted": s.accepted}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--repack", default="off")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", action="append", help="this prompt only (repeatable)")
    args = ap.parse_args(argv)
    settings = ModelSettings(n_ctx=2048, repack=args.repack)
    rows = []
    with SpeculativeEngine.load(args.target, args.draft, settings) as eng:
        run_once(eng, "Say OK as JSON.", {"type": "object"}, SIDES["auto"], 8)  # calibrates
        for name, prompt, schema in PROMPTS:
            if args.only and name not in args.only:
                continue
            runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
            for r in range(args.repeats):
                order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
                for side in order:
                    runs[side].append(run_once(eng, prompt, schema, SIDES[side],
                                               args.max_tokens))
            alone, auto = runs["alone"], runs["auto"]
            texts = {x["text"] for x in alone + auto}
            try:
                json.loads(alone[0]["text"])
                parses = True
            except ValueError:
                parses = False
            row = {"prompt": name, "tokens": alone[0]["tokens"],
                   "alone_tok_s": statistics.median(x["rate"] for x in alone),
                   "auto_tok_s": statistics.median(x["rate"] for x in auto),
                   "speedups": [b["rate"] / a["rate"] for a, b in zip(alone, auto, strict=True)],
                   "acceptance": (sum(x["accepted"] for x in auto)
                                  / max(1, sum(x["drafted"] for x in auto))),
                   "identical": len(texts) == 1, "parses": parses,
                   "finish": alone[0]["finish"], "text": alone[0]["text"],
                   # where they part, every distinct text (a near-tie's two sides, say)
                   "texts": sorted(texts) if len(texts) > 1 else []}
            row["speedup"] = statistics.median(row["speedups"])
            rows.append(row)
            print(f"{name:10s} {row['tokens']:4d} tokens  alone {row['alone_tok_s']:6.2f} tok/s  "
                  f"auto {row['auto_tok_s']:6.2f} tok/s  {row['speedup']:.2f}x "
                  f"({', '.join(f'{x:.2f}' for x in row['speedups'])})  "
                  f"acceptance {row['acceptance']:.0%}  identical "
                  f"{'yes' if row['identical'] else 'no'}  JSON {'yes' if parses else 'no'}  "
                  f"{row['finish']}", file=sys.stderr)
    total_alone = sum(r["tokens"] / r["alone_tok_s"] for r in rows)
    total_auto = sum(r["tokens"] / r["auto_tok_s"] for r in rows)
    summary = {"command": " ".join(sys.argv), "rows": rows,
               "speedup": total_alone / total_auto}
    print(f"all: {summary['speedup']:.2f}x (median runs' time, summed)", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
