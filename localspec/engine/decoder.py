"""The speculative decoder: draft, verify in one batched target pass, accept, roll back."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..errors import ContextOverflowError, LocalspecError
from .controller import AcceptanceModel, CostModel, DraftController
from .drafters import ModelDrafter, PromptLookupDrafter, Proposal
from .llama_backend import LlamaRunner, ModelSettings
from .sampling import (
    SamplingParams,
    apply_penalties,
    distribution,
    greedy_token,
    one_hot,
    residual,
    sample,
)
from .stats import GenerationStats
from .text import TextAssembler, TextChunk

log = logging.getLogger(__name__)

# Twice the largest batched-vs-single logit difference under which greedy auto mode speculates.
# Measured here: F16 ~0.03, Q8_0 ~0.66, Q4_K_M ~1.26 (CPU, llama.cpp of llama-cpp-python 0.3.36).
EXACT_TIE_MARGIN = 0.25


DraftMode = Literal["model", "lookup", "none"]
AcceptRule = Literal["rejection", "match"]
FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True, slots=True)
class DraftSettings:
    """How to draft. ``k=None`` is adaptive; an int is a fixed draft length."""

    mode: DraftMode = "model"
    k: int | None = None
    k_max: int = 12
    rule: AcceptRule = "rejection"
    lookup_ngram_max: int = 4
    lookup_ngram_min: int = 2

    def validate(self, has_draft_model: bool) -> None:
        if self.mode not in ("model", "lookup", "none"):
            raise ValueError(f"unknown draft mode {self.mode!r} (model, lookup or none)")
        if self.mode == "model" and not has_draft_model:
            raise LocalspecError(
                "draft mode 'model' needs a draft model (or use --draft-mode lookup)")
        if self.k is not None and not 0 <= self.k <= 32:
            raise ValueError("k must be between 0 and 32")
        if self.rule not in ("rejection", "match"):
            raise ValueError(f"unknown acceptance rule {self.rule!r}")


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One completion request over already-tokenized input."""

    prompt_tokens: tuple[int, ...]
    max_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    draft: DraftSettings = DraftSettings()


@dataclass(frozen=True, slots=True)
class Finished:
    """The last event of a stream."""

    text: str
    tokens: tuple[int, ...]
    finish_reason: FinishReason
    stats: GenerationStats = field(compare=False)


StreamEvent = TextChunk | Finished


@dataclass(slots=True)
class _Run:
    """Mutable state of one generation."""

    req: GenerationRequest
    rng: np.random.Generator
    seq: list[int]
    out: list[int]
    text: TextAssembler
    stats: GenerationStats
    max_new: int
    reason: FinishReason | None = None
    # Set after a near-tie: the next position is decided by a one-token step.
    plain_next: bool = False


class SpeculativeEngine:
    """A target model and an optional draft model, ready to generate.

    Thread-compatible, not thread-safe: one generation at a time (front ends queue requests).
    """

    def __init__(self, target: LlamaRunner, draft: LlamaRunner | None = None,
                 k_max: int = 12, calibrate: bool = True) -> None:
        self.target = target
        self.draft = draft
        self.k_max = k_max
        self._drafter = ModelDrafter(draft) if draft is not None else None
        self._costs = self._calibrate() if calibrate else CostModel.from_calibration(
            1.0, 1.0 * (k_max + 1), k_max + 1, k_max, 0.1)
        # What the target accepted from each drafter, carried from request to request; greedy
        # and sampled decoding accept differently, so each has its own.
        self._acceptance = {greedy: (AcceptanceModel(), AcceptanceModel(rate=0.5, prior_rate=0.5))
                            for greedy in (True, False)}
        # Greedy verification never decides a near-tie from batched logits (see _verify).
        self.tie_margin = self._measure_tie_margin() if calibrate else 0.0
        # Where batched and one-token logits disagree this much, the KV cache that batched
        # verification writes can steer later greedy choices away from plain decoding, so
        # auto mode does not speculate on greedy requests (a fixed K still does, guarded).
        self.greedy_exact = self.tie_margin <= EXACT_TIE_MARGIN
        if not self.greedy_exact:
            log.info("greedy auto mode decodes plainly: batched logits drift %.3f on this "
                     "build (a quantized target on a CPU); output stays the target's",
                     self.tie_margin / 2)
        self._lock = threading.Lock()
        self._formatters: dict[str, Any] = {}

    @classmethod
    def load(cls, target_path: str | Path, draft_path: str | Path | None = None,
             target_settings: ModelSettings = ModelSettings(),
             draft_settings: ModelSettings | None = None, k_max: int = 12) -> SpeculativeEngine:
        """Validate the files (and the pair), then load both models."""
        from .gguf_meta import read_gguf_info, validate_pair

        if draft_path is not None:
            validate_pair(target_path, draft_path)
        else:
            read_gguf_info(target_path)
        target = LlamaRunner(target_path, target_settings)
        draft = None
        try:
            if draft_path is not None:
                ds = draft_settings or ModelSettings(n_ctx=target_settings.n_ctx,
                                                     n_threads=target_settings.n_threads)
                draft = LlamaRunner(draft_path, ds)
            return cls(target, draft, k_max=k_max)
        except BaseException:
            target.close()
            if draft is not None:
                draft.close()
            raise

    def close(self) -> None:
        self.target.close()
        if self.draft is not None:
            self.draft.close()

    def __enter__(self) -> SpeculativeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calibration --------------------------------------------------------------------------
    def _calibrate(self) -> CostModel:
        """Time target decodes of several batch sizes and a draft step on this machine."""
        limit = max(2, min(self.k_max + 1, self.target.n_batch, self.target.n_ctx - 1))
        sizes = sorted({n for n in (1, 2, 3, 5, 8, limit) if n <= limit})
        points = {n: self.target.time_decode(n) for n in sizes}
        td = self.draft.time_decode(1) if self.draft is not None else 0.0
        log.info("calibration: target %s; draft %.4fs/token",
                 {n: round(t, 4) for n, t in points.items()}, td)
        return CostModel.from_measurements(points, self.k_max, td)

    def _measure_tie_margin(self, n: int = 6) -> float:
        """How far batched logits stray from one-token-at-a-time logits on this build.

        llama.cpp computes a batch with other kernels than a single token (on CPUs and GPUs,
        and most of all for k-quants: up to ~0.5 logits on a Q4_K_M here, ~0.01 on F16). Plain
        decoding runs one token at a time, so a greedy choice whose top-2 margin is within that
        drift could differ between the two; twice the measured drift is the margin below which
        verification leaves the choice to a one-token step."""
        # Token ids, not text: tokenizing arbitrary text aborts on vocabularies without byte
        # fallback, and any ids exercise the same kernels.
        vocab = self.target.n_vocab
        seq = [(vocab // 3 + 7919 * i) % vocab for i in range(2 * n)]
        if len(seq) >= self.target.n_ctx:
            return 0.0
        head, tail = seq[:-n], seq[-n:]
        self.target.sync(head, 1)
        # Copies: decode returns views of llama.cpp's buffer, overwritten by the next decode.
        single = [self.target.decode([t], 1)[0].copy() for t in tail]
        self.target.truncate(len(head))
        batched = self.target.decode(tail, n)
        self.target.reset()
        drift = max(float(np.abs(single[i] - batched[i]).max()) for i in range(n))
        log.info("batched vs single-token logits drift: %.4f", drift)
        return 2.0 * drift

    # -- prompts ------------------------------------------------------------------------------
    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> str:
        """Render chat messages with the target's own chat template."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        template = self.target.chat_template
        if not template:
            log.warning("%s has no chat template; sending the last message as plain text",
                        self.target.path.name)
            return messages[-1]["content"]
        fmt = self._formatters.get(template)
        if fmt is None:  # compiling a Jinja template costs milliseconds: once per engine
            fmt = Jinja2ChatFormatter(
                template=template,
                eos_token=self.target.piece(self.target.eos_token).decode("utf-8", "replace"),
                bos_token=self.target.piece(self.target.bos_token).decode("utf-8", "replace"))
            self._formatters[template] = fmt
        return fmt(messages=list(messages)).prompt  # type: ignore[arg-type]

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
               cancel: threading.Event | None = None) -> Iterator[StreamEvent]:
        """Yield text chunks as tokens are accepted, then one ``Finished``."""
        req.sampling.validate()
        req.draft.validate(self.draft is not None)
        with self._lock:
            yield from self._stream(req, cancel)

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
        run = _Run(req=req, rng=np.random.default_rng(req.sampling.seed),
                   seq=list(req.prompt_tokens), out=[], text=TextAssembler(req.stop),
                   stats=GenerationStats(prompt_tokens=n_prompt),
                   max_new=min(req.max_tokens, self.target.n_ctx - n_prompt))
        controller = DraftController(self._costs, min(req.draft.k_max, self.k_max)
                                     if req.draft.k is None else req.draft.k, req.draft.k,
                                     *self._acceptance[req.sampling.greedy])
        lookup = PromptLookupDrafter(req.draft.lookup_ngram_max, req.draft.lookup_ngram_min)

        t0 = time.perf_counter()
        logits = self.target.sync(run.seq, 1)
        run.stats.prefill_seconds = time.perf_counter() - t0
        run.stats.target_passes += 1
        first = self._pick(logits[0], run.seq, run)
        yield from self._emit(run, [first], n_drafted=0)
        run.stats.ttft_seconds = time.perf_counter() - t_start
        if run.max_new <= 0:
            run.reason = "length"

        while run.reason is None:
            if cancel is not None and cancel.is_set():
                run.reason = "cancelled"
                break
            room = min(run.max_new - len(run.out) - 1, self.target.n_ctx - len(run.seq) - 1)
            prop = self._propose(run, controller, lookup, room)
            k = len(prop.tokens)
            t0 = time.perf_counter()
            logits = self.target.sync(run.seq + prop.tokens, k + 1)
            dt = time.perf_counter() - t0
            run.stats.verify_seconds += dt
            run.stats.target_passes += 1
            self._costs.observe_verify(k + 1, dt)
            t0 = time.perf_counter()
            n_acc, nxt = self._verify(run, prop, logits)
            run.stats.sample_seconds += time.perf_counter() - t0
            run.plain_next = nxt is None
            if k:
                # An undecided near-tie is neither an acceptance nor a rejection.
                controller.observe(prop, k if nxt is not None else n_acc, n_acc)
                run.stats.drafted += k
                run.stats.accepted += n_acc
                run.stats.draft_rounds += 1
                run.stats.lookup_rounds += prop.source == "lookup"
            else:
                controller.observe_plain_step()
            run.stats.k_counts[k] += 1
            new = prop.tokens[:n_acc] + ([nxt] if nxt is not None else [])
            yield from self._emit(run, new, n_drafted=n_acc)

        for chunk in run.text.finish():
            yield chunk
        controller.end_request()
        run.stats.total_seconds = time.perf_counter() - t_start
        yield Finished(text=run.text.text, tokens=tuple(run.out), finish_reason=run.reason,
                       stats=run.stats)

    def _pick(self, logits: np.ndarray, history: Sequence[int], run: _Run) -> int:
        sp = run.req.sampling
        if sp.greedy:
            return greedy_token(logits, history, sp)
        return sample(distribution(logits, history, sp), run.rng)

    def _propose(self, run: _Run, controller: DraftController, lookup: PromptLookupDrafter,
                 room: int) -> Proposal:
        ds = run.req.draft
        if ds.mode == "none" or room <= 0 or run.plain_next:
            return Proposal(source="none")
        if ds.k is None and run.req.sampling.greedy and not self.greedy_exact:
            return Proposal(source="none")
        cap = min(room, ds.k if ds.k is not None else controller.k_max)
        if ds.mode == "lookup" or (ds.k is None and self._drafter is not None):
            cand = lookup.propose(run.seq, cap)
            if ds.mode == "lookup" or (
                cand.tokens and controller.lookup_rate(cand) >= controller.expected_model_rate(cap)
            ):
                cand.truncate(controller.trim(cand, 0.0))
                return cand
        assert self._drafter is not None
        if not controller.model_worth_trying(cap):
            if ds.k is not None or not controller.should_peek(cap):
                return Proposal(source="none")
            controller.start_peek()
        stochastic = not run.req.sampling.greedy and ds.rule == "rejection"
        prop = self._drafter.propose(run.seq, cap, run.req.sampling, run.rng,
                                     controller.keep_going, stochastic)
        run.stats.draft_seconds += prop.seconds
        if prop.step_seconds:
            self._costs.observe_draft(sum(prop.step_seconds) / len(prop.step_seconds))
        prop.truncate(controller.trim(prop, prop.seconds))
        return prop

    def _verify(self, run: _Run, prop: Proposal,
                logits: np.ndarray) -> tuple[int, int | None]:
        """Accept a prefix of the drafted tokens; return (n accepted, the next token).

        The next token is None when greedy verification met a near-tie in batched logits: the
        accepted prefix stands and the next step decodes that position alone, as plain
        decoding would."""
        sp = run.req.sampling
        hist = list(run.seq)
        guard = sp.greedy and len(prop.tokens) > 0 and self.tie_margin > 0
        for i, tok in enumerate(prop.tokens):
            if sp.greedy:
                if guard and _near_tie(logits[i], hist, sp, self.tie_margin):
                    return i, None
                y = greedy_token(logits[i], hist, sp)
                if y != tok:
                    return i, y
            elif run.req.draft.rule == "match":
                y = sample(distribution(logits[i], hist, sp), run.rng)
                if y != tok:
                    return i, y
            else:
                p = distribution(logits[i], hist, sp)
                q = prop.dists[i] if prop.dists is not None else one_hot(p.shape[0], tok)
                if run.rng.random() * q[tok] >= p[tok]:  # reject with prob 1 - min(1, p/q)
                    return i, sample(residual(p, q), run.rng)
            hist.append(tok)
        k = len(prop.tokens)
        if guard and _near_tie(logits[k], hist, sp, self.tie_margin):
            return k, None
        return k, self._pick(logits[k], hist, run)

    def _emit(self, run: _Run, tokens: list[int], n_drafted: int) -> Iterator[TextChunk]:
        for i, tok in enumerate(tokens):
            if self.target.is_eog(tok):
                run.reason = "stop"
                return
            run.seq.append(tok)
            run.out.append(tok)
            run.stats.completion_tokens += 1
            yield from run.text.feed(self.target.piece(tok), i < n_drafted)
            if run.text.stopped:
                run.reason = "stop"
                return
            if len(run.out) >= run.max_new:
                run.reason = "length"
                return


def _near_tie(logits: np.ndarray, history: Sequence[int], sp: SamplingParams,
              margin: float) -> bool:
    """Whether the two best (penalized) logits are closer than ``margin``."""
    x = apply_penalties(logits, history, sp)
    top2 = np.partition(x, -2)[-2:]
    return float(top2[1] - top2[0]) < margin
