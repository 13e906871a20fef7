"""Tool calls over the OpenAI wire format: the ``tools`` a request offers, the tool turns of its
messages, and the calls read back out of the model's text.

The model is told about the tools by its own chat template (the ``tools`` variable, as Hugging
Face templates take it) and answers a call as text, in the format that template asks for.
localspec reads three (``FORMATS``): Qwen2.5/Qwen3, Hermes and the many templates that copied
them, a JSON object ``{"name": ..., "arguments": ...}`` between ``<tool_call>`` and
``</tool_call>``; Llama 3.1-3.3, such an object (with ``"parameters"``) as the whole answer;
and Mistral's, a ``[TOOL_CALLS]`` token and a JSON array of them. Any of these forms is read
whatever the template (Qwen2.5-Coder writes the untagged one under its own). A call without
tags counts only as the whole answer; any call, only to a tool that was offered. Where
``tool_choice`` forces a call, the answer is held to a grammar of these forms
(``forced_calls``); where a tool is ``strict``, any call is held so from where it begins
(``held_calls``). A template that does not take tools, or asks for calls in another format,
is a 400 naming it, so a client never believes a tool was offered to a model that was not
shown it. Text that does not parse as calls
is answered as text: nothing the model wrote is dropped.

Pure functions and one small state machine; nothing here touches HTTP or the engine.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..engine.structure import OutputFormat, SchemaError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


class ToolError(ValueError):
    """A request's tools, tool choice or tool turn that cannot be served; ``param`` names it,
    ``unsupported`` tells a value localspec does not serve from one that is malformed."""

    def __init__(self, param: str, message: str, unsupported: bool = False) -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.unsupported = unsupported


# -- the request ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's tools: those the model is shown, the names one of which its answer must
    call (``tool_choice`` "required" or a named function; empty: the model chooses), and
    whether a forced answer may hold several calls (``parallel_tool_calls``)."""

    tools: tuple[dict[str, Any], ...] = ()
    forced: tuple[str, ...] = ()
    parallel: bool = True
    # The tools whose "strict" is true: a call to one is held to its parameters even where
    # the model chooses whether to call (see ``held_calls``).
    strict: tuple[str, ...] = ()

    @property
    def held(self) -> bool:
        """Whether a grammar holds the answer's calls (``forced_calls``, ``held_calls``)."""
        return bool(self.forced or self.strict)


def parse_tools(value: Any, choice: Any, parallel: Any = None) -> ToolRequest:
    """The tools the model is shown (none where ``tool_choice`` is "none": the model is not
    to call one, so it is not told of them), the call ``tool_choice`` forces, and the tools
    whose ``strict`` is true."""
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", "'parallel_tool_calls' must be true or false")
    if value is None:
        tools: tuple[dict[str, Any], ...] = ()
    elif not isinstance(value, list):
        raise ToolError("tools", "'tools' must be a list of {'type': 'function', 'function': "
                                 "{...}} objects")
    else:
        tools = tuple(_tool(item, f"tools[{i}]") for i, item in enumerate(value))
    mode = _tool_choice(choice, tools)
    if mode == "none":
        return ToolRequest()
    forced = () if mode == "auto" else \
        tuple(t["function"]["name"] for t in tools) if mode == "required" else (mode,)
    strict = tuple(item["function"]["name"] for item in value or ()
                   if item["function"].get("strict") is True)
    return ToolRequest(tools, forced, parallel is not False, strict)


def _tool_choice(value: Any, tools: Sequence[dict[str, Any]]) -> str:
    """"auto", "none", "required", or the name of the function a call must be to."""
    if value is None or value in ("auto", "none"):
        return value or "auto"
    if value == "required" or isinstance(value, dict):
        if not tools:
            raise ToolError("tool_choice", "'tool_choice' can force a call only to one of "
                                           "the 'tools' offered, and none were")
        if value == "required":
            return "required"
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if value.get("type") != "function" or not isinstance(name, str):
            raise ToolError("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' "
                                           "or {'type': 'function', 'function': {'name': ...}}")
        if name not in {t["function"]["name"] for t in tools}:
            raise ToolError("tool_choice.function.name",
                            f"'tool_choice' names the function {name!r}, which is not among "
                            "the 'tools' offered")
        return name
    raise ToolError("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' or an "
                                   "object naming a function")


def _tool(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict) or item.get("type") != "function":
        raise ToolError(where, f"'{where}' must be an object with type 'function' (the only "
                               "kind of tool there is)")
    fn = item.get("function")
    if not isinstance(fn, dict):
        raise ToolError(f"{where}.function", f"'{where}.function' must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ToolError(f"{where}.function.name",
                        f"'{where}.function.name' must be a non-empty string")
    for key, kind, label in (("description", str, "a string"),
                             ("parameters", dict, "a JSON Schema object"),
                             ("strict", bool, "true or false")):
        if fn.get(key) is not None and not isinstance(fn[key], kind):
            raise ToolError(f"{where}.function.{key}", f"'{where}.function.{key}' must be {label}")
    clean = {k: v for k, v in fn.items() if k in ("name", "description", "parameters")
             and v is not None}
    return {"type": "function", "function": clean}


def assistant_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An earlier answer's ``tool_calls``, as the chat template renders them: each call's
    arguments as an object (clients send OpenAI's JSON string; templates print the object)."""
    if not isinstance(value, list):
        raise ToolError(f"{where}.tool_calls", f"'{where}.tool_calls' must be a list")
    calls = []
    for i, call in enumerate(value):
        at = f"{where}.tool_calls[{i}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(at, f"'{at}' must be an object with function.name and "
                                "function.arguments")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):  # a decode error, or nesting or digits past
                # what Python parses
                raise ToolError(f"{at}.function.arguments",
                                f"'{at}.function.arguments' is not JSON") from None
        out: dict[str, Any] = {"type": "function",
                               "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            out["id"] = call["id"]
        calls.append(out)
    return calls


# The call formats localspec reads, by the chat template that asks for them. Parsing is the same
# for all (any of the forms below, to a tool that was offered); a format decides which templates
# are served and the calls' ids.
ToolFormat = Literal["tagged", "json", "mistral"]
FORMATS: dict[ToolFormat, str] = {
    "tagged": f"{OPEN}{{...}}{CLOSE} as Qwen and Hermes templates ask",
    "json": '{"name": ..., "parameters": ...} as the whole answer, as Llama 3.1-3.3 templates ask',
    "mistral": '[TOOL_CALLS] [{"name": ..., "arguments": ...}] as Mistral templates ask',
}
_MISTRAL_TAG = "[TOOL_CALLS]"
# Special tokens that open a call in the json and Mistral formats. They are control tokens, which
# the answer's text leaves out; where a model file makes them plain text they are stripped.
_CALL_PREFIXES = ("<|python_tag|>", _MISTRAL_TAG)


def tool_format(template: str | None, model: str) -> ToolFormat:
    """The call format ``model``'s chat template asks for; refused where the template would not
    show the tools, or asks for calls in a format localspec does not read."""
    if not template or "tools" not in template:
        raise ToolError("tools", f"the chat template of {model} does not take tools, so the "
                                 "model could not be told of them", unsupported=True)
    if OPEN in template:
        return "tagged"
    if _MISTRAL_TAG in template:
        return "mistral"
    # Llama 3.1-3.3: the tools in a user turn, a call answered as {"name": ..., "parameters":
    # ...} and rendered back so, its result in an "ipython" turn.
    # (Functionary's, on the same headers, asks for <function=...> and names no such key.)
    if "<|start_header_id|>" in template and '"parameters": ' in template:
        return "json"
    raise ToolError("tools", f"the chat template of {model} asks for tool calls in a format "
                             f"localspec does not read (it reads {'; '.join(FORMATS.values())})",
                    unsupported=True)


def _call_id(fmt: ToolFormat) -> str:
    # Mistral's templates refuse a call rendered back whose id is not 9 letters or digits.
    return uuid.uuid4().hex[:9] if fmt == "mistral" else "call_" + uuid.uuid4().hex[:24]


# -- a forced call ------------------------------------------------------------------------------
# Where tool_choice forces a call, the answer is held to a grammar of the forms read below: the
# template's own tags (Qwen, Hermes) or the untagged JSON every format's reader takes, bare or
# fenced. The model picks among them; the arguments are held to the tool's parameters. A format's
# control tokens (Mistral's [TOOL_CALLS], Llama's <|python_tag|>) are left out: each vocabulary
# names them differently, and the untagged JSON is read without them.
_ARGUMENTS_KEY: dict[ToolFormat, str] = {"tagged": "arguments", "json": "parameters",
                                         "mistral": "arguments"}
# Whitespace in a call: a space, or a line break and some indent (llama.cpp's rule for JSON in its
# grammars). Templates render calls back on one line, so a model writes them so; more only lets
# a weak model fill max_tokens with blanks.
_CALL_SPACE = r" |\n[ \t]{0,20}"
# Between calls: untagged ones, bare (Llama's ";" or a blank), or in an array (Mistral's).
_BARE_SEPARATOR, _LISTED_SEPARATOR = 'WS? ";"? WS?', 'WS? "," WS?'


def forced_calls(request: ToolRequest, fmt: ToolFormat,
                 tags: tuple[int, int] | None = None) -> OutputFormat:
    """What the answer must be where ``tool_choice`` forces a call: one call (several, where
    ``parallel``) to a tool of ``request.forced``, in a form of ``fmt`` that this module reads
    back; a ToolError names a tool whose parameters cannot hold arguments. ``tags``: the
    vocabulary's own tokens for the two tags, where it has them (see ``call_tags``)."""
    many = functools.partial(_many, parallel=request.parallel)
    rules = {"start": "calls | \"```\" \"json\"? WS? calls WS? \"```\"",
             "calls": many("call", _BARE_SEPARATOR)}
    if fmt == "mistral":
        rules["calls"] = '"[" WS? ' + many("call", _LISTED_SEPARATOR) + ' WS? "]"'
    if fmt == "tagged":
        rules["start"] += " | " + many("tagged", "WS?")
        opened, closed = f'"{OPEN}"', f'"{CLOSE}"'
        if tags:  # the vocabulary's own tokens, or the tags in pieces: whichever the model likes
            opened, closed = f"({opened} | <[{tags[0]}]>)", f"({closed} | <[{tags[1]}]>)"
        rules["tagged"] = f"{opened} WS? call WS? {closed}"
    rules["call"] = _call_rules(rules, request, fmt, request.forced, request.forced)
    # A line break after the last call, before the end: it would otherwise have to begin
    # another call.
    rules["start"] = f"({rules['start']}) WS?"
    return _checked(rules)


def _call_rules(rules: dict[str, str], request: ToolRequest, fmt: ToolFormat,
                names: Collection[str], held: Collection[str], either_key: bool = False) -> str:
    """Adds to ``rules`` a rule ``call_i`` for each tool of ``names``, its arguments held to
    its parameters where it is one of ``held`` (any object otherwise), and ``after_i``, the
    call after its arguments' key (under the format's key, or ``either_key`` of those read);
    returns the rule that is any of the calls."""
    # Each call spelled out, its arguments a schema of their own: a tool's "$ref"s point into
    # its parameters, which would not resolve nested inside a call's schema.
    key = json.dumps(json.dumps(_ARGUMENTS_KEY[fmt]))
    if either_key:
        key = "(" + " | ".join(json.dumps(json.dumps(k)) for k in sorted(_ARGUMENTS)) + ")"
    calls = []
    for i, tool in enumerate(request.tools):
        fn = tool["function"]
        if fn["name"] in names:
            rules[f"call_{i}"] = (f'"{{" WS? "\\"name\\"" WS? ":" WS? {_lark_string(fn["name"])}'
                                  f' WS? "," WS? {key} WS? ":" after_{i}')
            rules[f"after_{i}"] = f'WS? arguments_{i} WS? "}}"'
            schema = _arguments_schema(fn, f"tools[{i}].function.parameters") \
                if fn["name"] in held else _ANY_ARGUMENTS
            rules[f"arguments_{i}"] = "%json " + json.dumps(schema)
            calls.append(f"call_{i}")
    rules["WS"] = f"/{_CALL_SPACE}/"
    return " | ".join(calls)


# A call's arguments where they are not held to the tool's parameters: an object, with
# whitespace as pretty-printing takes but bounded (a model must not loop on blanks).
_ANY_ARGUMENTS = {"type": "object",
                  "x-guidance": {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,64}"}}


def _lark_string(text: str) -> str:
    """``text`` as a JSON string, as a Lark literal."""
    return json.dumps(json.dumps(text, ensure_ascii=False), ensure_ascii=False)


def _checked(rules: Mapping[str, str]) -> OutputFormat:
    lark = "\n".join(f"{name}: {rule}" for name, rule in rules.items())
    out = OutputFormat(lark=lark)
    try:
        out.check()
    except SchemaError as exc:
        raise ToolError("tools", f"the tools cannot be held to a call: {exc}") from None
    return out


# -- a strict tool's call, where the model chooses whether to call ------------------------------
# Under tool_choice "auto" with a tool whose "strict" is true, the answer is free text until it
# begins a call; from there on it is held, as a forced call is: a strict tool's arguments to its
# parameters, another tool's to an object. A call begins at a <tool_call> tag (the vocabulary's
# own token, or spelled out), at a format's opening control token (Mistral's [TOOL_CALLS],
# Llama's <|python_tag|>) as the answer's first, or where the answer begins as an untagged call,
# bare, in an array or fenced: {"name": "<an offered tool>", "arguments": (or "parameters").
# Text that begins no call is not touched: a JSON answer that names no offered tool, or names
# one without arguments (data, as the reader takes it), is free, and so is a call in words
# ("Call it so: {...}"), which is not read as one. Not held either, though read: the arguments
# before the name, and Mistral's name{arguments}.
_ANY_SPACE = r"[ \t\r\n]*"
_ANY_TEXT = r"(.|\n)*"


def held_calls(request: ToolRequest, fmt: ToolFormat, tags: tuple[int, int] | None = None,
               opener: int | None = None) -> OutputFormat:
    """What the answer must be where ``tool_choice`` is "auto" and some tools are strict
    (``request.strict``): any text, except that a call, from where it begins, is one in a
    form of ``fmt`` to an offered tool, a strict one's arguments held to its parameters.
    ``tags``: the vocabulary's own tokens for the two tags (see ``call_tags``); ``opener``:
    the format's control token that opens a call, where the vocabulary has it."""
    rules: dict[str, str] = {"start": "bare | free"}
    names = [t["function"]["name"] for t in request.tools]
    rules["call"] = _call_rules(rules, request, fmt, names, request.strict, either_key=True)
    rules |= _untagged_rules(request)
    if opener is not None:  # then calls, in an array (Mistral's) or not, as a forced answer's
        many = functools.partial(_many, parallel=request.parallel)
        listed = '"[" WS? ' + many("call", _LISTED_SEPARATOR) + ' WS? "]"'
        rules["start"] += f' | <[{opener}]> WS? ({listed} | {many("call", _BARE_SEPARATOR)}) WS?'
    rules |= _tagged_rules(tags, request.parallel)
    return _checked(rules)


def _untagged_rules(request: ToolRequest) -> dict[str, str]:
    """``bare``: an answer that is untagged calls; ``FIRST``: text that does not begin as one.
    A call's head, up to its arguments' key, is one lexeme, so that FIRST (a lexeme too) is
    told from it where the head is whole."""
    fence = rf"{_ANY_SPACE}(```(json)?{_ANY_SPACE})?" + \
        "".join(rf"({re.escape(p)}{_ANY_SPACE})?" for p in _CALL_PREFIXES)
    rules: dict[str, str] = {}
    heads, plain, listed = [], [], []
    for i, tool in enumerate(request.tools):
        head = _call_head(re.escape(json.dumps(tool["function"]["name"], ensure_ascii=False)))
        heads.append(rf"(\[{_ANY_SPACE})?{head}")
        rules[f"HEAD_{i}"] = _lark_regex(fence + head)
        rules[f"LISTED_{i}"] = _lark_regex(rf"{fence}\[{_ANY_SPACE}{head}")
        plain.append(f"HEAD_{i} after_{i}")
        listed.append(f"LISTED_{i} after_{i}")
    then, among = (f" ({_BARE_SEPARATOR} call)*", f" ({_LISTED_SEPARATOR} call)*") \
        if request.parallel else ("", "")
    rules["bare"] = (f'(({" | ".join(plain)}){then} | ({" | ".join(listed)}){among} WS? "]")'
                     ' (WS? "```")? WS?')
    rules["FIRST"] = _excluding(fence + "(" + "|".join(heads) + ")") + \
        f" & ~{_lark_regex(_ANY_TEXT + re.escape(OPEN) + _ANY_TEXT)}"
    return rules


def _call_head(name: str) -> str:
    """A call's head up to its arguments' key and colon, as a regex that llguidance and ``re``
    read alike: the grammar's head, and what a stream reads as one (``_CallScanner``).
    ``name``: the pattern of the tool's name as a JSON string."""
    key = "(" + "|".join(re.escape(json.dumps(k)) for k in sorted(_ARGUMENTS)) + ")"
    return rf'\{{{_ANY_SPACE}"name"{_ANY_SPACE}:{_ANY_SPACE}{name}{_ANY_SPACE},' \
        rf"{_ANY_SPACE}{key}{_ANY_SPACE}:"


def _tagged_rules(tags: tuple[int, int] | None, parallel: bool) -> dict[str, str]:
    """``free``: text, and the calls between tags in it. The reader takes tags in any format.
    No text holds the tag spelled out but where it opens a held call, so every tag in a held
    answer opens one (which is what lets a stream send a call as it is written)."""
    closed = json.dumps(CLOSE) + (f" | <[{tags[1]}]>" if tags else "")
    # A tag spelled out ends the text before it (one lexeme with it, so that the text's lexeme
    # is not cut short before the tag's last character); the vocabulary's own tag token is no
    # text, so the text before it has ended there.
    token = f"<[{tags[0]}]>" if tags else None
    rules = {"opened": "first_tag" + (f" | FIRST {token}" if token else ""),
             "first_tag[lazy]": f"FIRST {json.dumps(OPEN)}",
             "block": f"WS? call WS? ({closed})",
             "REST": _excluding(re.escape(OPEN), anywhere=True)}
    if not parallel:  # one call: the text after it opens no other
        return rules | {"free": "FIRST | opened block REST"}
    return rules | {"free": "FIRST | opened block (again block)* REST",
                    "again": "tag" + (f" | REST {token}" if token else ""),
                    "tag[lazy]": f"REST {json.dumps(OPEN)}"}


def _excluding(pattern: str, anywhere: bool = False) -> str:
    """A Lark token of any text but that which begins (or, ``anywhere``, holds) ``pattern``."""
    before = _ANY_TEXT if anywhere else ""
    return f"{_lark_regex(_ANY_TEXT)} & ~{_lark_regex(before + pattern + _ANY_TEXT)}"


def _lark_regex(pattern: str) -> str:
    """``pattern`` as a Lark regex literal (a "/" in it would end one)."""
    return "/" + pattern.replace("/", r"\/") + "/"


def call_tags(special_token: Callable[[str], int | None]) -> tuple[int, int] | None:
    """The tokens a vocabulary spells the two tags with, where both are its own (Qwen's and
    Hermes' are). A grammar's literal text is never written as such a token (llguidance
    keeps those for a grammar that names them), so without them a forced call could have its
    tags only in pieces, not as the model's template writes them."""
    opened, closed = special_token(OPEN), special_token(CLOSE)
    return (opened, closed) if opened is not None and closed is not None else None


def call_opener(fmt: ToolFormat, control_token: Callable[[str], int | None]) -> int | None:
    """The control token that opens a call in ``fmt`` (Mistral's ``[TOOL_CALLS]``, Llama's
    ``<|python_tag|>``), where the vocabulary has it: under a grammar, a token not named in it
    could not be written, and a model that opens its calls so would be kept from calling."""
    tag = {"mistral": _MISTRAL_TAG, "json": "<|python_tag|>"}.get(fmt)
    return control_token(tag) if tag else None


def _many(item: str, separator: str, parallel: bool) -> str:
    return f"{item} ({separator} {item})*" if parallel else item


def _arguments_schema(fn: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The schema a call's arguments to ``fn`` are held to: its parameters, as an object (a
    client parses arguments as one), with a call's whitespace unless they say otherwise."""
    parameters = dict(fn.get("parameters") or {"type": "object"})
    if parameters.setdefault("type", "object") != "object":
        raise ToolError(where, f"'{where}' must describe an object: a call's arguments are one")
    parameters.setdefault("x-guidance", {"whitespace_pattern": f"(?:{_CALL_SPACE})?"})
    try:
        OutputFormat(json.dumps(parameters)).check()
    except (SchemaError, RecursionError) as exc:  # RecursionError: json.dumps of deep nesting
        raise ToolError(where, f"'{where}' cannot hold a call's arguments: {exc}") from None
    return parameters


# -- the answer ----------------------------------------------------------------------------------
# A call written without tags is read only as the whole answer, bare or in a ```json fence, and
# only for a tool that was offered: a JSON object (Qwen2.5-Coder answers so under its own tools
# template, 1.5B Q4_K_M here: ```json {"name": "get_weather", "arguments": {...}} ```; Llama 3.x
# under its own, with "parameters"), several separated by ";", a JSON array of them (Mistral),
# or name{arguments} (Mistral's newer templates: [TOOL_CALLS]name[ARGS]{...}, the two control
# tokens left out of the text).
# A fence's either side may be missing (an answer cut short, or a model that opens none).
_FENCE_OPEN, _FENCE_CLOSE = re.compile(r"\A```(?:json)?\s*"), re.compile(r"\s*```\Z")
_DECODER = json.JSONDecoder()


def split_tool_calls(text: str, names: Collection[str] = (), fmt: ToolFormat = "tagged"
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """The answer's content (None where only calls were written) and its calls in OpenAI's
    shape: ``<tool_call>`` blocks, or an answer that is nothing but calls (see above), each to
    a tool of ``names``. Where any block is not a call's JSON, or calls a tool that was not
    offered (which no client could run), the whole text is content."""
    calls = []
    for match in _CALL.finditer(text):
        call = _call(match.group(1), fmt)
        if call is None or call["function"]["name"] not in names:
            return text, []
        calls.append(call)
    if calls:
        return _CALL.sub("", text).strip() or None, calls
    calls = _untagged_calls(text, names, fmt)
    return (None, calls) if calls else (text, [])


def _untagged_calls(text: str, names: Collection[str], fmt: ToolFormat) -> list[dict[str, Any]]:
    body = _FENCE_CLOSE.sub("", _FENCE_OPEN.sub("", text.strip()))
    for prefix in _CALL_PREFIXES:
        body = body.removeprefix(prefix).lstrip()
    values = _json_values(body) if body.startswith(("{", "[")) else _named_calls(body, names)
    objects = [o for v in values or () for o in (v if isinstance(v, list) else [v])]
    # Untagged, an object is a call only with its arguments: {"name": "search", ...} alone
    # may be data the answer is about.
    calls = [_call_of(o, fmt) if isinstance(o, dict) and _ARGUMENTS & o.keys() else None
             for o in objects]
    if not calls or any(c is None or c["function"]["name"] not in names for c in calls):
        return []
    return [c for c in calls if c is not None]


def _json_values(body: str) -> list[Any] | None:
    """The JSON values ``body`` holds one after another (whitespace or ";" between them), or
    None where anything else is there."""
    values: list[Any] = []
    i = 0
    while True:
        while i < len(body) and (body[i].isspace() or body[i] == ";"):
            i += 1
        if i == len(body):
            return values
        try:
            value, i = _DECODER.raw_decode(body, i)
        except (ValueError, RecursionError):  # not JSON, or nested past what Python parses
            return None
        values.append(value)


def _named_calls(body: str, names: Collection[str]) -> list[Any] | None:
    """``name{arguments}`` one after another, each name an offered tool's; None otherwise."""
    calls: list[Any] = []
    while body:
        name = max((n for n in names if body.startswith(n)), key=len, default=None)
        rest = body[len(name):].lstrip() if name else ""
        if not rest.startswith("{"):
            return None
        try:
            arguments, end = _DECODER.raw_decode(rest)
        except (ValueError, RecursionError):
            return None
        calls.append({"name": name, "arguments": arguments})
        body = rest[end:].lstrip()
    return calls


def _call(body: str, fmt: ToolFormat) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested or long past what Python parses
        return None
    return _call_of(obj, fmt)


_ARGUMENTS = frozenset({"arguments", "parameters"})


def _call_of(obj: Any, fmt: ToolFormat) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    try:  # JSON as a client parses it: no NaN, and nesting that Python writes back
        arguments = args if isinstance(args, str) else \
            json.dumps({} if args is None else args, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return None
    return {"id": _call_id(fmt), "type": "function",
            "function": {"name": obj["name"], "arguments": arguments}}


def _bare_start(text: str, names: Collection[str]) -> bool | None:
    """Whether an answer beginning so is a call without tags: True, False, or None while
    too little of it has come to tell."""
    compact = _compact(text)
    openings = ("{", "[{", *(_compact(name) + "{" for name in names))
    starts = tuple(fence + prefix + opening for fence in ("```json", "```", "")
                   for prefix in ("", *_CALL_PREFIXES, "".join(_CALL_PREFIXES))
                   for opening in openings)
    if compact.startswith(starts):
        return True
    return None if any(form.startswith(compact) for form in starts) else False


def _compact(text: str) -> str:
    return re.sub(r"\s+", "", text)


@dataclass(slots=True)
class ToolCallStream:
    """A streamed answer's text, passed on as content until a call may have begun: from a
    ``<tool_call>`` on (or the start of one at a chunk's end), or from an answer's start that
    may be a call without tags, it is held, to be read as calls at the finish, or, if it is
    not one, sent then as content. ``names``: the tools offered; ``fmt``: the template's.

    ``piecewise``: the answer is held to a grammar of calls (``forced_calls``,
    ``held_calls``), so a call that has begun is one: each is sent as it is written
    (``pieces``), its name once its arguments begin and then its arguments as they come, as
    OpenAI streams a call."""

    names: Collection[str] = ()
    fmt: ToolFormat = "tagged"
    piecewise: bool = False
    _held: str = ""
    _calling: bool = False
    _opening: bool = True  # the answer's start is still to be told a bare call or not
    _scanner: _CallScanner | None = None

    def feed(self, text: str) -> str:
        """The part of ``text`` to send as content now."""
        if self._calling:
            self._held += text
            return ""
        text = self._held + text
        if self._opening:
            bare = _bare_start(text, self.names)
            if bare is None:
                self._held = text
                return ""
            self._opening = False
            if bare:
                self._calling, self._held = True, text
                return ""
        at = text.find(OPEN)
        if at >= 0:
            self._calling = True
            self._held = text[at:]
            return text[:at]
        # Hold a tail that could be the beginning of OPEN.
        keep = next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1)
                     if OPEN.startswith(text[-n:])), 0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def pieces(self) -> list[dict[str, Any]]:
        """With ``piecewise``: what the calls held so far add to what was sent of them, as a
        stream's ``delta.tool_calls`` (a call's first with its id and name)."""
        if not (self.piecewise and self._calling):
            return []
        if self._scanner is None:
            self._scanner = _CallScanner(self.names, self.fmt, self._held.startswith(OPEN))
        return self._scanner.pieces(self._held)

    @property
    def streamed(self) -> int:
        """How many calls ``pieces`` began."""
        return self._scanner.begun if self._scanner is not None else 0

    def release(self) -> str:
        """The text held so far, as content: the answer ended without a finish (an error).
        Calls streamed in pieces were sent as calls; the text around them is content."""
        held, self._held, self._calling = self._held, "", False
        return self._around_calls(held) if self.streamed else held

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The content still to send, and the calls (all, also those streamed in pieces: the
        first ``streamed`` of them were sent so)."""
        held, self._held = self._held, ""
        if not self._calling:
            return held, []
        content, calls = split_tool_calls(held, self.names, self.fmt)
        if self.streamed:
            # Read as the stream sent it: the calls, or (cut short by max_tokens or a stop
            # string, or arguments a client could not parse) none more than were sent.
            return self._around_calls(held), calls if len(calls) >= self.streamed else []
        if not calls:
            return held, []
        # Text after the calls is content too, sent after the text before them.
        return content or "", calls

    def _around_calls(self, held: str) -> str:
        """The text of a held answer that is not its calls (once ``pieces`` read it): between
        and after tagged ones (an untagged answer is calls alone)."""
        assert self._scanner is not None
        return _CALL.sub("", held).strip() if self._scanner.tagged else ""


# Where a held answer's next call begins, up to its arguments, once they have begun (a
# grammar holds them to an object): in a tagged answer, right after a tag (every tag in a held
# answer opens a call); in an untagged one, past what may come between calls (the last one's
# closing brace, blanks, separators, fences and a format's openings).
_HEAD = _call_head(r'("(?:[^"\\]|\\.)*")') + _ANY_SPACE + r"(?=\{)"
_TAGGED_HEAD = re.compile(re.escape(OPEN) + _ANY_SPACE + _HEAD)
_UNTAGGED_HEAD = re.compile(
    r"(?:\s|[;,\[\]}]|```(?:json)?|" + "|".join(map(re.escape, _CALL_PREFIXES)) + r")*" + _HEAD)
# How far past where a head may begin it is looked for: a head is short, and a window keeps
# each look from reading all of a long text that is none.
_HEAD_WINDOW = 256


@dataclass(slots=True)
class _CallScanner:
    """The calls of a held answer as they are written, read once: each call's name where its
    arguments begin, then its arguments up to where the object they are closes. ``tagged``:
    the answer's calls are in tags (else it is untagged calls alone)."""

    names: Collection[str]
    fmt: ToolFormat
    tagged: bool
    begun: int = 0  # calls whose name was sent
    _at: int = 0  # where reading goes on: the next call's head, or the open call's arguments
    _sent: int | None = None  # how far the open call's arguments were sent (None: no call open)
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _done: bool = False  # what follows the last call is no call this reads

    def pieces(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while not self._done:
            if self._sent is None and not self._begin(text, out):
                break
            assert self._sent is not None
            end = self._scan(text)
            upto = len(text) if end is None else end
            if upto > self._sent:  # one delta per call and chunk, as OpenAI sends them
                if out and out[-1]["index"] == self.begun - 1:
                    out[-1]["function"]["arguments"] += text[self._sent:upto]
                else:
                    out.append({"index": self.begun - 1,
                                "function": {"arguments": text[self._sent:upto]}})
            self._sent = upto
            if end is None:
                break
            self._sent = None
        return out

    def _begin(self, text: str, out: list[dict[str, Any]]) -> bool:
        """Whether the next call's head is written: its first delta then goes to ``out``."""
        at = self._at
        if self.tagged:
            found = text.find(OPEN, at)
            if found < 0:  # no tag yet: the next look starts where one could still begin
                self._at = max(at, len(text) - len(OPEN) + 1)
                return False
            at = self._at = found
        limit = at + _HEAD_WINDOW + max(map(len, self.names), default=0)
        match = (_TAGGED_HEAD if self.tagged else _UNTAGGED_HEAD).match(text, at, limit)
        name = _json_string(match.group(1)) if match else None
        if match is None or name not in self.names:
            # Not written yet, or (a window read, or a name no grammar let through) not a call.
            self._done = len(text) >= limit or match is not None
            return False
        out.append({"index": self.begun, "id": _call_id(self.fmt), "type": "function",
                    "function": {"name": name, "arguments": ""}})
        self.begun += 1
        self._sent = self._at = match.end()
        return True

    def _scan(self, text: str) -> int | None:
        """Where the open call's arguments end (past their closing brace), or None while
        they go on; scanned from where the last look stopped."""
        for i in range(self._at, len(text)):
            ch = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._at = i + 1
                    return i + 1
        self._at = len(text)
        return None


def _json_string(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def call_deltas(calls: Sequence[Mapping[str, Any]], first: int = 0) -> list[dict[str, Any]]:
    """The calls as a stream's ``delta.tool_calls``: each whole, with its index (from
    ``first``)."""
    return [{"index": first + i, **dict(call)} for i, call in enumerate(calls)]
