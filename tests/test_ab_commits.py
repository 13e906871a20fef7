"""benchmarks/ab_commits.py's report: paired medians over the rounds both sides finished, as
the script writes it after every round (the runs themselves need real models)."""

from __future__ import annotations

import argparse

import pytest

from tests.benchmark_scripts import load_script

ab = load_script("ab_commits")


def _args(rounds: int) -> argparse.Namespace:
    return argparse.Namespace(a="A", b="B", a_args="", b_args="--tree off", keep_caches=False,
                              rounds=rounds)


def _run(overall: float, fib: float, identical: bool = True) -> dict[str, object]:
    return {"speedup": overall, "all_identical": identical,
            "prompts": [{"name": "fib", "speedup": fib, "identical": identical}]}


def test_a_cut_off_run_reports_the_rounds_both_sides_finished() -> None:
    # Round 2 ran B, then was cut off before its A: only round 1 is paired.
    runs = {"a": [_run(1.0, 2.0)], "b": [_run(1.1, 1.8), _run(9.0, 9.0)]}
    report = ab.summarize(_args(3), runs)
    assert (report["rounds_done"], report["complete"]) == (1, False)
    fib, overall = report["prompts"]
    assert fib["prompt"] == "fib" and fib["b_over_a_paired"] == pytest.approx(0.9)
    assert overall["prompt"] == "all" and overall["b_median"] == pytest.approx(1.1)


def test_a_finished_run_pairs_every_round_and_any_difference_shows() -> None:
    runs = {"a": [_run(1.0, 1.0), _run(2.0, 2.0), _run(1.0, 1.0)],
            "b": [_run(1.2, 1.0), _run(2.0, 2.0, identical=False), _run(1.1, 1.0)]}
    report = ab.summarize(_args(3), runs)
    assert (report["rounds_done"], report["complete"]) == (3, True)
    overall = report["prompts"][-1]
    assert overall["b_over_a_paired"] == pytest.approx(1.1)
    assert overall["identical"] is False


def test_no_finished_round_is_an_empty_report() -> None:
    report = ab.summarize(_args(2), {"a": [_run(1.0, 1.0)], "b": []})
    assert (report["rounds_done"], report["complete"], report["prompts"]) == (0, False, [])
