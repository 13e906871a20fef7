"""Stop conditions, cancellation, limits and the engine's bad-input errors."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from localspec.engine import (
    DraftSettings,
    Finished,
    GenerationRequest,
    ModelSettings,
    SamplingParams,
    SpeculativeEngine,
    TextChunk,
)
from localspec.errors import ContextOverflowError, IncompatiblePairError, LocalspecError
from localspec.models.tiny import TinyModelSpec, write_tiny_model

from .engine_helpers import PROMPTS, run


@pytest.fixture(scope="module")
def engine(target_gguf: Path, draft_gguf: Path) -> Iterator[SpeculativeEngine]:
    with SpeculativeEngine.load(target_gguf, draft_gguf, ModelSettings(n_ctx=512)) as eng:
        yield eng


def test_stop_string_cuts_text_and_never_leaks(engine: SpeculativeEngine) -> None:
    full = run(engine, PROMPTS[0], max_tokens=80, mode="none")
    # A stop string taken from the middle of the real output, spanning several tokens.
    stop = full.text[20:26]
    assert len(stop.strip()) > 0
    for mode in ("none", "model"):
        req = GenerationRequest(prompt_tokens=engine.tokenize(PROMPTS[0], chat=False),
                                max_tokens=80, stop=(stop,),
                                draft=DraftSettings(mode=mode))  # type: ignore[arg-type]
        chunks = list(engine.stream(req))
        done = chunks[-1]
        assert isinstance(done, Finished)
        assert done.finish_reason == "stop"
        expected = full.text[: full.text.index(stop)]
        assert done.text == expected
        streamed = "".join(c.text for c in chunks if isinstance(c, TextChunk))
        assert streamed == expected  # nothing of the stop string was ever streamed


def test_max_tokens_is_exact(engine: SpeculativeEngine) -> None:
    for k in (None, 5):
        res = run(engine, PROMPTS[2], max_tokens=17, k=k)
        assert res.finish_reason == "length"
        assert len(res.tokens) == 17 == res.stats.completion_tokens


def test_a_steps_first_draft_token_is_measured(engine: SpeculativeEngine) -> None:
    """The draft's first decode in a step also takes in what the last step added: auto plans
    with what that costs here, measured, not with the price of a later draft token."""
    engine._costs.draft_first = 0.0
    res = run(engine, PROMPTS[1], max_tokens=24, k=3)
    assert res.stats.draft_rounds >= 2
    assert 0 < engine._costs.draft_first <= res.stats.draft_seconds


def test_eos_stops_generation(tmp_path: Path) -> None:
    # Control tokens' output rows scaled up: EOS becomes a likely greedy choice.
    spec = TinyModelSpec(seed=4, eos_scale=3.0, n_layer=2)
    path = write_tiny_model(tmp_path / "eos.gguf", spec)
    with SpeculativeEngine.load(path, path, ModelSettings(n_ctx=256)) as eng:
        outcomes = [run(eng, p, max_tokens=200, k=3) for p in PROMPTS]
        stopped = [r for r in outcomes if r.finish_reason == "stop"]
        assert stopped, "no prompt reached EOS"
        for r in stopped:
            assert 2 not in r.tokens  # the EOS token itself is not part of the output
            assert len(r.tokens) < 200
            plain = run(eng, PROMPTS[outcomes.index(r)], max_tokens=200, mode="none")
            assert plain.tokens == r.tokens and plain.finish_reason == "stop"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_cancellation_between_steps_and_engine_stays_usable(pair: tuple[Path, Path],
                                                            sampled: bool) -> None:
    """On F32, Q8_0 and Q4_K_M: a cancelled generation stops between steps and leaves both KV
    caches consistent, so the next request is unaffected."""
    sp = SamplingParams(temperature=0.8, seed=5) if sampled else SamplingParams()
    with SpeculativeEngine.load(*pair, ModelSettings(n_ctx=512)) as engine:
        expected = run(engine, PROMPTS[3], max_tokens=60, k=3, sampling=sp)
        cancel = threading.Event()
        req = GenerationRequest(prompt_tokens=engine.tokenize(PROMPTS[1], chat=False),
                                max_tokens=400, sampling=sp, draft=DraftSettings(k=3))
        done = None
        for event in engine.stream(req, cancel):
            if isinstance(event, Finished):
                done = event
            else:
                cancel.set()  # cancel as soon as the first text arrives
        assert done is not None and done.finish_reason == "cancelled"
        assert 0 < len(done.tokens) < 400
        again = run(engine, PROMPTS[3], max_tokens=60, k=3, sampling=sp)
        assert again.tokens == expected.tokens


def test_context_overflow_and_empty_prompt(engine: SpeculativeEngine) -> None:
    long = tuple([5] * 600)
    with pytest.raises(ContextOverflowError, match="context holds 512"):
        engine.generate(GenerationRequest(prompt_tokens=long))
    with pytest.raises(LocalspecError, match="empty prompt"):
        engine.generate(GenerationRequest(prompt_tokens=()))
    # A request that would run past the context stops at the context, not with a crash.
    near = tuple(engine.tokenize(PROMPTS[0], chat=False)) + tuple([300] * 480)
    res = engine.generate(GenerationRequest(prompt_tokens=near, max_tokens=200))
    assert res.finish_reason == "length"
    assert len(near) + len(res.tokens) <= 512


def test_bad_settings_are_value_errors(engine: SpeculativeEngine) -> None:
    prompt = engine.tokenize("a", chat=False)
    for sp in (SamplingParams(temperature=-1), SamplingParams(top_p=0.0),
               SamplingParams(min_p=1.5), SamplingParams(top_k=-2)):
        with pytest.raises(ValueError):
            engine.generate(GenerationRequest(prompt_tokens=prompt, sampling=sp))
    with pytest.raises(ValueError, match="k must be"):
        engine.generate(GenerationRequest(prompt_tokens=prompt, draft=DraftSettings(k=99)))
    # What llama.cpp would take wrongly: an id past the vocabulary fails its decode as if
    # memory ran out; one string as stop would stop at each of its characters.
    n_vocab = engine.target.n_vocab
    for bad in (n_vocab, -1):
        with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
            engine.generate(GenerationRequest(prompt_tokens=(*prompt, bad)))
    with pytest.raises(ValueError, match="stop must be a sequence of strings"):
        engine.generate(GenerationRequest(prompt_tokens=prompt, stop="\n\n"))  # type: ignore[arg-type]
    assert engine.generate(GenerationRequest(prompt_tokens=prompt, max_tokens=3)).tokens


def test_draft_mode_model_needs_a_draft(target_gguf: Path) -> None:
    with SpeculativeEngine.load(target_gguf, None, ModelSettings(n_ctx=256)) as eng:
        prompt = eng.tokenize("a", chat=False)
        with pytest.raises(LocalspecError, match="needs a draft model"):
            eng.generate(GenerationRequest(prompt_tokens=prompt, draft=DraftSettings("model")))
        res = eng.generate(GenerationRequest(prompt_tokens=prompt, max_tokens=10,
                                             draft=DraftSettings("lookup")))
        assert len(res.tokens) == 10


def test_incompatible_pair_is_refused_before_loading(target_gguf: Path,
                                                     other_vocab_gguf: Path) -> None:
    with pytest.raises(IncompatiblePairError, match="token 259 differs"):
        SpeculativeEngine.load(target_gguf, other_vocab_gguf)


def test_chat_template_is_used(engine: SpeculativeEngine) -> None:
    text = engine.chat_prompt([{"role": "system", "content": "be brief"},
                               {"role": "user", "content": "hello"}])
    assert text == "<|system|>be brief\n<|user|>hello\n<|assistant|>"
    tokens = engine.tokenize(text, chat=True)
    assert tokens[0] == 1 and tokens[1] != 1  # one BOS, not two
