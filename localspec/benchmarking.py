"""Side-by-side measurement: the same prompts through the target alone and through the engine.

Both runs share one process and one loaded target (the plain run is the engine with drafting
off), so the ratio compares decoding strategies, not loads or machines.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .engine import DraftSettings, GenerationRequest, SamplingParams, SpeculativeEngine
from .engine.stats import GenerationStats


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    name: str
    kind: str  # code | prose | edit | user
    text: str


BUILTIN_PROMPTS: tuple[BenchPrompt, ...] = (
    BenchPrompt("fib", "code", "Write a Python function that returns the n-th Fibonacci number "
                "iteratively, with a docstring and type hints."),
    BenchPrompt("http", "code", "Write a small Python script that downloads a URL given on the "
                "command line with urllib and prints the HTTP status and the first 200 bytes."),
    BenchPrompt("sql", "code", "Write a SQL query that returns, for each customer, the total "
                "amount of their orders in 2023, highest first. Tables: customers(id, name), "
                "orders(id, customer_id, amount, created_at)."),
    BenchPrompt("story", "prose", "Write a short story about a lighthouse keeper who finds a "
                "message in a bottle."),
    BenchPrompt("explain", "prose", "Explain to a new programmer why version control matters, "
                "in three paragraphs."),
    BenchPrompt("typehints", "edit", "Add type hints to this function and return the whole "
                "function, unchanged otherwise:\n\n"
                "def merge_counts(a, b):\n"
                "    result = dict(a)\n"
                "    for key, value in b.items():\n"
                "        if key in result:\n"
                "            result[key] = result[key] + value\n"
                "        else:\n"
                "            result[key] = value\n"
                "    return result\n\n"
                "def top_items(counts, n):\n"
                "    items = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)\n"
                "    return items[:n]\n"),
    BenchPrompt("rename", "edit", "Rename the variable `tmp` to `total` in this code and "
                "return the full code:\n\n"
                "def summarize(values):\n"
                "    tmp = 0\n"
                "    for v in values:\n"
                "        tmp += v\n"
                "    mean = tmp / len(values)\n"
                "    print('sum', tmp, 'mean', mean)\n"
                "    return tmp, mean\n"),
)


@dataclass(slots=True)
class PromptResult:
    prompt: BenchPrompt
    plain: list[GenerationStats] = field(default_factory=list)
    spec: list[GenerationStats] = field(default_factory=list)
    identical: bool = True

    @staticmethod
    def _median(runs: list[GenerationStats], attr: str) -> float:
        return statistics.median(getattr(s, attr) for s in runs)

    def to_json(self) -> dict[str, Any]:
        m = self._median
        plain_tps, spec_tps = m(self.plain, "tokens_per_second"), m(self.spec, "tokens_per_second")
        plain_dec = m(self.plain, "decode_tokens_per_second")
        spec_dec = m(self.spec, "decode_tokens_per_second")
        return {
            "name": self.prompt.name,
            "kind": self.prompt.kind,
            "tokens": self.spec[-1].completion_tokens,
            "plain_tokens_per_second": round(plain_tps, 3),
            "spec_tokens_per_second": round(spec_tps, 3),
            "speedup": round(spec_tps / plain_tps, 3) if plain_tps else 0.0,
            "plain_decode_tokens_per_second": round(plain_dec, 3),
            "spec_decode_tokens_per_second": round(spec_dec, 3),
            "decode_speedup": round(spec_dec / plain_dec, 3) if plain_dec else 0.0,
            "plain_ttft_seconds": round(m(self.plain, "ttft_seconds"), 4),
            "spec_ttft_seconds": round(m(self.spec, "ttft_seconds"), 4),
            "acceptance_rate": round(m(self.spec, "acceptance_rate"), 4),
            "mean_accepted_length": round(m(self.spec, "mean_accepted_length"), 3),
            "mean_k": round(m(self.spec, "mean_k"), 3),
            "identical": self.identical,
        }


@dataclass(frozen=True, slots=True)
class BenchConfig:
    max_tokens: int = 128
    repeats: int = 1
    sampling: SamplingParams = SamplingParams()
    draft: DraftSettings = DraftSettings()
    raw: bool = False


def _request(engine: SpeculativeEngine, prompt: BenchPrompt, cfg: BenchConfig,
             draft: DraftSettings) -> GenerationRequest:
    if cfg.raw:
        tokens = engine.tokenize(prompt.text, chat=False)
    else:
        tokens = engine.tokenize(engine.chat_prompt([{"role": "user", "content": prompt.text}]),
                                 chat=True)
    return GenerationRequest(prompt_tokens=tokens, max_tokens=cfg.max_tokens,
                             sampling=cfg.sampling, draft=draft)


def run_bench(engine: SpeculativeEngine, prompts: Sequence[BenchPrompt], cfg: BenchConfig,
              on_step: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Alternate plain and speculative runs per prompt; medians per prompt, totals overall."""
    results: list[PromptResult] = []
    plain_draft = DraftSettings(mode="none")
    if prompts:
        # Not counted: the first decode of a given batch shape allocates llama.cpp's compute
        # graph, which would otherwise be charged to whichever run happens to go first.
        for draft in (plain_draft, cfg.draft):
            engine.generate(_request(engine, prompts[0], cfg, draft))
    for prompt in prompts:
        res = PromptResult(prompt)
        for _ in range(cfg.repeats):
            engine.target.reset()  # no prefix reuse between runs: each pays its prompt
            plain = engine.generate(_request(engine, prompt, cfg, plain_draft))
            if on_step:
                on_step(f"{prompt.name}: plain")
            engine.target.reset()
            if engine.draft is not None:
                engine.draft.reset()
            spec = engine.generate(_request(engine, prompt, cfg, cfg.draft))
            if on_step:
                on_step(f"{prompt.name}: speculative")
            res.plain.append(plain.stats)
            res.spec.append(spec.stats)
            res.identical &= plain.tokens == spec.tokens
        results.append(res)
    return summarize(results, cfg)


def summarize(results: list[PromptResult], cfg: BenchConfig) -> dict[str, Any]:
    per_prompt = [r.to_json() for r in results]
    tokens = sum(p["tokens"] for p in per_prompt)
    plain_time = sum(p["tokens"] / p["plain_tokens_per_second"] for p in per_prompt
                     if p["plain_tokens_per_second"])
    spec_time = sum(p["tokens"] / p["spec_tokens_per_second"] for p in per_prompt
                    if p["spec_tokens_per_second"])
    return {
        "speedup": round(plain_time / spec_time, 3) if spec_time else 0.0,
        "all_identical": all(r.identical for r in results),
        "plain_tokens_per_second": round(tokens / plain_time, 3) if plain_time else 0.0,
        "spec_tokens_per_second": round(tokens / spec_time, 3) if spec_time else 0.0,
        "max_tokens": cfg.max_tokens,
        "repeats": cfg.repeats,
        "temperature": cfg.sampling.temperature,
        "draft_mode": cfg.draft.mode,
        "k": "auto" if cfg.draft.k is None else cfg.draft.k,
        "prompts": per_prompt,
    }


def _remote_run(remote: Any, prompt: BenchPrompt, cfg: BenchConfig) -> tuple[str, GenerationStats]:
    from .remote import RemoteFinished

    events = (remote.stream_completion(prompt.text, cfg.max_tokens, cfg.sampling) if cfg.raw
              else remote.stream_chat([{"role": "user", "content": prompt.text}],
                                      cfg.max_tokens, cfg.sampling))
    for event in events:
        if isinstance(event, RemoteFinished):
            return event.text, event.stats
    raise AssertionError("remote stream ended without a final event")  # pragma: no cover


def run_remote_bench(remote: Any, prompts: Sequence[BenchPrompt], cfg: BenchConfig,
                     baseline: Any | None = None,
                     on_step: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The same measurement against OpenAI-compatible servers (``RemoteEngine``s): ``remote`` is
    the speculative deployment, ``baseline`` (optional) the same target without drafting.
    Without a baseline, the plain columns repeat the remote's own figures and speedup is 1."""
    results: list[PromptResult] = []
    if prompts:
        _remote_run(remote, prompts[0], cfg)  # warm-up, not counted
    for prompt in prompts:
        res = PromptResult(prompt)
        for _ in range(cfg.repeats):
            text, stats = _remote_run(remote, prompt, cfg)
            if on_step:
                on_step(f"{prompt.name}: remote")
            res.spec.append(stats)
            if baseline is not None:
                base_text, base_stats = _remote_run(baseline, prompt, cfg)
                if on_step:
                    on_step(f"{prompt.name}: baseline")
                res.plain.append(base_stats)
                res.identical &= base_text == text
            else:
                res.plain.append(stats)
        results.append(res)
    out = summarize(results, cfg)
    out["remote"] = True
    out["baseline"] = baseline is not None
    out["draft_mode"] = out["k"] = "server's"
    if baseline is None:  # nothing to compare against: no ratio rather than a made-up 1.0
        out["speedup"] = None
        for p in out["prompts"]:
            p["speedup"] = p["decode_speedup"] = None
            p["identical"] = None
    return out
