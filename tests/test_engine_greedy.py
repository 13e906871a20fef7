"""Greedy speculative decoding is token-for-token the target's own greedy decoding, on F32 and on
llama.cpp's quantized Q8_0 and Q4_K_M (every engine path runs on each precision)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest

from localspec.benchmarking import first_difference
from localspec.engine import (
    ModelSettings,
    SamplingParams,
    SpeculativeEngine,
    calibration,
    drafters,
)
from localspec.engine.calibration import Calibration
from localspec.engine.llama_backend import open_llama

from .engine_helpers import PROMPTS, run


@pytest.fixture
def engine(pair: tuple[Path, Path]) -> Iterator[SpeculativeEngine]:
    with SpeculativeEngine.load(*pair, ModelSettings(n_ctx=1024)) as eng:
        yield eng


@pytest.fixture(scope="module")
def f32_engine(target_gguf: Path, draft_gguf: Path) -> Iterator[SpeculativeEngine]:
    with SpeculativeEngine.load(target_gguf, draft_gguf, ModelSettings(n_ctx=1024)) as eng:
        yield eng


@pytest.fixture(scope="module")
def random_engine(target_gguf: Path, random_draft_gguf: Path) -> Iterator[SpeculativeEngine]:
    with SpeculativeEngine.load(target_gguf, random_draft_gguf, ModelSettings(n_ctx=1024)) as eng:
        yield eng


def test_plain_mode_matches_llama_cpp_python(pair: tuple[Path, Path],
                                             engine: SpeculativeEngine) -> None:
    """The baseline itself: draft mode none equals llama-cpp-python's own greedy generation
    (loaded with the same repack decision: Llama's defaults crash on some CPUs)."""
    llm = open_llama(pair[0], ModelSettings(n_ctx=512))
    try:
        for prompt in PROMPTS[:4]:
            tokens = engine.tokenize(prompt, chat=False)
            expected = []
            for tok in llm.generate(list(tokens), top_k=1, temp=0.0, reset=True):
                if llm.token_eos() == tok or len(expected) == 40:
                    break
                expected.append(tok)
            got = run(engine, prompt, max_tokens=40, mode="none")
            assert list(got.tokens) == expected
    finally:
        llm.close()


@pytest.mark.parametrize("k", [None, 1, 3, 8])
def test_identical_to_target_for_every_k(engine: SpeculativeEngine, k: int | None) -> None:
    drafted = 0
    for prompt in PROMPTS:
        plain = run(engine, prompt, mode="none", cold=True)
        spec = run(engine, prompt, mode="model", k=k, cold=True)
        assert spec.tokens == plain.tokens, (prompt, k)
        assert spec.text == plain.text
        drafted += spec.stats.drafted
    if k is not None:
        assert drafted > 0


def test_speculation_actually_happened(f32_engine: SpeculativeEngine) -> None:
    spec = run(f32_engine, PROMPTS[0], mode="model", k=4, max_tokens=64)
    s = spec.stats
    assert s.drafted > 0 and 0 < s.accepted <= s.drafted
    # Fewer target passes than tokens is the whole point of speculation.
    assert s.target_passes < s.completion_tokens
    assert s.k_counts[4] > 0
    # One llama_decode per target pass and per drafted token (a round's first draft step
    # also catches the draft up): what host time per model step is divided by.
    assert s.decode_calls == s.target_passes + s.drafted
    assert s.host_ms_per_decode < s.host_ms_per_step
    # A target pass yields more than one token, so host time per token is the smaller share.
    assert s.host_ms_per_token < s.host_ms_per_step
    assert s.host_ms_per_token * s.completion_tokens == pytest.approx(
        s.host_ms_per_step * s.target_passes)


@pytest.mark.parametrize("k", [None, 2, 6])
def test_identical_with_a_poorly_matched_draft(random_engine: SpeculativeEngine,
                                               k: int | None) -> None:
    for prompt in PROMPTS:
        plain = run(random_engine, prompt, mode="none", cold=True)
        spec = run(random_engine, prompt, mode="model", k=k, cold=True)
        assert spec.tokens == plain.tokens, (prompt, k)
    assert spec.stats.acceptance_rate < 0.9


@pytest.mark.parametrize("k", [None, 3])
@pytest.mark.parametrize("mode", drafters.names())
def test_identical_with_every_drafter(engine: SpeculativeEngine, mode: str,
                                      k: int | None) -> None:
    """Each registered drafter as the draft mode (prompt lookup, the draft model, ...)."""
    for prompt in PROMPTS:
        assert run(engine, prompt, mode=mode, k=k, cold=True).tokens == run(
            engine, prompt, mode="none", cold=True).tokens


def test_draft_equal_to_target_is_fully_accepted(target_gguf: Path) -> None:
    with SpeculativeEngine.load(target_gguf, target_gguf, ModelSettings(n_ctx=512)) as eng:
        for prompt in PROMPTS[:4]:
            res = run(eng, prompt, mode="model", k=4, max_tokens=60)
            assert res.stats.drafted > 0
            assert res.stats.accepted == res.stats.drafted
            assert res.stats.acceptance_rate == 1.0
            # Every round drafted K=4 (only the last may be cut short by max_tokens) and all
            # were accepted, so target passes yield about K+1 tokens each.
            assert res.stats.k_counts[4] >= res.stats.draft_rounds - 1
            assert res.stats.tokens_per_target_pass > 4.0


def test_rollback_over_long_generation_past_n_batch(pair: tuple[Path, Path]) -> None:
    """n_batch 16 and 300 tokens: many rollbacks, chunked prefill; still the target's output."""
    small = ModelSettings(n_ctx=1024, n_batch=16)
    with SpeculativeEngine.load(*pair, small, small) as eng:
        long_prompt = " ".join(PROMPTS * 3)  # longer than one batch of 16
        plain = run(eng, long_prompt, mode="none", max_tokens=300, cold=True)
        for k in (None, 7):
            spec = run(eng, long_prompt, mode="model", k=k, max_tokens=300, cold=True)
            assert spec.stats.completion_tokens == 300
            assert spec.tokens == plain.tokens
            if k is not None:  # whether auto drafts at all depends on this machine's timings
                assert spec.stats.drafted > spec.stats.accepted  # rejections: rollbacks


def test_requests_in_sequence_do_not_leak_state(engine: SpeculativeEngine,
                                                pair: tuple[Path, Path]) -> None:
    """Nothing of one request leaks into the next: a request after others gives what it gives
    on a fresh engine. The one allowed difference is a numerical near-tie: the later request
    reuses the cached prompt, whose last token is then decoded alone rather than in the
    prompt's batch, and some kernels (repacked Q4_K on AVX2) round the two differently."""
    a1 = run(engine, PROMPTS[0], k=3)
    run(engine, PROMPTS[1], k=None)
    run(engine, PROMPTS[0] + " extra words", k=5)
    a2 = run(engine, PROMPTS[0], k=3)
    with SpeculativeEngine.load(*pair, ModelSettings(n_ctx=1024)) as fresh:
        a3 = run(fresh, PROMPTS[0], k=3)
    assert a1.tokens == a3.tokens  # both from empty caches
    prompt = engine.tokenize(PROMPTS[0], chat=False)
    diff = first_difference(engine, prompt, a1.tokens, a2.tokens, SamplingParams())
    # 0.05 logits: a rounding difference, far below any real preference of the model.
    assert diff is None or diff["top2_margin"] < 0.05, diff


# -- the greedy policy on targets whose batched logits drift ---------------------------------------
def _memory_bound(drift: float) -> Calibration:
    """Costs as on a memory-bound GPU (verifying 13 tokens costs 1.3 steps, drafting is cheap)
    and a batched-vs-single drift as measured on quantized targets on a CPU."""
    return Calibration({1: 0.010, 2: 0.0105, 5: 0.011, 13: 0.013}, 0.001, drift)


def test_auto_speculates_on_a_drifting_target_and_exact_does_not(
        quantized_pairs: dict[str, tuple[Path, Path]]) -> None:
    """A Q4_K_M target whose batched logits drift 0.3 (as on this CPU's real models), costed like
    a memory-bound GPU: auto drafts (the near-tie guard keeps the output), --exact decodes
    plainly, and each says why."""
    target, draft = quantized_pairs["q4_k_m"]
    with SpeculativeEngine.load(target, draft, ModelSettings(n_ctx=1024)) as eng:
        eng.use_calibration(_memory_bound(0.3), learn=False)
        for prompt in PROMPTS[:4]:
            plain = run(eng, prompt, mode="none", max_tokens=40, cold=True)
            auto = run(eng, prompt, k=None, max_tokens=40, cold=True)
            exact = run(eng, prompt, k=None, max_tokens=40, exact=True, cold=True)
            assert auto.tokens == exact.tokens == plain.tokens
            assert auto.stats.drafted > 0, auto.stats.policy
            assert exact.stats.drafted == 0
            # The reason is given as the request ends, beside what it did there (these tiny
            # models' drafts are mostly rejected, so by the end auto may prefer plain steps).
            s = auto.stats
            assert s.policy.startswith(f"auto: drafted in {s.draft_rounds} of {s.target_passes}"
                                       f" steps, {s.acceptance_rate:.0%} accepted; by the end, ")
            assert "--exact" in exact.stats.policy and "drift 0.300" in exact.stats.policy


def test_auto_decodes_plainly_where_verification_is_expensive(
        quantized_pairs: dict[str, tuple[Path, Path]]) -> None:
    """Costs as a compute-bound CPU target: verifying K+1 tokens costs K+1 steps."""
    target, draft = quantized_pairs["q4_k_m"]
    with SpeculativeEngine.load(target, draft, ModelSettings(n_ctx=1024)) as eng:
        eng.use_calibration(Calibration({1: 0.01, 2: 0.02, 13: 0.13}, 0.002, 0.0), learn=False)
        res = run(eng, PROMPTS[0], k=None, max_tokens=40)
        assert res.stats.drafted == 0
        assert res.stats.policy.startswith("auto: plain decoding: verifying")


def test_calibration_is_measured_after_the_first_token_and_cached(
        target_gguf: Path, draft_gguf: Path) -> None:
    with SpeculativeEngine.load(target_gguf, draft_gguf, ModelSettings(n_ctx=1024)) as eng:
        assert eng.calibration is None  # nothing measured at load: the first token is not delayed
        res = run(eng, PROMPTS[0], k=None, max_tokens=20)
        assert eng.calibration is not None
        assert res.stats.calibration_seconds > 0
        # Every width verification can use is timed: the cost curve is a staircase, not a line;
        # and a few wider ones, for token trees.
        widths = sorted(eng.calibration.target_points)
        assert [w for w in widths if w <= eng.k_max + 1] == list(range(1, eng.k_max + 2))
        wide = widths[eng.k_max + 1:]
        assert set(wide) <= set(calibration.WIDE_WIDTHS)
        points = eng.calibration.target_points
        assert all(calibration.cheaper_per_token(points, w) for w in wide[:-1])
        # Calibration's own decodes are not generation time: host time stays a real quantity.
        generating = res.stats.total_seconds - res.stats.calibration_seconds
        assert 0 < res.stats.decode_seconds <= generating
        assert res.stats.host_ms_per_step >= 0
        assert 0.0 <= eng.tie_margin < 0.25  # F32: batched and single-token logits agree
        again = run(eng, PROMPTS[0], k=None, max_tokens=20)
        assert again.stats.calibration_seconds == 0 and again.tokens == res.tokens
    with SpeculativeEngine.load(target_gguf, draft_gguf, ModelSettings(n_ctx=1024)) as eng:
        assert eng.calibration is not None  # from the cache
    with SpeculativeEngine.load(target_gguf, draft_gguf, ModelSettings(n_ctx=512)) as eng:
        assert eng.calibration is None  # other settings: measured anew


def test_runs_apart_do_not_teach_auto(f32_engine: SpeculativeEngine) -> None:
    """bench's fixed-K sweep runs apart: auto must be measured on what its own runs taught it,
    never on what a fixed K=8 saw at depths auto had not reached."""
    def learned() -> list[object]:
        return [(lr.acceptance["model"].prior_rates, lr.acceptance["model"].hits, lr.ties.prior,
                 lr.peeks.interval, lr.peeks.streak) for lr in f32_engine._learned.values()]

    before = copy.deepcopy(learned())
    with f32_engine.separate_learning():
        res = run(f32_engine, PROMPTS[0], k=8, max_tokens=24)
    assert res.stats.drafted > 0
    assert learned() == before
    run(f32_engine, PROMPTS[0], k=8, max_tokens=24)  # not apart: it teaches
    assert learned() != before


def test_llama_cpp_python_baseline_pays_its_prompt_every_run(target_gguf: Path) -> None:
    """bench's "target alone" processes the whole prompt on every repeat, as the engine does:
    Llama.generate(reset=True) would otherwise reuse the prompt cached by the previous run."""
    from localspec.benchmarking import BenchConfig, LlamaCppPythonContender, run_alone

    llm = open_llama(target_gguf, ModelSettings(n_ctx=512))
    evaluated: list[int] = []
    real_eval = llm.eval

    def counting_eval(tokens: list[int]) -> None:  # a spy: the real eval still runs
        evaluated.append(len(tokens))
        real_eval(tokens)

    llm.eval = counting_eval
    try:
        contender = LlamaCppPythonContender(llm, BenchConfig(max_tokens=4), frozenset())
        prompt = tuple(llm.tokenize(PROMPTS[0].encode()))
        first = run_alone(contender, prompt)
        evaluated.clear()
        again = run_alone(contender, prompt)
        assert evaluated[0] == len(prompt)  # the whole prompt, not its last token
        assert again.tokens == first.tokens
    finally:
        llm.close()
