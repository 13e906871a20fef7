"""Sampling: the speculative output distribution is exactly the target's.

A tiny vocabulary makes the exact target distribution computable by enumeration, so the test
compares sampled frequencies against exact probabilities (chi-square, fixed seeds)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from localspec.engine import (
    DraftSettings,
    GenerationRequest,
    LlamaRunner,
    ModelSettings,
    SamplingParams,
    SpeculativeEngine,
)
from localspec.models.tiny import TinyModelSpec, quantized_model, write_tiny_model

from .engine_helpers import PROMPTS

WORDS = ("a", "b")  # vocabulary: 3 control + 2 words + 26 letters + "▁" = 32 tokens
PARAMS = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
N_RUNS = 3000


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("small")
    spec = dict(words=WORDS, byte_tokens=False, n_embd=32, n_head=4, n_head_kv=2, n_ff=64,
                output_scale=0.6)
    target = write_tiny_model(d / "t.gguf", TinyModelSpec(seed=21, n_layer=2, **spec))
    draft = write_tiny_model(d / "d.gguf", TinyModelSpec(seed=22, n_layer=1, **spec))
    return target, draft


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def _exact_joint(path: Path, prompt: tuple[int, ...]) -> dict[tuple[int, int], float]:
    """P(t1, t2) of plain temperature-1 sampling, by enumerating t1 (no localspec sampling code)."""
    runner = LlamaRunner(path, ModelSettings(n_ctx=64))
    try:
        p1 = _softmax(runner.sync(list(prompt), 1)[0])
        joint = {}
        for t1 in range(p1.shape[0]):
            if p1[t1] < 1e-9:
                continue
            p2 = _softmax(runner.sync(list(prompt) + [t1], 1)[0])
            for t2 in range(p2.shape[0]):
                joint[(t1, t2)] = p1[t1] * p2[t2]
        return joint
    finally:
        runner.close()


def _chi_square(counts: Counter[tuple[int, int]], probs: dict[tuple[int, int], float],
                n: int) -> tuple[float, int]:
    """Chi-square statistic with cells of expected count < 5 pooled; returns (stat, df)."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in probs.items():
        exp = p * n
        if exp < 5:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += exp
            continue
        stat += (counts.get(cell, 0) - exp) ** 2 / exp
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    return stat, cells - 1


def _critical(df: int, z: float = 3.29) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z=3.29: p = 0.0005)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _sample_pairs(engine: SpeculativeEngine, prompt: tuple[int, ...], draft: DraftSettings,
                  params: SamplingParams = PARAMS) -> Counter[tuple[int, int]]:
    counts: Counter[tuple[int, int]] = Counter()
    for seed in range(N_RUNS):
        sp = SamplingParams(temperature=params.temperature, top_k=0, top_p=1.0, min_p=0.0,
                            seed=seed)
        res = engine.generate(GenerationRequest(prompt_tokens=prompt, max_tokens=2, sampling=sp,
                                                draft=draft))
        if len(res.tokens) == 2:
            counts[(res.tokens[0], res.tokens[1])] += 1
        else:  # the end-of-sequence token was sampled: count it as its own outcome
            counts[(res.tokens[0] if res.tokens else 2, 2)] += 1
    return counts


@pytest.fixture(scope="module")
def engine(small_pair: tuple[Path, Path]) -> Iterator[SpeculativeEngine]:
    target, draft = small_pair
    with SpeculativeEngine.load(target, draft, ModelSettings(n_ctx=64)) as eng:
        yield eng


@pytest.fixture(scope="module")
def prompt(engine: SpeculativeEngine) -> tuple[int, ...]:
    return engine.tokenize("a b", chat=False)


@pytest.fixture(scope="module")
def exact(small_pair: tuple[Path, Path], prompt: tuple[int, ...]) -> dict:
    return _exact_joint(small_pair[0], prompt)


@pytest.mark.parametrize("draft", [
    DraftSettings(mode="model", k=1, rule="coupled"),
    DraftSettings(mode="model", k=None, rule="coupled"),
    DraftSettings(mode="model", k=1, rule="rejection"),
    DraftSettings(mode="model", k=None, rule="rejection"),
    DraftSettings(mode="model", k=1, rule="match"),
], ids=["coupled-k1", "coupled-auto", "rejection-k1", "rejection-auto", "sample-and-match"])
def test_speculative_sampling_matches_target_distribution(engine: SpeculativeEngine,
                                                          prompt: tuple[int, ...], exact: dict,
                                                          draft: DraftSettings) -> None:
    counts = _sample_pairs(engine, prompt, draft)
    stat, df = _chi_square(counts, exact, sum(counts.values()))
    assert df >= 10
    assert stat < _critical(df), (stat, df)


def test_coupled_sampling_on_a_quantized_target_matches_its_distribution(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same on llama.cpp's Q4_K_M (rows of 256 values: Q4_K's block size)."""
    d = tmp_path_factory.mktemp("small-q")
    spec = dict(words=WORDS, byte_tokens=False, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                output_scale=0.15)
    target = quantized_model(d, "Q4_K_M", TinyModelSpec(seed=21, n_layer=2, **spec))
    draft = quantized_model(d, "Q4_K_M", TinyModelSpec(seed=22, n_layer=1, **spec))
    with SpeculativeEngine.load(target, draft, ModelSettings(n_ctx=64)) as eng:
        prompt = eng.tokenize("a b", chat=False)
        exact = _exact_joint(target, prompt)
        counts = _sample_pairs(eng, prompt, DraftSettings(mode="model", k=None, rule="coupled"))
        assert sum(1 for p in exact.values() if p * N_RUNS >= 5) >= 10  # a real distribution
        stat, df = _chi_square(counts, exact, sum(counts.values()))
        assert stat < _critical(df), (stat, df)


def test_the_test_has_power(small_pair: tuple[Path, Path], prompt: tuple[int, ...],
                            exact: dict) -> None:
    """The draft's own distribution must fail the same test, or the test proves nothing."""
    draft_exact = _exact_joint(small_pair[1], prompt)
    rng = np.random.default_rng(0)
    cells = list(draft_exact)
    probs = np.array([draft_exact[c] for c in cells])
    draws = rng.choice(len(cells), size=N_RUNS, p=probs / probs.sum())
    counts = Counter(cells[i] for i in draws)
    stat, df = _chi_square(counts, exact, N_RUNS)
    assert stat > _critical(df)


def test_rejection_sampling_accepts_more_than_matching(engine: SpeculativeEngine,
                                                       prompt: tuple[int, ...]) -> None:
    """min(1, p/q) acceptance dominates 'sample from the target and compare'."""
    def acceptance(rule: str) -> float:
        drafted = accepted = 0
        for seed in range(300):
            sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
            res = engine.generate(GenerationRequest(
                prompt_tokens=prompt, max_tokens=12, sampling=sp,
                draft=DraftSettings(mode="model", k=3, rule=rule)))  # type: ignore[arg-type]
            drafted += res.stats.drafted
            accepted += res.stats.accepted
        return accepted / drafted

    assert acceptance("rejection") > acceptance("match")


# -- a seed reproduces the text, whatever the drafting did ----------------------------------------
SEEDS = (1, 7, 1234)
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
DRAFTINGS = [DraftSettings(mode="none"), DraftSettings(mode="model", k=None),
             DraftSettings(mode="model", k=1), DraftSettings(mode="model", k=3),
             DraftSettings(mode="model", k=8), DraftSettings(mode="lookup", k=None),
             DraftSettings(mode="lookup", k=4)]


def _seeded(engine: SpeculativeEngine, text: str, seed: int,
            draft: DraftSettings) -> tuple[int, ...]:
    sp = SamplingParams(temperature=SAMPLED.temperature, top_k=SAMPLED.top_k,
                        top_p=SAMPLED.top_p, min_p=SAMPLED.min_p, seed=seed)
    req = GenerationRequest(prompt_tokens=engine.tokenize(text, chat=False), max_tokens=40,
                            sampling=sp, draft=draft)
    return engine.generate(req).tokens


def test_seeded_text_is_the_same_whatever_is_drafted(pair: tuple[Path, Path]) -> None:
    """With a seed the text depends on (weights, prompt, settings, seed) only: every draft mode,
    K and request order gives the target-alone text (F32, Q8_0 and Q4_K_M)."""
    with SpeculativeEngine.load(*pair, ModelSettings(n_ctx=512)) as eng:
        expected = {(p, s): _seeded(eng, p, s, DraftSettings(mode="none"))
                    for p in PROMPTS[:3] for s in SEEDS}
        assert len({expected[(PROMPTS[0], s)] for s in SEEDS}) == len(SEEDS)  # seeds matter
        cases = [(p, s, d) for p in PROMPTS[:3] for s in SEEDS for d in DRAFTINGS]
        drafted = 0
        for order in (cases, cases[::-1]):
            for p, s, d in order:
                got = _seeded(eng, p, s, d)
                assert got == expected[(p, s)], (p, s, d)
        res = eng.generate(GenerationRequest(prompt_tokens=eng.tokenize(PROMPTS[0], chat=False),
                                             max_tokens=40, sampling=SamplingParams(
                                                 temperature=0.8, seed=1),
                                             draft=DraftSettings(mode="model", k=3)))
        drafted = res.stats.drafted
        assert drafted > 0 and res.stats.accepted > 0
    with SpeculativeEngine.load(*pair, ModelSettings(n_ctx=512)) as fresh:
        assert _seeded(fresh, PROMPTS[0], SEEDS[0], DraftSettings(mode="model", k=2)) \
            == expected[(PROMPTS[0], SEEDS[0])]


def test_first_difference_of_seeded_sampling_is_judged_on_the_coupled_choice(
        engine: SpeculativeEngine, prompt: tuple[int, ...]) -> None:
    """bench's diagnosis of a seeded coupled difference re-chooses the token at that output
    position under the seed from a one-token pass: it is the plain text's token there, with
    the gap between the two best Gumbel scores as its margin."""
    from localspec.benchmarking import first_difference

    sp = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=5)
    plain = engine.generate(GenerationRequest(prompt_tokens=prompt, max_tokens=12, sampling=sp,
                                              draft=DraftSettings(mode="none"))).tokens
    for n in (0, 4, 9):
        other = list(plain)
        other[n] = next(t for t in range(3, 32) if t != plain[n])
        diff = first_difference(engine, prompt, plain, other, sp)
        assert diff is not None and diff["position"] == n
        assert diff["target_token"] == diff["baseline_token"] == plain[n]
        assert diff["top2_margin"] > 0.0


def test_unseeded_requests_differ(engine: SpeculativeEngine, prompt: tuple[int, ...]) -> None:
    sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    outs = {engine.generate(GenerationRequest(prompt_tokens=prompt, max_tokens=12,
                                              sampling=sp)).tokens for _ in range(8)}
    assert len(outs) > 1
