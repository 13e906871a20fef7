"""Saved prompt states: a request that resends an earlier request's prefix after other requests
restores that state instead of prefilling it, on F32, Q8_0 and Q4_K_M, with the logits and the
text a fresh prefill gives; the policy (which state, how many bytes) on known sequences."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from localspec.engine import GenerationRequest, ModelSettings, SpeculativeEngine
from localspec.engine.llama_backend import LlamaRunner
from localspec.engine.prompt_cache import (
    MIN_GAIN,
    MIN_GAIN_CPU,
    MIN_TOKENS,
    PromptCache,
    common_prefix,
)

# As in test_token_tree: batch shapes may round float32 differently (1e-5 here); a wrong
# state (other tokens, other positions) moves logits by whole units.
TOL = 1e-3


def _seq(seed: int, n: int, vocab: int = 50) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, vocab, size=n)]


# -- the policy ---------------------------------------------------------------------------------
def test_common_prefix_counts_the_shared_head() -> None:
    a = np.array([1, 2, 3, 4], dtype=np.int32)
    assert common_prefix(a, np.array([1, 2, 9], dtype=np.int32)) == 2
    assert common_prefix(a, np.array([1, 2, 3, 4, 5], dtype=np.int32)) == 4
    assert common_prefix(a, np.array([7], dtype=np.int32)) == 0
    assert common_prefix(a, np.array([], dtype=np.int32)) == 0


def test_best_is_the_longest_shared_prefix_and_only_where_it_saves_enough() -> None:
    cache = PromptCache(1 << 20)
    a, b = _seq(1, 200), _seq(2, 200)
    assert cache.add(a, "A", 100) and cache.add(b, "B", 100)
    entry = cache.best(a[:150] + [1, 2, 3], held=0)
    assert entry is not None and entry.data == "A"
    assert cache.best(b + [5] * 10, held=0).data == "B"  # type: ignore[union-attr]
    # The KV cache already shares 130 tokens: a state sharing 150 saves too few.
    assert cache.best(a[:150] + [1], held=150 - MIN_GAIN + 1) is None
    assert cache.best(a[:150] + [1], held=150 - MIN_GAIN) is not None
    assert cache.best(_seq(3, 200), held=0) is None  # nothing shared
    assert cache.hits == 0  # only a restore counts (``used``)


def test_a_state_that_extends_another_replaces_it_and_one_covered_is_not_kept() -> None:
    cache = PromptCache(1 << 20)
    a = _seq(4, 100)
    assert cache.add(a, "short", 10)
    assert cache.add(a + _seq(5, 50), "long", 15)
    assert len(cache) == 1 and cache.nbytes == 15
    assert not cache.add(a[:80], "covered", 5)  # the kept state holds it already
    assert not cache.add(_seq(6, MIN_TOKENS - 1), "too short", 5)
    assert len(cache) == 1


def test_the_byte_budget_drops_the_least_recently_used() -> None:
    cache = PromptCache(250)
    a, b, c = _seq(7, 100), _seq(8, 100), _seq(9, 100)
    cache.add(a, "A", 100)
    cache.add(b, "B", 100)
    assert cache.best(a, held=0) is not None  # A used: B is now the oldest
    cache.add(c, "C", 100)
    assert cache.nbytes <= 250
    assert cache.best(b, held=0) is None
    assert cache.best(a, held=0) is not None and cache.best(c, held=0) is not None
    assert not cache.add(_seq(10, 100), "too big", 251)
    assert not PromptCache(0).add(a, "off", 1)


# -- the runner, on real llama.cpp ----------------------------------------------------------------
@pytest.fixture
def runners(pair: tuple[Path, Path]) -> Iterator[tuple[LlamaRunner, LlamaRunner]]:
    """A runner that keeps states (room for tree branches, as the engine's) and a fresh one."""
    settings = ModelSettings(n_ctx=512)
    with LlamaRunner(pair[0], settings, branches=4) as kept, LlamaRunner(
            pair[0], ModelSettings(n_ctx=512, prompt_cache_mib=0)) as fresh:
        yield kept, fresh


def test_a_prefix_resent_after_another_request_is_restored_not_prefilled(
        runners: tuple[LlamaRunner, LlamaRunner]) -> None:
    kept, fresh = runners
    vocab = min(kept.n_vocab, 50)
    a, b = _seq(11, 150, vocab), _seq(12, 120, vocab)
    assert kept.switch_to(a) == 0
    kept.sync(a)
    kept.decode(_seq(13, 5, vocab))  # an answer after the prompt, as a request leaves it
    assert len(kept.prompt_cache) == 0  # nothing copied while nothing is dropped
    kept.switch_to(b)  # another request: a's state is kept before b replaces it
    kept.sync(b)
    assert len(kept.prompt_cache) == 1
    calls = kept.decode_calls
    resent = a + _seq(14, 10, vocab)
    assert kept.switch_to(resent) == len(a)  # b's kept, a's restored
    assert len(kept.prompt_cache) == 2 and kept.prompt_cache.hits == 1
    logits = kept.sync(resent, 3).copy()
    assert kept.reused == len(a)  # only the 10 new tokens were decoded, in one call
    assert kept.decode_calls == calls + 1
    assert kept.tokens == resent
    expected = fresh.sync(resent, 3)
    assert np.abs(logits - expected).max() < TOL
    # The cache holds exactly the restored sequence: decoding on agrees with a fresh prefill.
    more = _seq(15, 4, vocab)
    assert np.abs(kept.decode(more, 4) - fresh.decode(more, 4)).max() < TOL


def test_on_the_cpu_a_few_shared_tokens_are_restored_not_prefilled(
        runners: tuple[LlamaRunner, LlamaRunner]) -> None:
    """An agent's file resent with its first line changed shares only the system prompt with
    the state the last revision left: on the CPU, where those tokens' prefill costs more than
    the copy, the state is restored for them (a GPU's runner waits for MIN_GAIN)."""
    kept, fresh = runners
    assert kept.prompt_cache.min_gain == MIN_GAIN_CPU < MIN_GAIN
    vocab = min(kept.n_vocab, 50)
    system = _seq(30, 12, vocab)
    first, other = system + _seq(31, 100, vocab), _seq(32, 100, vocab)
    kept.switch_to(first)
    kept.sync(first)
    kept.switch_to(other)  # another request: first's state is kept
    kept.sync(other)
    assert kept.common_prefix(system) < MIN_GAIN_CPU
    revised = system + _seq(33, 80, vocab)
    assert kept.switch_to(revised) >= len(system)
    assert kept.prompt_cache.hits == 1
    logits = kept.sync(revised, 2).copy()
    assert kept.tokens == revised
    assert np.abs(logits - fresh.sync(revised, 2)).max() < TOL


def test_states_are_kept_only_where_the_budget_allows(pair: tuple[Path, Path]) -> None:
    with LlamaRunner(pair[0], ModelSettings(n_ctx=512, prompt_cache_mib=0)) as off:
        vocab = min(off.n_vocab, 50)
        off.sync(_seq(16, 150, vocab))
        assert off.switch_to(_seq(17, 150, vocab)) == 0
        assert len(off.prompt_cache) == 0


def test_a_chats_next_turn_copies_nothing(pair: tuple[Path, Path]) -> None:
    """A prompt that extends what the cache holds drops nothing: no state is saved."""
    with LlamaRunner(pair[0], ModelSettings(n_ctx=512)) as runner:
        vocab = min(runner.n_vocab, 50)
        turn = _seq(18, 150, vocab)
        runner.sync(turn)
        assert runner.switch_to(turn + _seq(19, 40, vocab)) == len(turn)
        assert len(runner.prompt_cache) == 0


# -- the engine ---------------------------------------------------------------------------------
def _request(tokens: list[int]) -> GenerationRequest:
    return GenerationRequest(prompt_tokens=tuple(tokens), max_tokens=24)


@pytest.mark.parametrize("precision", ["f32", "q4_k_m"])
def test_interleaved_requests_give_the_same_text_with_and_without_saved_states(
        quantized_pairs: dict[str, tuple[Path, Path]], precision: str) -> None:
    """Chat-like: a long first request, an unrelated one, then the first again with its answer
    and a follow-up. The third restores the first's state (both models) and writes what an
    engine that prefills everything writes."""
    target, draft = quantized_pairs[precision]
    texts = {}
    for mib in (1024, 0):
        with SpeculativeEngine.load(target, draft, ModelSettings(n_ctx=1024,
                                                                 prompt_cache_mib=mib)) as eng:
            vocab = min(eng.target.n_vocab, 50)
            first = _seq(21, 160, vocab)
            one = eng.generate(_request(first))
            eng.generate(_request(_seq(22, 100, vocab)))
            again = eng.generate(_request(first + list(one.tokens) + _seq(23, 8, vocab)))
            texts[mib] = (one.tokens, again.tokens)
            if mib:
                assert again.stats.prompt_cached_tokens >= len(first)
                assert eng.target.prompt_cache.hits == 1
            else:
                assert again.stats.prompt_cached_tokens < MIN_GAIN
    assert texts[1024] == texts[0]
