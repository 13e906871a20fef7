"""The OpenAI-compatible server, live on loopback, driven by the official ``openai`` client."""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import h11
import httpx
import openai
import pytest

import localspec.loading
import localspec.server.app
from localspec.chat_engine import ChatOptions
from localspec.cli import main
from localspec.engine import (
    DraftSettings,
    Finished,
    GenerationRequest,
    ModelSettings,
    SamplingParams,
    SpeculativeEngine,
)
from localspec.remote import RemoteEngine, RemoteError
from localspec.server import ServerConfig
from localspec.server.app import create_app
from localspec.server.openai_schema import ApiError, parse_request
from localspec.server.running import BackgroundServer

MODEL = "tiny-pair"
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def engine(target_gguf: Path, draft_gguf: Path) -> Iterator[SpeculativeEngine]:
    with SpeculativeEngine.load(target_gguf, draft_gguf, ModelSettings(n_ctx=4096)) as eng:
        yield eng


def _serve(engine: SpeculativeEngine, **config: object) -> BackgroundServer:
    cfg = ServerConfig(model_id=MODEL, **config)  # type: ignore[arg-type]
    return BackgroundServer(create_app(engine, cfg)).start()


@pytest.fixture(scope="module")
def server(engine: SpeculativeEngine) -> Iterator[BackgroundServer]:
    # Fixed K: whether auto drafts depends on this machine's timings, and these tests check
    # that the server reports drafting. Room in the queue for the burst test's 20 clients.
    srv = _serve(engine, queue_size=32, draft=DraftSettings(k=3))
    yield srv
    srv.stop()


def _client(srv: BackgroundServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture()
def client(server: BackgroundServer) -> openai.OpenAI:
    return _client(server)


def _metrics(srv: BackgroundServer, headers: dict[str, str] | None = None) -> dict:
    return httpx.get(srv.url + "/metrics?format=json", headers=headers).json()


def _errors(srv: BackgroundServer) -> dict[str, int]:
    return _metrics(srv)["request_errors_total"]


def _cancelled(srv: BackgroundServer) -> int:
    return _metrics(srv)["requests_finished_total"].get("cancelled", 0)


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _on_one_connection(srv: BackgroundServer, *requests: tuple[str, str, bytes]
                       ) -> list[tuple[int, bytes]]:
    """Send the requests one after another on one keep-alive connection; (status, body) each.

    h11 refuses to start the next request if the server closed the connection or asked to
    (``Connection: close``), so a later answer proves the connection survived the earlier one.
    """
    conn = h11.Connection(h11.CLIENT)
    answers: list[tuple[int, bytes]] = []
    with socket.create_connection((srv.host, srv.port), timeout=30) as sock:
        for method, target, body in requests:
            if answers:
                conn.start_next_cycle()
            head = h11.Request(method=method, target=target,
                               headers=[("Host", srv.host), ("Content-Length", str(len(body))),
                                        ("Content-Type", "application/json")])
            sock.sendall(conn.send(head) + conn.send(h11.Data(data=body))
                         + conn.send(h11.EndOfMessage()))
            status, data = 0, b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(sock.recv(1 << 16))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    data += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    raise AssertionError(f"the server closed the connection ({event!r})")
            answers.append((status, data))
    return answers


@pytest.fixture()
def server_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """INFO and up from localspec's server, and uvicorn's error log (where an exception that
    escapes the app lands, with its traceback; it does not propagate to caplog's root)."""
    uvicorn_log = logging.getLogger("uvicorn.error")
    caplog.set_level(logging.INFO, logger="localspec.server")
    uvicorn_log.addHandler(caplog.handler)
    yield caplog
    uvicorn_log.removeHandler(caplog.handler)


def _long_stream(c: openai.OpenAI, prompt: str = "a long story"):  # type: ignore[no-untyped-def]
    # Sampled text from the tiny pair takes seconds to reach 3500 tokens: long enough to act on.
    return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                     max_tokens=3500, temperature=1.0, seed=1, stream=True)


# -- basics ------------------------------------------------------------------------------------
def test_models_health_and_names(server: BackgroundServer, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert "target.gguf" in models[0].model_extra["aliases"]
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    # The target's name works as the model name too.
    resp = client.completions.create(model="target", prompt="the model", max_tokens=3,
                                     temperature=0)
    assert resp.model == "target"


def test_chat_matches_in_process_engine(server: BackgroundServer, client: openai.OpenAI,
                                        engine: SpeculativeEngine) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=40,
                                          temperature=0)
    worker = server._server.config.app.state.localspec.worker  # type: ignore[attr-defined]
    expected = worker.call(lambda: engine.generate(GenerationRequest(
        engine.tokenize(engine.chat_prompt(HELLO), chat=True), max_tokens=40,
        sampling=SamplingParams(temperature=0.0)))).result()
    choice = resp.choices[0]
    assert choice.message.content == expected.text
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 40
    assert resp.usage.prompt_tokens == expected.stats.prompt_tokens
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 40
    timings = resp.model_extra["timings"]
    assert timings["predicted_n"] == 40 and timings["draft_n"] >= timings["draft_n_accepted"]
    assert 0.0 <= timings["acceptance_rate"] <= 1.0
    assert timings["draft_n"] > 0  # the draft model did propose


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=30,
                                          temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert finals[0].model_extra["timings"]["predicted_n"] == 30
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30


def test_completions_stream_and_not(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="the model", max_tokens=25,
                                     temperature=0)
    streamed = list(client.completions.create(model=MODEL, prompt="the model", max_tokens=25,
                                              temperature=0, stream=True))
    assert full.object == "text_completion" and full.usage.completion_tokens == 25
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"
    # A prompt given as token ids is the same prompt.
    ids = client.completions.create(model=MODEL, prompt=[1, *range(300, 305)], max_tokens=5,
                                    temperature=0)
    assert ids.usage.prompt_tokens == 6


def test_stop_strings(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL, prompt="the model", max_tokens=30,
                                     temperature=0).choices[0].text
    stop = free[5:8]
    cut = free.index(stop)
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(model=MODEL, prompt="the model",
                                                    max_tokens=30, temperature=0, stop=[stop],
                                                    stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            choice = client.completions.create(model=MODEL, prompt="the model", max_tokens=30,
                                               temperature=0, stop=stop).choices[0]
            text, reason = choice.text, choice.finish_reason
        assert text == free[:cut]
        assert reason == "stop"


def test_sampling_with_seed_is_reproducible(client: openai.OpenAI) -> None:
    def once() -> str:
        return client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=20, temperature=0.9, top_p=0.9, seed=42,
            frequency_penalty=0.5, extra_body={"top_k": 20, "min_p": 0.01}
        ).choices[0].message.content or ""
    assert once() == once()


def test_a_seed_of_minus_one_is_llama_servers_random_seed() -> None:
    """Clients written for llama-server send seed -1 for "random": a fixed seed of -1 would
    give the same text every time. It also overrides a server's own --seed."""
    from localspec.engine import SamplingParams
    from localspec.server.openai_schema import parse_request

    config = ServerConfig(model_id="m", default_sampling=SamplingParams(seed=5))
    assert parse_request({"prompt": "x", "seed": -1}, "completion", config).sampling.seed is None
    assert parse_request({"prompt": "x", "seed": 7}, "completion", config).sampling.seed == 7
    assert parse_request({"prompt": "x"}, "completion", config).sampling.seed == 5


# -- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "param"), [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": [1, 2]}, "stop"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"extra_body": {"mirostat": 2}}, "mirostat"),
    ({"extra_body": {"top_k": "many"}}, "top_k"),
])
def test_bad_parameters_are_400_naming_them(client: openai.OpenAI, kwargs: dict,
                                            param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HELLO, **kwargs)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param
    assert param in info.value.body["message"]


def test_bad_messages_and_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[])
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "function", "content": "x",
                                                               "name": "f"}])  # type: ignore[list-item]
    assert "messages[0]" in info.value.body["param"]
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert nf.value.body["code"] == "model_not_found" and MODEL in nf.value.body["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud800"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "system", "content": "\\udfff"}, '
                             '{"role": "user", "content": "hi"}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", '
                             '"text": "\\ud800"}]}]}', "messages[0].content[0].text"),
    ("/v1/chat/completions", '{"model": "\\ud800", "messages": [{"role": "user", '
                             '"content": "hi"}]}', "model"),
    ("/v1/completions", '{"prompt": "the \\ud800 end", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["\\ud800"], "max_tokens": 2}', "prompt[0]"),
    ("/v1/completions", '{"prompt": "the", "stop": ["x", "\\ud800"]}', "stop[1]"),
    ("/v1/completions", '{"prompt": "the", "\\ud800": 1}', "\\ud800"),
], ids=["content", "system", "content-part", "model", "prompt", "prompt-list", "stop", "name"])
def test_a_lone_surrogate_is_400_naming_the_field(
        server: BackgroundServer, server_log: pytest.LogCaptureFixture, path: str, body: str,
        param: str) -> None:
    """JSON may escape half a UTF-16 pair ("\\ud800"); it is not text, and the server says
    where it is instead of failing with a 500 when it tokenizes or echoes it. The connection
    serves the next request."""
    good = json.dumps({"prompt": "the", "max_tokens": 2, "temperature": 0}).encode()
    (status, answer), (next_status, _next) = _on_one_connection(
        server, ("POST", path, body.encode()), ("POST", "/v1/completions", good))
    assert status == 400, answer
    error = json.loads(answer)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert f"'{param}'" in error["message"] and "surrogate" in error["message"]
    assert next_status == 200
    assert not [r for r in server_log.records if r.exc_info or r.levelno >= logging.ERROR]


def test_context_limit(client: openai.OpenAI) -> None:
    long_prompt = "the " * 5000
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=5)
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="the " * 500, max_tokens=4000)
    assert info.value.body["param"] == "max_tokens"
    assert info.value.body["code"] == "context_length_exceeded"


def test_localspecs_own_clients_get_what_the_context_holds(target_gguf: Path) -> None:
    """fit_max_tokens (sent by the chat app and `run --url`): a max_tokens past the context
    is cut to what it holds, as the engine in process does, instead of a 400 that would take
    a long conversation's last message back. Other clients still get the 400."""
    from localspec.engine import DraftSettings

    app = create_app(lambda: SpeculativeEngine.load(target_gguf, None, ModelSettings(n_ctx=256)),
                     ServerConfig(model_id="small", draft=DraftSettings(mode="none")))
    prompt = "the " * 50  # about 200 tokens of the 256
    with BackgroundServer(app) as srv:
        assert app.state.localspec.worker.loaded.wait(60)
        with pytest.raises(openai.BadRequestError, match="lower max_tokens"):
            _client(srv).completions.create(model="small", prompt=prompt, max_tokens=200)
        answer = _client(srv).completions.create(model="small", prompt=prompt, max_tokens=200,
                                                 extra_body={"fit_max_tokens": True})
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage is not None and answer.usage.total_tokens == 256
        # Past the server's --max-tokens-limit too: what the limit gives, not a 400.
        capped = _client(srv).completions.create(model="small", prompt="the", max_tokens=10**6,
                                                 extra_body={"fit_max_tokens": True})
        assert capped.choices[0].finish_reason in ("length", "stop")
        with RemoteEngine(srv.url) as remote:
            done = list(remote.stream_completion(prompt, ChatOptions(max_tokens=200)))[-1]
    assert isinstance(done, Finished) and done.finish_reason == "length"
    assert done.stats.prompt_tokens + done.stats.completion_tokens == 256


def test_a_server_that_predates_fit_max_tokens_is_not_sent_it(
        server: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A localspec server from before the field refuses it as an unknown parameter; it does
    not list it in its model's meta, and the client then leaves it out (the server faked
    older by taking the field out of what it accepts and of its meta)."""
    from localspec.server import app as server_app
    from localspec.server import openai_schema

    monkeypatch.setattr(openai_schema, "_COMMON", openai_schema._COMMON - {"fit_max_tokens"})
    meta = server_app.ServerState.model_meta
    monkeypatch.setattr(server_app.ServerState, "model_meta", lambda self: {
        k: v for k, v in meta(self).items() if k != "fit_max_tokens"})
    with RemoteEngine(server.url) as remote:
        done = list(remote.stream_chat(HELLO, ChatOptions(max_tokens=4)))[-1]
    assert isinstance(done, Finished) and done.stats.completion_tokens == 4


def test_raw_http_errors(server: BackgroundServer) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 10**6], "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt"
    assert error["message"].startswith("token id 1000000 is outside the vocabulary (0..")
    for role in (["user"], {"a": 1}):  # unhashable: a set lookup raised TypeError, a 500
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"messages": [{"role": role, "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages[0].role"


def test_deeply_nested_json_is_400_and_the_connection_survives(
        server: BackgroundServer, server_log: pytest.LogCaptureFixture) -> None:
    good = json.dumps({"prompt": "the", "max_tokens": 2, "temperature": 0}).encode()
    (status, body), (next_status, next_body) = _on_one_connection(
        server, ("POST", "/v1/completions", b"[" * 100_000), ("POST", "/v1/completions", good))
    assert status == 400
    error = json.loads(body)["error"]
    assert "not valid JSON" in error["message"] and "nested too deeply" in error["message"]
    assert error["type"] == "invalid_request_error"
    assert next_status == 200 and json.loads(next_body)["usage"]["completion_tokens"] == 2
    assert not [r for r in server_log.records if r.exc_info or r.levelno >= logging.ERROR]


def test_unexpected_exception_is_a_500_body_and_one_log_line(
        server: BackgroundServer, server_log: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(localspec.server.app, "models_list", broken)
    before = _errors(server).get("500", 0)
    (status, body), (next_status, _) = _on_one_connection(
        server, ("GET", "/v1/models", b""), ("GET", "/health", b""))
    assert status == 500
    assert json.loads(body)["error"] == {"message": "internal error: RuntimeError",
                                         "type": "server_error", "param": None, "code": None}
    assert next_status == 200  # same connection
    logged = [r for r in server_log.records if r.levelno >= logging.WARNING]
    assert len(logged) == 1 and logged[0].name == "localspec.server.app"
    assert "/v1/models" in logged[0].getMessage() and "a bug" in logged[0].getMessage()
    assert not logged[0].exc_info
    assert _errors(server).get("500", 0) == before + 1


def test_client_leaving_during_upload_is_one_log_line(
        server: BackgroundServer, server_log: pytest.LogCaptureFixture) -> None:
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                     b'{"prompt": "' + b"the " * 1000)
        time.sleep(0.1)  # the server is reading the body when the client leaves

    def disconnect_lines() -> list[logging.LogRecord]:
        return [r for r in server_log.records if "disconnected" in r.getMessage()]

    assert _wait_for(lambda: bool(disconnect_lines()))
    time.sleep(0.1)  # anything logged after the line would be caught below
    (line,) = disconnect_lines()
    assert line.levelno == logging.INFO and "/v1/completions" in line.getMessage()
    assert [r for r in server_log.records if r.exc_info or r.levelno >= logging.WARNING] == []
    assert httpx.get(server.url + "/health").status_code == 200


def test_parse_request_does_not_recurse_into_nested_prompts() -> None:
    cfg = ServerConfig(model_id=MODEL)
    assert parse_request({"prompt": [[5, 6]]}, "completion", cfg).prompt_tokens == (5, 6)
    nested: list[object] = [1]
    for _ in range(5000):  # deeper than the interpreter's recursion limit
        nested = [nested]
    with pytest.raises(ApiError) as info:
        parse_request({"prompt": nested}, "completion", cfg)
    assert info.value.status == 400 and info.value.param == "prompt"


def test_parse_request_maps_onto_the_engine() -> None:
    cfg = ServerConfig(model_id=MODEL)
    parsed = parse_request({"model": MODEL, "prompt": "x", "temperature": 0.5, "top_k": -1,
                            "repetition_penalty": 1.1, "stop": "END", "seed": 3}, "completion",
                           cfg)
    assert parsed.sampling.temperature == 0.5 and parsed.sampling.top_k == 0
    assert parsed.sampling.repeat_penalty == 1.1 and parsed.sampling.seed == 3
    assert parsed.sampling.top_p == 1.0  # OpenAI's default, not llama.cpp's
    assert parsed.stop == ("END",) and parsed.max_tokens is None
    with pytest.raises(ApiError, match="stream_options"):
        parse_request({"messages": HELLO, "stream_options": {"include_usage": True}}, "chat",
                      cfg)
    with pytest.raises(ApiError, match="echo"):
        parse_request({"prompt": "x", "echo": True}, "completion", cfg)


def test_null_fields_are_fields_left_out() -> None:
    """Typed clients send every field, the unset ones as null, and resend an earlier reply's
    message as the SDK dumps it (refusal, tool_calls ... null): all served, not refused."""
    cfg = ServerConfig(model_id=MODEL)
    dumped = {"role": "assistant", "content": "hi", "refusal": None, "tool_calls": None,
              "function_call": None, "audio": None, "annotations": []}
    parsed = parse_request({"messages": [*HELLO, dumped, *HELLO], "tools": None,
                            "tool_choice": None, "max_tokens": None, "seed": None,
                            "stream_options": None, "logprobs": None, "n": None}, "chat", cfg)
    assert [m["role"] for m in parsed.messages or ()] == ["user", "assistant", "user"]
    assert parsed.max_tokens is None and parsed.sampling.seed is None
    for empty in ({"tools": []}, {"tool_choice": "none"}, {"logprobs": False}):
        assert parse_request({"messages": HELLO, **empty}, "chat", cfg).messages


@pytest.mark.parametrize(("kind", "fields", "param"), [
    ("chat", {"tools": [{"type": "function"}]}, "tools[0].function"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"n": True}, "n"),
    ("chat", {"logprobs": 0}, "logprobs"),
    ("completion", {"logprobs": 0}, "logprobs"),
    ("chat", {"messages": [{**HELLO[0], "refusal": "no"}]}, "messages[0].refusal"),
    ("chat", {"messages": [{**HELLO[0], "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls"),
])
def test_fields_that_ask_for_what_is_not_served_are_still_refused(
        kind: str, fields: dict, param: str) -> None:
    body = {"messages": HELLO} if kind == "chat" else {"prompt": "x"}
    with pytest.raises(ApiError) as info:
        parse_request({**body, **fields}, kind, ServerConfig(model_id=MODEL))  # type: ignore[arg-type]
    assert info.value.status == 400 and info.value.param == param


def test_a_chat_template_that_refuses_the_messages_is_a_400(tmp_path: Path) -> None:
    """A template may raise on messages it does not take (roles out of order): the request's
    problem, a 400 on messages with the server's remedy, not a 500 naming a CLI flag."""
    from localspec.models.tiny import TinyModelSpec, write_tiny_model

    template = "{{ raise_exception('Conversation roles must alternate') }}"
    model = write_tiny_model(tmp_path / "strict.gguf", TinyModelSpec(metadata=(
        ("tokenizer.chat_template", template),)))
    with SpeculativeEngine.load(model, None, ModelSettings(n_ctx=256)) as eng, \
            _serve(eng) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": HELLO})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and "roles must alternate" in error["message"]
        assert "/v1/completions" in error["message"] and "--raw" not in error["message"]
        done = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert done.status_code == 200


def test_a_trailing_slash_is_served_not_redirected(server: BackgroundServer) -> None:
    """A 307 would send the client to the URL Starlette builds from the Host header, which
    behind serve's front is the engine's private socket; the path is served as is instead."""
    r = httpx.post(server.url + "/v1/completions/", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(server.url + "/v1/models/").json()["data"][0]["id"] == MODEL


def test_a_model_without_a_chat_template_gets_the_whole_conversation(tmp_path: Path) -> None:
    from localspec.models.tiny import TinyModelSpec, write_tiny_model

    model = write_tiny_model(tmp_path / "base.gguf", TinyModelSpec(metadata=(
        ("tokenizer.chat_template", ""),)))
    conversation = [{"role": "system", "content": "the model"},
                    {"role": "user", "content": "import data"},
                    {"role": "assistant", "content": "from the list"},
                    {"role": "user", "content": "hello there"}]
    with SpeculativeEngine.load(model, None, ModelSettings(n_ctx=256)) as eng, \
            _serve(eng) as srv:
        rendered = eng.chat_prompt(conversation)
        assert all(m["content"] in rendered for m in conversation)  # no turn dropped
        assert rendered.index("import data") < rendered.index("hello there")
        assert eng.chat_prompt(conversation[-1:]) == "hello there"  # one message: plain text
        r = httpx.post(srv.url + "/v1/chat/completions",
                       json={"messages": conversation, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(eng.tokenize(rendered, chat=True))


# -- auth and limits ---------------------------------------------------------------------------
def test_api_key(engine: SpeculativeEngine) -> None:
    with _serve(engine, api_key="sekrit") as srv:
        with pytest.raises(openai.AuthenticationError):
            _client(srv, "wrong").models.list()
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": HELLO})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/metrics").status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key
        good = _client(srv, "sekrit")
        assert good.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3,
                                            temperature=0).usage.completion_tokens == 3


def test_body_limit(engine: SpeculativeEngine) -> None:
    with _serve(engine, max_body_bytes=4096) as srv:
        with pytest.raises(openai.APIStatusError) as info:
            _client(srv).completions.create(model=MODEL, prompt="the " * 20000, max_tokens=2)
        assert info.value.status_code == 413
        assert info.value.body["code"] == "request_too_large"
        assert "4096" in info.value.body["message"]
        # Chunked upload (no Content-Length) is counted too.
        r = httpx.post(srv.url + "/v1/completions", content=iter([b" " * 3000] * 3))
        assert r.status_code == 413
        ok = _client(srv).completions.create(model=MODEL, prompt="the", max_tokens=2)
        assert ok.usage.completion_tokens == 2


# -- many clients ------------------------------------------------------------------------------
def test_burst_of_concurrent_clients(server: BackgroundServer, client: openai.OpenAI) -> None:
    prompts = [f"the {w} model" for w in ("fast", "draft", "local", "code", "data", "token",
                                          "value", "list", "speed", "test")]

    def ask(prompt: str, stream: bool) -> str:
        kw = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
              "max_tokens": 24, "temperature": 0}
        if stream:
            return "".join(c.choices[0].delta.content or ""
                           for c in client.chat.completions.create(stream=True, **kw))
        return client.chat.completions.create(**kw).choices[0].message.content or ""

    expected = {p: ask(p, False) for p in prompts}
    assert len(set(expected.values())) > 1  # different prompts, different answers
    results: dict[tuple[str, bool], str] = {}
    errors: list[BaseException] = []

    def worker(prompt: str, stream: bool) -> None:
        try:
            results[(prompt, stream)] = ask(prompt, stream)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(p, s)) for p in prompts for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(results) == 2 * len(prompts)
    for (prompt, _stream), text in results.items():
        assert text == expected[prompt]


def test_disconnect_cancels_generation(server: BackgroundServer, client: openai.OpenAI,
                                       server_log: pytest.LogCaptureFixture) -> None:
    before = _metrics(server)
    stream = _long_stream(client)
    got = 0
    for _chunk in stream:
        got += 1
        if got == 5:
            break
    stream.close()
    t0 = time.monotonic()
    # The engine is freed for the next client long before 3500 tokens would be done.
    resp = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5,
                                          temperature=0)
    assert resp.usage.completion_tokens == 5
    after = _metrics(server)
    cancelled = after["requests_finished_total"].get("cancelled", 0) \
        - before["requests_finished_total"].get("cancelled", 0)
    assert cancelled == 1
    generated = after["completion_tokens_total"] - before["completion_tokens_total"]
    assert generated < 3500
    assert time.monotonic() - t0 < 10
    # A client that leaves is not a server error.
    assert after["request_errors_total"] == before["request_errors_total"]
    assert not [r for r in server_log.records if r.exc_info or r.levelno >= logging.WARNING]


def test_client_timeout_counts_as_cancelled_not_as_an_error(server: BackgroundServer) -> None:
    before = _metrics(server)
    long = {"messages": [{"role": "user", "content": "a long story"}], "max_tokens": 3500,
            "temperature": 1.0, "seed": 1}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=long,
                   timeout=httpx.Timeout(30, read=0.5))
    assert _wait_for(lambda: _cancelled(server) == before["requests_finished_total"]
                     .get("cancelled", 0) + 1)
    after = _metrics(server)
    assert after["request_errors_total"] == before["request_errors_total"]  # no 503
    assert after["completion_tokens_total"] - before["completion_tokens_total"] < 3500
    text = httpx.get(server.url + "/metrics").text
    assert 'localspec_requests_finished_total{reason="cancelled"}' in text
    assert 'localspec_request_errors_total{status="503"}' not in text


def test_client_timing_out_in_the_queue_counts_as_cancelled(engine: SpeculativeEngine) -> None:
    with _serve(engine, queue_size=4) as srv:
        c = _client(srv)
        worker = srv._server.config.app.state.localspec.worker  # type: ignore[attr-defined]
        running = _long_stream(c, "one")
        next(x for x in running if x.choices and x.choices[0].delta.content)  # generating now
        with pytest.raises(httpx.ReadTimeout):  # waits behind "one", gives up
            httpx.post(srv.url + "/v1/completions", json={"prompt": "two", "max_tokens": 5},
                       timeout=httpx.Timeout(30, read=0.5))
        assert _wait_for(lambda: worker.queued == 0)
        later = _long_stream(c, "three")  # its arrival drops "two" from the queue
        running.close()
        later.close()
        assert _wait_for(lambda: _cancelled(srv) == 3)  # one, two and three
        assert _errors(srv) == {}


@pytest.mark.parametrize("stream", [False, True])
def test_shutdown_cancelling_a_generation_is_a_503_error(engine: SpeculativeEngine,
                                                          stream: bool) -> None:
    long = {"prompt": "a long story", "max_tokens": 3500, "temperature": 1.0, "seed": 2,
            "stream": stream}
    with _serve(engine) as srv:
        worker = srv._server.config.app.state.localspec.worker  # type: ignore[attr-defined]
        if stream:
            with httpx.stream("POST", srv.url + "/v1/completions", json=long, timeout=30) as r:
                lines = (ln for ln in r.iter_lines() if ln)
                next(lines)  # generating now
                worker.close()  # what the server's shutdown does
                *_, last_event, done = lines
            assert done == "data: [DONE]"
            error = json.loads(last_event.removeprefix("data: "))["error"]
        else:
            answers: list[httpx.Response] = []
            asking = threading.Thread(target=lambda: answers.append(
                httpx.post(srv.url + "/v1/completions", json=long, timeout=30)))
            asking.start()
            assert _wait_for(lambda: worker.busy)
            worker.close()
            asking.join(30)
            (answer,) = answers
            assert answer.status_code == 503
            error = answer.json()["error"]
        assert error["code"] == "cancelled" and "shutting down" in error["message"]
        assert _errors(srv) == {"503": 1}
        assert _cancelled(srv) == 1


def test_full_queue_answers_429(engine: SpeculativeEngine) -> None:
    with _serve(engine, queue_size=1) as srv:
        c = _client(srv)
        running = _long_stream(c, "one")
        next(c for c in running if c.choices and c.choices[0].delta.content)  # generating now
        waiting = _long_stream(c, "two")  # headers come at once: it is queued
        with pytest.raises(openai.RateLimitError) as info:
            c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
        assert int(info.value.response.headers["retry-after"]) >= 1
        assert info.value.body["code"] == "queue_full"
        assert _metrics(srv)["queue_waiting"] == 1
        running.close()
        waiting.close()
        ok = c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
        assert ok.usage.completion_tokens == 2


def test_metrics_prometheus(server: BackgroundServer, client: openai.OpenAI) -> None:
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    assert "# TYPE localspec_completion_tokens_total counter" in text
    assert 'localspec_requests_total{endpoint="chat"}' in text
    data = _metrics(server)
    assert data["completion_tokens_total"] >= 4
    assert data["draft_tokens_total"] >= data["draft_tokens_accepted_total"]


def test_engine_factory_loads_on_the_worker(target_gguf: Path) -> None:
    gate = threading.Event()

    def factory() -> SpeculativeEngine:
        gate.wait(10)
        return SpeculativeEngine.load(target_gguf, None, ModelSettings(n_ctx=256))

    from localspec.engine import DraftSettings

    app = create_app(factory, ServerConfig(model_id="solo", draft=DraftSettings(mode="none")))
    with BackgroundServer(app) as srv:
        assert httpx.get(srv.url + "/health").status_code == 503
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "Retry-After" in r.headers
        assert _errors(srv) == {"503": 1}  # unavailable is a server error, unlike a client leaving
        gate.set()
        # Loading calibrates the pair with timed decodes: slow when the CPUs are shared.
        assert app.state.localspec.worker.loaded.wait(60)
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
        out = _client(srv).completions.create(model="solo", prompt="the", max_tokens=3)
        assert out.usage.completion_tokens == 3


# -- the remote client -------------------------------------------------------------------------
def test_remote_engine_streams_like_the_engine(server: BackgroundServer, client: openai.OpenAI,
                                               engine: SpeculativeEngine) -> None:
    """Through HTTP, the same events as in-process: text chunks with their drafted flags, then
    one Finished with every statistic (localspec's extension fields)."""
    expected = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=20,
                                              temperature=0).choices[0].message.content
    with RemoteEngine(server.url) as remote:
        assert [m["id"] for m in remote.list_models()] == [MODEL]
        events = list(remote.stream_chat(HELLO, ChatOptions(
            max_tokens=20, sampling=SamplingParams(temperature=0.0))))
        assert remote.info.draft is not None and remote.info.has_draft_model
    done = events[-1]
    assert isinstance(done, Finished)
    assert "".join(e.text for e in events[:-1]) == done.text == expected
    assert done.finish_reason == "length"
    s = done.stats
    assert s.completion_tokens == 20 and s.drafted >= s.accepted > 0
    assert s.target_passes < 20 and sum(s.k_counts.values()) == s.target_passes - 1
    assert s.policy == "fixed K=3" and s.decode_seconds > 0 and s.total_seconds > 0
    drafted_text = "".join(e.text for e in events[:-1] if e.drafted)
    assert drafted_text  # the colouring of accepted text crosses the boundary


def test_remote_engine_sends_this_requests_drafting(server: BackgroundServer) -> None:
    """The chat app's settings (draft mode, K, exact) apply across the process boundary."""
    from localspec.engine import DraftSettings

    with RemoteEngine(server.url) as remote:
        plain = list(remote.stream_chat(HELLO, ChatOptions(
            max_tokens=20, draft=DraftSettings(mode="none"))))[-1]
        fixed = list(remote.stream_chat(HELLO, ChatOptions(
            max_tokens=20, draft=DraftSettings(mode="model", k=5))))[-1]
    assert plain.stats.drafted == 0 and plain.stats.policy.startswith("plain decoding")
    assert fixed.stats.policy == "fixed K=5" and fixed.stats.k_counts[5] > 0
    assert plain.text == fixed.text


def test_remote_engine_errors_and_cancel(server: BackgroundServer) -> None:
    with RemoteEngine(server.url + "/v1", model="nope") as remote:
        with pytest.raises(RemoteError, match="does not exist"):
            list(remote.stream_completion("the", ChatOptions(max_tokens=2)))
    with RemoteEngine("http://127.0.0.1:9") as remote:
        with pytest.raises(RemoteError, match="cannot reach"):
            remote.list_models()
    cancel = threading.Event()
    with RemoteEngine(server.url) as remote:
        events = []
        for event in remote.stream_chat(HELLO, ChatOptions(
                max_tokens=3500, sampling=SamplingParams(temperature=1.0, seed=3)),
                cancel=cancel):
            events.append(event)
            if len(events) == 3:
                cancel.set()
    done = events[-1]
    assert isinstance(done, Finished) and done.finish_reason == "cancelled"
    assert len(events) == 4  # nothing more was read once cancelled


def test_sse_wire_format(server: BackgroundServer) -> None:
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"prompt": "the", "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


# -- `localspec serve`: the address is checked before the models load --------------------------
@pytest.fixture()
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def load_engine(_spec: object) -> None:
        raise AssertionError("models were loaded")

    monkeypatch.setattr(localspec.loading, "load_engine", load_engine)


@pytest.mark.parametrize("port", ["99999", "-1", "65536", "eighty"])
def test_serve_rejects_a_bad_port(port: str, no_loading: None,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--target", "model.gguf", f"--port={port}"])
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("localspec: error: argument --port: must be a whole number >= 0 and <= 65535, "
                    f"got {port} (see `localspec serve --help`)")


@pytest.mark.parametrize("host", ["127.0.0.1:8080", "http://127.0.0.1", ""])
def test_serve_rejects_a_host_with_a_port_or_scheme(host: str, no_loading: None,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--target", "model.gguf", f"--host={host}"])
    assert info.value.code == 2
    assert "argument --host:" in capsys.readouterr().err


def test_serve_port_in_use_is_one_line_before_loading(no_loading: None,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--target", "model.gguf", "--port", str(port)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"localspec: error: 127.0.0.1:{port} is already in use (another localspec serve? "
        "pick --port)"]


def test_serve_unresolvable_host_is_a_usage_error(no_loading: None,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--target", "model.gguf", "--host", "no-such-host.invalid"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("localspec: error: --host no-such-host.invalid does not resolve")


def test_serve_announces_the_port_it_listens_on(pair: tuple[Path, Path]) -> None:
    """A real `localspec serve` process on every precision (F32, Q8_0, Q4_K_M): it names its
    port (--port 0) as it starts loading, announces it again once it answers, serves a chat
    through the official client, and stops cleanly."""
    target_gguf, draft_gguf = pair
    proc = subprocess.Popen([sys.executable, "-m", "localspec", "serve", "--target",
                             str(target_gguf), "--draft", str(draft_gguf), "--ctx", "256",
                             "--port", "0"], stderr=subprocess.PIPE, text=True,
                            # SIGINT's default even under a runner that ignores it (started
                            # in the background): the test sends serve a Ctrl-C.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:  # ends early (EOF) if the server fails
            lines.append(line)
            if "serving" in line:
                break
        assert len(lines) == 2 and lines[0].startswith("localspec: loading"), lines
        found = re.search(r"at (http://127\.0\.0\.1:(\d+))/v1 ", lines[1])
        assert found and int(found[2]) != 0, lines
        # The port is known, and said, before the models load (a script waits on /health).
        assert f"(listening on {found[1]})" in lines[0], lines
        # Announced only once it answers.
        health = httpx.get(found[1] + "/health", timeout=5)
        assert health.json()["status"] == "ok"
        client = openai.OpenAI(base_url=found[1] + "/v1", api_key="x", max_retries=0)
        reply = client.completions.create(model=client.models.list().data[0].id,
                                          prompt="the model", max_tokens=12, temperature=0)
        assert reply.usage.completion_tokens == 12
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
        assert code >= 0, f"serve was killed by signal {-code}"
        assert code == 130
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
