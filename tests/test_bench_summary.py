"""The arithmetic of `bench`'s summary: which ratios it reports, computed from known run times.

The runs here are data (token counts and seconds), not generations: the figures must follow
from them exactly. The engine's own runs are covered by tests/test_cli_engine.py."""

from __future__ import annotations

import statistics

import pytest

from localspec.benchmarking import (
    BenchConfig,
    BenchPrompt,
    PromptResult,
    RunResult,
    repeat_order,
    summarize,
)
from localspec.engine.stats import GenerationStats

SWEEP = ["K=2", "K=5"]


def _run(tokens: int, seconds: float) -> RunResult:
    return RunResult(tuple(range(tokens)), GenerationStats(completion_tokens=tokens,
                                                           total_seconds=seconds))


def _prompt(name: str, seconds: dict[str, list[float]]) -> PromptResult:
    res = PromptResult(BenchPrompt(name, "code", "text"))
    for contender, times in seconds.items():
        for t in times:
            res.add(contender, _run(100, t))
    return res


def test_auto_is_paired_with_the_best_k_repeat_by_repeat() -> None:
    # K=5 is best by its median (10 s); repeat 2 was slow for everyone (a busy machine).
    res = _prompt("fib", {"plain": [20, 30, 20], "speculative": [10, 15, 11],
                          "K=2": [12, 18, 12], "K=5": [9, 14, 10]})
    out = summarize([res], BenchConfig(repeats=3), baseline="plain", sweep=SWEEP)
    sweep = out["prompts"][0]["sweep"]
    assert sweep["best"] == "K=5"
    assert sweep["auto_vs_best"] == pytest.approx(10 / 11, abs=1e-3)  # medians: 10 s, 11 s
    assert sweep["auto_vs_best_runs"] == pytest.approx([9 / 10, 14 / 15, 10 / 11], abs=1e-3)


def test_auto_against_one_k_for_every_prompt() -> None:
    """The best K per prompt is picked in hindsight; one K for the set is what --k runs."""
    fib = _prompt("fib", {"plain": [20], "speculative": [10], "K=2": [12], "K=5": [9]})
    story = _prompt("story", {"plain": [20], "speculative": [16], "K=2": [15], "K=5": [20]})
    out = summarize([fib, story], BenchConfig(), baseline="plain", sweep=SWEEP)
    sweep = out["sweep"]
    assert sweep["auto_vs_each_k_overall"] == pytest.approx({"K=2": 27 / 26, "K=5": 29 / 26},
                                                            abs=1e-3)
    assert sweep["auto_vs_best_overall"] == pytest.approx(24 / 26, abs=1e-3)  # 9 s + 15 s
    assert sweep["auto_vs_best_min"] == pytest.approx(9 / 10, abs=1e-3)


def test_speedup_is_also_given_repeat_by_repeat() -> None:
    # Repeat 2 was slow for both: the paired ratios stay near 2 where the medians alone hide it.
    res = _prompt("fib", {"plain": [20, 40, 22], "speculative": [10, 21, 11]})
    p = summarize([res], BenchConfig(repeats=3), baseline="plain")["prompts"][0]
    assert p["speedup"] == pytest.approx(22 / 11, abs=1e-3)  # medians: 22 s and 11 s
    assert p["speedup_runs"] == pytest.approx([2.0, 40 / 21, 2.0], abs=1e-3)


def test_each_repeat_starts_with_the_next_contender() -> None:
    names = ["llama-cpp-python", "plain", "speculative"]
    assert [repeat_order(names, r) for r in range(4)] == [
        ["llama-cpp-python", "plain", "speculative"],
        ["plain", "speculative", "llama-cpp-python"],
        ["speculative", "llama-cpp-python", "plain"],
        ["llama-cpp-python", "plain", "speculative"]]
    assert repeat_order([], 3) == []


def test_repeat_by_repeat_speedups_are_against_the_baseline_not_plain() -> None:
    # The engine's plain decoding ran at its own speed; the speedup is over llama-cpp-python.
    res = _prompt("fib", {"llama-cpp-python": [20, 30], "plain": [25, 25],
                          "speculative": [10, 10]})
    p = summarize([res], BenchConfig(repeats=2), baseline="llama-cpp-python")["prompts"][0]
    assert p["speedup_runs"] == pytest.approx([2.0, 3.0], abs=1e-3)


def test_a_raced_baseline_gives_the_median_of_the_paired_ratios() -> None:
    # llama-cpp-python raced the speculative engine in lockstep: each repeat's ratio is the
    # measurement. Here the medians come from different repeats (llama's 30 s, spec's 20 s) and
    # their ratio (1.5) mixes a slow repeat with a fast one; the repeats say 0.8, 2.0, 2.0.
    res = _prompt("fib", {"llama-cpp-python": [20, 40, 30], "plain": [25, 25, 25],
                          "speculative": [25, 20, 15]})
    out = summarize([res], BenchConfig(repeats=3), baseline="llama-cpp-python")
    p = out["prompts"][0]
    assert p["speedup_runs"] == pytest.approx([0.8, 2.0, 2.0], abs=1e-3)
    assert p["speedup"] == pytest.approx(2.0)
    # Over the set: each prompt's time at the baseline's median pace (30 s), over its speedup.
    assert out["speedup"] == pytest.approx(2.0)
    assert out["spec_tokens_per_second"] == pytest.approx(100 / 15, abs=1e-3)


def test_turns_against_the_engine_baseline_keep_the_ratio_of_medians() -> None:
    # --baseline engine: the runs share one context and take turns, so no pair shares a moment.
    res = _prompt("fib", {"plain": [20, 40, 30], "speculative": [25, 20, 15]})
    p = summarize([res], BenchConfig(repeats=3), baseline="plain")["prompts"][0]
    assert p["speedup"] == pytest.approx(30 / 20, abs=1e-3)


def test_a_raced_set_weighs_each_prompt_by_the_baselines_time() -> None:
    # fib: 10 s alone, 2.0x; story: 30 s alone, 1.0x. Weighted by time: 40 s against 35 s
    # (a plain mean of the speedups would say 1.5x).
    fib = _prompt("fib", {"llama-cpp-python": [10], "plain": [10], "speculative": [5]})
    story = _prompt("story", {"llama-cpp-python": [30], "plain": [30], "speculative": [30]})
    out = summarize([fib, story], BenchConfig(), baseline="llama-cpp-python")
    assert out["speedup"] == pytest.approx(40 / 35, abs=1e-3)


def test_a_raced_decode_speedup_is_paired_too() -> None:
    res = PromptResult(BenchPrompt("fib", "code", "text"))
    for name, runs in {"llama-cpp-python": [(20, 2), (40, 2), (30, 2)], "plain": [(25, 2)] * 3,
                       "speculative": [(25, 2), (20, 2), (15, 2)]}.items():
        for total, ttft in runs:
            res.add(name, RunResult(tuple(range(101)), GenerationStats(
                completion_tokens=101, total_seconds=total, ttft_seconds=ttft)))
    p = summarize([res], BenchConfig(repeats=3), baseline="llama-cpp-python")["prompts"][0]
    # Decode: 100 tokens in 18, 38, 28 s alone and 23, 18, 13 s speculative.
    assert p["decode_speedup"] == pytest.approx(statistics.median([18 / 23, 38 / 18, 28 / 13]),
                                                abs=1e-3)


def test_the_sweep_compares_fixed_k_with_autos_measured_time_when_raced() -> None:
    # auto ran 20 s (median) and K=5 20 s, each measured: auto against the best is 1.0x, per
    # prompt and over the set, whatever the raced speedup says.
    res = _prompt("fib", {"llama-cpp-python": [20, 40, 30], "plain": [25, 25, 25],
                          "speculative": [25, 20, 15], "K=2": [30, 30, 30], "K=5": [20, 20, 20]})
    out = summarize([res], BenchConfig(repeats=3), baseline="llama-cpp-python", sweep=SWEEP)
    assert out["prompts"][0]["sweep"]["auto_vs_best"] == pytest.approx(1.0)
    assert out["sweep"]["auto_vs_best_overall"] == pytest.approx(1.0)
