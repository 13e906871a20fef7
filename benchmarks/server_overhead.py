"""The server's overhead over the in-process engine: same engine, same prompts, tokens/s ratio.

    python benchmarks/server_overhead.py --target T.gguf --draft D.gguf [--max-tokens 256]
    python benchmarks/server_overhead.py --tiny        # a quick end-to-end check, tiny models

Greedy decoding, so both paths produce the same tokens; the server path streams over loopback
HTTP (SSE) with the localspec client, and its time includes tokenization and HTTP on top of
generation. Runs alternate (engine, server) per prompt to spread machine noise over both.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from localspec.benchmarking import BUILTIN_PROMPTS
from localspec.engine import (
    DraftSettings,
    GenerationRequest,
    ModelSettings,
    SamplingParams,
    SpeculativeEngine,
)
from localspec.remote import RemoteEngine, RemoteFinished
from localspec.server import ServerConfig
from localspec.server.app import create_app
from localspec.server.running import BackgroundServer

GREEDY = SamplingParams(temperature=0.0)


def _in_process(engine: SpeculativeEngine, text: str, max_tokens: int,
                draft: DraftSettings) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    tokens = engine.tokenize(engine.chat_prompt([{"role": "user", "content": text}]), chat=True)
    done = engine.generate(GenerationRequest(tokens, max_tokens=max_tokens, sampling=GREEDY,
                                             draft=draft))
    return done.stats.completion_tokens, time.perf_counter() - t0, done.text


def _through_server(remote: RemoteEngine, text: str, max_tokens: int) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    done = None
    for event in remote.stream_chat([{"role": "user", "content": text}], max_tokens, GREEDY):
        if isinstance(event, RemoteFinished):
            done = event
    assert done is not None
    return done.stats.completion_tokens, time.perf_counter() - t0, done.text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--tiny", action="store_true", help="generate tiny models and run quickly")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--gpu-layers", type=int, default=-1)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            from localspec.models.tiny import build_demo_pair

            target, draft = build_demo_pair(Path(tmp))
            args.max_tokens, args.repeats, args.gpu_layers = 48, 1, 0
        elif args.target:
            target, draft = Path(args.target), Path(args.draft) if args.draft else None
        else:
            p.error("give --target (and --draft), or --tiny")
        settings = ModelSettings(n_ctx=args.ctx, n_gpu_layers=args.gpu_layers)
        engine = SpeculativeEngine.load(target, draft, settings)
        try:
            result = _run(engine, args)
        finally:
            engine.close()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"in-process {result['in_process_tps']:.1f} tok/s, server "
              f"{result['server_tps']:.1f} tok/s, ratio {result['ratio']:.3f} "
              f"({result['tokens']} tokens, {result['mismatches']} text mismatches)")
    return 1 if result["mismatches"] else 0


def _run(engine: SpeculativeEngine, args: argparse.Namespace) -> dict[str, object]:
    draft = DraftSettings(mode="model" if engine.draft is not None else "lookup")
    prompts = [bp.text for bp in BUILTIN_PROMPTS]
    if args.tiny:
        prompts = prompts[:3]
    local_t = server_t = 0.0
    local_n = server_n = mismatches = 0
    per_prompt: list[float] = []
    # The server's worker owns the engine while it runs, so in-process runs go through the
    # same worker thread (worker.call), between server requests, never concurrently.
    app = create_app(engine, ServerConfig(model_id="bench", draft=draft,
                                          max_tokens_limit=args.max_tokens))
    worker = app.state.localspec.worker
    with BackgroundServer(app) as srv, RemoteEngine(srv.url) as remote:
        _through_server(remote, "warm up", 8)
        for _ in range(args.repeats):
            for text in prompts:
                n1, t1, text1 = worker.call(
                    lambda text=text: _in_process(engine, text, args.max_tokens, draft)).result()
                n2, t2, text2 = _through_server(remote, text, args.max_tokens)
                local_n, local_t = local_n + n1, local_t + t1
                server_n, server_t = server_n + n2, server_t + t2
                mismatches += text1 != text2
                per_prompt.append((n2 / t2) / (n1 / t1) if t1 and t2 and n1 else 0.0)
    in_tps, srv_tps = local_n / local_t, server_n / server_t
    return {"in_process_tps": round(in_tps, 2), "server_tps": round(srv_tps, 2),
            "ratio": round(srv_tps / in_tps, 4),
            "median_prompt_ratio": round(statistics.median(per_prompt), 4),
            "tokens": server_n, "mismatches": mismatches}


if __name__ == "__main__":
    sys.exit(main())
