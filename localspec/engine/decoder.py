"""The speculative decoder: draft, verify in one batched target pass, accept, roll back."""

from __future__ import annotations

import copy
import functools
import logging
import numbers
import secrets
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..errors import ChatTemplateError, ContextOverflowError, LocalspecError
from . import activity, calibration, drafters
from .calibration import Calibration
from .controller import (
    AcceptanceModel,
    CostModel,
    DraftController,
    NearTieRate,
    PeekSchedule,
    TreePauses,
    fill_acceptance,
)
from .drafters import (
    NO_DRAFT,
    DraftContext,
    Drafter,
    DraftSettings,
    Pick,
    Proposal,
    TreeRequest,
)
from .drafters.proposal import Children
from .history_index import MARK_CLEAR, MARK_TIED, MARK_UNKNOWN
from .history_store import HistoryStore
from .llama_backend import LlamaRunner, ModelSettings, max_branches
from .sampling import (
    AcceptRule,
    Candidates,
    Choice,
    SamplingParams,
    candidates,
    coupled_children,
    coupled_choice,
    greedy_children,
    greedy_choice,
    greedy_pick,
    greedy_token,
    point_mass,
    residual,
    sample,
)
from .stats import GenerationStats
from .structure import OutputFormat, OutputGuide, vocabulary_tokenizer
from .text import TextAssembler, TextChunk

log = logging.getLogger(__name__)

# Where batched logits stray more than this from one-token logits (a quantized target on a CPU:
# Q8_0 ~0.3, Q4_K_M ~0.7 here; F16 ~0.02), the KV cache that batched verification writes can
# steer later near-ties away from plain decoding. ``exact`` requests then decode plainly.
EXACT_DRIFT_LIMIT = 0.125
# The least near-tie margin on a quantized target (see ``tie_margin``): a tiny Q4_K model here
# drifts 0 logits in the first 32 positions and up to 0.08 after them.
QUANTIZED_TIE_FLOOR = 0.2


# Token trees (see tree_planner): the branches one target pass may hold (each a sequence of
# the runners' KV caches), the most nodes and the most children per node a tree may have.
TREE_BRANCHES = 32
TREE_MAX_NODES = 256
TREE_WIDTH = 4

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One completion request over already-tokenized input."""

    prompt_tokens: tuple[int, ...]
    max_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    draft: DraftSettings = DraftSettings()
    # The answer held to a JSON Schema (``structure``); None: free text.
    output: OutputFormat | None = None


def _check_types(req: GenerationRequest) -> None:
    """ValueError, in one line, for a request built with the wrong types (a library caller's
    slip): each would otherwise fail deep inside as an AttributeError or a TypeError."""
    for name, value, kind in (("sampling", req.sampling, SamplingParams),
                              ("draft", req.draft, DraftSettings)):
        if not isinstance(value, kind):
            raise ValueError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
    if req.output is not None and not isinstance(req.output, OutputFormat):
        raise ValueError(f"output must be an OutputFormat, got {type(req.output).__name__}")
    if isinstance(req.stop, str):  # it would stop at each of its characters
        raise ValueError("stop must be a sequence of strings, not one string: "
                         f"stop=({req.stop!r},)")
    if not isinstance(req.stop, Sequence) or not all(isinstance(s, str) for s in req.stop):
        raise ValueError(f"stop must be a sequence of strings, got {req.stop!r}")
    if isinstance(req.prompt_tokens, (str, bytes)) or not isinstance(req.prompt_tokens,
                                                                      (Sequence, np.ndarray)):
        raise ValueError("prompt_tokens must be a sequence of token ids (engine.tokenize "
                         f"makes one), got {type(req.prompt_tokens).__name__}")


@dataclass(frozen=True, slots=True)
class Finished:
    """The last event of a stream."""

    text: str
    tokens: tuple[int, ...]
    finish_reason: FinishReason
    stats: GenerationStats = field(compare=False)


StreamEvent = TextChunk | Finished


@dataclass(slots=True)
class _Learning:
    """What auto carries from request to request: the target's acceptance of each drafter's
    tokens (by drafter name), how often it met a near-tie, when to peek, and when to plan a
    tree."""

    acceptance: dict[str, AcceptanceModel]
    ties: NearTieRate
    peeks: PeekSchedule
    tree_pauses: TreePauses


@dataclass(slots=True)
class _Run:
    """Mutable state of one generation."""

    req: GenerationRequest
    rule: AcceptRule | Literal["greedy"]
    seed: int
    rng: np.random.Generator
    seq: list[int]
    out: list[int]
    text: TextAssembler
    stats: GenerationStats
    max_new: int
    speculate: bool
    # The draft mode's drafter (None: plain decoding) and, where it is costly and K is auto,
    # the free drafters tried before it each step; all by name.
    primary: Drafter | None = None
    fallbacks: tuple[Drafter, ...] = ()
    by_name: dict[str, Drafter] = field(default_factory=dict)
    reason: FinishReason | None = None
    # Set after a near-tie: the next position is decided by a one-token step.
    plain_next: bool = False
    # After a plain step auto chose: whether its position was a near-tie (None: not measured).
    plain_tie: bool | None = None
    # Per output token, what the target's choice there was (``history_index.MARK_*``): kept
    # with the answer in the history index, where a copy of it meets the same near-ties.
    marks: list[int] = field(default_factory=list)
    calibration_decode_seconds: float = 0.0
    calibration_decode_calls: int = 0
    # The schema's state where the answer is held to one: it masks each choice of the target.
    guide: OutputGuide | None = None

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """The logits the target chooses from at the next position of its answer."""
        return logits if self.guide is None else self.guide.mask(logits)

    def wrote(self, token: int | None) -> int | None:
        """The target chose ``token`` (None: a near-tie left the position to the next step)."""
        if token is not None and self.guide is not None:
            self.guide.advance(token)
        return token


def plain_transcript(messages: Sequence[Mapping[str, object]]) -> str:
    """Messages for a model with no chat template: one message is its text, as a plain prompt;
    a conversation is a labelled transcript ending where the assistant speaks next, the shape
    a base model continues. Every message is kept: the earlier turns are the context."""
    if len(messages) == 1:
        return str(messages[0]["content"])
    turns = [f"{str(m['role']).capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join([*turns, "Assistant:"])


class SpeculativeEngine:
    """A target model and an optional draft model, ready to generate.

    Thread-compatible, not thread-safe: one generation at a time (front ends queue requests).
    ``calibration`` (costs and drift) is measured after the first token of the first request
    that drafts, unless given or cached; ``cache_calibration=False`` always measures anew.
    """

    def __init__(self, target: LlamaRunner, draft: LlamaRunner | None = None,
                 k_max: int = 12, calibration: Calibration | None = None,
                 cache_calibration: bool = True, history: HistoryStore | None = None) -> None:
        self.target = target
        self.draft = draft
        # The index of earlier requests the history drafter drafts from (None: none kept);
        # every finished request that allows it is added (closed with the engine).
        self.history = history
        # Where the layers went, one line (localspec.placing's plan); None: not planned.
        self.placement: str | None = None
        self.k_max = k_max
        self._cache_calibration = cache_calibration
        self._quantized = _is_quantized(target)
        self.calibration: Calibration | None = None
        self._costs = CostModel.from_calibration(1.0, 1.0 * (k_max + 1), k_max + 1, k_max, 0.1)
        if calibration is None and cache_calibration:
            calibration = self._cached_calibration()
        if calibration is not None:
            self.use_calibration(calibration)
        # What auto learned, carried from request to request; greedy and sampled decoding
        # differ, so each has its own.
        self._learned = {greedy: _Learning(fill_acceptance({}), NearTieRate(), PeekSchedule(),
                                           TreePauses())
                         for greedy in (True, False)}
        self._lock = threading.Lock()
        self._formatters: dict[str, Any] = {}
        self._schema_tokenizer: Any = None  # llguidance's view of the vocabulary, when needed

    @classmethod
    def load(cls, target_path: str | Path, draft_path: str | Path | None = None,
             target_settings: ModelSettings = ModelSettings(),
             draft_settings: ModelSettings | None = None, k_max: int = 12,
             history: HistoryStore | None = None) -> SpeculativeEngine:
        """Validate the files (and the pair), then load both models. ``history``: see
        ``__init__`` (the engine closes it; the caller, if loading fails)."""
        from ..gguf_meta import read_gguf_info, validate_pair

        if draft_path is not None:
            validate_pair(target_path, draft_path)
        else:
            read_gguf_info(target_path)
        # Both runners can hold token trees: a context with room for TREE_BRANCHES sequences
        # decodes chains exactly as a single-sequence one (tests/test_token_tree.py).
        target = LlamaRunner(target_path, target_settings,
                             branches=min(TREE_BRANCHES, max_branches(target_settings)))
        draft = None
        try:
            if draft_path is not None:
                ds = draft_settings or ModelSettings(
                    n_ctx=target_settings.n_ctx, n_threads=target_settings.n_threads,
                    repack=target_settings.repack,
                    prompt_cache_mib=target_settings.prompt_cache_mib)
                draft = LlamaRunner(draft_path, ds,
                                    branches=min(TREE_BRANCHES, max_branches(ds)))
            return cls(target, draft, k_max=k_max, history=history)
        except BaseException:
            target.close()
            if draft is not None:
                draft.close()
            raise

    @contextmanager
    def separate_learning(self) -> Iterator[None]:
        """Requests inside teach acceptance to a copy that is dropped afterwards: a benchmark's
        fixed-K runs must not teach auto what they saw (auto would then be measured on
        knowledge a user's auto never had)."""
        saved = self._learned
        self._learned = copy.deepcopy(saved)
        try:
            with self.frozen_history():  # nor may they teach the history
                yield
        finally:
            self._learned = saved

    @contextmanager
    def frozen_history(self) -> Iterator[None]:
        """Requests inside draft from the history as it stands now and add nothing to it: a
        benchmark's repeats of one prompt must not draft from each other's answers."""
        saved = self.history
        if saved is not None:
            self.history = saved.detached()
        try:
            yield
        finally:
            self.history = saved

    def clear_caches(self) -> None:
        """Empty both models' KV caches and saved prompt states, so the next request decodes
        its whole prompt in one batch instead of reusing a cached prefix: what a comparison
        of runs needs, since a prompt's last token decoded alone can round differently from
        the same token decoded in the prompt's batch."""
        for runner in self._runners():
            runner.reset()
            runner.prompt_cache.clear()

    def _runners(self) -> tuple[LlamaRunner, ...]:
        return (self.target,) if self.draft is None else (self.target, self.draft)

    def _switch_prompts(self, seq: Sequence[int]) -> None:
        """Each model's cache before a new prompt: the state it holds kept for a later request
        that comes back to it, an earlier one restored where it shares more of this prompt (a
        chat's history after an agent's tool call): see ``prompt_cache``."""
        for runner in self._runners():
            runner.switch_to(seq)

    def close(self) -> None:
        if self.history is not None:
            self.history.close()  # what is unsaved is written first
        self.target.close()
        if self.draft is not None:
            self.draft.close()

    def __enter__(self) -> SpeculativeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calibration --------------------------------------------------------------------------
    @property
    def tie_margin(self) -> float:
        """Greedy/coupled verification never decides a choice closer than this (logits) from
        batched logits: twice the measured batched-vs-single drift, and for quantized weights
        at least QUANTIZED_TIE_FLOOR (their kernels can also differ at positions and batch
        shapes the calibration did not reach)."""
        if self.calibration is None:
            return 0.0
        floor = QUANTIZED_TIE_FLOOR if self._quantized else 0.0
        return max(2.0 * self.calibration.drift, floor)

    def _guarded(self, run: _Run) -> bool:
        """Whether this request's verification leaves near-ties to one-token passes: greedy
        and coupled choices, once a drift is measured."""
        return run.rule in ("greedy", "coupled") and self.tie_margin > 0

    def verify_seconds(self, n: int) -> float:
        """The current estimate of one target pass over ``n`` tokens (measured, then refined)."""
        return self._costs.verify(n)

    @property
    def drift_ok_for_exact(self) -> bool:
        return self.calibration is None or self.calibration.drift <= EXACT_DRIFT_LIMIT

    def _cached_calibration(self) -> Calibration | None:
        try:
            return calibration.load_cached(self._calibration_key())
        except OSError:
            return None

    def _calibration_key(self) -> str:
        return calibration.cache_key(self.target, self.draft, self.k_max)

    def use_calibration(self, cal: Calibration, learn: bool = True) -> None:
        """Decide with these costs and this drift (measured elsewhere, or a what-if such as a
        memory-bound GPU's costs); ``learn=False`` keeps the device's costs fixed instead of
        refining them with the times observed here (the host's work per tree node is this
        machine's, and is learned either way)."""
        self.calibration = cal
        self._costs = CostModel.from_measurements(cal.target_points, self.k_max,
                                                  cal.draft_token)
        self._costs.learning = learn

    def _ensure_calibrated(self, run: _Run) -> None:
        """Measure costs and drift once (after the first token: it never delays it)."""
        if self.calibration is not None:
            return
        t0 = time.perf_counter()
        decode_before = self._decode_seconds()
        calls_before = self._decode_calls()
        with activity.doing("measuring costs", self.target.path):
            cal = calibration.measure(self.target, self.draft, self.k_max, run.seq[-1])
        self.use_calibration(cal)
        if self._cache_calibration:
            calibration.store(self._calibration_key(), cal)
        run.stats.calibration_seconds += time.perf_counter() - t0
        # Its decodes are calibration, not generation: host time would go negative otherwise.
        run.calibration_decode_seconds += self._decode_seconds() - decode_before
        run.calibration_decode_calls += self._decode_calls() - calls_before

    # -- prompts ------------------------------------------------------------------------------
    def chat_prompt(self, messages: Sequence[Mapping[str, object]],
                    tools: Sequence[Mapping[str, object]] = ()) -> str:
        """Render chat messages (and the tools offered, for a template that takes them) with
        the target's own chat template."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        template = self.target.chat_template
        if not template:
            log.warning("%s has no chat template; sending the messages as a plain transcript",
                        self.target.path.name)
            return plain_transcript(messages)
        # The template is code from the model file: any failure while compiling or rendering
        # it (an unknown filter, runaway recursion, a huge range) is that file's problem.
        try:
            fmt = self._formatters.get(template)
            if fmt is None:  # compiling a Jinja template costs milliseconds: once per engine
                fmt = Jinja2ChatFormatter(
                    template=template,
                    eos_token=self.target.piece(self.target.eos_token).decode("utf-8", "replace"),
                    bos_token=self.target.piece(self.target.bos_token).decode("utf-8", "replace"))
                self._formatters[template] = fmt
            return fmt(messages=list(messages),  # type: ignore[arg-type]
                       tools=list(tools) or None).prompt  # type: ignore[arg-type]
        except Exception as exc:
            detail = str(exc).splitlines()[0][:200] if str(exc) else ""
            raise ChatTemplateError(
                f"the chat template in {self.target.path.name} cannot be rendered "
                f"({type(exc).__name__}{': ' + detail if detail else ''})",
                "--raw sends the prompt as plain text") from exc

    def tokenize(self, text: str, *, chat: bool) -> tuple[int, ...]:
        """Tokenize a prompt. A chat-rendered prompt may already start with the BOS text."""
        toks = self.target.tokenize(text, add_bos=self.target.add_bos, special=chat)
        bos = self.target.bos_token
        if len(toks) > 1 and toks[0] == bos and toks[1] == bos:
            toks = toks[1:]
        return tuple(toks)

    # -- generation ---------------------------------------------------------------------------
    def generate(self, req: GenerationRequest,
                 cancel: threading.Event | None = None) -> Finished:
        """Run a request to the end and return its result."""
        for event in self.stream(req, cancel):
            if isinstance(event, Finished):
                return event
        raise AssertionError("stream ended without Finished")  # pragma: no cover

    def stream(self, req: GenerationRequest,
               cancel: threading.Event | None = None) -> Generator[StreamEvent, None, None]:
        """Yield text chunks as tokens are accepted, then one ``Finished``."""
        _check_types(req)
        req.sampling.validate()
        req.draft.validate(self.draft is not None)
        from ..params import check

        check("max_tokens", req.max_tokens)
        self.check_prompt_tokens(req.prompt_tokens)
        with self._lock:
            yield from self._stream(req, cancel)

    def check_prompt_tokens(self, tokens: Sequence[int]) -> None:
        """ValueError for an id outside the target's vocabulary: llama.cpp fails its decode
        as if memory had run out."""
        n_vocab = self.target.n_vocab
        odd = next((t for t in tokens if isinstance(t, bool)
                    or not isinstance(t, numbers.Integral)), None)
        if odd is not None:
            raise ValueError(f"token ids are whole numbers, got {odd!r}")
        bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{n_vocab - 1})")

    def _new_run(self, req: GenerationRequest) -> _Run:
        sp = req.sampling
        if sp.greedy:
            rule: AcceptRule | Literal["greedy"] = "greedy"
        else:
            rule = "coupled" if req.draft.rule == "auto" else req.draft.rule
        # Unseeded requests draw a seed: every rule then uses its randomness the same way.
        seed = sp.seed if sp.seed is not None else secrets.randbits(64)
        n_prompt = len(req.prompt_tokens)
        run = _Run(req=req, rule=rule, seed=seed, rng=np.random.default_rng(seed & (2**64 - 1)),
                   seq=list(req.prompt_tokens), out=[], text=TextAssembler(req.stop),
                   stats=GenerationStats(prompt_tokens=n_prompt),
                   max_new=min(req.max_tokens, self.target.n_ctx - n_prompt),
                   speculate=req.draft.mode != NO_DRAFT)
        if req.output is not None:
            if self._schema_tokenizer is None:
                self._schema_tokenizer = vocabulary_tokenizer(self.target.vocab)
            run.guide = OutputGuide.start(self._schema_tokenizer, req.output)
        self._choose_drafters(run)
        return run

    def _available(self, name: str, ds: DraftSettings) -> bool:
        """Whether drafter ``name`` has what it drafts from, for this request."""
        return not drafters.get(name).needs_history or (ds.history and self.history is not None)

    def _choose_drafters(self, run: _Run) -> None:
        """The request's drafters: its draft mode's, and under auto with a costly one, every
        free drafter, tried first each step (free to run, verified when they pay)."""
        ds = run.req.draft
        if ds.mode == NO_DRAFT:
            return
        primary = drafters.create(ds.mode, ds, self.draft)
        if ds.k is None:
            # Beside a costly drafter every free one; beside a free one, the companions.
            run.fallbacks = tuple(
                drafters.create(name, ds, self.draft) for name in drafters.names()
                if name != ds.mode and not drafters.get(name).costly
                and (primary.costly or drafters.get(name).companion)
                and self._available(name, ds))
        run.primary = primary
        run.by_name = {d.name: d for d in (*run.fallbacks, primary)}

    def _stream(self, req: GenerationRequest,
                cancel: threading.Event | None) -> Iterator[StreamEvent]:
        t_start = time.perf_counter()
        n_prompt = len(req.prompt_tokens)
        if n_prompt == 0:
            raise LocalspecError("empty prompt")
        if n_prompt >= self.target.n_ctx:
            raise ContextOverflowError(
                f"prompt has {n_prompt} tokens but the context holds {self.target.n_ctx}; "
                "shorten it or raise --ctx")
        run = self._new_run(req)
        decode_before = self._decode_seconds()
        calls_before = self._decode_calls()

        t0 = time.perf_counter()
        activity.report("processing the prompt", self.target.path)
        self._switch_prompts(run.seq)
        logits = self.target.sync(run.seq, 1)
        run.stats.prefill_seconds = time.perf_counter() - t0
        run.stats.prompt_cached_tokens = self.target.reused
        run.stats.target_passes += 1
        first = self._pick(logits[0], run.seq, run)
        yield from self._emit(run, [first], n_drafted=0)
        run.stats.ttft_seconds = time.perf_counter() - t_start
        if run.max_new <= 0:
            run.reason = "length"
        if run.reason is None and run.speculate:
            self._ensure_calibrated(run)
        learned = self._learned[run.rule == "greedy"]
        costly = run.primary.name if run.primary is not None and run.primary.costly else None
        controller = DraftController(self._costs, min(req.draft.k_max, self.k_max)
                                     if req.draft.k is None else req.draft.k, req.draft.k,
                                     acceptance=learned.acceptance, ties=learned.ties,
                                     peeks=learned.peeks, model=costly,
                                     tree_pauses=learned.tree_pauses)
        auto_explains = self._decide_policy(run, controller)

        while run.reason is None:
            if cancel is not None and cancel.is_set():
                run.reason = "cancelled"
                break
            room = min(run.max_new - len(run.out) - 1, self.target.n_ctx - len(run.seq) - 1)
            prop = self._propose(run, controller, room)
            k = len(prop.tokens)
            if not prop.is_chain or prop.is_mixed:  # a chain of two drafters' nodes too
                new, n_acc = self._tree_step(run, controller, prop)
                # Every position a tree step decides, it decides clear of a near-tie.
                yield from self._emit(run, new, n_drafted=n_acc,
                                      mark=MARK_CLEAR if self._guarded(run) else MARK_UNKNOWN)
                continue
            t0 = time.perf_counter()
            activity.report("verifying" if k else "decoding", self.target.path)
            logits = self.target.sync(run.seq + prop.tokens, k + 1)
            dt = time.perf_counter() - t0
            run.stats.verify_seconds += dt
            run.stats.target_passes += 1
            self._costs.observe_verify(k + 1, dt)
            t0 = time.perf_counter()
            n_acc, nxt = self._verify(run, prop, logits, watch_tie=not run.plain_next)
            run.stats.sample_seconds += time.perf_counter() - t0
            mark = self._mark(run, k)
            run.plain_next = nxt is None
            if k:
                # An undecided near-tie is neither an acceptance nor a rejection.
                controller.observe(prop, k if nxt is not None else n_acc, n_acc,
                                   tied=nxt is None)
                run.stats.drafted += k
                run.stats.accepted += n_acc
                run.stats.draft_rounds += 1
                run.stats.tie_stops += nxt is None
                run.stats.count_round(prop.source, k, n_acc)
                run.by_name[prop.source].observe(prop, n_acc)
            else:
                controller.observe_plain_step(tied=run.plain_tie, token=nxt)
            run.stats.k_counts[k] += 1
            new = prop.tokens[:n_acc] + ([nxt] if nxt is not None else [])
            yield from self._emit(run, new, n_drafted=n_acc, mark=mark)

        activity.idle()
        for chunk in run.text.finish():
            yield chunk
        if auto_explains:
            self._explain_outcome(run, controller)
        controller.end_request()
        run.stats.total_seconds = time.perf_counter() - t_start
        run.stats.decode_seconds = (self._decode_seconds() - decode_before
                                    - run.calibration_decode_seconds)
        run.stats.decode_calls = (self._decode_calls() - calls_before
                                  - run.calibration_decode_calls)
        if self.history is not None and req.draft.history:
            self.history.record(req.prompt_tokens, run.out, run.marks)
        yield Finished(text=run.text.text, tokens=tuple(run.out), finish_reason=run.reason,
                       stats=run.stats)

    def _tree_step(self, run: _Run, controller: DraftController,
                   prop: Proposal) -> tuple[list[int], int]:
        """Verify a token tree in one target pass and keep its accepted branch in the KV
        cache; return the tokens the step yields (the branch, then the target's own token
        unless a near-tie left that position to the next step) and how many were drafted."""
        k = len(prop.tokens)
        t0 = time.perf_counter()
        activity.report("verifying", self.target.path)
        # The last accepted token is the tree's root node: its logits are the first choice's.
        prefix = run.seq[:-1]
        keep = self.target.common_prefix(prefix)
        self.target.truncate(keep)
        if keep < len(prefix):  # the cache fell behind (not after a step): catch it up
            self.target.decode(prefix[keep:], 1)
        parents = [-1] + [p + 1 for p in prop.parent_list()]
        logits = self.target.decode_tree([run.seq[-1], *prop.tokens], parents)
        dt = time.perf_counter() - t0
        run.stats.verify_seconds += dt
        run.stats.target_passes += 1
        self._costs.observe_verify(k + 1, dt)
        t0 = time.perf_counter()
        path, nxt, choices = self._verify_tree(run, prop, logits)
        self.target.keep_branch([0, *(i + 1 for i in path)])
        run.stats.sample_seconds += time.perf_counter() - t0
        run.plain_next = nxt is None
        controller.observe_tree(prop, path, choices)
        s = run.stats
        s.drafted += k
        s.accepted += len(path)
        s.draft_rounds += 1
        s.tree_rounds += 1
        s.tie_stops += nxt is None
        s.merged_rounds += prop.is_mixed
        for name, (drafted, accepted) in prop.counts_by_source(path).items():
            s.count_round(name, drafted, accepted)
        s.k_counts[k] += 1
        return [prop.tokens[i] for i in path] + ([nxt] if nxt is not None else []), len(path)

    def _verify_tree(self, run: _Run, prop: Proposal,
                     logits: np.ndarray) -> tuple[list[int], int | None, list[int | None]]:
        """The accepted branch of a tree: from the root, the child equal to the target's
        choice, as long as there is one (greedy or coupled: the choice at a position does not
        depend on what was drafted). Returns its nodes, the next token (None: a near-tie, as
        in ``_verify``) and the target's choice after each accepted prefix. ``logits`` row 0
        is the last accepted token's, row i + 1 node i's."""
        assert run.guide is None, "a schema's answer drafts chains (see _tree_request)"
        kids = prop.children()
        hist = list(run.seq)
        base = len(run.out)
        guard = self.tie_margin > 0
        path: list[int] = []
        choices: list[int | None] = []
        node = -1
        while True:
            below = kids[node]
            choice = self._choose(logits[node + 1], hist, run, base + len(path), guard)
            if guard and choice.margin < self.tie_margin:
                choices.append(None)
                return path, None, choices
            choices.append(choice.token)
            nxt = next((c for c in below if prop.tokens[c] == choice.token), None)
            if nxt is None:
                return path, choice.token, choices
            path.append(nxt)
            hist.append(choice.token)
            node = nxt

    def _decode_seconds(self) -> float:
        return self.target.decode_seconds + (self.draft.decode_seconds if self.draft else 0.0)

    def _decode_calls(self) -> int:
        return self.target.decode_calls + (self.draft.decode_calls if self.draft else 0)

    def _decide_policy(self, run: _Run, controller: DraftController) -> bool:
        """Whether this request speculates, and why (shown by --verbose and the chat app).
        True when auto decides with the draft model: its reason is then given again at the
        end, from what the request taught it."""
        ds = run.req.draft
        if run.primary is None:
            run.stats.policy = "plain decoding (draft mode none)"
            return False
        if ds.k is not None:
            run.stats.policy = f"fixed K={ds.k}"
            return False
        if ds.exact and run.rule in ("greedy", "coupled") and not self.drift_ok_for_exact:
            assert self.calibration is not None
            run.speculate = False
            run.stats.policy = (f"plain decoding (--exact): batched logits drift "
                                f"{self.calibration.drift:.3f} > {EXACT_DRIFT_LIMIT} on this "
                                "build, so a batched verification could change the output")
            return False
        if not run.primary.costly:
            titles = " and ".join(d.title or d.name for d in (run.primary, *run.fallbacks))
            run.stats.policy = f"auto with {titles} (free to draft; verified when it pays)"
            return False
        run.stats.policy = "auto: " + controller.explain()
        return True

    @staticmethod
    def _explain_outcome(run: _Run, controller: DraftController) -> None:
        """Auto's reason as the request ends: what it learned there, beside what it did. The
        reason given at the start (from past requests) could contradict the figures shown next
        to it, e.g. "plain decoding" beside a run that drafted most of its tokens."""
        s = run.stats
        if s.draft_rounds == 0:
            return  # nothing drafted: the reason given at the start stands
        s.policy = (f"auto: drafted in {s.draft_rounds} of {s.target_passes} steps, "
                    f"{s.acceptance_rate:.0%} accepted; by the end, " + controller.explain())

    # -- choosing tokens --------------------------------------------------------------------------
    def _choose(self, logits: np.ndarray, history: Sequence[int], run: _Run,
                position: int, guard: bool = True) -> Choice:
        """The token the target emits at output ``position`` (greedy or coupled); ``guard``:
        resolve its margin for the near-tie guard (a pass over the vocabulary)."""
        sp = run.req.sampling
        if run.rule == "greedy":
            return greedy_choice(logits, history, sp, self.tie_margin if guard else 0.0)
        return coupled_choice(candidates(logits, history, sp), sp.temperature, run.seed,
                              position)

    def _pick(self, logits: np.ndarray, history: Sequence[int], run: _Run) -> int:
        """The first token (from the prefill): there is no draft to compare with."""
        sp = run.req.sampling
        logits = run.masked(logits)
        if run.rule == "greedy":
            token = greedy_token(logits, history, sp)
        elif run.rule == "coupled":
            token = coupled_choice(candidates(logits, history, sp), sp.temperature, run.seed,
                                   len(run.out)).token
        else:
            token = sample(candidates(logits, history, sp), run.rng)
        run.wrote(token)
        return token

    def _draft_pick(self, run: _Run) -> Pick:
        """How the draft model chooses its tokens under this request's rule."""
        sp = run.req.sampling
        base = len(run.out)
        # Under a schema the draft chooses among the tokens it allows too, by a fork of the
        # answer's state that follows this draft (from its first token: j == 0).
        fork: OutputGuide | None = None

        def pick(logits: np.ndarray, history: list[int], j: int) -> tuple[int, float,
                                                                        Candidates | None]:
            nonlocal fork
            if run.guide is not None and j == 0:
                fork = run.guide.fork()
            if fork is None:
                return choose(logits, history, j)
            tok, conf, dist = choose(fork.mask(logits), history, j)
            try:
                fork.advance(tok)
            except LocalspecError:  # nothing the draft's vocabulary holds is allowed: it
                fork = None  # drafts freely on, and the target turns down what breaks the schema
            return tok, conf, dist

        def choose(logits: np.ndarray, history: list[int], j: int) -> tuple[int, float,
                                                                          Candidates | None]:
            if run.rule == "greedy" or run.rule == "match":
                tok, conf = greedy_pick(logits, history, sp)
                return tok, conf, None
            c = candidates(logits, history, sp)
            if run.rule == "coupled":
                tok = coupled_choice(c, sp.temperature, run.seed, base + j).token
                return tok, c.prob_of(tok), None
            tok = sample(c, run.rng)
            return tok, c.prob_of(tok), c

        return pick

    def _propose(self, run: _Run, controller: DraftController, room: int) -> Proposal:
        ds = run.req.draft
        primary = run.primary
        if primary is None or not run.speculate or room <= 0 or run.plain_next:
            return Proposal(source=NO_DRAFT)
        cap = min(room, ds.k if ds.k is not None else controller.k_max)
        free_cap = controller.free_cap(room)  # a copy may run longer than a model's draft
        ctx = DraftContext(run.seq, self._draft_pick(run), controller.keep_going,
                           history=self.history if ds.history else None)
        tree = self._tree_request(run, controller, room, primary)
        if not primary.costly and tree is not None:
            cand = primary.propose_tree(ctx, tree)
            if not cand.is_chain:
                controller.trim_tree(cand)
                return cand
            cand.truncate(min(free_cap, controller.trim(cand)))
            return cand
        if not primary.costly:
            cand = primary.propose(ctx, free_cap)
            controller.shadow(cand)
            if run.fallbacks:  # companions beside it: the proposal its acceptance rates best
                cand = self._free_proposal(run, controller, ctx, free_cap, cap, cand) or cand
            cand.truncate(controller.trim(cand))
            return cand
        # Counted at most once a step, and only where a decision needs it: it walks the
        # whole sequence.
        behind = functools.cache(lambda: self._answer_behind(run, primary))
        free = self._free_proposal(run, controller, ctx, free_cap, cap, behind=behind)
        if free is not None:
            return self._free_tree(run, controller, ctx, room, free)
        if tree is not None:
            prop = primary.propose_tree(ctx, tree)
            self._observe_drafting(run, prop)
            self._graft_companions(run, ctx, tree, prop)
            controller.trim_tree(prop)
            return prop
        if not controller.model_worth_trying(cap, behind):
            if ds.k is not None or not controller.should_peek(
                    cap, lambda: primary.behind(run.seq), room):
                return Proposal(source=NO_DRAFT)
            controller.start_peek()
        prop = primary.propose(ctx, cap)
        self._observe_drafting(run, prop)
        prop.truncate(controller.trim(prop))
        return prop

    @staticmethod
    def _answer_behind(run: _Run, drafter: Drafter) -> int:
        """Tokens of this answer a costly drafter has not seen beyond a step's usual one or
        two (the last draft's final token and the target's own): what a copy accepted since
        it last drafted left it to catch up on. The prompt's tokens are not counted: the
        draft reads them once, and every later draft of the answer shares that cost."""
        behind = min(drafter.behind(run.seq), len(run.out))
        return behind - 2 if behind > 2 else 0

    def _free_tree(self, run: _Run, controller: DraftController, ctx: DraftContext,
                   room: int, chain: Proposal) -> Proposal:
        """A free drafter's winning chain, or its tree where the planner finds one worth it
        for that drafter (the history's earlier answers that went different ways, prompt
        lookup's several matches): the same choice a free draft mode makes, beside a model."""
        drafter = run.by_name[chain.source]
        tree = self._tree_request(run, controller, room, drafter)
        if tree is not None:
            cand = drafter.propose_tree(ctx, tree)
            if not cand.is_chain:
                controller.trim_tree(cand)
                return cand
        chain.truncate(controller.trim(chain))
        return chain

    def _graft_companions(self, run: _Run, ctx: DraftContext, tree: TreeRequest,
                          prop: Proposal) -> None:
        """Add the free drafters' continuations (prompt lookup's several, history's) to the
        draft model's tree as more branches: the target checks them in the pass it pays for
        anyway, and ``trim_tree`` then keeps the nodes whose acceptance pays for their width.
        The target alone holds them (the draft never decodes a grafted node), so its room,
        not the draft's, bounds them."""
        if not run.fallbacks or prop.dists is not None:
            return
        # Within the widths measured, as the plan is: past them a pass's price is a guess.
        max_nodes = min(self._tree_room(run), self._costs.widest - 1)
        if max_nodes <= len(prop.tokens):
            return
        free_request = replace(tree, nodes=max_nodes, branches=self.target.branches,
                               children=None)
        for drafter in run.fallbacks:
            prop.graft(drafter.propose_tree(ctx, free_request), max_nodes, self.target.branches)

    def _tree_room(self, run: _Run) -> int:
        """The most nodes one tree may have: it and the last accepted token go in one target
        batch, within the context."""
        return min(TREE_MAX_NODES, self.target.n_batch - 1, self.target.n_ctx - len(run.seq) - 1)

    def _observe_drafting(self, run: _Run, prop: Proposal) -> None:
        """Count a costly drafter's work and teach the cost model what its passes took: the
        first (which catches up), then each one-token step of a chain or level of a tree."""
        run.stats.draft_seconds += prop.seconds
        run.stats.draft_host_seconds += prop.seconds - prop.decode_seconds
        run.stats.draft_model_tokens += len(prop.tokens)
        stepped = sum(prop.step_seconds) + sum(s for _, s in prop.level_passes)
        if prop.step_seconds:
            self._costs.observe_draft(sum(prop.step_seconds) / len(prop.step_seconds))
        for width, seconds in prop.level_passes:
            self._costs.observe_draft_pass(width, seconds)
        # A tree's first pass is timed on its own: its levels' ranking of children is host
        # work the first pass of a chain does not have.
        first = prop.first_seconds or prop.seconds - stepped
        if prop.catch_up_tokens <= 2:  # what the last step added: a step's usual start
            self._costs.observe_draft_first(first)
        self._costs.observe_catch_up(prop.catch_up_tokens, first)
        self._costs.observe_draft_host(len(prop.tokens), prop.seconds - prop.decode_seconds,
                                       tree=not prop.is_chain)

    def _tree_request(self, run: _Run, controller: DraftController, room: int,
                      drafter: Drafter) -> TreeRequest | None:
        """The tree the planner asks ``drafter`` for this step, or None for a chain: trees
        are auto's (a fixed K is a chain), for greedy and coupled requests only (their
        choice at a position does not depend on what was drafted, so any branch can be
        checked; rejection and match sampling keep chains), where both runners hold them."""
        ds = run.req.draft
        # A schema's masks follow one sequence of choices: a tree's branches would each need
        # their own, so a constrained answer drafts chains.
        if (not ds.tree or ds.k is not None or run.rule not in ("greedy", "coupled")
                or run.guide is not None):
            return None
        branches = self.target.branches
        if drafter.costly:
            branches = min(branches, self.draft.branches if self.draft is not None else 0)
        plan = controller.tree_plan(room, self._tree_room(run), branches, drafter.name)
        if plan is None:
            return None
        return TreeRequest(nodes=plan.nodes, depth=plan.depth, branches=branches,
                           width=TREE_WIDTH, floor=plan.floor,
                           estimate=controller.estimator(drafter.name),
                           children=self._draft_children(run) if drafter.costly else None)

    def _draft_children(self, run: _Run) -> Children:
        """How the draft model ranks a tree node's children under this request's rule: its
        guesses at the target's choice, the first what a chain would draft."""
        sp = run.req.sampling
        base = len(run.out)

        def children(logits: np.ndarray, history: list[int], depth: int,
                     n: int) -> list[tuple[int, float]]:
            if run.rule == "greedy":
                return greedy_children(logits, history, sp, n)
            return coupled_children(candidates(logits, history, sp), sp.temperature, run.seed,
                                    base + depth, n)

        return children

    @staticmethod
    def _free_proposal(run: _Run, controller: DraftController, ctx: DraftContext,
                       cap: int, model_cap: int,
                       first: Proposal | None = None,
                       behind: Callable[[], int] = lambda: 0) -> Proposal | None:
        """The free drafters' best proposal (of ``cap`` tokens at most) by its drafter's
        acceptance: beside a costly drafter, only where that predicts at least the tokens per
        second expected from it (drafting ``model_cap`` at most); beside a free draft mode's
        proposal ``first``, the best of them all. None: none."""
        best, best_rate, bar = None, 0.0, None
        if first is not None:
            bar = 0.0
            if first.tokens:
                best, best_rate = first, controller.free_rate(first)
        for drafter in run.fallbacks:
            cand = drafter.propose(ctx, cap)
            if not cand.tokens:
                continue
            controller.shadow(cand)
            rate = controller.free_rate(cand)
            if bar is None:
                bar = controller.expected_model_rate(model_cap, behind())
            if rate >= bar and (best is None or rate > best_rate):
                best, best_rate = cand, rate
        return best

    def _verify(self, run: _Run, prop: Proposal, logits: np.ndarray,
                watch_tie: bool = False) -> tuple[int, int | None]:
        """Accept a prefix of the drafted tokens; return (n accepted, the next token).

        The next token is None when greedy or coupled verification met a near-tie in batched
        logits: the accepted prefix stands and the next step decides that position alone, as
        plain decoding would. ``watch_tie`` (a plain step auto chose): the one-token pass
        decides its position exactly, but whether that was a near-tie goes to ``run.plain_tie``
        for the near-tie rate."""
        if not prop.is_chain or prop.is_mixed:
            raise ValueError(f"drafter {prop.source!r} proposed a token tree; verification "
                             "takes chains only")
        sp = run.req.sampling
        hist = list(run.seq)
        base = len(run.out)
        guard = len(prop.tokens) > 0 and self._guarded(run)
        for i, tok in enumerate(prop.tokens):
            row = run.masked(logits[i])
            if run.rule in ("greedy", "coupled"):
                choice = self._choose(row, hist, run, base + i)
                if guard and choice.margin < self.tie_margin:
                    return i, None
                if choice.token != tok:
                    return i, run.wrote(choice.token)
            elif run.rule == "match":
                y = sample(candidates(row, hist, sp), run.rng)
                if y != tok:
                    return i, run.wrote(y)
            else:
                p = candidates(row, hist, sp)
                q = prop.dists[i] if prop.dists is not None else point_mass(tok)
                # Reject with probability 1 - min(1, p/q).
                if run.rng.random() * q.prob_of(tok) >= p.prob_of(tok):
                    return i, run.wrote(sample(residual(p, q), run.rng))
            run.wrote(tok)
            hist.append(tok)
        k = len(prop.tokens)
        row = run.masked(logits[k])
        if run.rule in ("greedy", "coupled"):
            # A near-tie is a property of the target's text, not of drafting: counted at the
            # plain steps too, else the rate a tie raised stays up while auto decodes plainly
            # (it is never seen again), and prices every later copy as if ties cut it short:
            # a rename that copied its file decoded plainly for 90 tokens on Q4_K_M.
            watch = watch_tie and not k and run.speculate and self.tie_margin > 0
            choice = self._choose(row, hist, run, base + k, guard or watch)
            run.plain_tie = choice.margin < self.tie_margin if watch else None
            if guard and choice.margin < self.tie_margin:
                return k, None
            return k, run.wrote(choice.token)
        return k, run.wrote(sample(candidates(row, hist, sp), run.rng))

    def _mark(self, run: _Run, k: int) -> int:
        """The mark of the tokens a chain step of ``k`` drafted tokens just decided (before
        ``run.plain_next`` moves on): the position a near-tie left is tied; a verification
        with the guard, or a plain step auto watched, says whether each was clear."""
        if run.plain_next:
            return MARK_TIED
        if k:
            return MARK_CLEAR if self._guarded(run) else MARK_UNKNOWN
        if run.plain_tie is None:
            return MARK_UNKNOWN
        return MARK_TIED if run.plain_tie else MARK_CLEAR

    def _emit(self, run: _Run, tokens: list[int], n_drafted: int,
              mark: int = MARK_UNKNOWN) -> Iterator[TextChunk]:
        for i, tok in enumerate(tokens):
            if self.target.is_eog(tok):
                run.reason = "stop"
                return
            run.seq.append(tok)
            run.out.append(tok)
            run.marks.append(mark)
            run.stats.completion_tokens += 1
            yield from run.text.feed(self.target.piece(tok), i < n_drafted)
            if run.text.stopped:
                run.reason = "stop"
                return
            if len(run.out) >= run.max_new:
                run.reason = "length"
                return


def _is_quantized(runner: LlamaRunner) -> bool:
    from ..gguf_meta import has_quantized_weights

    try:
        return has_quantized_weights(runner.path)
    except LocalspecError:  # validated at load; an unreadable file now is not worth failing
        return True
