"""What a user feels before any speedup: the time from a command to its first token or answer,
cold (a new machine: no localspec caches) and warm (the same files again), against loading the
same pair with llama-cpp-python itself.

    .venv/bin/python benchmarks/startup.py [--models DIR] [--repeats 3] [--json OUT]

Measured, each the median of --repeats whole processes:
* ``run PAIR "hi" --max-tokens 1``: from the command to its first byte of output, and to its end;
* the same with llama-cpp-python: a script that imports it, loads both models (``Llama``, with
  this machine's repack decision: its defaults crash here on quantized models) and decodes the
  prompt and one token (what a library user runs; llama.cpp's own tools are not built here);
* ``inspect TARGET``; ``list`` over an Ollama store of 20 models (real 152k-vocabulary GGUFs);
  the pair picker's compatibility column (every pair checked on its files, as the picker does).
"Cold" runs get a fresh LOCALSPEC_HOME each time (the OS page cache stays warm: dropping it
needs root on the host). The repack self-test, which a first run starts in the background for a
quantized model, is cached outside the measured home so it does not run during every cold run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DRAFT = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
TARGET = "qwen2.5-coder-1.5b-instruct-f16.gguf"
CLI = [sys.executable, "-m", "localspec"]
PROMPT = "hi"

LLAMA_SCRIPT = """
import sys, time
t0 = time.perf_counter()
from localspec.engine.llama_backend import ModelSettings, open_llama
target = open_llama(sys.argv[1], ModelSettings(n_ctx=4096))
draft = open_llama(sys.argv[2], ModelSettings(n_ctx=4096))
prompt = target.tokenize(sys.argv[3].encode(), add_bos=True)
for tok in target.generate(prompt, top_k=1, temp=0.0):
    sys.stdout.write(target.detokenize([tok]).decode("utf-8", "replace") or "?")
    sys.stdout.flush()
    break
"""


def _first_byte(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(seconds to the first byte on stdout, seconds to exit)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    proc.stdout.read(1)
    first = time.perf_counter() - t0
    proc.stdout.read()
    code = proc.wait()
    if code != 0:
        raise SystemExit(f"failed ({code}): {' '.join(cmd)}")
    return first, time.perf_counter() - t0


def _wall(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t0


def _home(base: Path, verdict: Path | None) -> dict[str, str]:
    home = Path(tempfile.mkdtemp(dir=base))
    if verdict is not None:  # this machine's repack verdict, as after its first-ever run
        (home / "cache").mkdir(parents=True)
        for f in verdict.parent.glob(verdict.name + "*"):
            shutil.copy(f, home / "cache" / f.name)
    return {**os.environ, "LOCALSPEC_HOME": str(home), "OLLAMA_MODELS": str(base / "ollama"),
            "OLLAMA_HOST": "127.0.0.1:9"}


def _store_of_20(store: Path, gguf: Path) -> None:
    """20 models in an Ollama store, each a real GGUF (hard links of one file, 20 names)."""
    for i in range(20):
        digest = "sha256:" + hashlib.sha256(f"startup-{i}".encode()).hexdigest()
        blob = store / "blobs" / digest.replace(":", "-")
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            os.link(gguf, blob)
        layer = {"mediaType": "application/vnd.ollama.image.model", "digest": digest,
                 "size": gguf.stat().st_size}
        manifest = {"schemaVersion": 2, "config": layer, "layers": [layer]}
        path = store / "manifests" / "registry.ollama.ai" / "library" / f"model{i}" / "latest"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(manifest))


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=Path(os.environ.get(
        "LOCALSPEC_BENCH_MODELS", Path.home() / ".cache" / "localspec-bench")))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    target, draft = args.models / TARGET, args.models / DRAFT
    out: dict[str, Any] = {"repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        # This machine's repack verdict (the self-test runs once per llama.cpp build and CPU).
        verdict_home = _home(base, None)
        subprocess.run([*CLI, "doctor"], env=verdict_home, stdout=subprocess.DEVNULL)
        verdict = Path(verdict_home["LOCALSPEC_HOME"]) / "cache" / "repack-selftest.json"
        # --raw: the same prompt tokens as the llama-cpp-python script (no chat template).
        run = [*CLI, "run", "--target", str(target), "--draft", str(draft), "--raw", "-n", "1",
               PROMPT]
        llama = [sys.executable, "-c", LLAMA_SCRIPT, str(target), str(draft), PROMPT]
        warm_env = _home(base, verdict)
        _first_byte(run, warm_env)  # fills the caches (and the page cache) once
        cold, warm, lib = [], [], []
        for _ in range(args.repeats):  # alternating: machine drift hits all three alike
            cold.append(_first_byte(run, _home(base, verdict)))
            warm.append(_first_byte(run, warm_env))
            lib.append(_first_byte(llama, warm_env))
        out["run"] = {
            "cold_first_token_s": _median([c[0] for c in cold]),
            "warm_first_token_s": _median([w[0] for w in warm]),
            "llama_cpp_python_first_token_s": _median([x[0] for x in lib]),
            "cold_total_s": _median([c[1] for c in cold]),
            "warm_total_s": _median([w[1] for w in warm]),
        }
        r = out["run"]
        r["cold_minus_llama_cpp_python_s"] = round(r["cold_first_token_s"]
                                                   - r["llama_cpp_python_first_token_s"], 3)
        r["warm_minus_llama_cpp_python_s"] = round(r["warm_first_token_s"]
                                                   - r["llama_cpp_python_first_token_s"], 3)
        # A first answer longer than one token also pays auto's one-time cost measurement
        # (after its first token): 32 tokens, cold against warm.
        run32 = [*run[:-3], "-n", "32", PROMPT]
        out["run_32_tokens"] = {
            "cold_total_s": _median([_wall(run32, _home(base, verdict))
                                     for _ in range(args.repeats)]),
            "warm_total_s": _median([_wall(run32, warm_env) for _ in range(args.repeats)])}
        inspect = [*CLI, "inspect", str(target)]
        out["inspect"] = {"cold_s": _median([_wall(inspect, _home(base, verdict))
                                             for _ in range(args.repeats)]),
                          "warm_s": _median([_wall(inspect, warm_env)
                                             for _ in range(args.repeats)])}
        _store_of_20(base / "ollama", draft)
        listing = [*CLI, "list"]
        _wall(listing, warm_env)
        out["list_20_models"] = {"cold_s": _median([_wall(listing, _home(base, verdict))
                                                    for _ in range(args.repeats)]),
                                 "warm_s": _median([_wall(listing, warm_env)
                                                    for _ in range(args.repeats)])}
        subprocess.run([*CLI, "pair", "add", "bench", "--target", str(target), "--draft",
                        str(draft)], env=warm_env, check=True, stdout=subprocess.DEVNULL)
        picker = [sys.executable, "-c", "from localspec.models.library import DefaultLibrary; "
                  "lib = DefaultLibrary(); [lib.check_pair(p) for p in lib.pairs()]"]
        pairs_file = Path(warm_env["LOCALSPEC_HOME"]) / "config" / "models.toml"

        def cold_picker_home() -> dict[str, str]:
            env = _home(base, verdict)
            (Path(env["LOCALSPEC_HOME"]) / "config").mkdir(parents=True, exist_ok=True)
            shutil.copy(pairs_file, Path(env["LOCALSPEC_HOME"]) / "config" / "models.toml")
            return env

        out["pair_picker_column"] = {"cold_s": _median([_wall(picker, cold_picker_home())
                                                        for _ in range(args.repeats)]),
                                     "warm_s": _median([_wall(picker, warm_env)
                                                        for _ in range(args.repeats)])}
    text = json.dumps(out, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
