"""llama.cpp's own speculative decoding on the same pair: its tree against its chains.

    .venv/bin/python benchmarks/llama_cpp_anchor.py --bin BUILD/bin --target T.gguf \
        --draft D.gguf [--rounds 3] [--json OUT]

The anchor for localspec's trees (#27): llama.cpp's tree example (``llama-speculative``: several
draft sequences, a branch split off where the draft's probability of a sibling is above
``--spec-draft-p-split``) against its chain (``llama-speculative-simple``, one draft sequence of
at most K tokens), and against the target alone (``llama-completion``: the chain example aborts
on ``--spec-draft-n-max 0``), on the built-in prompts, greedy. The prompts go through the
target's chat template as ``localspec bench`` sends them.

BUILD is a llama.cpp build of the same version as the installed llama-cpp-python (its
``vendor/llama.cpp``), with examples: see benchmarks/README.md. Each contender runs in its own
process per prompt and round, interleaved (plain, each chain, the tree), so a machine that slows
down for a while moves all of them; the figures are llama.cpp's own "decoded N tokens"
or, for the target alone, its "eval time" over its one-token decodes (generation only, the
prompt's prefill not counted in either), medians over rounds. Text is compared with
the plain run's up to the shorter of the two (the examples stop a few tokens past ``-n``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localspec.benchmarking import BUILTIN_PROMPTS
from localspec.engine import ModelSettings
from localspec.engine.decoder import SpeculativeEngine
from localspec.engine.llama_backend import default_threads

_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPT = re.compile(r"n_accept\s*=\s*(\d+)")
_EVAL = re.compile(r"\s eval time =\s*([\d.]+) ms /\s*(\d+) runs")
_SPEC = ("--spec-type", "draft-simple")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the tree example colours tokens by branch on a terminal


@dataclass(frozen=True)
class Contender:
    name: str
    binary: str
    args: tuple[str, ...]


@dataclass
class Run:
    tokens: int
    seconds: float
    drafted: int
    accepted: int
    text: str

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class PromptRuns:
    name: str
    runs: dict[str, list[Run]] = field(default_factory=dict)


def contenders(chains: list[int], tree: tuple[int, float, int]) -> list[Contender]:
    np_, split, n_max = tree
    out = [Contender("plain", "llama-completion", ("-no-cnv", "--no-display-prompt"))]
    out += [Contender(f"chain K={k}", "llama-speculative-simple",
                      (*_SPEC, "--spec-draft-n-max", str(k))) for k in chains]
    out.append(Contender(f"tree np={np_} p-split={split} K={n_max}", "llama-speculative",
                         (*_SPEC, "-np", str(np_), "--spec-draft-p-split", str(split),
                          "--spec-draft-n-max", str(n_max))))
    return out


def run_one(bin_dir: Path, c: Contender, target: str, draft: str, prompt: str,
            max_tokens: int, threads: int, extra: list[str]) -> Run:
    alone = c.binary == "llama-completion"
    cmd = [str(bin_dir / c.binary), "-m", target, "-p", prompt,
           "-n", str(max_tokens), "--temp", "0", "--top-k", "1", "-c", "4096",
           "-t", str(threads), "--seed", "1", *c.args, *extra]
    if not alone:
        cmd += ["-md", draft, "-td", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", check=False,
                          stdin=subprocess.DEVNULL)
    log = proc.stderr + proc.stdout
    m = _EVAL.search(log) if alone else _DECODED.search(log)
    if proc.returncode != 0 or m is None:
        tail = "\n".join(log.strip().splitlines()[-5:])
        raise SystemExit(f"{c.binary} failed (exit {proc.returncode}):\n{tail}")
    if alone:
        tokens, seconds = int(m.group(2)), float(m.group(1)) / 1000
    else:
        tokens, seconds = int(m.group(1)), float(m.group(2))
    drafted, accepted = _DRAFTED.search(log), _ACCEPT.search(log)
    # The examples print the prompt, then the generated text, to stdout.
    text = proc.stdout.split(prompt, 1)[-1] if prompt in proc.stdout else proc.stdout
    return Run(tokens, seconds, int(drafted.group(1)) if drafted else 0,
               int(accepted.group(1)) if accepted else 0, _ANSI.sub("", text).strip())


def _same(a: str, b: str) -> bool:
    n = min(len(a), len(b))
    # An empty text (a run that printed nothing) matches nothing but another empty one.
    return a[:n] == b[:n] and (n > 0 or a == b)


def _numbers(kind: type[int] | type[float], count: int | None) -> Any:
    """An argparse type for comma-separated numbers: a bad list is one line, not a traceback."""
    def parse(text: str) -> list[Any]:
        try:
            out = [kind(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not comma-separated numbers: {text!r}") from None
        if not out or (count is not None and len(out) != count):
            raise argparse.ArgumentTypeError(
                f"expected {count or 'some'} comma-separated numbers, got {text!r}")
        return out
    return parse


def summarize(results: list[PromptRuns], names: list[str]) -> dict[str, Any]:
    prompts = []
    for r in results:
        plain = r.runs["plain"]
        base = statistics.median(x.tokens_per_second for x in plain)
        row: dict[str, Any] = {"name": r.name, "plain_tokens_per_second": round(base, 3)}
        for n in names[1:]:
            runs = r.runs[n]
            tps = statistics.median(x.tokens_per_second for x in runs)
            drafted = sum(x.drafted for x in runs)
            row[n] = {"tokens_per_second": round(tps, 3),
                      "speedup": round(tps / base, 3) if base else None,
                      "acceptance": round(sum(x.accepted for x in runs) / drafted, 4)
                      if drafted else None,
                      "identical": all(_same(a.text, b.text)
                                       for a, b in zip(plain, runs, strict=True))}
        prompts.append(row)

    def overall(n: str) -> float:
        # Total time over the set at each prompt's median rate, as `bench` sums it.
        tokens = [statistics.median(x.tokens for x in r.runs[n]) for r in results]
        rates = [statistics.median(x.tokens_per_second for x in r.runs[n]) for r in results]
        return sum(tokens) / sum(t / v for t, v in zip(tokens, rates, strict=True))

    base = overall("plain")
    return {"plain_tokens_per_second": round(base, 3),
            "overall": {n: {"tokens_per_second": round(overall(n), 3),
                            "speedup": round(overall(n) / base, 3)} for n in names[1:]},
            "prompts": prompts}


def prompt_texts(target: str, names: set[str] | None) -> list[tuple[str, str]]:
    """The built-in prompts through the target's chat template, as `bench` asks them."""
    engine = SpeculativeEngine.load(target, None, ModelSettings(n_ctx=512))
    try:
        return [(p.name, engine.chat_prompt([{"role": "user", "content": p.text}]))
                for p in BUILTIN_PROMPTS if names is None or p.name in names]
    finally:
        engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, type=Path,
                    help="folder with llama-speculative, -speculative-simple and llama-completion")
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--chains", default="3,5,8", type=_numbers(int, None),
                    help="chain lengths K (comma-separated)")
    ap.add_argument("--tree", default="3,0.1,8", type=_numbers(float, 3),
                    help="the tree example's sequences, split probability and K")
    ap.add_argument("--prompts", default="", help="built-in prompt names (default: all)")
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--llama-arg", action="append", default=[],
                    help="one more argument for every example run (repeatable)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    for b in ("llama-speculative", "llama-speculative-simple", "llama-completion"):
        if not (args.bin / b).is_file():
            print(f"error: {args.bin / b} not found (build llama.cpp's examples first)",
                  file=sys.stderr)
            return 1
    np_, split, n_max = args.tree
    cs = contenders(args.chains, (int(np_), split, int(n_max)))
    names = {n for n in args.prompts.split(",") if n} or None
    results = []
    t0 = time.time()
    texts = prompt_texts(args.target, names)
    # Not counted: each binary's first run reads the files into the page cache.
    for c in cs:
        run_one(args.bin, c, args.target, args.draft, texts[0][1], 8, args.threads,
                args.llama_arg)
    for name, text in texts:
        pr = PromptRuns(name, {c.name: [] for c in cs})
        for rnd in range(args.rounds):
            order = cs if rnd % 2 == 0 else cs[::-1]
            for c in order:
                run = run_one(args.bin, c, args.target, args.draft, text, args.max_tokens,
                              args.threads, args.llama_arg)
                pr.runs[c.name].append(run)
                print(f"{name} round {rnd + 1} {c.name}: {run.tokens_per_second:.2f} tok/s"
                      f" ({run.accepted}/{run.drafted} accepted)", file=sys.stderr, flush=True)
        results.append(pr)
    out = summarize(results, [c.name for c in cs])
    out.update({"target": args.target, "draft": args.draft, "max_tokens": args.max_tokens,
                "rounds": args.rounds, "threads": args.threads, "llama_args": args.llama_arg,
                "seconds": round(time.time() - t0, 1)})
    text = json.dumps(out, indent=2)
    if args.json:
        args.json.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
