"""Side-by-side measurement: the same prompts through the target alone and through the engine.

Everything is a ratio from one process and one run: the speculative engine against what a user
would run instead, on the same target, prompts and settings. "Instead" is llama-cpp-python's own
generation loop (``Llama.generate`` on the same file) or, with ``baseline="engine"``, this engine
with drafting off. llama-cpp-python's loop and the speculative engine run in lockstep (see
``race``); the engine's other runs take turns with them, whole runs apart, each repeat starting
with the next contender, so drift in the machine's speed hits them alike. Optionally each fixed
K runs beside auto (``sweep``) to show how auto compares with the best fixed draft length in
hindsight.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, TypeVar

import numpy as np

from .engine import DraftSettings, Finished, GenerationRequest, SamplingParams, SpeculativeEngine
from .engine.sampling import apply_penalties, candidates, coupled_choice
from .engine.stats import GenerationStats, drafter_totals
from .errors import ContextOverflowError
from .requests import ChatOptions, Prompt, build_request, prompt_tokens

Baseline = Literal["llama-cpp-python", "engine"]
T = TypeVar("T")


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


@dataclass(frozen=True, slots=True)
class BenchConfig:
    max_tokens: int = 128
    repeats: int = 1
    sampling: SamplingParams = SamplingParams()
    draft: DraftSettings = DraftSettings()
    raw: bool = False
    baseline: Baseline = "llama-cpp-python"
    sweep: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RunResult:
    # Token ids; a server's run has only its text (compared whole, no token positions).
    tokens: tuple[int, ...] | str
    stats: GenerationStats


# A generation advanced a step at a time: each ``next`` yields the bytes of text the step made,
# and its return value is the run's result.
Steps = Generator[int, None, RunResult]


class Contender(Protocol):
    """One way of generating: ``steps(prompt tokens)`` from an empty cache."""

    name: str

    def steps(self, prompt: tuple[int, ...]) -> Steps: ...


@dataclass(slots=True)
class _Clocked:
    """A contender's generation on its own clock: it runs only while this one steps. Its time
    to first token is to its first text, on either side (the engine yields only text)."""

    steps: Steps
    seconds: float = 0.0
    ttft: float | None = None
    made: int = 0  # bytes of text so far
    result: RunResult | None = None

    def step(self) -> None:
        t0 = time.perf_counter()
        try:
            self.made += next(self.steps)
        except StopIteration as stop:
            self.result = stop.value
        self.seconds += time.perf_counter() - t0
        if self.ttft is None and (self.made or self.result is not None):
            self.ttft = self.seconds

    def finished(self) -> RunResult:
        assert self.result is not None
        stats = self.result.stats
        stats.total_seconds = self.seconds
        stats.ttft_seconds = self.ttft or 0.0
        return self.result


def race(generations: Sequence[Steps]) -> list[RunResult]:
    """Run generations in lockstep, each timed on its own clock: the one whose text is behind
    steps next (the earlier on a tie, so the order given is the order of their prompts). A slow
    spell of the machine then falls on all of them alike, where whole runs one after another
    take it on whichever was running: on a 2-core VM that moved a prompt's median of 3 by
    10% between two identical contenders. One generation alone is an ordinary timed run."""
    clocked = [_Clocked(g) for g in generations]
    try:
        while True:
            live = [c for c in clocked if c.result is None]
            if not live:
                return [c.finished() for c in clocked]
            min(live, key=lambda c: c.made).step()
    finally:
        # One side failing must not leave the other suspended in its generation (the engine's
        # stream holds its lock until its generator ends).
        for g in generations:
            g.close()


def run_alone(contender: Contender, prompt: tuple[int, ...]) -> RunResult:
    return race([contender.steps(prompt)])[0]


def check_fits(n_prompt: int, n_ctx: int) -> None:
    """Refuse a prompt the context cannot hold, in the engine's words (whichever side meets it
    first, the user reads one line)."""
    if n_prompt >= n_ctx:
        raise ContextOverflowError(f"prompt has {n_prompt} tokens but the context holds {n_ctx}; "
                                   "shorten it or raise --ctx")


def max_new_tokens(max_tokens: int, n_prompt: int, n_ctx: int) -> int:
    """The tokens a run may make: as many as asked, up to the context's end (as the engine)."""
    return min(max_tokens, n_ctx - n_prompt)


@dataclass(slots=True)
class EngineContender:
    """The engine with some draft settings (drafting off: the engine's own plain decoding).

    ``apart``: what its runs see is not learned by the others (the K sweep's runs)."""

    name: str
    engine: SpeculativeEngine
    cfg: BenchConfig
    draft: DraftSettings
    apart: bool = False

    def steps(self, prompt: tuple[int, ...]) -> Steps:
        self.engine.clear_caches()  # no prefix reuse between runs: each pays its prompt
        req = build_request(self.engine, prompt, ChatOptions(
            max_tokens=self.cfg.max_tokens, sampling=self.cfg.sampling, draft=self.draft))
        return self._steps(req)

    def _steps(self, req: GenerationRequest) -> Steps:
        with self.engine.separate_learning() if self.apart else nullcontext():
            for event in self.engine.stream(req):
                if isinstance(event, Finished):
                    return RunResult(event.tokens, event.stats)
                yield len(event.text.encode())
        raise AssertionError("stream ended without Finished")  # pragma: no cover


@dataclass(slots=True)
class LlamaCppPythonContender:
    """llama-cpp-python's own ``Llama.generate`` loop on the same target file: what a user of
    the library runs instead. Greedy is ``top_k=1``; sampling uses its own sampler chain."""

    llm: Any
    cfg: BenchConfig
    eos: frozenset[int]
    name: str = "llama-cpp-python"
    # The engine's context, when racing it: runs then stop where the engine's would.
    n_ctx: int | None = None

    def steps(self, prompt: tuple[int, ...]) -> Steps:
        check_fits(len(prompt), self.context())
        # Llama.generate(reset=True) still reuses the longest cached prefix: without this every
        # repeat after the first would skip its prompt, unlike the engine's runs.
        self.llm.reset()
        return self._steps(prompt)

    def context(self) -> int:
        """The tokens a run may hold: its Llama's context, and no more than the engine's."""
        own = int(self.llm.n_ctx())
        return own if self.n_ctx is None else min(own, self.n_ctx)

    def _steps(self, prompt: tuple[int, ...]) -> Steps:
        sp = self.cfg.sampling
        greedy = sp.greedy
        stats = GenerationStats(prompt_tokens=len(prompt))
        out: list[int] = []
        # Llama.generate decodes past the context's end (llama_decode fails); the engine stops
        # there, and the same limit keeps both sides making the same number of tokens.
        limit = max_new_tokens(self.cfg.max_tokens, len(prompt), self.context())
        for tok in self.llm.generate(list(prompt), reset=True, temp=0.0 if greedy else
                                     sp.temperature, top_k=1 if greedy else sp.top_k,
                                     top_p=sp.top_p, min_p=sp.min_p,
                                     repeat_penalty=sp.repeat_penalty):
            if tok in self.eos:
                break
            out.append(int(tok))
            if len(out) >= limit:
                break
            yield len(self.llm.detokenize([tok]))
        stats.completion_tokens = len(out)
        stats.target_passes = len(out)
        return RunResult(tuple(out), stats)


@dataclass(slots=True)
class PromptResult:
    prompt: BenchPrompt
    runs: dict[str, list[RunResult]] = field(default_factory=dict)
    first_difference: dict[str, Any] | None = None

    def add(self, name: str, result: RunResult) -> None:
        self.runs.setdefault(name, []).append(result)

    def median(self, name: str, attr: str) -> float:
        return statistics.median(getattr(r.stats, attr) for r in self.runs[name])

    def identical(self, a: str, b: str) -> bool:
        return all(x.tokens == y.tokens for x, y in zip(self.runs[a], self.runs[b], strict=True))


def outputs_must_match(cfg: BenchConfig, baseline: str) -> bool:
    """Whether speculation must reproduce the baseline's text token for token: greedy, or
    seeded sampling under the coupled rule against the engine's own plain sampling (the same
    sampler and noise; llama-cpp-python's sampler draws differently, and rejection and match
    sampling only preserve the distribution)."""
    if cfg.sampling.greedy:
        return True
    return (baseline == "plain" and cfg.sampling.seed is not None
            and cfg.draft.rule in ("auto", "coupled"))


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def paired_speedups(runs: Sequence[RunResult], over: Sequence[RunResult],
                    attr: str = "tokens_per_second") -> list[float | None]:
    """Each run's tokens/s over its partner's of the same repeat (seconds apart, or raced in
    lockstep, so a machine that slows for a while moves both): their spread is how far a
    median ratio can be trusted on this machine."""
    return [_ratio(getattr(a.stats, attr), getattr(b.stats, attr))
            for a, b in zip(runs, over, strict=True)]


def raced(baseline: str) -> bool:
    """Whether ``run_bench`` races this baseline beside the speculative engine in lockstep."""
    return baseline == "llama-cpp-python"


def _median_ratio(ratios: Sequence[float | None]) -> float | None:
    known = [x for x in ratios if x is not None]
    return round(statistics.median(known), 3) if known else None


def _asked(prompt: BenchPrompt, raw: bool) -> Prompt:
    """A prompt as every contender is asked it: its text (raw) or one user message."""
    return prompt.text if raw else [{"role": "user", "content": prompt.text}]


def _prompt_tokens(engine: SpeculativeEngine, prompt: BenchPrompt, raw: bool) -> tuple[int, ...]:
    return prompt_tokens(engine, _asked(prompt, raw))


def first_difference(engine: SpeculativeEngine, prompt: tuple[int, ...], a: Sequence[int],
                     b: Sequence[int], sampling: SamplingParams) -> dict[str, Any] | None:
    """Where two outputs of one prompt part, and how close the target's choice was there.

    The target's margin at that position comes from a one-token pass (what plain decoding
    computes): greedy, its top-2 logit gap; seeded coupled sampling, the gap between its two
    best Gumbel scores (times the temperature: logit units). A margin within the engine's
    near-tie guard means a numerical near-tie that batched kernels may decide differently; a
    large margin would be a bug."""
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
             None if len(a) == len(b) else min(len(a), len(b)))
    if n is None:
        return None
    seq = list(prompt) + list(a[:n])
    runner = engine.target
    runner.reset()
    runner.sync(seq[:-1], 1)
    logits = np.array(runner.decode(seq[-1:], 1)[0], dtype=np.float64)
    runner.reset()
    if sampling.greedy or sampling.seed is None:
        x = apply_penalties(logits, seq, sampling)
        top2 = np.sort(np.partition(x, -2)[-2:])
        margin = float(top2[1] - top2[0])
        target_token = int(np.argmax(x))
    else:  # the output position n is what the coupled noise is keyed on
        choice = coupled_choice(candidates(logits, seq, sampling), sampling.temperature,
                                sampling.seed, n)
        margin, target_token = choice.margin, choice.token
    return {"position": n, "baseline_token": a[n] if n < len(a) else None,
            "target_token": target_token,
            "speculative_token": b[n] if n < len(b) else None,
            "top2_margin": round(margin, 5), "tie_margin": round(engine.tie_margin, 5),
            "near_tie": margin < max(engine.tie_margin, 1e-6)}


def repeat_order(contenders: Sequence[T], repeat: int) -> list[T]:
    """The contenders in the order of one repeat: each repeat starts with the next, so none
    always runs first or last (after another prompt's runs, or before a slow spell)."""
    n = repeat % len(contenders) if contenders else 0
    return list(contenders[n:]) + list(contenders[:n])


def run_bench(engine: SpeculativeEngine, prompts: Sequence[BenchPrompt], cfg: BenchConfig,
              on_step: Callable[[str], None] | None = None,
              llama: Any | None = None) -> dict[str, Any]:
    """Alternate the contenders per prompt; medians per prompt, totals overall.

    ``llama`` is llama-cpp-python's ``Llama`` on the target (needed for that baseline)."""
    plain = EngineContender("plain", engine, cfg, DraftSettings(mode="none"))
    spec = EngineContender("speculative", engine, cfg, cfg.draft)
    contenders: list[Contender] = [plain, spec]
    if cfg.baseline == "llama-cpp-python":
        if llama is None:
            raise ValueError("the llama-cpp-python baseline needs a Llama instance")
        eos = frozenset(t for t in range(engine.target.n_vocab) if engine.target.is_eog(t))
        contenders.insert(0, LlamaCppPythonContender(llama, cfg, eos,
                                                     n_ctx=engine.target.n_ctx))
    sweep_names = [f"K={k}" for k in cfg.sweep]
    contenders += [EngineContender(name, engine, cfg, replace(cfg.draft, k=k), apart=True)
                   for name, k in zip(sweep_names, cfg.sweep, strict=True)]
    baseline = contenders[0].name
    results: list[PromptResult] = []
    asked = [_prompt_tokens(engine, prompt, cfg.raw) for prompt in prompts]
    # Every prompt before any run: one too long for the context would otherwise fail in
    # whichever contender met it first, in its own words, after the others' runs were spent.
    for tokens in asked:
        check_fits(len(tokens), engine.target.n_ctx)
    if prompts:
        # Not counted: the first decode of a given batch shape allocates llama.cpp's compute
        # graph (and auto calibrates once), which would otherwise be charged to whoever ran first.
        for c in contenders:
            with engine.frozen_history():
                run_alone(c, asked[0])
    # llama-cpp-python's own loop runs beside the speculative engine in lockstep (see race):
    # the ratio that matters most then carries no drift. The engine's other runs share its one
    # context, so they take turns, whole runs apart.
    partner = spec if raced(baseline) else None
    for prompt, tokens in zip(prompts, asked, strict=True):
        res = PromptResult(prompt)
        for rep in range(cfg.repeats):
            for c in repeat_order(contenders, rep):
                if c is partner:
                    continue  # raced beside the baseline
                together = [c, partner] if partner is not None and c.name == baseline else [c]
                if rep % 2:
                    together.reverse()  # the pair takes turns processing its prompt first
                # With the history drafter on, every run of a prompt drafts from the index as
                # it stood before the prompt (the earlier prompts' answers, once each): a
                # repeat drafting the answer a run before it gave would measure nothing.
                with engine.frozen_history():
                    done = race([x.steps(tokens) for x in together])
                for x, result in zip(together, done, strict=True):
                    res.add(x.name, result)
                    if on_step:
                        on_step(f"{prompt.name}: {x.name}")
        answer = res.runs["plain"][-1].tokens
        if engine.history is not None and not isinstance(answer, str):
            engine.history.record(tokens, answer)  # the prompt, answered once, as a user's
        # The first repeat whose outputs differ: any repeat may meet a near-tie.
        alone, fast = next(((x.tokens, y.tokens) for x, y in zip(
            res.runs[baseline], res.runs["speculative"], strict=True) if x.tokens != y.tokens),
            ((), ()))
        if outputs_must_match(cfg, baseline) and not isinstance(alone, str) \
                and not isinstance(fast, str) and alone != fast:
            res.first_difference = first_difference(engine, tokens, alone, fast, cfg.sampling)
        results.append(res)
    out = summarize(results, cfg, baseline, sweep_names)
    out["history"] = engine.history is not None and cfg.draft.history
    out["tree"] = cfg.draft.tree
    return out


def _prompt_json(r: PromptResult, cfg: BenchConfig, baseline: str,
                 sweep: list[str]) -> dict[str, Any]:
    m = r.median
    base_tps, spec_tps = m(baseline, "tokens_per_second"), m("speculative", "tokens_per_second")
    base_dec = m(baseline, "decode_tokens_per_second")
    spec_dec = m("speculative", "decode_tokens_per_second")
    runs = paired_speedups(r.runs["speculative"], r.runs[baseline])
    # Raced runs: each repeat's ratio carries no drift, a ratio of medians may pair a fast
    # repeat of one side with a slow one of the other.
    speedup, decode_speedup = (_ratio(spec_tps, base_tps), _ratio(spec_dec, base_dec))
    if raced(baseline):
        speedup = _median_ratio(runs)
        decode_speedup = _median_ratio(paired_speedups(
            r.runs["speculative"], r.runs[baseline], "decode_tokens_per_second"))
    out: dict[str, Any] = {
        "name": r.prompt.name,
        "kind": r.prompt.kind,
        "tokens": r.runs["speculative"][-1].stats.completion_tokens,
        "baseline": baseline,
        "plain_tokens_per_second": round(base_tps, 3),
        "spec_tokens_per_second": round(spec_tps, 3),
        "speedup": speedup,
        "plain_decode_tokens_per_second": round(base_dec, 3),
        "spec_decode_tokens_per_second": round(spec_dec, 3),
        "decode_speedup": decode_speedup,
        "plain_ttft_seconds": round(m(baseline, "ttft_seconds"), 4),
        "spec_ttft_seconds": round(m("speculative", "ttft_seconds"), 4),
        "speedup_runs": runs,
        "acceptance_rate": round(m("speculative", "acceptance_rate"), 4),
        "mean_accepted_length": round(m("speculative", "mean_accepted_length"), 3),
        "mean_k": round(m("speculative", "mean_k"), 3),
        "spec_host_ms_per_step": round(m("speculative", "host_ms_per_step"), 4),
        "spec_host_ms_per_decode": round(m("speculative", "host_ms_per_decode"), 4),
        "spec_host_ms_per_token": round(m("speculative", "host_ms_per_token"), 4),
        # Token trees: tokens one target pass yields, nodes a drafting round verified, and
        # the draft model's host cost per token it drafted (what a GPU exposes).
        "tokens_per_target_pass": round(m("speculative", "tokens_per_target_pass"), 3),
        "mean_tree_size": round(m("speculative", "mean_tree_size"), 3),
        "tree_rounds": int(m("speculative", "tree_rounds")),
        "merged_rounds": int(m("speculative", "merged_rounds")),
        "tie_stops": int(m("speculative", "tie_stops")),
        "host_ms_per_draft_token": round(m("speculative", "host_ms_per_draft_token"), 4),
        "drafters": _drafter_totals(r.runs["speculative"]),
        "engine_plain_tokens_per_second": round(m("plain", "tokens_per_second"), 3),
        "engine_plain_host_ms_per_step": round(m("plain", "host_ms_per_step"), 4),
        "policy": r.runs["speculative"][-1].stats.policy,
        "identical": (r.identical(baseline, "speculative")
                      if outputs_must_match(cfg, baseline) else None),
        "first_difference": r.first_difference,
    }
    if baseline != "plain":
        out["engine_plain_vs_baseline"] = _ratio(m("plain", "tokens_per_second"), base_tps)
    if sweep:
        fixed = {name: round(m(name, "tokens_per_second"), 3) for name in sweep}
        best = max(fixed, key=lambda n: fixed[n])
        out["sweep"] = {"tokens_per_second": fixed, "best": best,
                        "auto_vs_best": _ratio(spec_tps, fixed[best]),
                        "auto_vs_best_runs": paired_speedups(r.runs["speculative"],
                                                             r.runs[best])}
    return out


def _drafter_totals(runs: Sequence[RunResult]) -> dict[str, dict[str, float]]:
    """Per drafter over a prompt's runs: tokens drafted and accepted, and their acceptance."""
    return {name: {"drafted": d.drafted, "accepted": d.accepted,
                   "acceptance_rate": round(d.accepted / d.drafted, 4) if d.drafted else 0.0}
            for name, d in drafter_totals(run.stats for run in runs).items()}


def summarize(results: list[PromptResult], cfg: BenchConfig, baseline: str = "plain",
              sweep: list[str] | None = None) -> dict[str, Any]:
    per_prompt = [_prompt_json(r, cfg, baseline, sweep or []) for r in results]

    def total_time(key: str) -> float:
        return sum(p["tokens"] / p[key] for p in per_prompt if p.get(key))

    tokens = sum(p["tokens"] for p in per_prompt)
    plain_time = total_time("plain_tokens_per_second")
    # The fixed-K runs took turns with the speculative engine's: compared with its measured time.
    measured_spec_time = total_time("spec_tokens_per_second")
    if raced(baseline):  # each prompt's time at the baseline's pace over its raced speedup
        spec_time = sum(p["tokens"] / p["plain_tokens_per_second"] / p["speedup"]
                        for p in per_prompt if p.get("plain_tokens_per_second")
                        and p.get("speedup"))
    else:
        spec_time = measured_spec_time
    out: dict[str, Any] = {
        "speedup": round(plain_time / spec_time, 3) if spec_time else 0.0,
        "all_identical": (all(p["identical"] for p in per_prompt)
                          if outputs_must_match(cfg, baseline) else None),
        "baseline": baseline,
        "plain_tokens_per_second": round(tokens / plain_time, 3) if plain_time else 0.0,
        "spec_tokens_per_second": round(tokens / spec_time, 3) if spec_time else 0.0,
        "max_tokens": cfg.max_tokens,
        "repeats": cfg.repeats,
        "temperature": cfg.sampling.temperature,
        "draft_mode": cfg.draft.mode,
        "k": "auto" if cfg.draft.k is None else cfg.draft.k,
        "prompts": per_prompt,
    }
    if baseline != "plain":
        engine_time = total_time("engine_plain_tokens_per_second")
        out["engine_plain_vs_baseline"] = round(plain_time / engine_time, 3) \
            if engine_time else None
    if sweep:
        ratios = [p["sweep"]["auto_vs_best"] for p in per_prompt if p["sweep"]["auto_vs_best"]]
        best_time = sum(p["tokens"] / p["sweep"]["tokens_per_second"][p["sweep"]["best"]]
                        for p in per_prompt)
        # The best K in hindsight per prompt is the highest of five noisy medians, so it leans
        # lucky; one K for the whole set is what a user who sets --k would run instead.
        each_k = {name: round(sum(p["tokens"] / p["sweep"]["tokens_per_second"][name]
                                  for p in per_prompt) / measured_spec_time, 3)
                  if measured_spec_time else None for name in sweep}
        out["sweep"] = {"k": list(cfg.sweep),
                        "auto_vs_best_min": min(ratios) if ratios else None,
                        "auto_vs_best_overall": round(best_time / measured_spec_time, 3)
                        if measured_spec_time else None,
                        "auto_vs_each_k_overall": each_k}
    return out


# -- servers -------------------------------------------------------------------------------------
def _remote_run(remote: Any, prompt: BenchPrompt, cfg: BenchConfig) -> RunResult:
    from .engine.decoder import Finished

    options = ChatOptions(max_tokens=cfg.max_tokens, sampling=cfg.sampling)
    asked = _asked(prompt, cfg.raw)
    events = (remote.stream_completion(asked, options) if isinstance(asked, str)
              else remote.stream_chat(asked, options))
    for event in events:
        if isinstance(event, Finished):
            return RunResult(event.text, event.stats)
    raise AssertionError("remote stream ended without a final event")  # pragma: no cover


def run_remote_bench(remote: Any, prompts: Sequence[BenchPrompt], cfg: BenchConfig,
                     baseline: Any | None = None,
                     on_step: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The same measurement against OpenAI-compatible servers (``RemoteEngine``s): ``remote`` is
    the speculative deployment, ``baseline`` (optional) the same target without drafting."""
    results: list[PromptResult] = []
    if prompts:
        _remote_run(remote, prompts[0], cfg)  # warm-up, not counted
    for prompt in prompts:
        res = PromptResult(prompt)
        for _ in range(cfg.repeats):
            res.add("speculative", _remote_run(remote, prompt, cfg))
            if on_step:
                on_step(f"{prompt.name}: remote")
            if baseline is not None:
                res.add("baseline", _remote_run(baseline, prompt, cfg))
                if on_step:
                    on_step(f"{prompt.name}: baseline")
            res.add("plain", res.runs["baseline" if baseline is not None else "speculative"][-1])
        if baseline is None:
            res.runs["baseline"] = res.runs["speculative"]
        results.append(res)
    out = summarize(results, cfg, "baseline")
    out.pop("engine_plain_vs_baseline", None)
    out["remote"] = True
    out["baseline"] = baseline is not None
    out["draft_mode"] = out["k"] = "server's"
    for p in out["prompts"]:
        for key in ("engine_plain_vs_baseline", "engine_plain_tokens_per_second",
                    "engine_plain_host_ms_per_step", "spec_host_ms_per_step",
                    "spec_host_ms_per_decode", "spec_host_ms_per_token", "policy"):
            p.pop(key, None)
    if baseline is None:  # nothing to compare against: no ratio rather than a made-up 1.0
        out["speedup"] = None
        for p in out["prompts"]:
            p["speedup"] = p["decode_speedup"] = None
            p["speedup_runs"] = None
            p["identical"] = None
    return out
