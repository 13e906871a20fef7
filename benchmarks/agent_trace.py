"""Replays an agent-like trace of chat requests against `localspec serve`, to measure drafting
from history (suffix decoding) on the work it is for: requests that repeat themselves.

The trace (30 requests, greedy, built-in):
  - a coding loop: one Python function revised one change at a time, the whole file resent
    with each request (as an editor plugin or coding agent does);
  - tool calls in one JSON schema with different arguments;
  - a chat where the user asks for the previous answer again, with one change.

Each configuration is its own `localspec serve` process on loopback, replayed through the
`openai` client with the same requests in the same order:
  - `alone`: the target alone (`--draft-mode none`: localspec's plain decoding, measured at
    0.99-1.01x llama-cpp-python's own generation in benchmarks/README.md);
  - `history-off`: the pair's drafting as shipped, with `--history off`;
  - `history-on`: the same with the history drafter on (a fresh, empty index: the server's
    own, under a temporary LOCALSPEC_HOME);
  - `alone-no-prompt-cache` (not run unless named in --configs): the target alone without
    saved prompt states (`--prompt-cache 0`), as every run before them measured it.
All the servers run at once and each request goes to each of them in turn (the order
rotated per request), so the machine's drift over the minutes a trace takes weighs on every
configuration alike; each configuration builds its later prompts from its own answers.
`--sequential` runs one server after another instead (every run before 2026-12-04's AVX2
ones). Each server first answers one untimed request ("Say OK."): a user's first request on a
machine also measures its costs (calibration), once, cached for every later start, which a
fresh LOCALSPEC_HOME would charge to the trace (`--no-warmup` keeps it in).
Every configuration keeps prompt states as shipped (`--prompt-cache`), the target alone too,
as llama-server keeps its slots' prompts: speedups are drafting's, over the same server.
Reported: tokens/s per request and over the trace, the seconds to first token (prefill, the
same work with or without drafting) and how many prompt tokens came from a cache, acceptance
per drafter, and whether every text is identical to the target alone's.

  .venv/bin/python benchmarks/agent_trace.py --target T.gguf [--draft D.gguf] \
      [--max-tokens 160] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localspec.benchmarking import repeat_order
from localspec.engine.stats import GenerationStats, drafter_totals

Messages = list[dict[str, str]]

_FUNCTION = '''def parse_config(path):
    data = {}
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            data[key.strip()] = value.strip()
    return data
'''

_REVISIONS = [
    "Add type hints to parse_config.",
    "Make parse_config raise ValueError naming the line number when a line has no '='.",
    "Let parse_config accept a pathlib.Path as well as a str.",
    "Strip surrounding double quotes from values in parse_config.",
    "Add a docstring to parse_config.",
    "Make parse_config ignore lines that start with ';' too.",
    "Convert values that look like integers to int in parse_config.",
    "Let parse_config take an optional defaults dict that the file's values override.",
    "Rename the variable fh to handle in parse_config.",
    "Make parse_config lower-case every key.",
    "Let parse_config read the file as UTF-8 explicitly.",
    "Make parse_config skip a UTF-8 byte order mark at the start of the file.",
]

_TOOL_SYSTEM = (
    "You are an agent. Answer only with one JSON object calling a tool, of the form "
    '{"tool": "search_files", "arguments": {"pattern": ..., "path": ..., "max_results": ...}}.')

_TOOL_TASKS = [
    "Find where parse_config is defined under src/.",
    "Find every TODO comment under tests/.",
    "Find the files under docs/ that mention 'install'.",
    "Find where the logger is created under src/localspec/.",
    "Find uses of subprocess.run under benchmarks/.",
    "Find the test that covers the chat store migrations under tests/.",
    "Find every 'import numpy' under src/.",
    "Find where max_tokens is defaulted under src/.",
    "Find the files under assets/ with 'svg' in their name.",
    "Find where the port is parsed under src/localspec/cli/.",
]

_CHAT_ASKS = [
    "Write a short README section explaining how to install a Python package with pip "
    "in a virtual environment.",
    "Give me that section again, but use `python3 -m pip` instead of `pip`.",
    "Again, the same section, but add a line about upgrading pip first.",
    "Once more, exactly the same, but call the virtual environment .venv everywhere.",
    "The same again, with the title changed to 'Installing'.",
    "Repeat the last version, but mention Python 3.11 as the minimum.",
    "Repeat it once more, adding a final line on how to run the tests with pytest.",
    "Give me the final version again, unchanged.",
]


@dataclass(slots=True)
class Step:
    """One request; ``build`` makes its messages from the answers so far (by step name)."""

    name: str
    build: Callable[[dict[str, str]], Messages]


def _code_step(i: int) -> Step:
    def build(answers: dict[str, str]) -> Messages:
        # The file as the previous revision left it (its code block), resent whole.
        current = _FUNCTION if i == 0 else _code_of(answers[f"code-{i - 1}"]) or _FUNCTION
        return [{"role": "system", "content": "You edit Python code. Answer with the whole "
                 "revised file in one ```python block, nothing else."},
                {"role": "user", "content": f"```python\n{current}```\n\n{_REVISIONS[i]}"}]
    return Step(f"code-{i}", build)


def _tool_step(i: int) -> Step:
    return Step(f"tool-{i}", lambda _a: [{"role": "system", "content": _TOOL_SYSTEM},
                                         {"role": "user", "content": _TOOL_TASKS[i]}])


def _chat_step(i: int) -> Step:
    def build(answers: dict[str, str]) -> Messages:
        messages: Messages = []
        for j in range(i + 1):
            messages.append({"role": "user", "content": _CHAT_ASKS[j]})
            if j < i:
                messages.append({"role": "assistant", "content": answers[f"chat-{j}"]})
        return messages
    return Step(f"chat-{i}", build)


def trace() -> list[Step]:
    """The 30 requests, interleaved as an agent's session would send them."""
    steps = [_code_step(i) for i in range(len(_REVISIONS))]
    tools = [_tool_step(i) for i in range(len(_TOOL_TASKS))]
    chats = [_chat_step(i) for i in range(len(_CHAT_ASKS))]
    out: list[Step] = []
    while steps or tools or chats:
        for group in (steps, tools, chats):
            if group:
                out.append(group.pop(0))
    return out


def _code_of(answer: str) -> str | None:
    m = re.search(r"```(?:python)?\n(.*?)```", answer, re.S)
    return m.group(1) if m else None


@dataclass(slots=True)
class Result:
    name: str
    tokens: int
    seconds: float
    text: str
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


CONFIGS: dict[str, list[str]] = {
    "alone": ["--draft-mode", "none", "--history", "off"],
    "history-off": ["--history", "off"],
    "history-on": ["--history", "on"],
    # The target alone without saved prompt states: what every run before them measured.
    "alone-no-prompt-cache": ["--draft-mode", "none", "--history", "off", "--prompt-cache", "0"],
}


@dataclass(slots=True)
class Server:
    process: subprocess.Popen[str]
    url: str
    home: tempfile.TemporaryDirectory[str]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.home.cleanup()


def start_server(args: argparse.Namespace, extra: list[str]) -> Server:
    home = tempfile.TemporaryDirectory(prefix="agent-trace-")
    env = dict(os.environ, LOCALSPEC_HOME=home.name)
    # --model-name: the name the replay asks for (serve answers 404 to any other).
    cmd = [sys.executable, "-m", "localspec", "serve", "--port", "0", "--target", args.target,
           "--ctx", str(args.ctx), "--repack", args.repack, "--model-name", "localspec", *extra]
    if args.draft and "none" not in extra:
        cmd += ["--draft", args.draft]
    # serve names its address on stderr ("listening on http://..."), so stderr is read here
    # until then and passed through after.
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    deadline = time.monotonic() + 300
    for line in _lines(proc, deadline):
        sys.stderr.write(line)
        m = re.search(r"(http://[\w.\[\]:]+:\d+)", line)
        if m:
            threading.Thread(target=_pass_through, args=(proc,), daemon=True).start()
            server = Server(proc, m.group(1), home)
            _wait_ready(server.url, deadline)
            return server
    proc.kill()
    raise SystemExit(f"serve did not print its address: {' '.join(cmd)}")


def _lines(proc: subprocess.Popen[str], deadline: float) -> Iterator[str]:
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            return
        yield line


def _pass_through(proc: subprocess.Popen[str]) -> None:
    """The rest of serve's stderr, so its pipe never fills and blocks it."""
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write(line)


def _wait_ready(url: str, deadline: float) -> None:
    import httpx

    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).json().get("status") == "ok":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} never became ready")


# Untimed, before the trace: a user's first request on a machine also measures what a target
# pass costs there (calibration, ~10 s for Q4_K_M on 2 cores), once, cached for every later
# start; a fresh LOCALSPEC_HOME per configuration would charge it to the trace's first request.
_WARMUP = [{"role": "user", "content": "Say OK."}]


class Replay:
    """One server's side of the trace: its client, and its own answers to build the next
    prompts from (as the agent it stands for would, so a text that parts from the target
    alone's carries on into that configuration's later prompts)."""

    def __init__(self, url: str) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=600)
        self.answers: dict[str, str] = {}
        self.results: list[Result] = []

    def warm_up(self) -> None:
        warmup: Any = _WARMUP
        self.client.chat.completions.create(model="localspec", messages=warmup,
                                            max_tokens=16, temperature=0)

    def send(self, step: Step, max_tokens: int) -> Result:
        # The openai stubs want their message TypedDicts; the trace's dicts are those shapes.
        messages: Any = step.build(self.answers)
        t0 = time.perf_counter()
        stream = self.client.chat.completions.create(
            model="localspec", messages=messages, max_tokens=max_tokens, temperature=0,
            stream=True)
        parts: list[str] = []
        stats: dict[str, Any] = {}
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            extra = (chunk.model_extra or {}).get("localspec") or {}
            if "stats" in extra:
                stats = extra["stats"]
        seconds = time.perf_counter() - t0
        text = "".join(parts)
        self.answers[step.name] = text
        result = Result(step.name, int(stats.get("completion_tokens", 0)), seconds, text, stats)
        self.results.append(result)
        return result


def replay(url: str, max_tokens: int, warmup: bool = True) -> list[Result]:
    """The whole trace against one server."""
    side = Replay(url)
    if warmup:
        side.warm_up()
    for step in trace():
        side.send(step, max_tokens)
    return side.results


def replay_interleaved(urls: dict[str, str], max_tokens: int,
                       warmup: bool = True) -> dict[str, list[Result]]:
    """The trace against every server at once, request by request: each request goes to
    each server in turn (the order rotated from one request to the next), so a machine that
    slows down or speeds up over the minutes a trace takes weighs on every configuration
    alike. Run one after the other, the configurations were up to 10-25% apart in speed of
    the same target alone on this kind of machine, and that drift went into the speedup."""
    sides = {name: Replay(url) for name, url in urls.items()}
    if warmup:
        for side in sides.values():
            side.warm_up()
    for i, step in enumerate(trace()):
        for name in repeat_order(list(sides), i):
            sides[name].send(step, max_tokens)
    return {name: side.results for name, side in sides.items()}


def summarize(runs: dict[str, list[Result]]) -> dict[str, Any]:
    alone = runs["alone"]
    base_tokens = sum(r.tokens for r in alone)
    base_seconds = sum(r.seconds for r in alone)
    out: dict[str, Any] = {"requests": len(alone), "configs": {}}
    for name, results in runs.items():
        tokens = sum(r.tokens for r in results)
        seconds = sum(r.seconds for r in results)
        identical = [a.text == b.text for a, b in zip(alone, results, strict=True)]
        per_drafter = drafter_totals(GenerationStats.from_json(r.stats) for r in results)
        out["configs"][name] = {
            "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
            "speedup": (tokens / seconds) / (base_tokens / base_seconds),
            "identical": all(identical), "differing": [r.name for r, same
                                                      in zip(results, identical, strict=True)
                                                      if not same],
            "acceptance": {k: (v.accepted / v.drafted if v.drafted else None)
                           for k, v in per_drafter.items()},
            "prefill_seconds": round(sum(_prefill(r) for r in results), 3),
            "prompt_cached_tokens": sum(int(r.stats.get("prompt_cached_tokens", 0))
                                        for r in results),
            "prompt_tokens": sum(int(r.stats.get("prompt_tokens", 0)) for r in results),
            "per_request": [{"name": r.name, "tokens": r.tokens, "seconds": round(r.seconds, 3),
                             "tokens_per_second": round(r.rate, 2),
                             "speedup": round(r.rate / a.rate, 3) if a.rate else None,
                             "prompt_tokens": r.stats.get("prompt_tokens"),
                             "prompt_cached_tokens": r.stats.get("prompt_cached_tokens"),
                             "prefill_seconds": round(_prefill(r), 3),
                             # the engine's own clock, and its time inside llama_decode: what
                             # the client waited beyond the first is serve's and the HTTP's
                             "engine_seconds": r.stats.get("total_seconds"),
                             "decode_seconds": r.stats.get("decode_seconds"),
                             "drafters": r.stats.get("drafters"),
                             "tokens_per_target_pass": r.stats.get("tokens_per_target_pass"),
                             "tie_stops": r.stats.get("tie_stops"),
                             # the text, so a run that parts from the target alone can be
                             # diagnosed afterwards (where, and at what margin)
                             "text": r.text}
                            for r, a in zip(results, alone, strict=True)],
        }
    return out


def _prefill(r: Result) -> float:
    """Seconds the request spent on its prompt (to the first token): the same work with or
    without drafting, so it bounds what drafting can gain end to end."""
    return float(r.stats.get("ttft_seconds", 0.0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--repack", default="off")
    ap.add_argument("--configs", default="alone,history-off,history-on")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--sequential", action="store_true",
                    help="one configuration's server after another, as before 2026-12-04's "
                    "AVX2 runs (default: all servers up at once, each request sent to each)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="no untimed first request: the first-use calibration counts in the "
                    "trace's first request")
    args = ap.parse_args(argv)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or "alone" not in names:
        ap.error(f"--configs: {', '.join(unknown) or 'alone'} "
                 f"{'unknown' if unknown else 'is required'} (known: {', '.join(CONFIGS)})")
    runs: dict[str, list[Result]] = {}
    if args.sequential:
        for name in names:
            server = start_server(args, CONFIGS[name])
            try:
                print(f"[{name}] {server.url}", file=sys.stderr)
                runs[name] = replay(server.url, args.max_tokens, not args.no_warmup)
            finally:
                server.stop()
    else:
        servers: dict[str, Server] = {}
        try:
            for name in names:
                servers[name] = start_server(args, CONFIGS[name])
                print(f"[{name}] {servers[name].url}", file=sys.stderr)
            runs = replay_interleaved({n: s.url for n, s in servers.items()}, args.max_tokens,
                                      not args.no_warmup)
        finally:
            for server in servers.values():
                server.stop()
    summary = summarize(runs)
    summary["command"] = " ".join(sys.argv)
    summary["target"], summary["draft"] = args.target, args.draft
    for name, c in summary["configs"].items():
        acc = ", ".join(f"{k} {v:.0%}" for k, v in c["acceptance"].items() if v is not None)
        print(f"{name:22s} {c['tokens_per_second']:6.2f} tok/s  {c['speedup']:.2f}x  "
              f"prefill {c['prefill_seconds']:.1f}s, {c['prompt_cached_tokens']} of "
              f"{c['prompt_tokens']} prompt tokens cached  "
              f"identical {'yes' if c['identical'] else 'no ' + str(c['differing'])}  {acc}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
