"""Answers held to a JSON Schema (``response_format``): on real tiny llama.cpp models, whose free
text is nothing like JSON, every answer is JSON that matches the schema, and the same text
whether or not (and however) it was drafted; through the server with the ``openai`` client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from localspec.engine import DraftSettings, ModelSettings, SamplingParams, SpeculativeEngine
from localspec.engine.decoder import GenerationRequest
from localspec.engine.structure import OutputFormat, SchemaError, vocabulary_tokenizer
from localspec.server import ServerConfig
from localspec.server.app import create_app
from localspec.server.running import BackgroundServer

from .conftest import run_cli

# Finite: no whitespace or free strings, so even a random model's answer ends.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]},
                   "n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "ok": {"type": "boolean"}},
    "required": ["color", "n", "ok"], "additionalProperties": False,
    "x-guidance": {"whitespace_pattern": ""},
}
FORMAT = OutputFormat(json.dumps(SCHEMA))
DRAFTING = {"none": DraftSettings(mode="none"), "auto": DraftSettings(),
            "k4": DraftSettings(k=4), "lookup": DraftSettings(mode="lookup"),
            "lookup-k4": DraftSettings(mode="lookup", k=4)}


def _matches(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"color", "n", "ok"} and value["color"] in ("red", "green", "blue")
            and isinstance(value["n"], int) and 0 <= value["n"] <= 999
            and isinstance(value["ok"], bool))


@pytest.fixture(scope="module")
def engines(quantized_pairs: dict[str, tuple[Path, Path]]
            ) -> Iterator[dict[str, SpeculativeEngine]]:
    loaded = {p: SpeculativeEngine.load(t, d, ModelSettings(n_ctx=512))
              for p, (t, d) in quantized_pairs.items()}
    yield loaded
    for eng in loaded.values():
        eng.close()


def _answer(eng: SpeculativeEngine, draft: DraftSettings, output: OutputFormat | None = FORMAT,
            sampling: SamplingParams = SamplingParams(), prompt: str = "the answer is") -> Any:
    return eng.generate(GenerationRequest(prompt_tokens=eng.tokenize(prompt, chat=False),
                                          max_tokens=60, sampling=sampling, draft=draft,
                                          output=output))


def test_free_text_is_not_json_so_the_schema_is_what_makes_it(
        engines: dict[str, SpeculativeEngine]) -> None:
    free = _answer(engines["f32"], DRAFTING["none"], output=None).text
    with pytest.raises(ValueError):
        json.loads(free)


@pytest.mark.parametrize("precision", ["f32", "q8_0", "q4_k_m"])
def test_greedy_answers_match_the_schema_and_not_drafting_alike(
        engines: dict[str, SpeculativeEngine], precision: str) -> None:
    eng = engines[precision]
    drafted = accepted = 0
    # The last prompt holds such an answer for prompt lookup to copy from.
    for prompt in ("the answer is", "a b c d", 'say {"color":"blue","n":12,"ok":false} again'):
        texts = {name: _answer(eng, ds, prompt=prompt) for name, ds in DRAFTING.items()}
        plain = texts["none"]
        assert plain.finish_reason == "stop" and _matches(plain.text), plain.text
        assert {n: r.text for n, r in texts.items()} == {n: plain.text for n in texts}
        for name in ("k4", "lookup-k4"):
            drafted += texts[name].stats.drafted
            accepted += texts[name].stats.accepted
    # Unmasked drafts were verified, some of their tokens accepted and some turned down.
    assert 0 < accepted < drafted


@pytest.mark.parametrize("precision", ["f32", "q4_k_m"])
def test_seeded_sampling_gives_the_same_schema_bound_text_with_or_without_drafting(
        engines: dict[str, SpeculativeEngine], precision: str) -> None:
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    texts = {name: _answer(engines[precision], ds, sampling=sampling).text
             for name, ds in DRAFTING.items()}
    assert _matches(texts["none"]) and set(texts.values()) == {texts["none"]}
    rejection = _answer(engines[precision], DraftSettings(k=3, rule="rejection"),
                        sampling=sampling)
    assert _matches(rejection.text)


@pytest.mark.parametrize("prompt", ["the answer is", "a b c d"])
def test_json_mode_writes_an_object_or_the_start_of_one(
        engines: dict[str, SpeculativeEngine], prompt: str) -> None:
    """OpenAI's JSON mode (any object, whitespace as a schema allows by default): an answer
    cut by max_tokens is still, token for token, the beginning of one."""
    from llguidance import LLMatcher

    eng = engines["f32"]
    done = _answer(eng, DRAFTING["auto"], output=OutputFormat(), prompt=prompt)
    if done.finish_reason == "stop":
        assert isinstance(json.loads(done.text), dict)
    else:
        assert done.finish_reason == "length" and done.text.lstrip().startswith("{")
    fresh = LLMatcher(vocabulary_tokenizer(eng.target.vocab), OutputFormat().grammar())
    assert fresh.validate_tokens(list(done.tokens)) == len(done.tokens)
    assert done.text != _answer(eng, DRAFTING["auto"], output=None, prompt=prompt).text


@pytest.mark.parametrize(("schema", "says"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}', "nowhere"),
])
def test_a_schema_that_cannot_hold_an_answer_says_why(schema: str, says: str) -> None:
    with pytest.raises(SchemaError, match=says):
        OutputFormat(schema).check()


# -- through the server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(engines: dict[str, SpeculativeEngine]) -> Iterator[openai.OpenAI]:
    srv = BackgroundServer(create_app(engines["q4_k_m"], ServerConfig(model_id="tiny"))).start()
    try:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                            timeout=60)
    finally:
        srv.stop()


ASK: Any = [{"role": "user", "content": "the answer is"}]
RESPONSE_FORMAT: Any = {"type": "json_schema",
                        "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


def test_response_format_holds_the_answer_to_the_schema(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60,
                                           temperature=0, response_format=RESPONSE_FORMAT)
    text = whole.choices[0].message.content or ""
    assert whole.choices[0].finish_reason == "stop" and _matches(text)
    parts = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60,
                                           temperature=0, response_format=RESPONSE_FORMAT,
                                           stream=True)
    assert "".join(c.delta.content or "" for p in parts for c in p.choices) == text
    free = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60,
                                          temperature=0)
    assert free.choices[0].message.content != text
    # JSON mode, and the completions endpoint (llama-server takes it there too).
    mode = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60,
                                          temperature=0, response_format={"type": "json_object"})
    content = mode.choices[0].message.content or ""
    assert content.lstrip().startswith("{")
    if mode.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    raw = client.completions.create(model="tiny", prompt="the answer is", max_tokens=60,
                                    temperature=0, extra_body={"response_format": RESPONSE_FORMAT})
    assert raw.choices[0].finish_reason == "stop" and _matches(raw.choices[0].text)


@pytest.mark.parametrize(("fmt", "param", "code"), [
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}},
     "response_format.json_schema.schema", "invalid_value"),
    ({"type": "json_schema", "json_schema": {"name": "a"}},
     "response_format.json_schema.schema", "invalid_value"),
    ({"type": "json_schema", "json_schema": "a"}, "response_format.json_schema", "invalid_value"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}},
     "response_format.json_schema.schema", "invalid_value"),
    ({"type": "xml"}, "response_format", "invalid_value"),
])
def test_a_bad_response_format_is_a_400_naming_it(client: openai.OpenAI, fmt: Any, param: str,
                                                 code: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt)
    body: Any = info.value.body
    assert (body["param"], body["code"]) == (param, code)


def test_a_schema_and_tools_together_are_refused(client: openai.OpenAI) -> None:
    tool: Any = {"type": "function", "function": {"name": "f"}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=ASK, tools=[tool],
                                       response_format={"type": "json_object"})
    body: Any = info.value.body
    assert (body["param"], body["code"]) == ("response_format", "unsupported_parameter")


# -- run --schema ------------------------------------------------------------------------------
def test_run_holds_its_answer_to_a_schema_in_process_and_through_a_server(
        quantized_pairs: dict[str, tuple[Path, Path]], client: openai.OpenAI,
        tmp_path: Path) -> None:
    target, draft = quantized_pairs["q4_k_m"]
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    here = run_cli("run", "--target", str(target), "--draft", str(draft), "--schema",
                   str(schema_file), "-n", "60", "--temperature", "0", "--json", "the answer is")
    assert here.returncode == 0, here.stderr
    text = json.loads(here.stdout)["text"]
    assert _matches(text)
    url = str(client.base_url).removesuffix("/v1/")  # the same tiny Q4_K_M target, served
    for raw in ((), ("--raw",)):  # a chat, and a plain completion
        served = run_cli("run", "--url", url, "--schema", json.dumps(SCHEMA), "-n", "60",
                         "--temperature", "0", "--json", *raw, "the answer is")
        assert served.returncode == 0, served.stderr
        assert _matches(json.loads(served.stdout)["text"])
    anything = run_cli("run", "--target", str(target), "--schema", "object", "-n", "30",
                       "--json", "the answer is")
    assert anything.returncode == 0, anything.stderr
    assert json.loads(anything.stdout)["text"].lstrip().startswith("{")


@pytest.mark.parametrize(("schema", "says"), [
    ("/no/such/schema.json", "cannot read /no/such/schema.json"),
    ('{"type": "object", "properties": {"a": {"$ref": "#/x"}}}', "--schema: "),
    ("{oops", "not JSON"),
])
def test_run_with_a_bad_schema_is_one_line_and_a_non_zero_exit(
        target_gguf: Path, schema: str, says: str) -> None:
    proc = run_cli("run", "--target", str(target_gguf), "--schema", schema, "hi")
    assert proc.returncode != 0 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert says in line and "Traceback" not in line


def test_the_draft_model_drafts_within_the_schema(
        quantized_pairs: dict[str, tuple[Path, Path]]) -> None:
    """The target as its own draft: masked alike, every drafted token is the target's choice
    (unmasked, its free guesses would be turned down wherever the schema forbids them)."""
    target, _ = quantized_pairs["f32"]
    with SpeculativeEngine.load(target, target, ModelSettings(n_ctx=512)) as eng:
        for prompt in ("the answer is", "a b c d"):
            done = _answer(eng, DraftSettings(k=4), prompt=prompt)
            assert _matches(done.text)
            # (a near-tie stop leaves at most the rest of its 4 unjudged)
            s = done.stats
            assert s.drafted > 0 and s.accepted + 4 * s.tie_stops >= s.drafted


def test_a_mask_forbids_the_tokens_past_the_vocabulary_it_was_compiled_for(
        engines: dict[str, SpeculativeEngine]) -> None:
    """A draft's vocabulary may hold a few more tokens than the target's (the pair check
    allows it): the guide it drafts under forbids them."""
    import numpy as np

    from localspec.engine.structure import OutputGuide

    eng = engines["f32"]
    n = eng.target.n_vocab
    guide = OutputGuide.start(vocabulary_tokenizer(eng.target.vocab), FORMAT)
    masked = guide.mask(np.zeros(n + 100, dtype=np.float32))
    assert masked.shape == (n + 100,) and np.isneginf(masked[n:]).all()
    assert np.isfinite(masked[:n]).sum() >= 1  # "{" at least
