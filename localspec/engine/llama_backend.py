"""One llama.cpp model and context with explicit control of its KV cache.

This is the only module that calls llama.cpp. It loads models and contexts through llama.cpp's C
API (as exposed by llama-cpp-python's ctypes bindings) rather than through ``Llama`` because:

* ``Llama`` gives no way to set ``llama_model_params.use_extra_bufts`` (llama.cpp's
  ``--no-repack``), which some CPUs need to run quantized models at all (see ``repack.py``);
* ``Llama.eval`` keeps logits for one position, or (``logits_all=True``) for the whole context,
  an n_ctx x n_vocab buffer; verification needs logits for exactly the K+1 drafted positions;
* ``Llama.__init__`` also reads every metadata key and compiles chat-format handlers, time a
  user pays at every start for nothing the engine uses.

Checked against llama-cpp-python 0.3.36 (llama.cpp memory API ``llama_memory_seq_rm``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..errors import ContextOverflowError, ModelLoadError, UnencodableTextError
from . import activity
from .drafters.proposal import check_tree
from .prompt_cache import MIN_GAIN, MIN_GAIN_CPU, PromptCache

log = logging.getLogger(__name__)
_llama_log = logging.getLogger("localspec.llama_cpp")
# A failed GGML_ASSERT's message, logged just before llama.cpp aborts the process; a supervisor
# may give this logger handlers of its own (the CLI's crash guard puts it in its one line).
abort_log = logging.getLogger("localspec.llama_cpp.abort")
# ggml_log_level: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 (continuation lines).
_LOG_LEVELS = {0: logging.DEBUG, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING,
               4: logging.ERROR, 5: logging.DEBUG}
_log_callback: Any = None  # keeps the ctypes callback alive for as long as llama.cpp may call it
_abort_callback: Any = None  # likewise for ggml's abort callback
_backend_ready = False
# llama.cpp reports why a load failed only in its log: the error lines logged during a load,
# from which the reason goes into our message.
_load_errors: list[str] = []
# A Ctrl-C that landed in the log callback. Python runs a signal's handler at the next Python
# code in the main thread, which during a load is this callback; the KeyboardInterrupt it raises
# there is one ctypes cannot pass through native code, so it only reports it (unraisable) and
# llama.cpp carries on. Noted here instead, it is raised once the native call has returned.
_interrupted = False
_unraisable_hook: Any = None  # ours, once installed (see _keep_interrupts)

RepackMode = Literal["auto", "on", "off"]
# common_prefix compares all but this many trailing tokens in one go (see there).
_TAIL = 64


@dataclass(frozen=True, slots=True)
class _FallbackGaps:
    """A SentencePiece vocabulary without every byte-fallback token. llama.cpp's tokenizer
    turns text it has no token for into byte tokens (``<0xXX>``, else the byte itself as a
    token: llama_vocab::byte_to_token); where neither exists it throws from a noexcept path and
    the process aborts. Such files exist (models trained without byte fallback, test models)
    and run on any text within their vocabulary, so the text is checked, not the file: a
    character that is a token of its own is safe, and so is one whose every byte has a token."""

    missing: frozenset[int]  # bytes with no fallback token
    chars: frozenset[str]  # characters that are tokens of their own
    # Control and user-defined tokens' texts: with special tokens parsed, llama.cpp takes
    # them out of the text before the SentencePiece tokenizer sees it. Longest first.
    specials: tuple[str, ...] = ()

    @classmethod
    def of(cls, lib: Any, vocab: Any, n_vocab: int) -> _FallbackGaps | None:
        """None for every vocabulary but a SentencePiece one with gaps (real models have all
        256 byte tokens, at the start of the vocabulary: looked at first)."""
        if int(lib.llama_vocab_type(vocab)) != lib.LLAMA_VOCAB_TYPE_SPM:
            return None
        found: set[int] = set()
        chars: set[str] = set()
        for ids in (range(min(n_vocab, 512)), range(512, n_vocab)):
            for token in ids:
                text = bytes(lib.llama_vocab_get_text(vocab, token) or b"")
                if len(text) == 6 and text.startswith(b"<0x") and text.endswith(b">"):
                    with contextlib.suppress(ValueError):
                        byte = int(text[3:5], 16)
                        if text == f"<0x{byte:02X}>".encode():
                            found.add(byte)
                elif len(text) <= 4 and len(piece := text.decode("utf-8", "replace")) == 1:
                    chars.add(piece)
            if len(found) == 256:
                return None
        missing = frozenset(b for b in range(256)
                            if b not in found and not (b < 0x80 and chr(b) in chars))
        if not missing:
            return None
        special = lib.LLAMA_TOKEN_ATTR_CONTROL | lib.LLAMA_TOKEN_ATTR_USER_DEFINED
        specials = {bytes(lib.llama_vocab_get_text(vocab, token) or b"").decode("utf-8", "replace")
                    for token in range(n_vocab)
                    if int(lib.llama_vocab_get_attr(vocab, token)) & special}
        return cls(missing, frozenset(chars),
                   tuple(sorted(filter(None, specials), key=len, reverse=True)))

    def check(self, text: str, path: Path, special: bool) -> None:
        if special:
            for piece in self.specials:
                text = text.replace(piece, "")
        for ch in dict.fromkeys(text):  # the first one it cannot take, in the text's order
            piece = "\u2581" if ch == " " else ch  # SentencePiece's space
            if piece not in self.chars and any(b in self.missing for b in piece.encode()):
                raise UnencodableTextError(
                    f"{path.name} cannot take the character {ch!r} (U+{ord(ch):04X}): its "
                    "vocabulary has no token for it and no byte-fallback tokens, and llama.cpp "
                    "would abort on it")


def _load_reason(errors: list[str]) -> str:
    """Why llama.cpp refused a model, from the error lines it logged: the first names the cause
    ("gguf_init_from_reader: key 'general.alignment' must be of type u32 but is i32", or
    "llama_model_load: error loading model: check_tensor_dims: tensor ... has wrong shape");
    the ones after it pass it up, down to the last ("failed to load model"), which says
    nothing."""
    if not errors:
        return "no reason given"
    first, marker = errors[0], "error loading model: "
    return first.split(marker, 1)[1] if marker in first else first.split(": ", 1)[-1]


def route_llama_logs_to_logging() -> None:
    """Send llama.cpp's own log lines to ``logging`` instead of stderr (they wreck a TUI), and
    the message of a failed assertion too, without the backtrace ggml prints before aborting."""
    global _log_callback
    _keep_interrupts()
    if _log_callback is not None:
        return
    # ggml answers a failed GGML_ASSERT (and an uncaught C++ exception) by attaching gdb to the
    # process: seconds, and ~70 lines of backtrace on the user's terminal. It reads this
    # variable when the library loads and again at each abort; a user who set it keeps theirs.
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    import llama_cpp

    _route_aborts_to_logging()
    _log_callback = llama_cpp.llama_log_callback(_log_line)
    llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))


def _log_line(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    """llama.cpp's log callback. A KeyboardInterrupt can surface anywhere in it, even before
    its first line (where Python checks for signals on entering a function), so no ``try``
    here could catch it: ``_keep_interrupts`` takes it from ctypes instead."""
    msg = text.decode("utf-8", errors="replace").rstrip()
    if msg:
        if level == 4 and len(_load_errors) < 32:
            _load_errors.append(msg)
        _llama_log.log(_LOG_LEVELS.get(level, logging.DEBUG), "%s", msg)


def _keep_interrupts() -> None:
    """Have a KeyboardInterrupt that escaped ``_log_line`` noted for ``_take_interrupt``
    rather than printed and dropped; every other unraisable exception goes where it went. Put
    back if something replaced it since (a test runner swaps the hook around each test)."""
    global _unraisable_hook
    if sys.unraisablehook is _unraisable_hook:
        return
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        global _interrupted
        if _in_log_line(unraisable) and isinstance(unraisable.exc_value, KeyboardInterrupt):
            _interrupted = True
        else:
            previous(unraisable)

    _unraisable_hook = sys.unraisablehook = hook


def _in_log_line(unraisable: Any) -> bool:
    """Whether ctypes reports an exception of ``_log_line``: Python 3.11 and 3.12 give the
    callback as the object, 3.13 names it in the message instead."""
    if unraisable.object is not None:
        return unraisable.object is _log_line
    return repr(_log_line) in (unraisable.err_msg or "")


def _take_interrupt() -> bool:
    """Whether a Ctrl-C landed in the log callback during the native call that just returned
    (then it is for the caller to raise). Only the main thread's: signals are its alone."""
    global _interrupted
    if not _interrupted or threading.current_thread() is not threading.main_thread():
        return False
    _interrupted = False
    return True


def _raise_if_interrupted() -> None:
    """After a native call that logs: raise the Ctrl-C that landed in its log callback."""
    if _take_interrupt():
        raise KeyboardInterrupt


def _route_aborts_to_logging() -> None:
    """ggml's abort callback: the assertion's message goes to ``abort_log``, not stderr (ggml
    then aborts the process as before; what supervises it reports the death)."""
    global _abort_callback
    # llama_cpp._ggml (llama-cpp-python 0.3.36) loads libggml; ggml_set_abort_callback is ggml's
    # public C API (ggml.h), not bound by llama-cpp-python.
    import llama_cpp._ggml as ggml

    callback_type = ctypes.CFUNCTYPE(None, ctypes.c_char_p)

    @callback_type  # type: ignore[misc]
    def _callback(message: bytes | None) -> None:
        try:
            text = (message or b"").decode("utf-8", errors="replace").strip()
            # "/build/.../src/llama-model.cpp:1328: GGML_ASSERT(...) failed": the file's name
            # is enough; the build folder is noise.
            where, sep, rest = text.partition(": ")
            abort_log.critical("%s", Path(where).name + sep + rest)
        except Exception:  # nothing may escape into native code
            pass

    try:
        setter = ggml.libggml.ggml_set_abort_callback
    except AttributeError:  # a build without it: ggml prints the message itself
        return
    setter.argtypes = [callback_type]
    setter.restype = ctypes.c_void_p
    setter(_callback)
    _abort_callback = _callback


def _init_backend() -> Any:
    global _backend_ready
    import llama_cpp  # deferred: importing llama_cpp loads the shared library

    route_llama_logs_to_logging()
    if not _backend_ready:
        llama_cpp.llama_backend_init()
        _backend_ready = True
    return llama_cpp


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """How to load one model: offload, context and threads are per model.

    ``repack`` is llama.cpp's "extra buffer types" (repacked and AMX CPU kernels for quantized
    weights): ``auto`` uses them where this machine's self-test says they work.
    ``n_gpu_layers``: -1 all, None auto (``localspec.placing`` turns it into a number before
    loading; a runner given None offloads nothing)."""

    n_gpu_layers: int | None = 0
    n_ctx: int = 4096
    n_threads: int | None = None
    n_batch: int = 512
    flash_attn: bool = False
    repack: RepackMode = "auto"
    # RAM for KV states of earlier prompts (localspec.engine.prompt_cache); 0: none kept.
    prompt_cache_mib: int = 1024


def default_threads() -> int:
    # llama.cpp slows down sharply when it oversubscribes cores, so use the physical count.
    try:
        import psutil

        return max(1, psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    except Exception:  # psutil missing counts on some containers
        return max(1, os.cpu_count() or 1)


def max_branches(settings: ModelSettings) -> int:
    """The most tree branches a runner with these settings can hold: llama.cpp needs a batch
    row per sequence, and sequence 0 is the accepted text."""
    return max(0, min(settings.n_batch, settings.n_ctx) - 1)


@dataclass(frozen=True, slots=True)
class _Tree:
    """A token tree decoded after ``base`` cached tokens, awaiting ``keep_branch``."""

    base: int
    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    # Each node's sequence ids, ascending: one per branch (root to leaf) through it.
    seqs: tuple[tuple[int, ...], ...]


class LlamaRunner:
    """A loaded model whose KV cache holds exactly ``self.tokens`` (sequence 0).

    ``extra_bufts`` overrides the repack decision (``settings.repack``) when given.
    ``branches``: how many branches a token tree given to ``decode_tree`` may have (each is a
    sequence of its own in the KV cache); 0, a runner for chains only, is llama.cpp's
    single-sequence context exactly.
    """

    def __init__(self, path: str | Path, settings: ModelSettings = ModelSettings(),
                 *, extra_bufts: bool | None = None, branches: int = 0) -> None:
        if branches < 0:
            raise ValueError(f"branches must be >= 0, got {branches}")
        if branches > max_branches(settings):
            # llama.cpp asserts (aborts the process) when a context has more sequences than
            # a batch has rows (llama-context.cpp, n_outputs_max).
            raise ValueError(f"a runner with n_batch {settings.n_batch} holds at most "
                             f"{max_branches(settings)} branches, not {branches}")
        self.branches = branches
        self._tree: _Tree | None = None
        lib = _init_backend()
        self._lib = lib
        self.path = Path(path)
        self.settings = settings
        from .repack import RepackDecision, repack_decision

        if extra_bufts is None:
            from ..gguf_meta import has_quantized_weights

            self.repack = repack_decision(settings.repack, has_quantized_weights(self.path))
        else:
            self.repack = RepackDecision(extra_bufts, "forced", "set by the caller")
        extra_bufts = self.repack.use_extra_bufts
        threads = settings.n_threads or default_threads()
        self._model: Any = None
        self._ctx: Any = None
        self._batch: Any = None
        with activity.doing("loading", self.path):
            self._model = self._load_model(settings, extra_bufts)
            try:
                self._ctx = self._new_context(settings, threads)
            except BaseException:
                lib.llama_model_free(self._model)
                self._model = None
                raise
        # llama.cpp clamps n_batch to n_ctx; chunk by what the context really accepts.
        self.n_ctx = int(lib.llama_n_ctx(self._ctx))
        self.n_batch = int(lib.llama_n_batch(self._ctx))
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        self._fallback_gaps = _FallbackGaps.of(lib, self._vocab, self.n_vocab)
        self._mem = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1 + branches)
        self.tokens: list[int] = []
        # Views of llama.cpp's logits rows by (address, rows): making a view through ctypes
        # costs ~0.1 ms right after a decode, a visible share of a fast GPU step.
        self._views: dict[tuple[int, int], np.ndarray] = {}
        self._pieces: dict[int, bytes] = {}
        # _spelled's answers: a server asks for a template's tags on every call.
        self._spellings: dict[str, int | None] = {}
        # Seconds spent inside llama_decode since load: wall time minus this is host overhead.
        self.decode_seconds = 0.0
        self.decode_calls = 0
        self.prompt_cache = PromptCache(
            settings.prompt_cache_mib << 20 if self._states_restorable() else 0,
            min_gain=MIN_GAIN if self._offloads(settings) else MIN_GAIN_CPU)
        self.reused = 0  # tokens the last sync kept from the cache (held or restored)
        lib.llama_memory_clear(self._mem, True)

    def _offloads(self, settings: ModelSettings) -> bool:
        """Whether any of this model's layers run on a GPU."""
        return bool(settings.n_gpu_layers) and bool(self._lib.llama_supports_gpu_offload())

    def _states_restorable(self) -> bool:
        """Whether a saved state cut back to a shorter prefix is still that prefix's: not with
        a sliding window (the cells before it are gone) or a recurrent state (it cannot be
        cut), so such models keep no saved states."""
        lib, model = self._lib, self._model
        return not (int(lib.llama_model_n_swa(model)) > 0 or lib.llama_model_is_recurrent(model)
                    or lib.llama_model_is_hybrid(model))

    def _load_model(self, settings: ModelSettings, extra_bufts: bool) -> Any:
        lib = self._lib
        params = lib.llama_model_default_params()
        # INT32_MAX: llama.cpp's "every layer" (it clamps to the model's layer count).
        layers = settings.n_gpu_layers or 0
        params.n_gpu_layers = 0x7FFFFFFF if layers < 0 else layers
        params.use_extra_bufts = extra_bufts
        _load_errors.clear()
        _raise_if_interrupted()  # noted in an earlier native call (a dry run while placing)
        model = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if _take_interrupt():  # Ctrl-C during the load (see _interrupted)
            if model:
                lib.llama_model_free(model)
            raise KeyboardInterrupt
        if not model:
            reason = _load_reason(_load_errors)
            raise ModelLoadError(f"{self.path}: llama.cpp could not load it ({reason})")
        return model

    def _new_context(self, settings: ModelSettings, threads: int) -> Any:
        lib = self._lib
        params = lib.llama_context_default_params()
        params.n_ctx = settings.n_ctx
        params.n_batch = settings.n_batch
        params.n_ubatch = settings.n_batch
        params.n_threads = threads
        params.n_threads_batch = threads
        params.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attn
                                  else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.no_perf = True
        if self.branches:
            params.n_seq_max = 1 + self.branches
            # One cache for all sequences: a branch shares the cached prefix's cells instead of
            # copying them, and each sequence keeps the whole n_ctx (a split cache would give
            # each n_ctx / n_seq_max).
            params.kv_unified = True
        ctx = lib.llama_init_from_model(self._model, params)
        if _take_interrupt():  # Ctrl-C while it was made (see _interrupted)
            if ctx:
                lib.llama_free(ctx)
            raise KeyboardInterrupt
        if not ctx:
            raise ModelLoadError(f"{self.path}: llama.cpp could not create a context of "
                                 f"{settings.n_ctx} tokens (out of memory? try a smaller --ctx)")
        return ctx

    # -- vocabulary ---------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        if self._fallback_gaps is not None:
            self._fallback_gaps.check(text, self.path, special)
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (self._lib.llama_token * n_max)()
        n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_bos, special)
        if n < 0:  # the buffer was too small: -n is what it needs
            n_max = -n
            buf = (self._lib.llama_token * n_max)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_bos,
                                         special)
        if n < 0:
            raise ValueError(f"the text could not be tokenized ({len(data)} bytes)")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes of one token as it continues a text (leading space kept).

        A buffer per call (not per runner) so front ends may detokenize from any thread; the
        result is remembered (a vocabulary does not change while it is loaded)."""
        known = self._pieces.get(token)
        if known is not None:
            return known
        buf = ctypes.create_string_buffer(64)
        n = self._lib.llama_token_to_piece(self._vocab, token, buf, 64, 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lib.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
        data = bytes(buf.raw[:n])
        self._pieces[token] = data
        return data

    def special_token(self, text: str) -> int | None:
        """The one control or user-defined token spelled ``text`` that an answer's text shows
        as ``text`` (a template's tag, such as Qwen's ``<tool_call>``); None where this
        vocabulary writes it as plain text, or its token shows as nothing (a control token's
        piece is empty: a call written in it would lose its tags)."""
        token = self._spelled(text)
        kinds = self._lib.LLAMA_TOKEN_ATTR_CONTROL | self._lib.LLAMA_TOKEN_ATTR_USER_DEFINED
        if token is None or not self._lib.llama_vocab_get_attr(self._vocab, token) & kinds:
            return None
        return token if self.piece(token) == text.encode() else None

    def control_token(self, text: str) -> int | None:
        """The one control token spelled ``text`` (a format's opening of a call, such as
        Mistral's ``[TOOL_CALLS]``, which an answer's text shows as nothing); None where this
        vocabulary has none."""
        token = self._spelled(text)
        if token is None:
            return None
        attributes = self._lib.llama_vocab_get_attr(self._vocab, token)
        return token if attributes & self._lib.LLAMA_TOKEN_ATTR_CONTROL else None

    def _spelled(self, text: str) -> int | None:
        """The one token ``text`` is, special tokens taken as such; None where it is more."""
        if text not in self._spellings:
            ids = self.tokenize(text, add_bos=False, special=True)
            self._spellings[text] = ids[0] if len(ids) == 1 else None
        return self._spellings[text]

    def is_eog(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    @property
    def vocab(self) -> Any:
        """llama.cpp's vocabulary handle (for a grammar engine that reads its tokens)."""
        return self._vocab

    @property
    def add_bos(self) -> bool:
        return bool(self._lib.llama_vocab_get_add_bos(self._vocab))

    @property
    def bos_token(self) -> int:
        return int(self._lib.llama_vocab_bos(self._vocab))

    @property
    def eos_token(self) -> int:
        return int(self._lib.llama_vocab_eos(self._vocab))

    @property
    def chat_template(self) -> str | None:
        """The model's own chat template (``tokenizer.chat_template``), if it has one."""
        raw = self._lib.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8", "replace") if raw else None

    def meta(self, key: str) -> str | None:
        """One metadata value as text (llama.cpp's rendering), or None when absent."""
        size = 256
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._lib.llama_model_meta_val_str(self._model, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", "replace")
            size = n + 1

    # -- KV cache -----------------------------------------------------------------------------
    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens of the KV cache, drop the rest."""
        if self._tree is not None:
            self.keep_branch([])
        if n < len(self.tokens):
            self._lib.llama_memory_seq_rm(self._mem, 0, n, -1)
            del self.tokens[n:]

    def reset(self) -> None:
        self._tree = None
        self._lib.llama_memory_clear(self._mem, True)
        self.tokens.clear()

    def common_prefix(self, seq: Sequence[int]) -> int:
        """How many leading tokens of ``seq`` the KV cache already holds.

        Called every step with the whole sequence, which usually differs from the cache only
        in its last few tokens (rejected drafts): the head is compared as one list (in C), the
        tail token by token."""
        toks = self.tokens
        n = min(len(toks), len(seq))
        head = max(0, n - _TAIL)
        start = 0
        if head:
            seq_head = seq[:head]  # a list already when seq is one: no second copy
            if toks[:head] == (seq_head if isinstance(seq_head, list) else list(seq_head)):
                start = head
        for i in range(start, n):
            if toks[i] != seq[i]:
                return i
        return n

    # -- decoding -----------------------------------------------------------------------------
    def decode(self, new_tokens: Sequence[int], n_logits: int = 1) -> np.ndarray:
        """Append ``new_tokens`` to the KV cache; return logits of the last ``n_logits`` of them.

        Returns an (n_logits, n_vocab) float32 array that is a *view* of llama.cpp's own logits
        buffer (no copy: on a fast GPU a copy of a 152k vocabulary per step is measurable). It
        is valid until the next decode on this runner; callers that keep logits copy them.
        """
        if not new_tokens:
            raise ValueError("decode needs at least one token")
        if self._tree is not None:
            self.keep_branch([])
        if len(self.tokens) + len(new_tokens) > self.n_ctx:
            raise ContextOverflowError(
                f"context of {self.n_ctx} tokens is full ({len(self.tokens)} + {len(new_tokens)})"
            )
        # Logits survive only for the last batch, so all requested positions must share it.
        n_logits = min(n_logits, len(new_tokens), self.n_batch)
        first_logit = len(new_tokens) - n_logits
        start = 0
        while start < len(new_tokens):
            chunk = new_tokens[start:start + self.n_batch]
            self._fill_batch(chunk, len(self.tokens), first_logit - start)
            t0 = time.perf_counter()
            rc = self._lib.llama_decode(self._ctx, self._batch)
            # On a GPU llama_decode only queues the work: the time a decode takes ends when its
            # results are ready, which is what the cost model and host-overhead figures need.
            self._lib.llama_synchronize(self._ctx)
            self.decode_seconds += time.perf_counter() - t0
            self.decode_calls += 1
            if rc != 0:
                # Leave the cache as it was: a failed decode may have written part of the chunk.
                self._lib.llama_memory_seq_rm(self._mem, 0, len(self.tokens), -1)
                _raise_if_interrupted()  # the Ctrl-C, not the failure it may have caused
                raise ModelLoadError(f"llama_decode failed with code {rc} (out of memory?)")
            self.tokens.extend(chunk)
            start += len(chunk)
            _raise_if_interrupted()  # Ctrl-C while it logged; the cache matches self.tokens
        return self._logits_view(n_logits)

    def _fill_batch(self, chunk: Sequence[int], pos0: int, first_logit: int) -> None:
        b = self._batch
        b.n_tokens = len(chunk)
        for i, tok in enumerate(chunk):
            b.token[i] = tok
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = i >= first_logit

    def _logits_view(self, n_logits: int) -> np.ndarray:
        # Negative indices count from the end of the last decoded batch. With one sequence the
        # requested rows are consecutive in llama.cpp's output buffer; checked, not assumed.
        first = self._lib.llama_get_logits_ith(self._ctx, -n_logits)
        base = ctypes.cast(first, ctypes.c_void_p).value
        if base is None:
            raise ModelLoadError("llama.cpp returned no logits for the last batch")
        # A remembered view is valid: llama.cpp just said these rows start at this address.
        view = self._views.get((base, n_logits))
        if view is not None:
            return view
        row_bytes = self.n_vocab * 4
        contiguous = all(
            ctypes.cast(self._lib.llama_get_logits_ith(self._ctx, j - n_logits),
                        ctypes.c_void_p).value == base + j * row_bytes  # type: ignore[operator]
            for j in range(1, n_logits))
        if contiguous:
            view = np.ctypeslib.as_array(first, shape=(n_logits, self.n_vocab))
            if len(self._views) >= 64:  # the buffer moved (it grows): forget old addresses
                self._views.clear()
            self._views[(base, n_logits)] = view
            return view
        out = np.empty((n_logits, self.n_vocab), dtype=np.float32)
        for j in range(n_logits):
            out[j] = np.ctypeslib.as_array(self._lib.llama_get_logits_ith(self._ctx, j - n_logits),
                                           shape=(self.n_vocab,))
        return out

    def sync(self, seq: Sequence[int], n_logits: int = 1) -> np.ndarray:
        """Make the KV cache hold exactly ``seq`` and return logits of its last ``n_logits``.

        Reuses the longest common prefix already in the cache; at least ``n_logits`` tokens are
        always decoded again because llama.cpp only keeps logits of the last batch. (Saved
        states of earlier prompts come back only through ``switch_to``, at a request's start:
        within a request a restore would only cost a copy.)
        """
        keep = min(self.common_prefix(seq), len(seq) - n_logits)
        self.truncate(keep)
        self.reused = keep
        return self.decode(seq[keep:], n_logits)

    # -- saved prompt states ----------------------------------------------------------------------
    def switch_to(self, seq: Sequence[int]) -> int:
        """A new request's prompt ``seq`` is about to be synced: keep what the cache holds if
        the prompt would drop much of it (a later request may come back to it), and restore
        the saved state sharing the longest prefix with ``seq`` where it beats what the cache
        shares. Returns the tokens of ``seq`` the cache holds afterwards. A request that only
        extends the last one (a chat's next turn) copies nothing."""
        held = self.common_prefix(seq)
        cache = self.prompt_cache
        if cache.max_bytes <= 0:
            return held
        if len(self.tokens) - held >= cache.min_gain:
            self._save()
        if len(seq) - held >= cache.min_gain and len(cache):
            held = self._restore(seq, held)
        return held

    def _save(self) -> bool:
        """Save the KV state of the tokens held now. False: not kept (too short, already
        covered, over the budget, or llama.cpp gave no state)."""
        cache = self.prompt_cache
        if self._tree is not None:
            self.keep_branch([])
        if not cache.wants(self.tokens, 0):
            return False
        lib = self._lib
        size = int(lib.llama_state_seq_get_size(self._ctx, 0))
        if size <= 0 or not cache.wants(self.tokens, size):
            return False
        buf = (ctypes.c_uint8 * size)()
        if int(lib.llama_state_seq_get_data(self._ctx, buf, size, 0)) <= 0:
            return False
        return cache.add(self.tokens, buf, size)

    def _restore(self, seq: Sequence[int], held: int) -> int:
        """Load the saved state sharing the longest prefix with ``seq`` if it beats the
        ``held`` tokens the cache shares now; return the tokens shared afterwards."""
        entry = self.prompt_cache.best(seq, held)
        if entry is None:
            return held
        if self._tree is not None:
            self.keep_branch([])
        lib = self._lib
        lib.llama_memory_seq_rm(self._mem, 0, -1, -1)  # set_data wants the sequence empty
        self.tokens.clear()
        if int(lib.llama_state_seq_set_data(self._ctx, entry.data, entry.nbytes, 0)) == 0:
            # No room for its cells (llama.cpp logged why): prefill as if nothing were saved,
            # and never try that state again.
            log.warning("could not restore a saved prompt state of %d tokens", len(entry.tokens))
            lib.llama_memory_seq_rm(self._mem, 0, -1, -1)
            self.prompt_cache.discard(entry)
            _raise_if_interrupted()  # a Ctrl-C while it logged why: now, not at some later call
            return 0
        self.tokens.extend(entry.tokens.tolist())
        shared = self.common_prefix(seq)
        self.prompt_cache.used(shared - held)
        return shared

    # -- token trees ----------------------------------------------------------------------------
    def decode_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Decode a token tree after the cached tokens in one batch; return every node's logits
        (an (n, n_vocab) view, valid until the next decode, as ``decode``'s).

        Node i continues node ``parents[i]`` (-1: the last cached token); parents come before
        their children. A node sits at position ``len(self.tokens)`` + its depth and belongs
        to the sequence of each branch (root to leaf) through it, so it attends to the cached
        tokens and its own ancestors only. The tree stays in the cache beside ``self.tokens``
        until ``keep_branch`` keeps one path of it (any other call on the cache keeps none).
        """
        if self._tree is not None:
            self.keep_branch([])
        return self._add_to_tree(_Tree(len(self.tokens), (), (), ()), tokens, parents)

    def extend_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Add nodes to the tree ``decode_tree`` left pending, in one batch; return the new
        nodes' logits. ``parents`` index the whole tree (its earlier nodes, then these), so a
        drafter can grow a tree level by level, one batch per level, without decoding again
        what it decoded before. With no tree pending this is ``decode_tree``."""
        tree = self._tree or _Tree(len(self.tokens), (), (), ())
        return self._add_to_tree(tree, tokens, parents)

    def _add_to_tree(self, tree: _Tree, tokens: Sequence[int],
                     parents: Sequence[int]) -> np.ndarray:
        n_old, n_new = len(tree.tokens), len(tokens)
        all_parents = [*tree.parents, *parents]
        check_tree(all_parents, n_old + n_new)
        if not 0 < n_new <= self.n_batch:
            raise ValueError(f"a token tree must have 1 to {self.n_batch} nodes, got {n_new}")
        base = tree.base
        if base + n_old + n_new > self.n_ctx:
            raise ContextOverflowError(
                f"context of {self.n_ctx} tokens is full ({base} + a tree of {n_old + n_new})")
        has_child = [False] * (n_old + n_new)
        for p in all_parents:
            if p >= 0:
                has_child[p] = True
        n_leaves = has_child.count(False)
        if n_leaves > self.branches:
            raise ValueError(f"a tree of {n_leaves} branches needs a runner made with "
                             f"branches >= {n_leaves}; this one has {self.branches}")
        lib = self._lib
        seqs = [list(s) for s in tree.seqs] + [[] for _ in range(n_new)]
        depth = [0] * (n_old + n_new)
        for i, p in enumerate(all_parents):
            depth[i] = depth[p] + 1 if p >= 0 else 0
        # Each branch (root to leaf) is a sequence of its own, numbered from 1. A node that
        # continues a leaf takes over the leaf's sequence; any other starts one, tagging the
        # cells its branch shares: the cached prefix and its ancestors already decoded (a
        # sequence through the parent holds exactly those below the parent's position). In
        # the unified cache tagging moves no data; ancestors in this batch get the tag here.
        next_seq = 1 + max((max(s) for s in seqs if s), default=0)
        has_child = [False] * (n_old + n_new)
        for p in tree.parents:
            if p >= 0:
                has_child[p] = True
        for i in range(n_old, n_old + n_new):
            p = all_parents[i]
            if p >= 0 and not has_child[p]:
                has_child[p] = True
                seqs[i].append(seqs[p][0])  # a leaf has exactly one sequence
                continue
            seq_id, next_seq = next_seq, next_seq + 1
            if p < 0:
                lib.llama_memory_seq_cp(self._mem, 0, seq_id, -1, -1)
            else:
                lib.llama_memory_seq_cp(self._mem, seqs[p][0], seq_id, -1, base + depth[p] + 1)
            node = p
            while node >= 0:
                seqs[node].append(seq_id)
                node = all_parents[node]
            seqs[i].append(seq_id)
        b = self._batch
        b.n_tokens = n_new
        for j, tok in enumerate(tokens):
            i = n_old + j
            b.token[j] = tok
            b.pos[j] = base + depth[i]
            # llama.cpp masks a token by its sequence ids; every ancestor shares them (a
            # branch through a node runs through all of its ancestors).
            b.n_seq_id[j] = len(seqs[i])
            for k, seq_id in enumerate(sorted(seqs[i])):
                b.seq_id[j][k] = seq_id
            b.logits[j] = True
        t0 = time.perf_counter()
        rc = lib.llama_decode(self._ctx, b)
        lib.llama_synchronize(self._ctx)
        self.decode_seconds += time.perf_counter() - t0
        self.decode_calls += 1
        if rc != 0:
            self._tree = None
            lib.llama_memory_seq_keep(self._mem, 0)  # drop whatever of the tree was written
            _raise_if_interrupted()
            raise ModelLoadError(f"llama_decode failed with code {rc} (out of memory?)")
        self._tree = _Tree(base, (*tree.tokens, *tokens), tuple(all_parents),
                           tuple(tuple(sorted(s)) for s in seqs))
        _raise_if_interrupted()  # Ctrl-C while it logged; the tree is recorded for keep_branch
        return self._logits_view(n_new)

    def keep_branch(self, path: Sequence[int]) -> None:
        """After ``decode_tree``: keep the nodes ``path`` (a root, then each node a child of the
        one before) as the continuation of ``self.tokens``, and drop every other node, so the
        cache holds exactly ``self.tokens`` again (in sequence 0). An empty path keeps none."""
        tree = self._tree
        if tree is None:
            raise ValueError("keep_branch needs a token tree decoded first")
        for i, node in enumerate(path):
            if not 0 <= node < len(tree.tokens) or tree.parents[node] != (path[i - 1] if i
                                                                           else -1):
                raise ValueError(f"nodes {list(path)} are not a path from a root of the tree")
        lib, mem = self._lib, self._mem
        self._tree = None
        if not path:
            # Cells outside sequence 0 (the tree) are freed; the prefix keeps sequence 0 alone.
            lib.llama_memory_seq_keep(mem, 0)
            return
        branch = tree.seqs[path[-1]][0]  # a branch through the last kept node
        # That branch minus its nodes below the path is the prefix and the path: keep exactly
        # its cells, then hand them back to sequence 0.
        lib.llama_memory_seq_rm(mem, branch, tree.base + len(path), -1)
        lib.llama_memory_seq_keep(mem, branch)
        lib.llama_memory_seq_cp(mem, branch, 0, -1, -1)
        lib.llama_memory_seq_rm(mem, branch, -1, -1)
        self.tokens.extend(tree.tokens[node] for node in path)

    def time_decode(self, n_tokens: int, repeats: int = 2) -> float:
        """Seconds one decode of ``n_tokens`` takes here (KV restored afterwards)."""
        base = len(self.tokens)
        dummy = [self.tokens[-1] if self.tokens else 0] * n_tokens
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.decode(dummy, n_logits=n_tokens)
            best = min(best, time.perf_counter() - t0)
            self.truncate(base)
        return best

    def close(self) -> None:
        lib = self._lib
        self._views = {}
        with contextlib.suppress(Exception):
            if self._batch is not None:
                lib.llama_batch_free(self._batch)
        self._batch = None
        with contextlib.suppress(Exception):
            if self._ctx is not None:
                lib.llama_free(self._ctx)
        self._ctx = None
        with contextlib.suppress(Exception):
            if self._model is not None:
                lib.llama_model_free(self._model)
        self._model = None

    def __del__(self) -> None:
        # A runner dropped without close() must still free llama.cpp's memory (and VRAM).
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self) -> LlamaRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_llama(path: str | Path, settings: ModelSettings = ModelSettings(), **kwargs: Any) -> Any:
    """llama-cpp-python's own ``Llama`` on ``path`` (for comparisons with what a library user
    runs), loaded with this machine's repack decision: ``Llama`` has no parameter for
    ``use_extra_bufts``, so its default model parameters are swapped for the duration of the
    constructor. Checked against llama-cpp-python 0.3.36 (``llama.py`` reads
    ``llama_cpp.llama_model_default_params()`` once, in ``Llama.__init__``)."""
    _init_backend()
    import llama_cpp.llama as llama_module

    from ..gguf_meta import has_quantized_weights
    from .repack import repack_decision

    use = repack_decision(settings.repack, has_quantized_weights(path)).use_extra_bufts
    original = llama_module.llama_cpp.llama_model_default_params

    def params() -> Any:
        p = original()
        p.use_extra_bufts = use
        return p

    threads = settings.n_threads or default_threads()
    llama_module.llama_cpp.llama_model_default_params = params
    try:
        return llama_module.Llama(model_path=str(path), n_gpu_layers=settings.n_gpu_layers or 0,
                                  n_ctx=settings.n_ctx, n_batch=settings.n_batch,
                                  n_threads=threads, n_threads_batch=threads,
                                  flash_attn=settings.flash_attn, verbose=False, **kwargs)
    finally:
        llama_module.llama_cpp.llama_model_default_params = original
