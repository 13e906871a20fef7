"""Settings and messages -> the engine's request: the one path every front end uses.

``run``, ``bench``, ``demo``, the engine process behind ``serve`` and the chat app, and
:class:`~localspec.chat_engine.LocalChatEngine` (the library's chat contract) all turn what they
were given into a ``GenerationRequest`` with :func:`build_request`. So the chat template, the
tokenizing, and the drafting rule, "the draft model when one is loaded, else prompt lookup"
(:func:`draft_mode_for`), are written here once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from .engine import DraftSettings, GenerationRequest, SamplingParams, drafters
from .engine.structure import OutputFormat
from .params import DEFAULT_MAX_TOKENS

if TYPE_CHECKING:
    from .options import Settings

# What a request is asked with: chat messages (rendered with the target's template), a raw
# prompt (no template), or token ids (a server's /v1/completions may send those).
Messages = Sequence[Mapping[str, object]]  # ChatMessage dicts (a TypedDict is one)
Prompt = Messages | str | tuple[int, ...]

# Where a drafter that needs a draft model is asked for and none is loaded, prompt lookup
# drafts instead (it needs nothing but the prompt).
FALLBACK_MODE = drafters.PromptLookupDrafter.name


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How to answer one request. ``draft`` None: the engine's own drafting (a server's
    configuration); the in-process engine then drafts with its draft model when it has one."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: SamplingParams = SamplingParams()
    draft: DraftSettings | None = None
    stop: tuple[str, ...] = ()
    # The tools the chat template shows the model (OpenAI's ``tools`` objects), for messages.
    tools: tuple[Mapping[str, object], ...] = ()
    # The JSON Schema the answer is held to (None: free text).
    output: OutputFormat | None = None


class Encoder(Protocol):
    """What building a request needs of the engine: its template, its tokenizer and whether it
    holds a draft model (``SpeculativeEngine`` is one)."""

    @property
    def draft(self) -> object | None: ...

    def chat_prompt(self, messages: Sequence[Mapping[str, object]],
                    tools: Sequence[Mapping[str, object]] = ()) -> str: ...

    def tokenize(self, text: str, *, chat: bool) -> tuple[int, ...]: ...


def draft_mode_for(mode: str, has_draft_model: bool) -> str:
    """The rule, once: ``mode``, or prompt lookup where ``mode``'s drafter needs a draft model
    and none is loaded. An unknown mode is returned as it is (its check names it)."""
    if (mode in drafters.names() and drafters.get(mode).needs_draft_model
            and not has_draft_model):
        return FALLBACK_MODE
    return mode


def recommended_mode(has_draft_model: bool) -> str:
    """What files draft with when nothing says otherwise: the default mode, under the rule."""
    return draft_mode_for(DraftSettings().mode, has_draft_model)


def fit_draft(draft: DraftSettings, has_draft_model: bool) -> DraftSettings:
    """``draft`` with :func:`draft_mode_for`'s mode (every other setting kept)."""
    mode = draft_mode_for(draft.mode, has_draft_model)
    return draft if mode == draft.mode else replace(draft, mode=mode)


def draft_from_settings(settings: Settings, mode: str | None = None) -> DraftSettings:
    """The settings' drafting fields; ``mode`` (the one a pair was loaded with) overrides
    ``settings.draft_mode``. The rule is applied when the request is built."""
    return DraftSettings(mode=mode or settings.draft_mode, k=settings.k, k_max=settings.k_max,
                         rule=settings.accept_rule,  # type: ignore[arg-type]
                         exact=settings.exact, history=settings.history == "on")


def options_from_settings(settings: Settings, *, draft_mode: str | None = None,
                          stop: Sequence[str] = (), draft: bool = True) -> ChatOptions:
    """A request's options from settings (config.toml and flags). ``draft`` False: leave the
    drafting to the engine (a server's own configuration)."""
    from .options import sampling_params

    return ChatOptions(max_tokens=settings.max_tokens, sampling=sampling_params(settings),
                       draft=draft_from_settings(settings, draft_mode) if draft else None,
                       stop=tuple(stop))


# What of a message reaches the chat template beside its role and content: an answer's tool
# calls and the call a tool's result answers (a server's message may also carry a name: not
# rendered).
_TOOL_FIELDS = ("tool_calls", "tool_call_id")


def prompt_tokens(engine: Encoder, prompt: Prompt,
                  tools: Sequence[Mapping[str, object]] = ()) -> tuple[int, ...]:
    """The prompt's tokens: messages (and the tools offered) through the target's chat
    template, a string as it is."""
    if isinstance(prompt, str):
        return engine.tokenize(prompt, chat=False)
    if prompt and all(isinstance(t, int) for t in prompt):
        return tuple(prompt)  # type: ignore[arg-type]
    messages: list[dict[str, object]] = []
    for m in prompt:
        msg: dict[str, object] = {"role": str(m["role"]),  # type: ignore[index]
                                  "content": str(m["content"])}  # type: ignore[index]
        msg.update({k: m[k] for k in _TOOL_FIELDS if k in m})  # type: ignore[operator,index]
        messages.append(msg)
    return engine.tokenize(engine.chat_prompt(messages, tools), chat=True)


def build_request(engine: Encoder, prompt: Prompt, options: ChatOptions,
                  default_draft: DraftSettings | None = None) -> GenerationRequest:
    """The engine's request for ``prompt`` under ``options``. ``options.draft`` None drafts as
    ``default_draft`` (a server's configuration; by default the draft model); either way the
    rule of :func:`draft_mode_for` applies to what this engine holds."""
    draft = options.draft or default_draft or DraftSettings()
    return GenerationRequest(prompt_tokens=prompt_tokens(engine, prompt, options.tools),
                             max_tokens=options.max_tokens, sampling=options.sampling,
                             stop=options.stop, output=options.output,
                             draft=fit_draft(draft, engine.draft is not None))
