"""The OpenAI wire format: request validation into engine terms, responses, error bodies.

Pure functions over dicts; nothing here touches HTTP or the engine, so it is tested directly.
A parameter that would change the answer and that localspec cannot honour is a 400 naming it,
never silently dropped: a client must not believe it got ``logprobs`` or ``n=3`` when it did not.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ..engine.decoder import Finished, GenerationRequest
from ..engine.sampling import SamplingParams
from ..engine.stats import GenerationStats
from ..engine.structure import OutputFormat, SchemaError
from ..requests import ChatOptions
from .config import ServerConfig
from .tool_calls import (
    ToolError,
    ToolFormat,
    ToolRequest,
    assistant_tool_calls,
    parse_tools,
    split_tool_calls,
)

Kind = Literal["chat", "completion"]

# Fields read by every generating endpoint.
_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options",
    "frequency_penalty", "presence_penalty", "n", "logprobs", "logit_bias", "user",
    # llama.cpp-style extensions (llama-server and vLLM accept the same names)
    "top_k", "min_p", "repeat_penalty", "repetition_penalty", "repeat_last_n",
    # chat's, and llama-server's on completions too (``run --raw --schema --url`` sends it)
    "response_format",
    # localspec's own: how this request drafts (see `localspec run --help`)
    "exact", "draft_mode", "k", "k_max", "accept_rule", "history", "fit_max_tokens",
    # accepted and ignored: they do not change the generated text
    "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
}
_CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs",
              "modalities", "parallel_tool_calls", "tools", "tool_choice"}
_COMPLETION_ONLY = {"prompt", "echo", "best_of", "suffix"}
_ROLES = {"system", "developer", "user", "assistant", "tool"}
# What the OpenAI SDK's ``model_dump()`` of a reply's message adds beside role and content: fields
# that say "none" when null or empty, so a client that sends an earlier answer back is served.
_MESSAGE_EMPTY_FIELDS = {"refusal", "tool_calls", "function_call", "audio", "annotations"}


class ApiError(Exception):
    """An error answered as an OpenAI error body with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, which its clients parse into the exception message."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_param(param: str, message: str, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, why: str = "") -> ApiError:
    detail = f": {why}" if why else ""
    return ApiError(400, f"localspec does not support the parameter '{param}'{detail}",
                    param=param, code="unsupported_parameter")


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated request, before tokenization.

    Exactly one of ``messages``, ``prompt`` and ``prompt_tokens`` is set.
    """

    kind: Kind
    model: str | None
    messages: tuple[dict[str, Any], ...] | None
    prompt: str | None
    prompt_tokens: tuple[int, ...] | None
    max_tokens: int | None  # None: as many as the context holds, up to the server's limit
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    draft: dict[str, Any] = field(default_factory=dict)  # localspec's drafting fields
    # localspec's extension: a max_tokens past the context is cut to what it holds, as the
    # engine in process does (sent by localspec's own clients), instead of a 400.
    fit_max_tokens: bool = False
    # The tools the model is shown (its answer is read for calls to them), and the call
    # ``tool_choice`` forces.
    tool_request: ToolRequest = ToolRequest()
    # ``response_format``'s schema, which the answer is held to (None: free text).
    output: OutputFormat | None = None

    @property
    def tools(self) -> tuple[dict[str, Any], ...]:
        return self.tool_request.tools

    @property
    def tool_names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def tool_turns(self) -> bool:
        """Whether the messages hold earlier calls or tool results: only a template that
        takes tools renders them."""
        return any(m["role"] == "tool" or "tool_calls" in m for m in self.messages or ())


# -- request validation ------------------------------------------------------------------------
def parse_request(body: Any, kind: Kind, config: ServerConfig) -> ParsedRequest:
    """Validate a decoded JSON body for /v1/chat/completions or /v1/completions."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_text(body)
    # A null field is the field left out, as OpenAI reads it (clients send every field of a
    # typed request, the unset ones as null).
    body = {key: value for key, value in body.items() if value is not None}
    allowed = _COMMON | (_CHAT_ONLY if kind == "chat" else _COMPLETION_ONLY)
    for key in body:
        if key not in allowed:
            raise unsupported(key)
    _reject_unsupported_values(body, kind)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_param("model", "'model' must be a string")
    messages = prompt = prompt_tokens = None
    tools = ToolRequest()
    if kind == "chat":
        try:
            tools = parse_tools(body.get("tools"), body.get("tool_choice"),
                                body.get("parallel_tool_calls"))
            messages = _messages(body.get("messages"))
        except ToolError as exc:
            raise tool_error(exc) from None
    else:
        prompt, prompt_tokens = _prompt(body.get("prompt"))
    output = _response_format(body.get("response_format"))
    if output is not None and tools.tools:
        raise unsupported("response_format", "with tools: the whole answer is held to the "
                          "schema, so the model could not call one")
    stream = _bool(body, "stream", False)
    fit = _bool(body, "fit_max_tokens", False)
    include_usage = _stream_options(body.get("stream_options"), stream)
    return ParsedRequest(kind=kind, model=model, messages=messages, prompt=prompt,
                         prompt_tokens=prompt_tokens, max_tokens=_max_tokens(body, config, fit),
                         sampling=_sampling(body, config.default_sampling),
                         stop=_stop(body.get("stop"), config.max_stop_strings), stream=stream,
                         include_usage=include_usage, draft=_draft_fields(body),
                         fit_max_tokens=fit, tool_request=tools, output=output)


def _response_format(value: Any) -> OutputFormat | None:
    """``response_format``: text, any JSON object (``json_object``), or JSON matching a schema
    (``json_schema``; held to it whether or not ``strict`` is set)."""
    where = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat()
    if kind != "json_schema":
        raise bad_param(where, "'response_format' must be {'type': 'text'}, {'type': "
                               "'json_object'} or {'type': 'json_schema', 'json_schema': {...}}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_param(f"{where}.json_schema", "'response_format.json_schema' must be an "
                                                "object holding the 'schema'")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_param(f"{where}.json_schema.schema",
                        "'response_format.json_schema.schema' must be a JSON Schema object")
    try:
        out = OutputFormat(json.dumps(schema))
        out.check()
    except (SchemaError, RecursionError) as exc:  # RecursionError: json.dumps of deep nesting
        raise bad_param(f"{where}.json_schema.schema",
                        f"'response_format.json_schema.schema' cannot hold an answer: {exc}") \
            from None
    return out


def tool_error(exc: ToolError) -> ApiError:
    if exc.unsupported:
        return ApiError(400, exc.message, param=exc.param, code="unsupported_parameter")
    return bad_param(exc.param, exc.message)


def _check_text(body: dict[str, Any]) -> None:
    """Every string, names included, must be text UTF-8 can hold. JSON's ``"\\ud800"`` decodes
    to a lone surrogate, which fails only later (tokenizing it, or echoing it in an error body)
    as a 500; so it is a 400 naming the field, before anything else reads the body. Walked with
    a stack, not recursion (nesting is bounded only by the JSON decoder), and a field's path is
    spelled out only for the one that is named."""
    stack: list[tuple[Any, _Path]] = [(body, None)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_string(value, path)
        elif isinstance(value, dict):
            fields = []
            for key, item in value.items():
                where = (path, key)
                _check_string(key, where, name=True)
                if isinstance(item, str | dict | list):
                    fields.append((item, where))
            stack.extend(reversed(fields))  # reversed: the first bad field is the one named
        elif isinstance(value, list):
            stack.extend((item, (path, i)) for i, item in reversed(list(enumerate(value)))
                         if isinstance(item, str | dict | list))


# A field's place in the body: (the parent's place, a key or an index); None is the body.
_Path = tuple[Any, str | int] | None


def _spell(path: _Path) -> str:
    """``messages[0].content`` for ((((None, "messages"), 0), "content"))."""
    parts: list[str | int] = []
    while path is not None:
        path, part = path
        parts.append(part)
    out = ""
    for part in reversed(parts):
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out.encode("utf-8", "backslashreplace").decode("utf-8")


def _check_string(text: str, path: _Path, name: bool = False) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = _spell(path)
        bad = ascii(text[exc.start])[1:-1]
        what = f"the field name '{where}'" if name else f"'{where}'"
        raise bad_param(where, f"{what} holds a lone UTF-16 surrogate ({bad}), which is not "
                               "text: send valid Unicode") from None


def _reject_unsupported_values(body: dict[str, Any], kind: Kind) -> None:
    """Fields that are accepted only at the value that means 'not used'."""
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise unsupported("n", "only n=1 (one choice per request) is served")
    if kind == "completion" and body.get("best_of") not in (None, 1):
        raise unsupported("best_of", "only best_of=1 is served")
    # Chat's logprobs is a flag; the completions' is a count, where 0 still asks for the chosen
    # token's log-probability. Compared by identity: 0 == False in Python.
    logprobs = body.get("logprobs")
    if logprobs is not None and not (kind == "chat" and logprobs is False):
        raise unsupported("logprobs")
    if body.get("top_logprobs") not in (None, 0):
        raise unsupported("top_logprobs")
    if body.get("logit_bias"):
        raise unsupported("logit_bias")
    if body.get("echo"):
        raise unsupported("echo")
    if body.get("suffix"):
        raise unsupported("suffix")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise unsupported("modalities", "only ['text']")
    if body.get("store"):
        raise unsupported("store", "completions are not stored")


def _messages(value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise bad_param("messages", "'messages' must be a non-empty list", "missing_required"
                        if value is None else "invalid_value")
    out = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad_param(where, f"'{where}' must be an object")
        role = msg.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            if role == "function":
                raise unsupported(f"{where}.role", "the 'function' role is OpenAI's old name "
                                                   "for 'tool': send tool results as 'tool'")
            raise bad_param(f"{where}.role",
                            f"'{where}.role' must be one of {', '.join(sorted(_ROLES))}")
        calls = msg.get("tool_calls") if role == "assistant" else None
        for key, field_value in msg.items():
            if key in ("role", "content", "name") or (key == "tool_calls" and calls):
                continue
            if key == "tool_call_id" and role == "tool":
                if not isinstance(field_value, str):
                    raise bad_param(f"{where}.tool_call_id",
                                    f"'{where}.tool_call_id' must be a string")
                continue
            if key in _MESSAGE_EMPTY_FIELDS and field_value in (None, [], ""):
                continue
            raise unsupported(f"{where}.{key}")
        # 'developer' is OpenAI's newer name for 'system'; chat templates know only the latter.
        # An answer that only called tools has no content (null, as OpenAI sends it back).
        content = "" if calls and msg.get("content") is None \
            else _content(msg.get("content"), where)
        item: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                "content": content}
        if calls:
            item["tool_calls"] = assistant_tool_calls(calls, where)
        if role == "tool" and "tool_call_id" in msg:
            item["tool_call_id"] = msg["tool_call_id"]
        out.append(item)
    return tuple(out)


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise unsupported(f"{where}.content[{j}]", "only text content parts")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_param(f"{where}.content", f"'{where}.content' must be a string or text parts")


def _prompt(value: Any) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(value, str):
        return value, None
    if isinstance(value, list) and value:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return None, tuple(value)
        if len(value) == 1 and isinstance(value[0], str):
            return value[0], None
        inner = value[0]
        # One list of token ids in a list: OpenAI's batch form with one prompt. Unwrapped once,
        # not recursively, so a deeply nested body cannot exhaust the stack here.
        if len(value) == 1 and isinstance(inner, list) and inner \
                and all(isinstance(t, int) and not isinstance(t, bool) for t in inner):
            return None, tuple(inner)
        raise unsupported("prompt", "one prompt per request (a string or a list of token ids)")
    raise bad_param("prompt", "'prompt' must be a string or a list of token ids",
                    "missing_required" if value is None else "invalid_value")


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_param(key, f"'{key}' must be true or false")
    return value


def _stream_options(value: Any, stream: bool) -> bool:
    if value is None:
        return False
    if not isinstance(value, dict):
        raise bad_param("stream_options", "'stream_options' must be an object")
    for key in value:
        if key != "include_usage":
            raise unsupported(f"stream_options.{key}")
    if not stream:
        raise bad_param("stream_options", "'stream_options' is only allowed with stream=true")
    return _bool(value, "include_usage", False)


def _number(body: dict[str, Any], key: str, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_param(key, f"'{key}' must be a number")
    low_ok = lo is None or (value > lo if lo_open else value >= lo)
    if not low_ok or (hi is not None and value > hi):
        lo_s = "" if lo is None else f"{'>' if lo_open else '>='} {lo}"
        hi_s = "" if hi is None else f"<= {hi}"
        rng = " and ".join(s for s in (lo_s, hi_s) if s)
        raise bad_param(key, f"'{key}' must be {rng}, got {value}")
    return float(value)


def _integer(body: dict[str, Any], key: str, lo: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_param(key, f"'{key}' must be an integer")
    if lo is not None and value < lo:
        raise bad_param(key, f"'{key}' must be >= {lo}, got {value}")
    return value


def _max_tokens(body: dict[str, Any], config: ServerConfig, fit: bool) -> int | None:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    value = _integer(body, key, lo=1)
    if value is not None and value > config.max_tokens_limit and fit:
        return config.max_tokens_limit  # "as many as you give", like the context's cut
    if value is not None and value > config.max_tokens_limit:
        raise bad_param(key, f"'{key}' is {value} but this server allows at most "
                             f"{config.max_tokens_limit} (--max-tokens-limit)")
    return value


def _sampling(body: dict[str, Any], base: SamplingParams) -> SamplingParams:
    """Sampling fields, each checked against localspec's one definition of its range
    (``params.PARAMS``: the CLI and config.toml accept exactly the same values)."""
    changes: dict[str, Any] = {}
    for key in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                "top_k", "repeat_last_n", "seed"):
        value = body.get(key)
        if value is None:
            continue
        if key == "top_k" and value == -1:
            value = 0  # -1 is vLLM's and llama.cpp's "disabled" for top_k; ours is 0
        if key == "seed" and value == -1 and not isinstance(value, bool):
            changes[key] = None  # llama-server's "a random seed", not a fixed seed of -1
            continue
        changes[key] = _checked(key, value)
    for key in ("repeat_penalty", "repetition_penalty"):  # llama.cpp's and vLLM's names
        value = body.get(key)
        if value is not None:
            value = _checked("repeat_penalty", value, label=key)
            if "repeat_penalty" in changes and changes["repeat_penalty"] != value:
                raise bad_param(key, "'repeat_penalty' and 'repetition_penalty' disagree")
            changes["repeat_penalty"] = value
    return replace(base, **changes)


def _checked(name: str, value: Any, label: str | None = None) -> Any:
    from ..params import PARAMS, InvalidOptionError

    label = label or name
    try:
        return PARAMS[name].check(value, label=f"'{label}'")
    except InvalidOptionError as exc:
        raise bad_param(label, exc.message) from None


def _draft_fields(body: dict[str, Any]) -> dict[str, Any]:
    """localspec's extension: draft_mode, k (a number or "auto"), k_max, accept_rule, exact,
    history ("on"/"off", or true/false)."""
    out: dict[str, Any] = {}
    for key in ("draft_mode", "k", "k_max", "accept_rule", "exact", "history"):
        if key not in body or body[key] is None:
            continue
        value = body[key]
        if key == "k" and isinstance(value, str) and value.lower() == "auto":
            out[key] = None
            continue
        if key == "history":  # DraftSettings holds it as a bool
            out[key] = value if isinstance(value, bool) else _checked(key, value) == "on"
            continue
        out[key] = _checked(key, value)
    return out


def _stop(value: Any, limit: int) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_param("stop", "'stop' must be a string or a list of strings")
    if len(stops) > limit:
        raise bad_param("stop", f"at most {limit} stop strings, got {len(stops)}")
    return tuple(s for s in stops if s)


# -- responses ---------------------------------------------------------------------------------
def new_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(stats: GenerationStats) -> dict[str, int]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}


def timings(stats: GenerationStats) -> dict[str, Any]:
    """llama-server's ``timings`` names for the same quantities, plus localspec's own."""
    predicted_s = max(stats.total_seconds - stats.ttft_seconds, 0.0)
    return {
        "prompt_n": stats.prompt_tokens,
        "prompt_ms": round(stats.prefill_seconds * 1000, 3),
        "prompt_per_second": round(stats.prompt_tokens / stats.prefill_seconds, 3)
        if stats.prefill_seconds > 0 else 0.0,
        "predicted_n": stats.completion_tokens,
        "predicted_ms": round(predicted_s * 1000, 3),
        "predicted_per_second": round(stats.decode_tokens_per_second, 3),
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "mean_accepted_length": round(stats.mean_accepted_length, 3),
        "draft_rounds": stats.draft_rounds,
        "target_passes": stats.target_passes,
        "ttft_ms": round(stats.ttft_seconds * 1000, 3),
        "total_ms": round(stats.total_seconds * 1000, 3),
        "tokens_per_second": round(stats.tokens_per_second, 3),
    }


def finish_reason(done: Finished, called: bool = False) -> str:
    # "cancelled" is localspec's; OpenAI clients know only stop, length and tool_calls.
    if called:
        return "tool_calls"
    return "length" if done.finish_reason == "length" else "stop"


def full_response(kind: Kind, rid: str, model: str, done: Finished,
                  tool_names: Collection[str] = (), fmt: ToolFormat = "tagged") -> dict[str, Any]:
    """A non-streamed chat.completion or text_completion; ``tool_names``: the tools the model
    was shown, so its text is read for calls (``fmt``: its template's call format)."""
    if kind == "chat":
        content, calls = split_tool_calls(done.text, tool_names, fmt) if tool_names \
            else (done.text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(done, bool(calls)),
                                  "logprobs": None, "message": message}
    else:
        choice = {"index": 0, "text": done.text, "finish_reason": finish_reason(done),
                  "logprobs": None}
    return {**_envelope(kind, rid, model, chunk=False), "choices": [choice],
            "usage": usage(done.stats), "timings": timings(done.stats),
            "localspec": {"stats": done.stats.to_json()}}


def chunk(kind: Kind, rid: str, model: str, text: str | None = None, *, first: bool = False,
          drafted: bool = False, done: Finished | None = None,
          pieces: Sequence[Mapping[str, Any]] = (), called: bool = False) -> dict[str, Any]:
    """One streamed chunk: the role (chat, first), a text delta, calls or pieces of them (a
    stream's ``delta.tool_calls``, see ``call_deltas``), or the finish with timings
    (``called``: the answer called tools)."""
    reason = finish_reason(done, called) if done is not None else None
    if kind == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if pieces:
            delta["tool_calls"] = list(pieces)
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason,
                                  "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
    out = {**_envelope(kind, rid, model, chunk=True), "choices": [choice]}
    if drafted:  # localspec's extension: this text was accepted from a drafter
        out["localspec"] = {"drafted": True}
    if done is not None:
        out["timings"] = timings(done.stats)
        out["localspec"] = {"stats": done.stats.to_json()}  # every statistic, for clients
    return out


def usage_chunk(kind: Kind, rid: str, model: str, done: Finished) -> dict[str, Any]:
    """The extra last chunk of ``stream_options.include_usage``: no choices, only usage."""
    return {**_envelope(kind, rid, model, chunk=True), "choices": [],
            "usage": usage(done.stats)}


def _envelope(kind: Kind, rid: str, model: str, chunk: bool) -> dict[str, Any]:
    obj = {"chat": ("chat.completion", "chat.completion.chunk"),
           "completion": ("text_completion", "text_completion")}[kind][chunk]
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "system_fingerprint": "localspec"}


def models_list(model_id: str, aliases: Sequence[str], owned_by: str, created: int,
                meta: Mapping[str, Any]) -> dict[str, Any]:
    """``/v1/models``: one model (the pair), with the other names it answers to."""
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                        "owned_by": owned_by, "aliases": list(aliases),
                                        "meta": dict(meta)}]}


def sse(payload: Mapping[str, Any] | str) -> bytes:
    """One server-sent event line pair."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


# The wire's names for localspec's drafting fields, and DraftSettings' names for them.
_DRAFT_FIELDS = {"draft_mode": "mode", "k": "k", "k_max": "k_max", "accept_rule": "rule",
                 "exact": "exact", "history": "history"}


def request_options(parsed: ParsedRequest, config: ServerConfig) -> ChatOptions:
    """The request's options for ``requests.build_request``: its drafting fields over the
    server's drafting, and its max_tokens (the server's default when it names none, which
    :func:`fit_context` fits to the context once the prompt is tokenized)."""
    draft = replace(config.draft, **{_DRAFT_FIELDS[k]: v for k, v in parsed.draft.items()})
    return ChatOptions(max_tokens=parsed.max_tokens or config.default_max_tokens,
                       sampling=parsed.sampling, stop=parsed.stop, draft=draft,
                       tools=parsed.tools, output=parsed.output)


def fit_context(req: GenerationRequest, parsed: ParsedRequest, n_ctx: int,
                config: ServerConfig) -> GenerationRequest:
    """``req`` checked against the context window: a prompt that does not fit, or does not
    leave room for the max_tokens asked for (unless ``fit_max_tokens``), is a 400; a request
    that asked for none gets what the context holds, up to the server's default and limit."""
    param = "messages" if parsed.kind == "chat" else "prompt"
    n = len(req.prompt_tokens)
    if n == 0:
        raise bad_param(param, "the prompt is empty")
    if n >= n_ctx:
        raise ApiError(400, f"this model's maximum context length is {n_ctx} tokens, but the "
                            f"prompt has {n} tokens; shorten it (or restart the server with a "
                            "larger --ctx)", param=param, code="context_length_exceeded")
    if parsed.max_tokens is not None and n + parsed.max_tokens > n_ctx:
        if parsed.fit_max_tokens:
            return replace(req, max_tokens=n_ctx - n)
        raise ApiError(400, f"this model's maximum context length is {n_ctx} tokens, but "
                            f"{n + parsed.max_tokens} were requested ({n} in the prompt, "
                            f"{parsed.max_tokens} for the completion); lower max_tokens",
                       param="max_tokens", code="context_length_exceeded")
    if parsed.max_tokens is not None:
        return req
    return replace(req, max_tokens=min(config.default_max_tokens, config.max_tokens_limit,
                                       n_ctx - n))
