"""One llama.cpp model and context with explicit control of its KV cache.

This is the only module that touches llama-cpp-python below the ``Llama`` class. ``Llama`` loads
the model, context and tokenizer; decoding goes through llama.cpp's C API directly because
``Llama.eval`` either keeps logits for one position or (``logits_all=True``) for the whole context,
an n_ctx x n_vocab buffer. Verification needs logits for exactly the K+1 drafted positions.
Checked against llama-cpp-python 0.3.36 (llama.cpp memory API ``llama_memory_seq_rm``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ContextOverflowError, ModelLoadError

log = logging.getLogger(__name__)
_llama_log = logging.getLogger("localspec.llama_cpp")
# ggml_log_level: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 (continuation lines).
_LOG_LEVELS = {0: logging.DEBUG, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING,
               4: logging.ERROR, 5: logging.DEBUG}
_log_callback: Any = None  # keeps the ctypes callback alive for as long as llama.cpp may call it


def route_llama_logs_to_logging() -> None:
    """Send llama.cpp's own log lines to ``logging`` instead of stderr (they wreck a TUI)."""
    global _log_callback
    if _log_callback is not None:
        return
    import llama_cpp

    @llama_cpp.llama_log_callback  # type: ignore[misc]
    def _callback(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        msg = text.decode("utf-8", errors="replace").rstrip()
        if msg:
            _llama_log.log(_LOG_LEVELS.get(level, logging.DEBUG), "%s", msg)

    _log_callback = _callback
    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """How to load one model: offload, context and threads are per model."""

    n_gpu_layers: int = 0
    n_ctx: int = 4096
    n_threads: int | None = None
    n_batch: int = 512
    flash_attn: bool = False


def default_threads() -> int:
    # llama.cpp slows down sharply when it oversubscribes cores, so use the physical count.
    try:
        import psutil

        return max(1, psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    except Exception:  # psutil missing counts on some containers
        return max(1, os.cpu_count() or 1)


class LlamaRunner:
    """A loaded model whose KV cache holds exactly ``self.tokens`` (sequence 0)."""

    def __init__(self, path: str | Path, settings: ModelSettings = ModelSettings()) -> None:
        route_llama_logs_to_logging()
        from llama_cpp import Llama  # deferred: importing llama_cpp loads the shared library

        threads = settings.n_threads or default_threads()
        try:
            self.llm = Llama(
                model_path=str(path),
                n_gpu_layers=settings.n_gpu_layers,
                n_ctx=settings.n_ctx,
                n_batch=settings.n_batch,
                n_ubatch=settings.n_batch,
                n_threads=threads,
                n_threads_batch=threads,
                flash_attn=settings.flash_attn,
                logits_all=False,
                verbose=False,
            )
        except Exception as exc:  # llama-cpp-python raises ValueError for most load failures
            raise ModelLoadError(f"{path}: llama.cpp could not load it ({exc})") from exc
        import llama_cpp

        self._lib = llama_cpp
        self.path = Path(path)
        self.settings = settings
        self.n_ctx = self.llm.n_ctx()
        # llama.cpp clamps n_batch to n_ctx; chunk by what the context really accepts.
        self.n_batch = int(llama_cpp.llama_n_batch(self.llm.ctx))
        self._ctx = self.llm.ctx
        self._vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.tokens: list[int] = []
        llama_cpp.llama_memory_clear(self._mem, True)

    # -- vocabulary ---------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))

    def piece(self, token: int) -> bytes:
        """The bytes of one token as it continues a text (leading space kept).

        A buffer per call (not per runner) so front ends may detokenize from any thread."""
        buf = ctypes.create_string_buffer(64)
        n = self._lib.llama_token_to_piece(self._vocab, token, buf, 64, 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lib.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
        return bytes(buf.raw[:n])

    def is_eog(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    @property
    def add_bos(self) -> bool:
        return bool(self._lib.llama_vocab_get_add_bos(self._vocab))

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.llm.metadata)

    # -- KV cache -----------------------------------------------------------------------------
    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens of the KV cache, drop the rest."""
        if n < len(self.tokens):
            self._lib.llama_memory_seq_rm(self._mem, 0, n, -1)
            del self.tokens[n:]

    def reset(self) -> None:
        self._lib.llama_memory_clear(self._mem, True)
        self.tokens.clear()

    def common_prefix(self, seq: Sequence[int]) -> int:
        n = 0
        for a, b in zip(self.tokens, seq, strict=False):
            if a != b:
                break
            n += 1
        return n

    # -- decoding -----------------------------------------------------------------------------
    def decode(self, new_tokens: Sequence[int], n_logits: int = 1) -> np.ndarray:
        """Append ``new_tokens`` to the KV cache; return logits of the last ``n_logits`` of them.

        Returns an array of shape (n_logits, n_vocab), copied out of llama.cpp's buffer.
        """
        if not new_tokens:
            raise ValueError("decode needs at least one token")
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
            rc = self._lib.llama_decode(self._ctx, self._batch)
            if rc != 0:
                # Leave the cache as it was: a failed decode may have written part of the chunk.
                self._lib.llama_memory_seq_rm(self._mem, 0, len(self.tokens), -1)
                raise ModelLoadError(f"llama_decode failed with code {rc} (out of memory?)")
            self.tokens.extend(chunk)
            start += len(chunk)
        return self._read_logits(n_logits)

    def _fill_batch(self, chunk: Sequence[int], pos0: int, first_logit: int) -> None:
        b = self._batch
        b.n_tokens = len(chunk)
        for i, tok in enumerate(chunk):
            b.token[i] = tok
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = i >= first_logit

    def _read_logits(self, n_logits: int) -> np.ndarray:
        out = np.empty((n_logits, self.n_vocab), dtype=np.float32)
        for j in range(n_logits):
            # Negative indices count from the end of the last decoded batch.
            ptr = self._lib.llama_get_logits_ith(self._ctx, j - n_logits)
            out[j] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        return out

    def sync(self, seq: Sequence[int], n_logits: int = 1) -> np.ndarray:
        """Make the KV cache hold exactly ``seq`` and return logits of its last ``n_logits``.

        Reuses the longest common prefix already in the cache; at least ``n_logits`` tokens are
        always decoded again because llama.cpp only keeps logits of the last batch.
        """
        keep = min(self.common_prefix(seq), len(seq) - n_logits)
        self.truncate(keep)
        return self.decode(seq[keep:], n_logits)

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
        with contextlib.suppress(Exception):
            if self._batch is not None:
                self._lib.llama_batch_free(self._batch)
                self._batch = None
        with contextlib.suppress(Exception):
            self.llm.close()

    def __enter__(self) -> LlamaRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
