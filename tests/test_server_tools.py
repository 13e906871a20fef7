"""Tool calls through the OpenAI-compatible server: the tools shown to the model by its chat
template, and its calls read back out of its text, whole or streamed, with the ``openai``
client. The model is a real tiny llama.cpp model whose answer is scripted in its weights (a
sentence, then a call in the ``<tool_call>`` format Qwen and Hermes templates ask for; or a
call in the format of Llama 3.x's or Mistral's templates, under a template of that shape)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest

from localspec.engine import DraftSettings, GenerationRequest, ModelSettings, SpeculativeEngine
from localspec.engine.structure import vocabulary_tokenizer
from localspec.models.tiny import _WORDS, TinyModelSpec, write_tiny_model
from localspec.server import ServerConfig
from localspec.server.app import create_app
from localspec.server.openai_schema import ApiError, parse_request
from localspec.server.running import BackgroundServer
from localspec.server.tool_calls import (
    CLOSE,
    OPEN,
    ToolCallStream,
    ToolError,
    ToolFormat,
    ToolRequest,
    call_opener,
    call_tags,
    forced_calls,
    held_calls,
    split_tool_calls,
    tool_format,
)

SCRIPT = ("Let", "me", "check.", "<tool_call>", '{"name":', '"get_weather",', '"arguments":',
          '{"city":', '"Paris"}}', "</tool_call>")
# A template that shows the tools and asks for calls between <tool_call> tags, as Qwen2.5's does.
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>You may call: {% for t in tools %}{{ t | tojson }}{% endfor %}. "
    "Answer a call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]
MODEL = "scripted"
# Qwen2.5-Coder's way under its own tools template (1.5B Q4_K_M, greedy): no tags, a fenced call.
FENCED = ("```json", '{"name":', '"get_weather",', '"arguments":', '{"city":', '"Paris"}}', "```")


# Templates in the shape of Llama 3.1's (the tools in the user's turn, a call answered and
# rendered back as {"name": ..., "parameters": ...}, its result in an "ipython" turn) and of
# Mistral's (a [TOOL_CALLS] array, ids of 9 letters or digits or the template refuses them).
LLAMA_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}"
    "<|end_header_id|>\n\n{% if tools and m.role == 'user' %}Answer a call as {\"name\": "
    "function name, \"parameters\": its arguments}. {% for t in tools %}{{ t | tojson }}"
    "{% endfor %}\n{% endif %}{% for c in m.tool_calls or [] %}{\"name\": \""
    "{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}"
    "{{ m.content or '' }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}"
    "{% if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric "
    "strings with length 9!') }}{% endif %}{{ c.function | tojson }}{% endfor %}]</s>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS] {{ m.content }} {{ m.tool_call_id }}"
    "[/TOOL_RESULTS]{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"
)
# Their calls as the models write them ([TOOL_CALLS] is a control token, left out of the text).
LLAMA_CALL = ('{"name":', '"get_weather",', '"parameters":', '{"city":', '"Paris"}}')
MISTRAL_CALL = ('[{"name":', '"get_weather",', '"arguments":', '{"city":', '"Paris"}}]')


def _scripted(folder: Path, script: tuple[str, ...], template: str = TOOLS_TEMPLATE,
              added: tuple[str, ...] = (), control: bool = False) -> Path:
    words = tuple(_WORDS) + tuple(w for w in script if w not in _WORDS and w not in added)
    spec = TinyModelSpec(seed=3, words=words, script=script, added_tokens=added,
                         added_control=control,
                         metadata=(("tokenizer.chat_template", template),))
    return write_tiny_model(folder / "scripted.gguf", spec)


@contextmanager
def _serving(model: Path, n_ctx: int = 1024) -> Iterator[openai.OpenAI]:
    with SpeculativeEngine.load(model, None, ModelSettings(n_ctx=n_ctx)) as eng:
        srv = BackgroundServer(create_app(eng, ServerConfig(model_id=MODEL))).start()
        try:
            yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                                timeout=60)
        finally:
            srv.stop()


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with _serving(_scripted(tmp_path_factory.mktemp("scripted"), SCRIPT)) as api:
        yield api


@pytest.fixture(scope="module")
def fenced_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with _serving(_scripted(tmp_path_factory.mktemp("fenced"), FENCED)) as api:
        yield api


def _ask(client: openai.OpenAI, **kw: Any) -> Any:
    """A completion (or, with stream=True, its chunks) for ASK, greedy."""
    return client.chat.completions.create(model=MODEL, messages=ASK,  # type: ignore[arg-type]
                                          max_tokens=40, temperature=0, **kw)


# -- through the server ------------------------------------------------------------------------
def test_a_call_in_the_answer_is_returned_as_tool_calls(client: openai.OpenAI) -> None:
    choice = _ask(client, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_written_without_tags_as_the_whole_answer_is_a_call(
        fenced_client: openai.OpenAI, stream: bool) -> None:
    if stream:
        parts = list(_ask(fenced_client, tools=[WEATHER], stream=True))
        content = "".join(c.delta.content or "" for p in parts for c in p.choices)
        calls = [t for p in parts for c in p.choices for t in c.delta.tool_calls or []]
        reason = next(c.finish_reason for p in parts for c in p.choices if c.finish_reason)
    else:
        choice = _ask(fenced_client, tools=[WEATHER]).choices[0]
        content, calls, reason = choice.message.content or "", choice.message.tool_calls or [], \
            choice.finish_reason
    assert content == "" and reason == "tool_calls"
    (call,) = calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_an_answer_that_only_called_is_sent_back_as_the_sdk_dumps_it(
        fenced_client: openai.OpenAI) -> None:
    """content null, refusal and the rest null: served, with the call rendered back."""
    answer = _ask(fenced_client, tools=[WEATHER]).choices[0].message
    dumped = answer.model_dump()
    assert dumped["content"] is None and dumped["refusal"] is None
    again = fenced_client.chat.completions.create(
        model=MODEL, messages=[*ASK, dumped, {"role": "tool", "content": "clear",  # type: ignore[list-item]
                                              "tool_call_id": answer.tool_calls[0].id}],
        tools=[WEATHER], max_tokens=40, temperature=0)  # type: ignore[list-item]
    assert again.choices[0].finish_reason == "tool_calls"


def test_a_fenced_answer_naming_no_offered_tool_is_text(fenced_client: openai.OpenAI) -> None:
    other = {"type": "function", "function": {"name": "get_time"}}
    choice = _ask(fenced_client, tools=[other]).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert '"get_weather"' in (choice.message.content or "")


def test_without_tools_the_same_answer_is_text(client: openai.OpenAI) -> None:
    """Only a request that offered tools has its answer read for calls."""
    choice = _ask(client).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert "<tool_call>" in (choice.message.content or "")
    none = _ask(client, tools=[WEATHER], tool_choice="none").choices[0]
    assert none.finish_reason == "stop" and "<tool_call>" in (none.message.content or "")


def test_the_tools_reach_the_model_through_its_template(client: openai.OpenAI) -> None:
    plain = _ask(client).usage
    offered = _ask(client, tools=[WEATHER]).usage
    assert plain is not None and offered is not None
    assert offered.prompt_tokens > plain.prompt_tokens + 20  # the tool's JSON was rendered


def test_a_streamed_call_is_held_back_from_the_content_and_sent_whole(
        client: openai.OpenAI) -> None:
    content: list[str] = []
    calls: list[Any] = []
    reasons: list[str | None] = []
    for part in _ask(client, tools=[WEATHER], stream=True):
        for choice in part.choices:
            content.append(choice.delta.content or "")
            calls += choice.delta.tool_calls or []
            reasons.append(choice.finish_reason)
    assert "".join(content).strip() == "Let me check."
    assert not any("<tool" in c for c in content)
    (call,) = calls
    assert call.index == 0 and call.function is not None
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments or "") == {"city": "Paris"}
    assert [r for r in reasons if r] == ["tool_calls"]


def test_a_conversation_goes_on_after_a_call_and_its_result(client: openai.OpenAI) -> None:
    """The answer sent back as the SDK dumps it (content null, the call's arguments a JSON
    string) and the tool's result: the call is rendered into the next prompt."""
    answer = _ask(client, tools=[WEATHER]).choices[0].message
    result = {"role": "tool", "tool_call_id": answer.tool_calls[0].id,
              "content": '{"sky": "clear"}'}

    def follow_up(sent_answer: dict[str, Any]) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=[*ASK, sent_answer, result],  # type: ignore[list-item]
            tools=[WEATHER], max_tokens=40, temperature=0)  # type: ignore[list-item]

    again = follow_up(answer.model_dump(exclude_none=True))
    assert again.choices[0].finish_reason == "tool_calls"  # the script again: it was served
    bare = follow_up({"role": "assistant", "content": ""})
    # The call's name and arguments are in the prompt: the bare turn lacks only them.
    assert again.usage.prompt_tokens > bare.usage.prompt_tokens + 20


# A model that answers in words and never calls, and tools whose arguments are finite (an enum),
# so that even a random model's forced call ends within max_tokens: with one call allowed
# (parallel_tool_calls false), since such a model would go on calling (the grammar's parallel
# calls are checked below, without a model), and room for the blanks it writes between tokens.
PROSE = ("It", "is", "sunny", "today.")
CITY: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}}
TIME: dict[str, Any] = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}}
FORCED_MAX_TOKENS = 600


def _answer(api: openai.OpenAI, stream: bool, **kw: Any) -> tuple[str, list[Any], str]:
    """The content, the calls and the finish reason of an answer to ASK, greedy."""
    kw |= {"model": MODEL, "messages": ASK, "max_tokens": FORCED_MAX_TOKENS, "temperature": 0,
           "parallel_tool_calls": False}
    if not stream:
        choice = api.chat.completions.create(**kw).choices[0]
        return choice.message.content or "", list(choice.message.tool_calls or []), \
            choice.finish_reason
    parts = list(api.chat.completions.create(stream=True, **kw))
    return ("".join(c.delta.content or "" for p in parts for c in p.choices),
            _merged([t for p in parts for c in p.choices for t in c.delta.tool_calls or []]),
            next(c.finish_reason for p in parts for c in p.choices if c.finish_reason))


def _merged(deltas: list[Any]) -> list[Any]:
    """A stream's ``delta.tool_calls`` put together by index, as a client does: a call's first
    delta has its id and name, the others more of its arguments."""
    calls: dict[int, Any] = {}
    for delta in deltas:
        if delta.index not in calls:
            calls[delta.index] = delta.model_copy(deep=True)
        else:
            fn = calls[delta.index].function
            fn.arguments = (fn.arguments or "") + (delta.function.arguments or "")
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("template", [TOOLS_TEMPLATE, LLAMA_TEMPLATE, MISTRAL_TEMPLATE],
                         ids=["tagged", "llama3", "mistral"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_is_made_by_a_model_that_would_answer_in_words(
        tmp_path: Path, template: str, stream: bool) -> None:
    with _serving(_scripted(tmp_path, PROSE, template), n_ctx=2048) as api:
        content, calls, reason = _answer(api, stream, tools=[CITY, TIME])
        assert (content.strip(), calls, reason) == ("It is sunny today.", [], "stop")
        content, calls, reason = _answer(api, stream, tools=[CITY, TIME],
                                         tool_choice="required")
        assert reason == "tool_calls" and content == ""
        (call,) = calls
        assert (call.function.name, json.loads(call.function.arguments)) in [
            ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"}),
            ("get_time", {"zone": "UTC"}), ("get_time", {"zone": "CET"})]


def test_a_named_function_is_the_one_called(tmp_path: Path) -> None:
    with _serving(_scripted(tmp_path, PROSE), n_ctx=2048) as api:
        for name, key in (("get_time", "zone"), ("get_weather", "city")):
            _, calls, reason = _answer(api, False, tools=[CITY, TIME],
                                       tool_choice={"type": "function", "function": {"name": name}})
            (call,) = calls
            assert reason == "tool_calls" and call.function.name == name
            assert set(json.loads(call.function.arguments)) == {key}


# Qwen's and Hermes' vocabularies hold the tags as tokens of their own. A tiny model of that kind,
# scripted to call in them (the second tool, its second zone: not the grammar's first choices).
TAG_SCRIPT = (OPEN, '{"name":', '"get_time",', '"arguments":', '{"zone":', '"CET"}}', CLOSE)


def _tag_token_model(folder: Path, control: bool = False) -> Path:
    return _scripted(folder, TAG_SCRIPT, added=(OPEN, CLOSE), control=control)


def test_a_forced_call_is_written_in_the_vocabularys_own_tag_tokens(tmp_path: Path) -> None:
    """The model's own answer is a call in its tag tokens; forced, it writes that answer, not
    the tags spelled out or the untagged form."""
    with SpeculativeEngine.load(_tag_token_model(tmp_path), None,
                                ModelSettings(n_ctx=512)) as eng:
        tags = call_tags(eng.target.special_token)
        assert tags is not None
        assert [eng.target.tokenize(t, add_bos=False) for t in (OPEN, CLOSE)] == \
            [[tags[0]], [tags[1]]]

        def answer(output: Any) -> str:
            return eng.generate(GenerationRequest(
                prompt_tokens=eng.tokenize("the", chat=False), max_tokens=40,
                draft=DraftSettings(mode="none"), output=output)).text

        own = answer(None)
        assert own.lstrip().startswith(OPEN) and own.rstrip().endswith(CLOSE)
        forced = forced_calls(ToolRequest((CITY, TIME), ("get_weather", "get_time"), False),
                              "tagged", tags)
        assert answer(forced) == own


def test_tags_spelled_in_plain_pieces_are_not_tag_tokens(target_gguf: Path) -> None:
    with SpeculativeEngine.load(target_gguf, None, ModelSettings(n_ctx=256)) as eng:
        assert call_tags(eng.target.special_token) is None
        assert eng.target.special_token("</s>") is None  # a control token shows as nothing


def test_a_forced_call_is_not_written_in_tag_tokens_that_show_as_nothing(
        tmp_path: Path) -> None:
    """Where the tags are control tokens, whose text an answer shows as nothing, a forced
    call spells them out: written in the tokens it would lose its tags."""
    with SpeculativeEngine.load(_tag_token_model(tmp_path, control=True), None,
                                ModelSettings(n_ctx=512)) as eng:
        # Each tag is one token of the vocabulary's, a control token.
        assert all(len(eng.target.tokenize(t, add_bos=False)) == 1 for t in (OPEN, CLOSE))
        tags = call_tags(eng.target.special_token)
        assert tags is None
        forced = forced_calls(ToolRequest((CITY, TIME), ("get_weather", "get_time"), False),
                              "tagged", tags)
        text = eng.generate(GenerationRequest(
            prompt_tokens=eng.tokenize("the", chat=False), max_tokens=60,
            draft=DraftSettings(mode="none"), output=forced)).text
        assert text.lstrip().startswith(OPEN) and text.rstrip().endswith(CLOSE)


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_in_tag_tokens_comes_back_as_the_model_made_it(
        tmp_path: Path, stream: bool) -> None:
    with _serving(_tag_token_model(tmp_path), n_ctx=2048) as api:
        content, calls, reason = _answer(api, stream, tools=[CITY, TIME], tool_choice="required")
        (call,) = calls
        assert (content, reason) == ("", "tool_calls")
        assert (call.function.name, json.loads(call.function.arguments)) == \
            ("get_time", {"zone": "CET"})


def test_a_held_call_is_streamed_in_pieces_as_the_model_writes_it(tmp_path: Path) -> None:
    """Where a grammar holds the calls, a call that began is one: its id and name come first,
    then its arguments as they are written, before the answer ends."""
    with _serving(_tag_token_model(tmp_path), n_ctx=2048) as api:
        parts = list(api.chat.completions.create(
            model=MODEL, messages=ASK, tools=[CITY, TIME], tool_choice="required",  # type: ignore[arg-type, list-item]
            max_tokens=FORCED_MAX_TOKENS, temperature=0, stream=True))
    carrying = [i for i, p in enumerate(parts) for c in p.choices if c.delta.tool_calls]
    deltas = [t for p in parts for c in p.choices for t in c.delta.tool_calls or []]
    assert len(carrying) == len(deltas) >= 2  # the arguments in pieces, one delta a chunk
    first, *rest = deltas
    assert first.id and first.function.name == "get_time"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"zone": "CET"}
    finish = next(i for i, p in enumerate(parts) for c in p.choices if c.finish_reason)
    assert max(carrying) < finish and parts[finish].choices[0].finish_reason == "tool_calls"


def test_a_held_call_cut_short_is_streamed_as_far_as_it_went_and_finishes_for_length(
        tmp_path: Path) -> None:
    def stream(max_tokens: int) -> list[Any]:
        return list(api.chat.completions.create(
            model=MODEL, messages=ASK, tools=[CITY, TIME], tool_choice="required",  # type: ignore[arg-type, list-item]
            max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}))
    with _serving(_tag_token_model(tmp_path), n_ctx=2048) as api:
        whole = stream(FORCED_MAX_TOKENS)[-1].usage.completion_tokens
        parts = stream(whole - 2)  # the arguments' end cut off
    deltas = [t for p in parts for c in p.choices for t in c.delta.tool_calls or []]
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert [d.function.name for d in deltas if d.id] == ["get_time"]
    assert arguments == '{"zone":'  # the script's token before its last two
    assert "".join(c.delta.content or "" for p in parts for c in p.choices) == ""
    assert [c.finish_reason for p in parts for c in p.choices if c.finish_reason] == ["length"]


def test_tools_whose_parameters_cannot_hold_a_call_are_400_naming_them(
        client: openai.OpenAI) -> None:
    broken = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "("}}}}}
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, tools=[WEATHER, broken], tool_choice="required")
    assert info.value.body["param"] == "tools[1].function.parameters"  # type: ignore[index]
    # Not forced, the same tools are only shown: the model's answer is read as ever.
    assert _ask(client, tools=[WEATHER, broken]).choices[0].finish_reason == "tool_calls"
    # Unless one is strict: then any call is held, so the broken one is named.
    strict = {"type": "function", "function": {**broken["function"], "strict": True}}
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, tools=[WEATHER, strict])
    assert info.value.body["param"] == "tools[1].function.parameters"  # type: ignore[index]


@pytest.mark.parametrize("ask", [
    {"messages": ASK, "tools": [WEATHER]},
    # A tool turn, with no tools offered: such a template would not render it either.
    {"messages": [*ASK, {"role": "tool", "content": "clear", "tool_call_id": "call_1"}]},
], ids=["tools", "tool-turn"])
def test_a_model_whose_template_takes_no_tools_refuses_them(target_gguf: Path,
                                                           ask: dict[str, Any]) -> None:
    with SpeculativeEngine.load(target_gguf, None, ModelSettings(n_ctx=256)) as eng:
        srv = BackgroundServer(create_app(eng, ServerConfig(model_id="tiny"))).start()
        try:
            api = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.BadRequestError) as info:
                api.chat.completions.create(model="tiny", **ask)
        finally:
            srv.stop()
    assert info.value.body["param"] == "tools"  # type: ignore[index]
    assert "does not take tools" in info.value.body["message"]  # type: ignore[index]


@pytest.mark.parametrize(("template", "script"), [(LLAMA_TEMPLATE, LLAMA_CALL),
                                                  (MISTRAL_TEMPLATE, MISTRAL_CALL)],
                         ids=["llama3", "mistral"])
@pytest.mark.parametrize("stream", [False, True])
def test_calls_in_the_format_the_template_asks_for_are_returned_and_rendered_back(
        tmp_path: Path, template: str, script: tuple[str, ...], stream: bool) -> None:
    with _serving(_scripted(tmp_path, script, template)) as api:
        if stream:
            parts = list(_ask(api, tools=[WEATHER], stream=True))
            content = "".join(c.delta.content or "" for p in parts for c in p.choices)
            calls = [t for p in parts for c in p.choices for t in c.delta.tool_calls or []]
            assert content == ""
        else:
            answer = _ask(api, tools=[WEATHER]).choices[0]
            assert answer.finish_reason == "tool_calls" and answer.message.content is None
            calls = answer.message.tool_calls or []
        (call,) = calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        # The call and its result go back in; Mistral's template takes only 9-letter ids.
        again = api.chat.completions.create(
            model=MODEL, tools=[WEATHER], max_tokens=40, temperature=0,  # type: ignore[list-item]
            messages=[*ASK, {"role": "assistant", "content": None,  # type: ignore[list-item]
                             "tool_calls": [{"id": call.id, "type": "function",
                                             "function": {"name": "get_weather",
                                                          "arguments": call.function.arguments}}]},
                      {"role": "tool", "tool_call_id": call.id, "content": "clear"}])
        assert again.choices[0].finish_reason == "tool_calls"
        assert again.usage is not None and again.usage.prompt_tokens > 0


# -- the request -------------------------------------------------------------------------------
CFG = ServerConfig(model_id=MODEL)


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"tools": {"type": "function"}}, "tools", "invalid_value"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name",
     "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters", "invalid_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice.function.name", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "invalid_value"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "invalid_value"),
    ({"messages": [{"role": "assistant", "content": None,
                    "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]},
     "messages[0].tool_call_id", "unsupported_parameter"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 7}]},
     "messages[0].tool_call_id", "invalid_value"),
    # Nesting past what Python's JSON parser takes: a 400, not a 500.
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "[" * 100_000}}]}]},
     "messages[0].tool_calls[0].function.arguments", "invalid_value"),
])
def test_bad_tools_and_tool_turns_are_400_naming_them(fields: dict, param: str,
                                                      code: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_request({"messages": ASK, **fields}, "chat", CFG)
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)


def test_tool_turns_reach_the_template_as_it_takes_them() -> None:
    """An answer's calls with their arguments as objects (templates print them; clients send
    OpenAI's JSON string), a tool's result with the call it answers; "none" shows no tools."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    parsed = parse_request({"messages": [*ASK, {"role": "assistant", "content": None,
                                                "tool_calls": [call]},
                                         {"role": "tool", "tool_call_id": "call_1",
                                          "content": "clear"}],
                            "tools": [WEATHER]}, "chat", CFG)
    assert parsed.tools == (WEATHER,)
    answer, result = (parsed.messages or ())[1:]
    assert answer == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert result == {"role": "tool", "content": "clear", "tool_call_id": "call_1"}
    assert parse_request({"messages": ASK, "tools": [WEATHER], "tool_choice": "none"},
                         "chat", CFG).tools == ()


def test_the_template_names_the_call_format() -> None:
    assert tool_format(TOOLS_TEMPLATE, MODEL) == "tagged"
    assert tool_format(LLAMA_TEMPLATE, MODEL) == "json"
    assert tool_format(MISTRAL_TEMPLATE, MODEL) == "mistral"
    # A template that shows tools but asks for some other format: refused, naming the three.
    with pytest.raises(ToolError, match=r"format localspec does not read .*Qwen.*Llama.*Mistral"):
        tool_format("{{ tools }} answer as <function=name>{...}</function>", MODEL)
    # Llama 3's headers, Functionary's format: its schema has parameters, but not as a call's key.
    with pytest.raises(ToolError, match="does not read"):
        tool_format("<|start_header_id|>{{ tools }} {% set parameters = f.parameters %}"
                    "<function=", MODEL)


# -- what a forced call may be ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_vocab(target_gguf: Path) -> Iterator[Any]:
    """The tiny target's vocabulary as llguidance sees it (it tokenizes through the loaded
    model, so the model stays loaded while it is used)."""
    with SpeculativeEngine.load(target_gguf, None, ModelSettings(n_ctx=256)) as eng:
        yield vocabulary_tokenizer(eng.target.vocab)


def _allowed(vocab: Any, out: Any, text: str) -> bool:
    """Whether ``text`` is a whole answer the grammar of ``out`` allows."""
    from llguidance import LLMatcher

    matcher = LLMatcher(vocab, out.grammar(), log_level=0)
    tokens = vocab.tokenize_str(text)
    return matcher.validate_tokens(tokens) == len(tokens) and \
        matcher.consume_tokens(tokens) and matcher.is_accepting()


W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get_time", "arguments": {"zone": "CET"}}'


@pytest.mark.parametrize(("fmt", "parallel", "text", "calls"), [
    ("tagged", True, W, ["get_weather"]),
    ("tagged", True, f"<tool_call>\n{W}\n</tool_call>", ["get_weather"]),
    ("tagged", True, f"<tool_call>{W}</tool_call>\n<tool_call>{T}</tool_call>",
     ["get_weather", "get_time"]),
    ("tagged", True, f"```json\n{W}\n```", ["get_weather"]),
    ("tagged", True, f"{W}; {T}", ["get_weather", "get_time"]),
    ("tagged", False, f"<tool_call>{W}</tool_call>\n<tool_call>{T}</tool_call>", None),
    ("tagged", False, f"{W} {T}", None),
    ("tagged", True, f"Sure. {W}", None),  # words around a call
    ("tagged", True, W.replace("Paris", "Berlin"), None),  # arguments its parameters forbid
    ("tagged", True, W.replace("get_weather", "get_news"), None),  # a tool not offered
    ("tagged", True, '{"name": "get_weather"}', None),  # no arguments
    ("tagged", True, W.replace("}}", '}, "id": 1}'), None),  # a key a call does not have
    ("json", True, W.replace("arguments", "parameters"), ["get_weather"]),
    ("json", True, W, None),  # Llama's templates render "parameters" back
    ("mistral", True, f"[{W}, {T}]", ["get_weather", "get_time"]),
    ("mistral", False, f"[{W}]", ["get_weather"]),
    ("mistral", False, f"[{W}, {T}]", None),
])
def test_a_forced_answer_is_a_call_in_a_form_read_back(
        tiny_vocab: Any, fmt: ToolFormat, parallel: bool, text: str,
        calls: list[str] | None) -> None:
    """The grammar allows the forms the template's reader takes, each read back as the same
    calls, and nothing else: no prose, no other tool, no arguments the parameters forbid."""
    out = forced_calls(ToolRequest((CITY, TIME), ("get_weather", "get_time"), parallel), fmt)
    assert _allowed(tiny_vocab, out, text) == (calls is not None)
    if calls is not None:
        content, read = split_tool_calls(text, ("get_weather", "get_time"), fmt)
        assert content is None and [c["function"]["name"] for c in read] == calls


def test_a_named_function_forbids_calls_to_the_others(tiny_vocab: Any) -> None:
    out = forced_calls(ToolRequest((CITY, TIME), ("get_time",)), "tagged")
    assert _allowed(tiny_vocab, out, T) and not _allowed(tiny_vocab, out, W)
    # A tool that names no parameters takes any object of arguments.
    bare = {"type": "function", "function": {"name": "ping"}}
    out = forced_calls(ToolRequest((bare,), ("ping",)), "tagged")
    assert _allowed(tiny_vocab, out, '{"name": "ping", "arguments": {"any": [1, "x"]}}')


def test_a_forced_calls_arguments_keep_their_own_schema(tiny_vocab: Any) -> None:
    """A tool's "$ref"s resolve in its own parameters (as pydantic writes them), arguments
    are an object whatever the parameters leave out, and a name is matched as written."""
    refs = {"type": "function", "function": {"name": 'say "hi"', "parameters": {
        "$defs": {"Mood": {"enum": ["glad", "sad"]}},
        "properties": {"mood": {"$ref": "#/$defs/Mood"}}, "required": ["mood"]}}}
    out = forced_calls(ToolRequest((refs,), ('say "hi"',)), "tagged")
    good = '{"name": "say \\"hi\\"", "arguments": {"mood": "glad"}}'
    assert _allowed(tiny_vocab, out, good)
    assert split_tool_calls(good, {'say "hi"'})[1][0]["function"]["name"] == 'say "hi"'
    assert not _allowed(tiny_vocab, out, good.replace("glad", "mad"))
    assert not _allowed(tiny_vocab, out, '{"name": "say \\"hi\\"", "arguments": "glad"}')
    text = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    with pytest.raises(ToolError) as info:
        forced_calls(ToolRequest((text,), ("f",)), "tagged")
    assert info.value.param == "tools[0].function.parameters"


# -- a strict tool's call, where the model chooses -----------------------------------------------
STRICT_CITY: dict[str, Any] = {"type": "function",
                               "function": {**CITY["function"], "strict": True}}
BAD_W = W.replace('"city"', '"town"')  # arguments the strict tool's parameters forbid
BAD_T = T.replace('"CET"', "5")  # and the other tool's, which is not strict


@pytest.mark.parametrize(("fmt", "text", "held"), [
    ("tagged", "It is sunny today.", False),
    ("tagged", '{"result": 1}', False),  # JSON that names no strict tool is free
    ("tagged", f"Sure: {BAD_W}", False),  # a call in words is not read as one: not held
    ("tagged", '{"name": "get_weather"}', False),  # no arguments: data, not a call
    ("tagged", '{"name": "get_weather", "description": "x"}', False),
    ("tagged", BAD_T, False),  # a call to a tool that is not strict
    ("tagged", W, False),
    ("tagged", BAD_W, True),
    ("tagged", f"```json\n{BAD_W}\n```", True),
    ("tagged", f"  [{BAD_W}]", True),
    ("tagged", f"{W} and then words", True),  # a bare call is the whole answer
    ("tagged", f"Let me check. <tool_call>{W}</tool_call>", False),
    ("tagged", f"Let me check. <tool_call>{BAD_W}</tool_call>", True),
    # In tags, any offered tool: the strict one held, the other to an object of arguments.
    ("tagged", f"<tool_call>{BAD_T}</tool_call> and <tool_call>{W}</tool_call>", False),
    ("tagged", "the format is <tool_call>{...}</tool_call>", True),  # a tag opened is a call
    ("tagged", BAD_W.replace("arguments", "parameters"), True),  # either key is read
    ("tagged", f"<|python_tag|>{BAD_W}", True),  # a format's opening spelled out
    ("json", W.replace("arguments", "parameters"), False),
    ("json", BAD_W.replace("arguments", "parameters"), True),
    ("json", f"Let me check. <tool_call>{BAD_W}</tool_call>", True),  # tags, read in any format
    ("mistral", f"[{W}, {BAD_T}]", False),
    ("mistral", f"[{BAD_W}]", True),
    ("mistral", f"[{T}, {BAD_W}]", True),
])
def test_a_strict_tools_call_is_held_to_its_parameters_from_where_it_begins(
        tiny_vocab: Any, fmt: ToolFormat, text: str, held: bool) -> None:
    """Under tool_choice "auto", text that does not begin a call to a strict tool is free;
    one that does is a call, with arguments its parameters allow."""
    out = held_calls(ToolRequest((STRICT_CITY, TIME), (), True, ("get_weather",)), fmt)
    assert _allowed(tiny_vocab, out, text) == (not held)
    if not held:  # what the grammar allows reads back as calls it held, or as content
        content, calls = split_tool_calls(text, {"get_weather", "get_time"}, fmt)
        assert all(json.loads(c["function"]["arguments"]) == {"city": "Paris"}
                   for c in calls if c["function"]["name"] == "get_weather")
        assert calls or content == text


def test_a_strict_call_is_held_whatever_its_tools_name() -> None:
    """Names with the characters of a regex or a Lark literal in them."""
    for name in ("fs/read", "a.b", "a-b", 'say "hi"', "x|y", "(z)"):
        tool = {"type": "function", "function": {**STRICT_CITY["function"], "name": name}}
        held_calls(ToolRequest((tool,), (), True, (name,)), "tagged").check()


def test_one_strict_call_is_all_an_answer_holds_without_parallel_calls(
        tiny_vocab: Any) -> None:
    one = ToolRequest((STRICT_CITY, TIME), (), False, ("get_weather",))
    two = f"a <tool_call>{W}</tool_call> b <tool_call>{T}</tool_call>"
    for fmt, text in (("tagged", two), ("tagged", f"{W}; {T}"), ("mistral", f"[{W}, {T}]")):
        assert not _allowed(tiny_vocab, held_calls(one, fmt), text)
        assert _allowed(tiny_vocab, held_calls(replace(one, parallel=True), fmt), text)
    assert _allowed(tiny_vocab, held_calls(one, "tagged"), f"a <tool_call>{W}</tool_call> b")


def _tokens_allowed(vocab: Any, out: Any, parts: list[str | int]) -> bool:
    """``_allowed`` for an answer in pieces: text, or a token by its id."""
    from llguidance import LLMatcher

    matcher = LLMatcher(vocab, out.grammar(), log_level=0)
    tokens = [t for p in parts for t in ([p] if isinstance(p, int) else vocab.tokenize_str(p))]
    return matcher.validate_tokens(tokens) == len(tokens) and \
        matcher.consume_tokens(tokens) and matcher.is_accepting()


def test_a_strict_call_begins_at_the_vocabularys_own_tag_or_opening_token(
        tmp_path: Path) -> None:
    """A call opened by a token of the vocabulary's own (Qwen's tag, Mistral's control token
    [TOOL_CALLS]) is held from that token on; text before it stays free."""
    request = ToolRequest((STRICT_CITY, TIME), (), True, ("get_weather",))
    with SpeculativeEngine.load(_tag_token_model(tmp_path), None,
                                ModelSettings(n_ctx=256)) as eng:
        vocab = vocabulary_tokenizer(eng.target.vocab)
        tags = call_tags(eng.target.special_token)
        assert tags is not None and call_opener("tagged", eng.target.control_token) is None
        out = held_calls(request, "tagged", tags)
        opened, closed = tags
        assert _tokens_allowed(vocab, out, ["Let me check. ", opened, W, closed])
        assert _tokens_allowed(vocab, out, ["Let me check. ", opened, BAD_T, CLOSE, " ok"])
        assert not _tokens_allowed(vocab, out, ["Let me check. ", opened, BAD_W, closed])
    for fmt, template, tag in (("mistral", MISTRAL_TEMPLATE, "[TOOL_CALLS]"),
                               ("json", LLAMA_TEMPLATE, "<|python_tag|>")):
        (tmp_path / fmt).mkdir()
        model = _scripted(tmp_path / fmt, PROSE, template, added=(tag,), control=True)
        with SpeculativeEngine.load(model, None, ModelSettings(n_ctx=256)) as eng:
            vocab = vocabulary_tokenizer(eng.target.vocab)
            opener = call_opener(fmt, eng.target.control_token)
            assert opener is not None and eng.target.special_token(tag) is None
            out = held_calls(request, fmt, None, opener)
            assert _tokens_allowed(vocab, out, [opener, f"[{W}]"])
            assert _tokens_allowed(vocab, out, [opener, f" {BAD_T}\n"])
            assert not _tokens_allowed(vocab, out, [opener, f"[{BAD_W}]"])
            assert not _tokens_allowed(vocab, out, [opener, "words"])
            assert not _tokens_allowed(vocab, out, ["words ", opener])
            assert _tokens_allowed(vocab, out, ["It is sunny today."])


# The call of SCRIPT, FENCED and TAG_SCRIPT, its arguments under a key the tool does not have.
BAD_SCRIPTS = {
    "tags-in-pieces": (SCRIPT[:4] + ('{"name":', '"get_weather",', '"arguments":', '{"town":',
                                     '"Paris"}}', CLOSE), ()),
    "tag-tokens": (SCRIPT[:3] + TAG_SCRIPT[:1] + ('{"name":', '"get_weather",', '"arguments":',
                                                  '{"town":', '"Paris"}}') + (CLOSE,),
                   (OPEN, CLOSE)),
    "fenced": (FENCED[:4] + ('{"town":', '"Paris"}}', "```"), ()),
}


@pytest.mark.parametrize("script", BAD_SCRIPTS, ids=list(BAD_SCRIPTS))
@pytest.mark.parametrize("stream", [False, True])
def test_a_strict_tools_call_is_made_as_its_parameters_ask_where_the_model_chose_to_call(
        tmp_path: Path, script: str, stream: bool) -> None:
    """A model whose call's arguments miss its tool's parameters: not strict, the call comes
    back as the model wrote it; strict, its arguments are ones the parameters allow, and the
    words it wrote before the call are its own."""
    words, added = BAD_SCRIPTS[script]
    with _serving(_scripted(tmp_path, words, added=added), n_ctx=2048) as api:
        content, calls, reason = _answer(api, stream, tools=[CITY, TIME])
        (call,) = calls
        assert reason == "tool_calls" and json.loads(call.function.arguments) == {"town": "Paris"}
        before = content
        content, calls, reason = _answer(api, stream, tools=[STRICT_CITY, TIME])
        (call,) = calls
        assert reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Rome"})
        if script == "fenced":  # an untagged call is the whole answer
            assert before == content == ""
        else:
            assert before.strip() == "Let me check." and content.startswith(before)


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_in_words_is_untouched_by_strict_tools(tmp_path: Path, stream: bool) -> None:
    with _serving(_scripted(tmp_path, PROSE), n_ctx=2048) as api:
        content, calls, reason = _answer(api, stream, tools=[CITY, TIME])
        assert (content.strip(), calls, reason) == ("It is sunny today.", [], "stop")
        assert _answer(api, stream, tools=[STRICT_CITY, TIME]) == (content, [], "stop")


def test_strict_names_the_tools_held_where_the_model_chooses() -> None:
    def parse(*tools: dict[str, Any], **fields: Any) -> ToolRequest:
        return parse_request({"messages": ASK, "tools": list(tools), **fields}, "chat",
                             CFG).tool_request
    assert parse(STRICT_CITY, TIME).strict == ("get_weather",)
    assert parse(CITY, TIME).strict == ()
    assert parse(STRICT_CITY, TIME, tool_choice="none") == ToolRequest()
    # Shown to the model as any tool: "strict" is the server's to keep, not the template's.
    assert "strict" not in parse(STRICT_CITY).tools[0]["function"]


def test_tool_choice_names_what_a_call_is_forced_to() -> None:
    def parse(**fields: Any) -> ToolRequest:
        return parse_request({"messages": ASK, "tools": [CITY, TIME], **fields}, "chat",
                             CFG).tool_request
    assert parse().forced == () and parse(tool_choice="auto").forced == ()
    assert parse(tool_choice="required") == ToolRequest((CITY, TIME), ("get_weather", "get_time"))
    named = parse(tool_choice={"type": "function", "function": {"name": "get_time"}},
                  parallel_tool_calls=False)
    assert named == ToolRequest((CITY, TIME), ("get_time",), parallel=False)
    assert parse(tool_choice="none") == ToolRequest()


# -- reading calls out of text -----------------------------------------------------------------
def test_calls_are_read_out_of_the_text_around_them() -> None:
    text = ('Two calls.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "b", "parameters": {"y": "é"}}</tool_call>')
    content, calls = split_tool_calls(text, {"a", "b"})
    assert content == "Two calls."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("a", {"x": 1}), ("b", {"y": "é"})]
    assert len({c["id"] for c in calls}) == 2
    # The answer ended (EOS or max_tokens) before the closing tag: a whole call still counts.
    assert split_tool_calls('<tool_call>{"name": "a", "arguments": {}}', {"a"})[0] is None
    # A call to a tool that was not offered is no call a client could run: the text is content.
    assert split_tool_calls(text, {"a"}) == (text, [])


def test_an_answer_that_is_one_call_to_an_offered_tool_needs_no_tags() -> None:
    fenced = '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```'
    for text in (fenced, ' {"name": "get_weather", "arguments": {"city": "Paris"}}\n'):
        content, calls = split_tool_calls(text, {"get_weather"})
        assert content is None
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
    assert split_tool_calls(fenced) == (fenced, [])  # no tool offered by that name
    chatty = 'Call it so: {"name": "get_weather", "arguments": {}}'
    assert split_tool_calls(chatty, {"get_weather"}) == (chatty, [])  # not the whole answer


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',  # Llama 3.x
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',  # the tag as text
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',  # Mistral
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    'get_weather{"city": "Paris"}',  # Mistral's newer templates: name[ARGS]{...}, tags left out
    '[TOOL_CALLS]get_weather{"city": "Paris"}',
    '```json\n[{"name": "get_weather", "arguments": {"city": "Paris"}}]\n```',
    '```json\nget_weather{"city": "Paris"}\n```',
    '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}',  # the fence never closed
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
], ids=["json", "python-tag", "array", "mistral-tag", "name-args", "mistral-tag-name-args",
        "fenced-array", "fenced-name-args", "fence-opened", "fence-closed"])
def test_the_untagged_forms_of_a_call_are_read_as_the_whole_answer(text: str) -> None:
    content, calls = split_tool_calls(text, {"get_weather"})
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("get_weather", {"city": "Paris"})]
    assert split_tool_calls(text) == (text, [])  # no tool offered by that name


def test_several_untagged_calls_are_read_and_any_other_value_makes_it_text() -> None:
    names = {"a", "b"}
    for text in ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
                 '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]',
                 'a{} b{"x": 1}'):
        assert [c["function"]["name"] for c in split_tool_calls(text, names)[1]] == ["a", "b"]
    for text in ('[{"name": "a", "arguments": {}}, 3]', '{"name": "a", "parameters": {}} ok',
                 '[{"name": "a", "arguments": {}}, {"name": "c", "arguments": {}}]',
                 "a{} and b", "[]", '{"name": "a"', "a{",
                 # an object naming a tool but with no arguments may be data, not a call
                 '[{"name": "a", "type": "tool"}, {"name": "b"}]',
                 '{"name": "a", "arguments": {"x": NaN}}',  # not JSON a client parses
                 # nested as deep as Python reads but one level past what it writes back
                 '{"name": "a", "arguments": ' + "[" * 990 + "]" * 990 + "}"):
        assert split_tool_calls(text, names) == (text, [])


def test_mistral_calls_have_the_ids_its_templates_take() -> None:
    text = '[{"name": "f", "arguments": {}}]'
    (call,) = split_tool_calls(text, {"f"}, "mistral")[1]
    assert len(call["id"]) == 9 and call["id"].isalnum()
    (other,) = split_tool_calls(text, {"f"})[1]
    assert other["id"].startswith("call_")


@pytest.mark.parametrize("text", [
    "no calls here",
    "the format is <tool_call>{...}</tool_call>",  # the model explaining, not calling
    '<tool_call>{"name": "a"}</tool_call> then <tool_call>not json</tool_call>',
    '<tool_call>["a"]</tool_call>',
])
def test_text_that_is_not_calls_is_all_content(text: str) -> None:
    assert split_tool_calls(text) == (text, [])


def test_a_stream_sends_text_up_to_a_call_and_holds_a_tag_split_across_chunks() -> None:
    stream = ToolCallStream({"f"})
    pieces = ["Let me ", "check. <tool", "_call>", '{"name": "f", ', '"arguments": {}}',
              "</tool_call>"]
    sent = [stream.feed(p) for p in pieces]
    assert "".join(sent) == "Let me check. "
    assert sent[1] == "check. "  # "<tool" might begin a call: held
    tail, calls = stream.finish()
    assert tail == "" and [c["function"]["name"] for c in calls] == ["f"]


def test_a_stream_holds_an_answer_while_its_start_may_be_a_call_without_tags() -> None:
    stream = ToolCallStream({"f"})
    assert [stream.feed(p) for p in ["``", "`json\n", '{"na']] == ["", "", ""]
    assert stream.feed('me": "f", "arguments": {}}\n```') == ""
    assert [c["function"]["name"] for c in stream.finish()[1]] == ["f"]
    code = ToolCallStream({"f"})
    assert code.feed("``") == "" and code.feed("`python\nx = 1") == "```python\nx = 1"


@pytest.mark.parametrize("text", [
    'Let me check. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
    '{"arguments": {"a": 1}, "name": "f"}',  # the keys in another order
    '```json\n{"name": "f", "arguments": {}}\n```',
    '{"name": "g", "arguments": {}}',  # not an offered tool
    '<tool_call>{"name": "g", "arguments": {}}</tool_call>',  # nor in tags
    "```python\nprint(1)\n```",
    '[{"name": "f", "arguments": {"a": 1}}]',
    'f{"a": 1}',
    "[a link](https://example.com) and f{} as text",
    "far from it",
    '```json\nf{"a": 1}\n```',
    '<|python_tag|>[TOOL_CALLS]{"name": "f", "arguments": {}}',
    'my tool {"a": 1}',  # an offered name with a space in it
], ids=["tags", "keys-reordered", "fenced", "not-offered", "tagged-not-offered", "code", "array",
        "name-args", "link", "a-name's-start", "fenced-name-args", "both-prefixes", "spaced-name"])
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_streamed_and_whole_answers_read_the_same_calls(text: str, size: int) -> None:
    names = {"f", "my tool"}
    whole_content, whole_calls = split_tool_calls(text, names)
    stream = ToolCallStream(names)
    sent = "".join(stream.feed(text[i:i + size]) for i in range(0, len(text), size))
    tail, calls = stream.finish()
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
    assert (sent + tail).strip() == (whole_content or "")


def _streamed(stream: ToolCallStream, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """The content sent and the call deltas, piece by piece, of ``pieces`` fed one by one."""
    content, deltas = "", []
    for piece in pieces:
        content += stream.feed(piece)
        deltas += stream.pieces()
    return content, deltas


def _arguments(deltas: list[dict[str, Any]], index: int) -> str:
    return "".join(d["function"]["arguments"] for d in deltas if d["index"] == index)


def test_a_held_call_is_sent_in_pieces_as_it_is_written() -> None:
    stream = ToolCallStream({"f"}, piecewise=True)
    content, deltas = _streamed(stream, [
        "Let me ", "check. <tool_call>", '{"name": "f", ', '"arguments": {"a": ',
        '"x}\\"y", "b": [1, {"c": 2}]', "}}", "</tool_call>"])
    assert content == "Let me check. "
    head, *rest = deltas
    assert head["function"]["name"] == "f" and head["id"].startswith("call_")
    assert len(rest) >= 2 and all(d.keys() == {"index", "function"} for d in rest)
    # Braces inside a string are not the arguments' end; the call's own closing brace is not
    # part of them.
    assert _arguments(deltas, 0) == '{"a": "x}\\"y", "b": [1, {"c": 2}]}'
    tail, calls = stream.finish()
    assert tail == "" and len(calls) == stream.streamed == 1
    assert json.loads(calls[0]["function"]["arguments"]) == json.loads(_arguments(deltas, 0))


def test_held_calls_in_an_array_are_sent_one_after_another() -> None:
    text = '[{"name": "f", "arguments": {}}, {"name": "g", "parameters": {"x": [1]}}]'
    stream = ToolCallStream({"f", "g"}, "mistral", piecewise=True)
    _, deltas = _streamed(stream, list(text))  # a character at a time
    assert [(d["index"], d["function"]["name"]) for d in deltas if "id" in d] == \
        [(0, "f"), (1, "g")]
    assert (_arguments(deltas, 0), _arguments(deltas, 1)) == ("{}", '{"x": [1]}')
    assert len(stream.finish()[1]) == 2


def test_a_held_call_cut_short_is_sent_as_far_as_it_went() -> None:
    """Cut short (max_tokens), the calls are what was sent of them and the text around
    them is content; not sent again as content, and the same where an error ends it."""
    pieces = ['ok <tool_call>{"name": "f", "arguments": {}}</tool_call> and ',
              '<tool_call>{"name": "f", "arguments": {"a": 1']
    stream = ToolCallStream({"f"}, piecewise=True)
    content, deltas = _streamed(stream, pieces)
    assert (content, _arguments(deltas, 0), _arguments(deltas, 1)) == ("ok ", "{}", '{"a": 1')
    assert stream.finish() == ("and", []) and stream.streamed == 2
    stream = ToolCallStream({"f"}, piecewise=True)
    _streamed(stream, pieces)
    assert stream.release() == "and"


STREAMED_TEXTS = [
    'a <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> b <tool_call>'
    '{"name": "my tool", "arguments": {}}</tool_call> c',
    # After the tagged calls, text shaped like a call is text, as the reader takes it.
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n{"name": "f", "arguments": {"a": 2}}',
    '{"name": "f", "arguments": {}}; {"name": "my tool", "parameters": {"a": [1, "]"]}}',
    '```json\n{"name": "f", "arguments": {"a": "}\\\\"}}\n```',
    '<tool_call>{"name": "g", "arguments": {}}</tool_call>',  # not an offered tool
    '{"arguments": {"a": 1}, "name": "f"}',  # read, though not as the stream reads a call
]


@pytest.mark.parametrize("text", STREAMED_TEXTS)
@pytest.mark.parametrize("size", [1, 3, 7])
def test_calls_streamed_in_pieces_are_the_calls_of_the_whole_answer(text: str, size: int) -> None:
    """What a client puts together from the pieces (and the calls sent whole at the finish)
    is the whole answer's calls and content."""
    names = {"f", "my tool"}
    whole_content, whole_calls = split_tool_calls(text, names)
    stream = ToolCallStream(names, piecewise=True)
    content, deltas = _streamed(stream, [text[i:i + size] for i in range(0, len(text), size)])
    tail, calls = stream.finish()
    got = [(d["function"]["name"], json.loads(_arguments(deltas, d["index"])))
           for d in deltas if "id" in d]
    got += [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls[stream.streamed:]]
    assert got == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                   for c in whole_calls]
    assert (content + " " + tail).split() == (whole_content or "").split()


def test_a_call_not_held_is_sent_whole_at_the_finish() -> None:
    stream = ToolCallStream({"f"})
    assert _streamed(stream, ['<tool_call>{"name": "f", "arguments": {"a": 1}}'])[1] == []
    assert [c["function"]["name"] for c in stream.finish()[1]] == ["f"]


def test_a_stream_that_ends_in_an_error_releases_what_it_held() -> None:
    stream = ToolCallStream({"f"})
    assert stream.feed('ok <tool_call>{"name": "f", ') == "ok "
    assert stream.release() == '<tool_call>{"name": "f", '
    assert stream.finish() == ("", [])


@pytest.mark.parametrize("pieces", [
    ["a <tool", "s are fine"],  # a tag's beginning that was not one
    ["```json\n", '{"name": "g", "arguments": {}}'],  # not an offered tool's call
    ["{", '"name": "f", "arguments": {}} and more'],  # a call and then text: not a call
    ["x <tool_call>", "not a call"],  # a tag with no call after it: sent at the finish
    ["ends with <tool_c"],
])
def test_a_stream_drops_nothing_that_is_not_a_call(pieces: list[str]) -> None:
    stream = ToolCallStream({"f"})
    sent = "".join(stream.feed(p) for p in pieces)
    tail, calls = stream.finish()
    assert calls == [] and sent + tail == "".join(pieces)
