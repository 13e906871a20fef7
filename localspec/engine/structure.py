"""Structured output: an answer held to a JSON Schema, to any JSON object, or to a grammar (what
a forced tool call must be).

At each position the target decides, the tokens the schema does not allow there are masked out
of its logits before the choice (greedy, coupled or sampled, as without a schema). llguidance,
the grammar engine llama.cpp itself can use, matches the schema against this vocabulary's
tokens (a mask in well under a millisecond on a 152k vocabulary); this module is the engine's
small protocol over it, so the decoding loop knows only "which tokens may come next" and "this
token came".

A drafted token the schema forbids differs from the target's masked choice and is rejected like
any other, so the text is the target's constrained text whatever was drafted (greedy and seeded
coupled sampling give the same answer with drafting on or off). The draft model is masked too,
by a fork of the answer's state, only so that it does not waste its guesses on tokens that
cannot be accepted.
"""

from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import LocalspecError

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

# The schema of OpenAI's JSON mode (``response_format: {"type": "json_object"}``): any object.
ANY_OBJECT = '{"type": "object"}'
# Whitespace between JSON tokens, unless a schema's "x-guidance" says otherwise: as much as
# pretty-printing 16 levels deep takes, and no more, so a model cannot loop on spaces until
# max_tokens (llguidance's default is any amount).
_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,64}"


class SchemaError(ValueError):
    """A JSON Schema or grammar that cannot hold an answer (not JSON, not an object, or a
    grammar llguidance refuses); the message says why."""


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """What an answer must be: JSON matching ``schema``, a JSON Schema as JSON text, or, where
    ``lark`` is set, text of that grammar (llguidance's Lark dialect, whose ``%json {...}``
    holds a part to a schema). Plain data, so a request carrying it crosses to an engine
    process."""

    schema: str = ANY_OBJECT
    lark: str | None = None

    def grammar(self) -> str:
        """llguidance's grammar for the schema or Lark text; SchemaError where it is neither."""
        return _grammar(self.schema) if self.lark is None else _lark_grammar(self.lark)

    def check(self) -> None:
        """SchemaError where the schema cannot hold an answer (before a request is queued)."""
        self.grammar()

    def response_format(self) -> dict[str, Any]:
        """The OpenAI ``response_format`` that asks a server for the same (a schema's: the
        wire has none for a grammar)."""
        if self.lark is not None:
            raise ValueError("a grammar has no OpenAI response_format")
        if self.schema == ANY_OBJECT:
            return {"type": "json_object"}
        return {"type": "json_schema",
                "json_schema": {"name": "answer", "schema": json.loads(self.schema),
                                "strict": True}}

    @classmethod
    def from_argument(cls, value: str) -> OutputFormat:
        """``--schema``: ``object`` (any JSON object), a file holding a schema, or its JSON
        text; checked (SchemaError says why it cannot hold an answer)."""
        if value == "object":
            return cls()
        text = value
        if not value.lstrip().startswith("{"):
            try:
                text = Path(value).read_text(encoding="utf-8")
            except OSError as exc:
                raise SchemaError(f"cannot read {value} ({exc.strerror or exc})") from None
            except UnicodeDecodeError:
                raise SchemaError(f"{value} is not UTF-8 text") from None
        out = cls(text)
        out.check()
        return out


# Compiled once per schema and process: a request's schema is checked before it is queued and
# compiled again where its answer starts, and agents send the same schema request after request.
@functools.lru_cache(maxsize=32)
def _grammar(schema: str) -> str:
    from llguidance import LLMatcher

    try:
        value = json.loads(schema)
    except (TypeError, ValueError, RecursionError) as exc:
        raise SchemaError(f"the schema is not JSON text ({exc})") from None
    if not isinstance(value, dict):
        raise SchemaError("the schema must be a JSON object")
    try:
        grammar = LLMatcher.grammar_from_json_schema(
            value, defaults={"whitespace_pattern": _WHITESPACE})
    except (ValueError, RecursionError) as exc:
        raise SchemaError(_one_line(str(exc))) from None
    return _validated(grammar)


@functools.lru_cache(maxsize=32)
def _lark_grammar(lark: str) -> str:
    from llguidance import LLMatcher

    return _validated(LLMatcher.grammar_from_lark(lark))


def _validated(grammar: str) -> str:
    from llguidance import LLMatcher

    error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if error:
        raise SchemaError(_one_line(messages[0] if messages else ""))
    return grammar


def _one_line(message: str) -> str:
    return " ".join(message.split()) or "not a schema"


def vocabulary_tokenizer(vocab: Any) -> LLTokenizer:
    """llguidance's view of a loaded llama.cpp vocabulary (about a second for 152k tokens:
    build once per model)."""
    from llguidance.llamacpp import lltokenizer_from_vocab

    with warnings.catch_warnings():  # it reads each token's attributes by a deprecated name
        warnings.simplefilter("ignore", DeprecationWarning)
        return lltokenizer_from_vocab(vocab)


class OutputGuide:
    """One sequence's schema state: the mask of the tokens that may come next, and the tokens
    that came, in order (the target's answer, or a fork's draft)."""

    def __init__(self, matcher: LLMatcher) -> None:
        self._matcher = matcher

    @classmethod
    def start(cls, tokenizer: LLTokenizer, fmt: OutputFormat) -> OutputGuide:
        """The state before an answer's first token."""
        from llguidance import LLMatcher

        matcher = LLMatcher(tokenizer, fmt.grammar(), log_level=0)
        if matcher.is_error():  # a schema this vocabulary cannot write: the request's
            raise SchemaError(_one_line(matcher.get_error()))
        return cls(matcher)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with every token the schema forbids next at -inf (a copy). Logits past
        the vocabulary the schema was compiled for (a draft's larger one) are forbidden."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)
        n = logits.shape[-1]
        if allowed.size < n:
            allowed = np.concatenate([allowed, np.zeros(n - allowed.size, dtype=bool)])
        return np.where(allowed[:n], logits, -np.inf).astype(logits.dtype, copy=False)

    def fork(self) -> OutputGuide:
        """A copy to draft with: advanced over a draft's tokens, it leaves this one where the
        answer is."""
        return OutputGuide(self._matcher.deep_copy())

    def advance(self, token: int) -> None:
        """``token`` came next (one the mask allowed)."""
        self._matcher.consume_token(token)
        self._check()

    def _check(self) -> None:
        if self._matcher.is_error():
            # Only a bug would get here: every token advanced was one the mask allowed.
            raise LocalspecError(f"response format: {self._matcher.get_error()}")
