"""benchmarks/trace_model.py's pricing: the cost of a pass from a curve, the bound any drafting
from history and lookup could reach, and the planner it models. Pure functions on hand-made
texts (the recording itself needs real models and belongs to the benchmark)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_script

tm = load_script("trace_model")
STEEP = {1: 1.0, 4: 2.0, 8: 4.0}
FLAT = {1: 1.0, 64: 1.0}
LINEAR = {1: 1.0, 64: 64.0}
OUT = list(range(10))  # the target's text; OUT[0] comes with the prefill
Cands = list[list[tuple[list[int], list[float]]]]


def cost(curve: dict[int, float]) -> Callable[[int], float]:
    return lambda n: tm.pass_cost(curve, n)


def test_pass_cost_interpolates_and_batches_past_the_widest() -> None:
    assert tm.pass_cost(STEEP, 1) == pytest.approx(1.0)
    assert tm.pass_cost(STEEP, 6) == pytest.approx(3.0)
    # Past the widest width: passes of the widest, then the rest.
    assert tm.pass_cost(STEEP, 16) == pytest.approx(8.0)
    assert tm.pass_cost(STEEP, 10) == pytest.approx(4.0 + 4.0 / 3.0)
    # In one-token passes, whatever the curve's unit.
    assert tm.pass_cost({1: 0.05, 2: 0.08}, 2) == pytest.approx(1.6)


def test_matched_counts_the_agreeing_prefix() -> None:
    assert tm.matched([3, 4, 9], OUT, 3) == 2
    assert tm.matched([3, 4, 5], OUT, 3) == 3
    assert tm.matched([8, 9, 10, 11], OUT, 8) == 2  # the text ends
    assert tm.matched([7], OUT, 3) == 0


def test_bound_without_candidates_is_plain_decoding() -> None:
    no_cands: Cands = [[] for _ in OUT[1:]]
    assert tm.bound_passes(no_cands, OUT, cost(FLAT)) == pytest.approx(9.0)


def test_bound_takes_a_whole_copy_in_one_pass_on_a_flat_curve() -> None:
    cands: Cands = [[] for _ in OUT[1:]]
    cands[0] = [(OUT[1:], [0.5] * 9)]  # at position 1: the rest of the text, right throughout
    assert tm.bound_passes(cands, OUT, cost(FLAT)) == pytest.approx(1.0)


def test_bound_truncates_a_copy_where_it_stops_matching() -> None:
    cands: Cands = [[] for _ in OUT[1:]]
    cands[0] = [([1, 2, 3, 99, 5], [0.9] * 5)]  # right for 3 tokens
    # 3 drafted and the target's own 4th token in one pass of 4, then 5 plain steps.
    assert tm.bound_passes(cands, OUT, cost(STEEP)) == pytest.approx(2.0 + 5.0)


def test_bound_may_stop_a_copy_short_to_reach_another() -> None:
    # A pass of up to 8 tokens costs one; 9 cost a hundred. From position 1 a copy matches 8
    # tokens (a pass of 9); stopping after 2 lands on position 4, where 7 drafted tokens and
    # the target's own finish the text in one cheap pass: 2 passes. Taking only whole
    # matches, the best is 11 plain steps.
    out = list(range(12))
    cliff = {1: 1.0, 8: 1.0, 9: 100.0}
    cands: Cands = [[] for _ in out[1:]]
    cands[0] = [(out[1:9], [0.9] * 8)]
    cands[3] = [(out[4:12], [0.9] * 8)]
    assert tm.bound_passes(cands, out, cost(cliff)) == pytest.approx(2.0)
    assert tm.policy_passes(cands, out, cost(cliff)) >= 2.0 - 1e-9


def test_bound_prefers_plain_steps_where_a_pass_costs_what_its_tokens_do() -> None:
    cands = [[(OUT[p:], [1.0] * (10 - p))] for p in range(1, 10)]
    assert tm.bound_passes(cands, OUT, cost(LINEAR)) == pytest.approx(9.0)


def test_policy_drafts_a_confident_copy_on_a_flat_curve() -> None:
    cands: Cands = [[] for _ in OUT[1:]]
    cands[0] = [(OUT[1:], [0.99] * 9)]
    assert tm.policy_passes(cands, OUT, cost(FLAT)) == pytest.approx(1.0)


def test_policy_pays_for_the_tokens_it_drafts_wrong() -> None:
    cands: Cands = [[] for _ in OUT[1:]]
    cands[0] = [([1, 2, 3, 99, 98, 97, 96], [0.99] * 7)]
    mild = {1: 1.0, 8: 1.4}
    # It verifies all 7 (the planner cannot know), keeps 3 and the target's 4th, then goes
    # plain for the 5 positions left; the bound verifies only the 3 that match.
    assert tm.policy_passes(cands, OUT, cost(mild)) == pytest.approx(1.4 + 5.0)
    assert tm.bound_passes(cands, OUT, cost(mild)) == pytest.approx(
        tm.pass_cost(mild, 4) + 5.0)


def test_policy_never_drafts_where_no_length_beats_a_plain_step() -> None:
    cands = [[(OUT[p:], [0.99] * (10 - p))] for p in range(1, 10)]
    assert tm.policy_passes(cands, OUT, cost(LINEAR)) == pytest.approx(9.0)
    # Where a wider pass costs nothing, even an unlikely token is worth verifying.
    cands = [[(OUT[p:], [0.05] * (10 - p))] for p in range(1, 10)]
    assert tm.policy_passes(cands, OUT, cost(FLAT)) == pytest.approx(1.0)


def test_policy_is_never_below_the_bound() -> None:
    cands = [[([p, p + 1, 77], [0.9, 0.9, 0.9])] for p in range(1, 10)]
    for curve in (STEEP, FLAT, LINEAR):
        assert (tm.policy_passes(cands, OUT, cost(curve))
                >= tm.bound_passes(cands, OUT, cost(curve)) - 1e-9)


def test_a_bad_recording_is_one_line_and_exit_2(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "rec.json"
    bad.write_text("{not json")
    assert tm.main(["--from", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read" in err
    assert tm.main(["--from", str(tmp_path / "missing.json")]) == 2
    bad.write_text('{"recording": [1, 2]}')  # JSON, but not a recording
    assert tm.main(["--from", str(bad)]) == 2
    bad.write_text('{"recording": {"here": {}}}')
    assert tm.main(["--from", str(bad)]) == 2


def test_step_report_sorts_the_engines_steps_against_what_the_free_drafters_matched() -> None:
    """An answer that copies its prompt: the first step has nothing to copy yet (prompt
    lookup needs a 2-token match), then a copy taken in part, one the log says was rejected,
    and a plain step where the copy would have held."""
    prompt = list(range(100, 120))
    out = prompt[:10]
    steps = [("plain", 0, 0), ("lookup", 3, 3), ("lookup", 2, 0), ("plain", 0, 0),
             ("model", 1, 1)]
    rec = {"here": {"1": 1.0, "4": 2.0, "8": 4.0},
           "requests": [{"name": "r", "prompt": prompt, "output": out, "steps": steps}]}
    report = tm.step_report(rec)
    assert report == {
        "plain, nothing matched": {"steps": 1, "passes": 1.0},
        "lookup, all accepted, the copy went further": {"steps": 1, "passes": 2.0},
        "lookup, rejected at once": {"steps": 1, "passes": 1.7},  # a pass of 3
        "plain, a free proposal matched": {"steps": 1, "passes": 1.0},
        "model, a free proposal matched further": {"steps": 1, "passes": 1.3},
    }
