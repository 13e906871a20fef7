"""`bench`'s lockstep: generations advanced a step at a time, the one behind in text first, each
timed on its own clock. The generations here are scripted steps and the clock a counter the
steps move, so which side ran when, and what each was charged, follow exactly. The race over
real models (the engine beside llama-cpp-python) runs in tests/test_cli_engine.py's bench."""

from __future__ import annotations

import pytest

from localspec import benchmarking
from localspec.benchmarking import RunResult, Steps, race
from localspec.engine.stats import GenerationStats


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
