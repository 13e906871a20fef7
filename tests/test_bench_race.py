"""`bench`'s lockstep: generations advanced a step at a time, the one behind in text first, each
timed on its own clock. The generations here are scripted steps and the clock a counter the
steps move, so which side ran when, and what each was charged, follow exactly. The race over
real models (the engine beside llama-cpp-python) runs in tests/test_cli_engine.py's bench; the
context's end, where both sides must stop alike, is also met here over real models."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localspec import benchmarking
from localspec.benchmarking import (
    BenchConfig,
    LlamaCppPythonContender,
    RunResult,
    Steps,
    race,
    run_alone,
)
from localspec.cli import main
from localspec.engine.stats import GenerationStats
from localspec.errors import ContextOverflowError


class Clock:
    """A stand-in for time.perf_counter that moves only when a step says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(benchmarking.time, "perf_counter", c)
    return c


def scripted(name: str, steps: list[tuple[int, float]], clock: Clock,
             log: list[str]) -> Steps:
    """Each step makes ``bytes`` of text and takes ``seconds``; the result holds its name."""
    for made, seconds in steps:
        log.append(name)
        clock.now += seconds
        yield made
    log.append(f"{name} done")
    return RunResult((len(steps),), GenerationStats(completion_tokens=len(steps)))


def test_the_side_behind_in_text_steps_next(clock: Clock) -> None:
    log: list[str] = []
    # a makes 1 byte a step; b makes 3 (a speculative step that accepted a draft).
    race([scripted("a", [(1, 0.1)] * 6, clock, log),
          scripted("b", [(3, 0.1)] * 2, clock, log)])
    steps = [x for x in log if not x.endswith("done")]
    assert steps == ["a", "b", "a", "a", "a", "b", "a", "a"]


def test_each_side_is_charged_only_its_own_steps(clock: Clock) -> None:
    log: list[str] = []
    fast, slow = race([scripted("fast", [(1, 0.5), (1, 0.1), (1, 0.1)], clock, log),
                       scripted("slow", [(1, 0.7), (1, 0.3), (1, 0.3)], clock, log)])
    assert fast.stats.total_seconds == pytest.approx(0.7)
    assert fast.stats.ttft_seconds == pytest.approx(0.5)
    assert slow.stats.total_seconds == pytest.approx(1.3)
    assert slow.stats.ttft_seconds == pytest.approx(0.7)
    assert clock.now == pytest.approx(2.0)  # the wall clock saw both


def test_the_order_given_is_the_order_of_the_prompts(clock: Clock) -> None:
    for order in (["a", "b"], ["b", "a"]):
        log: list[str] = []
        race([scripted(n, [(2, 0.1)], clock, log) for n in order])
        assert log[0] == order[0]


def test_a_side_that_finishes_early_lets_the_other_run_on(clock: Clock) -> None:
    log: list[str] = []
    short, long = race([scripted("short", [(1, 0.1)], clock, log),
                        scripted("long", [(1, 0.1)] * 4, clock, log)])
    assert short.tokens == (1,) and long.tokens == (4,)
    assert log == ["short", "long", "short done", "long", "long", "long", "long done"]


def test_one_generation_alone_is_an_ordinary_timed_run(clock: Clock) -> None:
    (result,) = race([scripted("only", [(1, 0.2), (1, 0.3)], clock, [])])
    assert result.stats.total_seconds == pytest.approx(0.5)
    assert result.stats.ttft_seconds == pytest.approx(0.2)


def test_a_side_that_fails_ends_the_others_generation(clock: Clock) -> None:
    closed: list[str] = []

    def holding(name: str) -> Steps:
        try:  # as the engine's stream holds its lock while open
            while True:
                yield 1
        finally:
            closed.append(name)
        return RunResult((), GenerationStats())  # pragma: no cover

    def failing() -> Steps:
        yield 1
        raise RuntimeError("the model failed")

    with pytest.raises(RuntimeError, match="the model failed"):
        race([holding("engine"), failing()])
    assert closed == ["engine"]


def test_time_to_first_token_waits_for_text(clock: Clock) -> None:
    log: list[str] = []
    # A first token with no text of its own (half a UTF-8 character): the first text is later.
    (result,) = race([scripted("a", [(0, 0.4), (2, 0.1), (1, 0.1)], clock, log)])
    assert result.stats.ttft_seconds == pytest.approx(0.5)


class ContextLlama:
    """A stand-in for llama-cpp-python's Llama: tokens 5, 6, 7, ... for as long as asked, and
    like llama_decode, a failure when a token is decoded past the context's end."""

    def __init__(self, n_ctx: int) -> None:
        self._n_ctx = n_ctx
        self.decoded = 0

    def n_ctx(self) -> int:
        return self._n_ctx

    def reset(self) -> None:
        self.decoded = 0

    def detokenize(self, tokens: list[int]) -> bytes:
        return b"x" * len(tokens)

    def generate(self, tokens: list[int], **_: Any) -> Iterator[int]:
        self.decoded = len(tokens)
        new = 5
        while True:
            if self.decoded > self._n_ctx:
                raise RuntimeError("llama_decode returned 1")
            yield new
            self.decoded += 1  # the token just made is decoded before the next is chosen
            new += 1


def test_llama_cpp_python_stops_where_the_context_ends() -> None:
    prompt = tuple(range(10))
    cfg = BenchConfig(max_tokens=128)
    alone = run_alone(LlamaCppPythonContender(ContextLlama(16), cfg, frozenset()), prompt)
    assert alone.tokens == (5, 6, 7, 8, 9, 10)  # as many as the engine makes: n_ctx - prompt
    # Beside a smaller engine context, as many as the engine makes there.
    beside = LlamaCppPythonContender(ContextLlama(16), cfg, frozenset(), n_ctx=13)
    assert run_alone(beside, prompt).tokens == (5, 6, 7)
    # A prompt that fills the context is refused in the engine's words.
    with pytest.raises(ContextOverflowError, match="prompt has 10 tokens but the context "
                                                   "holds 10; shorten it or raise --ctx"):
        run_alone(LlamaCppPythonContender(ContextLlama(10), cfg, frozenset()), prompt)


def _bench(*args: str) -> list[str]:
    return ["bench", "--json", "--repeats", "1", *args]


def test_bench_makes_as_many_tokens_on_both_sides_at_the_contexts_end(
        target_gguf: Path, draft_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A prompt that fits, with more tokens asked than the context has left after it: both
    sides stop at the context's end, so llama-cpp-python's loop neither fails nor runs on."""
    prompt = "print the value of the list and return it " * 4
    assert main(_bench("--target", str(target_gguf), "--draft", str(draft_gguf), "--ctx",
                       "256", "-n", "256", "--raw", "--prompt", prompt)) == 0
    (result,) = json.loads(capsys.readouterr().out)["prompts"]
    assert result["identical"] is True
    assert 0 < result["tokens"] < 256


def test_bench_refuses_a_prompt_longer_than_the_context_before_any_run(
        target_gguf: Path, draft_gguf: Path) -> None:
    from localspec.engine import ModelSettings, SpeculativeEngine
    from localspec.engine.llama_backend import open_llama

    settings = ModelSettings(n_ctx=256)
    prompts = [benchmarking.BenchPrompt("short", "user", "the model"),
               benchmarking.BenchPrompt("long", "user", "print the value of the list " * 40)]
    steps: list[str] = []
    with SpeculativeEngine.load(target_gguf, draft_gguf, settings) as engine:
        llama = open_llama(target_gguf, settings)
        try:
            with pytest.raises(ContextOverflowError, match=r"^prompt has \d+ tokens but the "
                               "context holds 256; shorten it or raise --ctx$"):
                benchmarking.run_bench(engine, prompts, BenchConfig(max_tokens=8, raw=True),
                                       on_step=steps.append, llama=llama)
        finally:
            llama.close()
    assert steps == []  # the short prompt's runs were not spent first


def test_bench_says_a_prompt_is_longer_than_the_context_in_one_line(
        target_gguf: Path, draft_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_bench("--target", str(target_gguf), "--draft", str(draft_gguf), "--ctx",
                       "256", "-n", "8", "--kind", "edit")) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("localspec: error: prompt has "), err
    assert err.endswith("tokens but the context holds 256; shorten it or raise --ctx"), err
    assert "\n" not in err and "report it" not in err
