"""Greedy speculative decoding is token-for-token the target's own greedy decoding."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from localspec.engine import ModelSettings, SpeculativeEngine

from .engine_helpers import PROMPTS, run


@pytest.fixture(scope="module")
def engine(target_gguf: Path, draft_gguf: Path) -> Iterator[SpeculativeEngine]:
    with SpeculativeEngine.load(target_gguf, draft_gguf, ModelSettings(n_ctx=1024)) as eng:
        yield eng


@pytest.fixture(scope="module")
def random_engine(target_gguf: Path, random_draft_gguf: Path) -> Iterator[SpeculativeEngine]:
    with SpeculativeEngine.load(target_gguf, random_draft_gguf, ModelSettings(n_ctx=1024)) as eng:
        yield eng


def test_plain_mode_matches_llama_cpp_python(target_gguf: Path,
                                             engine: SpeculativeEngine) -> None:
    """The baseline itself: draft mode none equals llama-cpp-python's own greedy generation."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(target_gguf), n_ctx=512, verbose=False)
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


@pytest.mark.parametrize("k", [None, 1, 2, 3, 5, 8])
def test_identical_to_target_for_every_k(engine: SpeculativeEngine, k: int | None) -> None:
    for prompt in PROMPTS:
        plain = run(engine, prompt, mode="none")
        spec = run(engine, prompt, mode="model", k=k)
        assert spec.tokens == plain.tokens, (prompt, k)
        assert spec.text == plain.text


def test_speculation_actually_happened(engine: SpeculativeEngine) -> None:
    spec = run(engine, PROMPTS[0], mode="model", k=4, max_tokens=64)
    s = spec.stats
    assert s.drafted > 0 and 0 < s.accepted <= s.drafted
    # Fewer target passes than tokens is the whole point of speculation.
    assert s.target_passes < s.completion_tokens
    assert s.k_counts[4] > 0


@pytest.mark.parametrize("k", [None, 2, 6])
def test_identical_with_a_poorly_matched_draft(random_engine: SpeculativeEngine,
                                               k: int | None) -> None:
    for prompt in PROMPTS:
        plain = run(random_engine, prompt, mode="none")
        spec = run(random_engine, prompt, mode="model", k=k)
        assert spec.tokens == plain.tokens, (prompt, k)
    assert spec.stats.acceptance_rate < 0.9


@pytest.mark.parametrize("k", [None, 3])
def test_identical_with_prompt_lookup(engine: SpeculativeEngine, k: int | None) -> None:
    for prompt in PROMPTS:
        assert run(engine, prompt, mode="lookup", k=k).tokens == run(engine, prompt,
                                                                      mode="none").tokens


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


def test_rollback_over_long_generation_past_n_batch(target_gguf: Path, draft_gguf: Path) -> None:
    """n_batch 16 and 400 tokens: many rollbacks, chunked prefill; still the target's output."""
    small = ModelSettings(n_ctx=1024, n_batch=16)
    with SpeculativeEngine.load(target_gguf, draft_gguf, small, small) as eng:
        long_prompt = " ".join(PROMPTS * 3)  # longer than one batch of 16
        plain = run(eng, long_prompt, mode="none", max_tokens=400)
        for k in (None, 7):
            spec = run(eng, long_prompt, mode="model", k=k, max_tokens=400)
            assert spec.stats.completion_tokens == 400
            assert spec.tokens == plain.tokens
            assert spec.stats.drafted > spec.stats.accepted  # rejections happened: rollbacks


def test_requests_in_sequence_do_not_leak_state(engine: SpeculativeEngine,
                                                target_gguf: Path, draft_gguf: Path) -> None:
    """KV prefix reuse across requests must not change any output."""
    a1 = run(engine, PROMPTS[0], k=3)
    run(engine, PROMPTS[1], k=None)
    run(engine, PROMPTS[0] + " extra words", k=5)
    a2 = run(engine, PROMPTS[0], k=3)
    with SpeculativeEngine.load(target_gguf, draft_gguf, ModelSettings(n_ctx=1024)) as fresh:
        a3 = run(fresh, PROMPTS[0], k=3)
    assert a1.tokens == a2.tokens == a3.tokens


def test_auto_mode_decodes_plainly_when_batched_logits_drift(engine: SpeculativeEngine) -> None:
    """A build whose batched kernels stray from one-token ones (a quantized target on a CPU):
    auto mode must not speculate on greedy requests; a fixed K still does."""
    saved = engine.greedy_exact
    engine.greedy_exact = False
    try:
        auto = run(engine, PROMPTS[0], k=None, max_tokens=40)
        fixed = run(engine, PROMPTS[0], k=3, max_tokens=40)
    finally:
        engine.greedy_exact = saved
    assert auto.stats.drafted == 0
    assert fixed.stats.drafted > 0
    assert auto.tokens == fixed.tokens == run(engine, PROMPTS[0], mode="none",
                                              max_tokens=40).tokens


def test_tie_margin_is_measured_and_small_for_f32(engine: SpeculativeEngine) -> None:
    assert 0.0 <= engine.tie_margin < 0.25
    assert engine.greedy_exact
