"""What the engine process costs: the same pair, prompts and settings through the engine in this
process, through the chat app's engine process (a unix socket), and through `localspec serve`
(its front relays to its engine process over HTTP), alternating per prompt.

    .venv/bin/python benchmarks/process_overhead.py --target T.gguf --draft D.gguf \
        [--max-tokens 128] [--repeats 3] [--json OUT]
    .venv/bin/python benchmarks/process_overhead.py --tiny       # a quick end-to-end check

Greedy, so every path must produce the same text. Tokens/s is end to end (request to last
token), TTFT from the request to the first streamed text, as the chat app measures them.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from localspec.benchmarking import BUILTIN_PROMPTS
from localspec.chat_engine import ChatEngine, ChatOptions, LocalChatEngine
from localspec.engine import Finished, ModelSettings, SamplingParams, SpeculativeEngine
from localspec.loading import EngineSpec
from localspec.remote import RemoteEngine
from localspec.server.config import ServerConfig
from localspec.server.engine_process import ProcessChatEngine


def _one(engine: ChatEngine, text: str, options: ChatOptions) -> tuple[float, float, int, str]:
    t0 = time.perf_counter()
    ttft = 0.0
    done = None
    for event in engine.stream_chat([{"role": "user", "content": text}], options):
        if isinstance(event, Finished):
            done = event
        elif not ttft:
            ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    assert done is not None
    return total, ttft, done.stats.completion_tokens, done.text


def _serve(target: Path, draft: Path | None, ctx: int) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "localspec", "serve", "--target", str(target), "--ctx", str(ctx),
           "--port", "0"] + (["--draft", str(draft)] if draft else [])
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        found = re.search(r"at (http://127\.0\.0\.1:\d+)/v1 ", line)
        if found:
            return proc, found[1]
    raise SystemExit("serve did not start")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--tiny", action="store_true", help="generate tiny models and run quickly")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            from localspec.models.tiny import build_demo_pair

            target, draft = build_demo_pair(Path(tmp))
            args.max_tokens, args.repeats = 48, 1
        elif args.target:
            target, draft = Path(args.target), Path(args.draft) if args.draft else None
        else:
            p.error("give --target (and --draft), or --tiny")
        result = _run(target, draft, args)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 1 if result["mismatches"] else 0


def _run(target: Path, draft: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    settings = ModelSettings(n_ctx=args.ctx)
    spec = EngineSpec(target=str(target), draft=str(draft) if draft else None,
                      target_settings=settings, draft_settings=settings, pair_name="bench",
                      draft_mode="model" if draft else "lookup")
    options = ChatOptions(max_tokens=args.max_tokens, sampling=SamplingParams(temperature=0.0))
    local = LocalChatEngine(SpeculativeEngine.load(target, draft, settings, settings), "bench")
    child = ProcessChatEngine(spec, ServerConfig(model_id="bench"))
    server, url = _serve(target, draft, args.ctx)
    remote = RemoteEngine(url)
    paths: dict[str, ChatEngine] = {"in_process": local, "engine_process": child, "serve": remote}
    runs: dict[str, list[tuple[float, float, int, str]]] = {k: [] for k in paths}
    try:
        for engine in paths.values():  # warm-up: graphs, calibration (then cached), imports
            _one(engine, "warm up", ChatOptions(max_tokens=16))
        prompts = [bp.text for bp in BUILTIN_PROMPTS][: 3 if args.tiny else None]
        for _ in range(args.repeats):
            for text in prompts:
                for name, engine in paths.items():
                    runs[name].append(_one(engine, text, options))
    finally:
        remote.close()
        child.close()
        local.close()
        server.send_signal(signal.SIGINT)
        server.wait(30)
    n = len(runs["in_process"])
    mismatches = sum(runs[name][i][3] != runs["in_process"][i][3]
                     for name in ("engine_process", "serve") for i in range(n))
    out: dict[str, Any] = {"prompts": len(prompts), "repeats": args.repeats,
                           "max_tokens": args.max_tokens, "mismatches": mismatches}
    for name, rs in runs.items():
        tokens, seconds = sum(r[2] for r in rs), sum(r[0] for r in rs)
        out[name] = {"tokens_per_second": round(tokens / seconds, 3),
                     "median_ttft_ms": round(1000 * statistics.median(r[1] for r in rs), 2)}
    for name in ("engine_process", "serve"):
        ratios = [(runs[name][i][2] / runs[name][i][0]) / (runs["in_process"][i][2] /
                                                            runs["in_process"][i][0])
                  for i in range(n)]
        ttft = [1000 * (runs[name][i][1] - runs["in_process"][i][1]) for i in range(n)]
        out[name]["tps_ratio_vs_in_process_median"] = round(statistics.median(ratios), 4)
        out[name]["ttft_extra_ms_median"] = round(statistics.median(ttft), 2)
    return out


if __name__ == "__main__":
    sys.exit(main())
