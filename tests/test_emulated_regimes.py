"""benchmarks/emulated_regimes.py: the engine deciding under a stated cost curve, priced by the
passes it made. Its pure parts on hand-made numbers, and one regime end to end on the tiny
Q4_K_M pair (real llama.cpp: the recorded widths are the decodes the engine made)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from localspec.engine.calibration import WIDE_WIDTHS
from tests.benchmark_scripts import load_script

er = load_script("emulated_regimes")


def test_the_prompts_batches_are_split_from_the_passes_after_it() -> None:
    assert er.split_prefill([256, 44, 1, 5, 1], 300) == ([256, 44], [1, 5, 1])
    assert er.split_prefill([7, 1, 1], 7) == ([7], [1, 1])
    assert er.split_prefill([7], 7) == ([7], [])
    # The draft catching up on the prompt and two tokens since, in one batch.
    assert er.split_prefill([9, 1, 3], 7) == ([7], [2, 1, 3])
    # The target: its uncached prompt in batches of its own, or the split is refused.
    assert er.target_prefill([200, 1, 1], 300, cached=100) == ([200], [1, 1])
    for widths, cached in (([203, 1], 100), ([150], 100)):
        with pytest.raises(SystemExit, match="not its 200 uncached prompt tokens"):
            er.target_prefill(widths, 300, cached)


def test_the_stated_calibration_prices_every_width_calibration_times() -> None:
    curve = {1: 1.0, 16: 1.5, 256: 3.0}
    cal = er.stated_calibration(curve, unit=0.2, draft_ratio=0.05, k_max=12, drift=0.3)
    assert sorted(cal.target_points) == [*range(1, 14), *WIDE_WIDTHS]
    assert cal.target_points[1] == pytest.approx(0.2)
    assert cal.target_points[16] == pytest.approx(0.3)
    assert cal.target_points[256] == pytest.approx(0.6)
    assert cal.target_points[8] == pytest.approx(0.2 * (1 + 0.5 * 7 / 15))
    assert cal.draft_token == pytest.approx(0.01)
    assert cal.drift == 0.3


def test_a_flat_regime_end_to_end_on_the_tiny_pair(
        quantized_pairs: dict[str, tuple[Path, Path]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the offloaded shape the engine drafts, its text is the target alone's, and the
    priced passes are the ones it made: the target alone takes one pass a token."""
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    target, draft = quantized_pairs["q4_k_m"]
    args = argparse.Namespace(target=str(target), draft=str(draft), history="off",
                              draft_ratio=0.05, unit_ms=None, max_tokens=24,
                              prompt=["fib", "rename"])
    result = er.run_regime(args, "offload")
    assert [p["name"] for p in result["prompts"]] == ["fib", "rename"]
    for p in result["prompts"]:
        alone, trees, chains = p["alone"], p["trees"], p["chains"]
        assert alone["draft_passes"] == 0 and alone["drafted"] == 0
        assert alone["units"] == pytest.approx(alone["target_passes"])  # one-token passes
        for side in (trees, chains):  # the target alone's text, up to a numerical near-tie
            assert side["identical"] or side["first_difference"]["near_tie"]
        assert chains["tree_rounds"] == 0
        for side in (trees, chains):
            assert side["target_passes"] < alone["target_passes"]
            assert side["draft_passes"] > 0
            # Every pass costs at least a one-token pass on this curve (a draft's, a twentieth
            # of one), so the priced units hold at least the passes made, and drafting paid.
            assert side["units"] >= side["target_passes"] + 0.05 * side["draft_passes"]
            assert side["units"] < alone["units"] and side["speedup"] > 1.0
    assert sum(p["trees"]["tree_rounds"] for p in result["prompts"]) > 0
