"""Saved KV states of earlier prompts, so a request that resends a long prefix skips its prefill.

A runner's KV cache holds one sequence: the last request's. Agents and chats interleave
requests whose prompts share long prefixes with an *earlier* request, not the last one (a
chat's whole history, a file resent by a coding loop between two tool calls). Prefilling that
again costs more than decoding the answer on a CPU (1,300 chat tokens: ~13 s for a 1.5B F16
target on 2 cores, against ~13 s for 160 answer tokens). llama-server keeps such states per
slot and in RAM (``--cache-ram``); this is the same for localspec's one sequence.

This module is the policy alone (which state to keep, which to restore); ``LlamaRunner``
copies the states in and out of llama.cpp, at a request's start only: the state the cache
holds is saved when the new prompt would drop much of it (as llama-server saves a slot it
reuses), so a chat's next turn, which extends the last one, copies nothing. Entries are
bounded in bytes, the least recently used dropped first; a state whose tokens extend
another's replaces it (the longer one serves every prompt the shorter did).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# A state is worth restoring only where it saves at least this many prefill tokens over what
# the KV cache already holds: a restore copies the whole state (a few ms per thousand tokens
# of a 1.5B model), a 32-token prefill costs about as much on a GPU.
MIN_GAIN = 32
# The same for a model on the CPU, where 4 prefilled tokens cost more than that copy (a 1.5B
# F16 target on 2 cores: 16 ms a token, against ~5 ms to restore 1,300 tokens). An agent's
# file resent with its first line changed shares only the system prompt with the last
# revision's state (~30 tokens): 0.5 s of prefill there that a 32-token floor threw away.
MIN_GAIN_CPU = 4
# Shorter sequences are not kept: their prefill is cheaper than the bookkeeping.
MIN_TOKENS = 64


@dataclass(slots=True)
class Entry:
    """One saved state: the tokens its KV cache holds, and llama.cpp's bytes for it."""

    tokens: np.ndarray  # int32
    data: object  # a ctypes buffer from llama_state_seq_get_data
    nbytes: int


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two int32 arrays share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    eq = a[:n] == b[:n]
    return n if bool(eq.all()) else int(np.argmin(eq))


class PromptCache:
    """Saved states by their tokens, ``max_bytes`` at most (0: keep none); one is restored
    only where it spares at least ``min_gain`` prefill tokens."""

    def __init__(self, max_bytes: int, min_gain: int = MIN_GAIN) -> None:
        self.max_bytes = max(0, max_bytes)
        self.min_gain = max(1, min_gain)
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # oldest use first
        self._next_id = 0
        self.hits = 0
        self.tokens_saved = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def covers(self, tokens: Sequence[int]) -> bool:
        """Whether a kept state already holds ``tokens`` or more (saving them adds nothing)."""
        arr = np.asarray(tokens, dtype=np.int32)
        return any(len(e.tokens) >= len(arr) and common_prefix(e.tokens, arr) == len(arr)
                   for e in self._entries.values())

    def wants(self, tokens: Sequence[int], nbytes: int) -> bool:
        """Whether a state of ``tokens`` taking ``nbytes`` would be kept."""
        return (self.max_bytes > 0 and len(tokens) >= MIN_TOKENS and nbytes <= self.max_bytes
                and not self.covers(tokens))

    def add(self, tokens: Sequence[int], data: object, nbytes: int) -> bool:
        """Keep a state; False where it is not worth keeping (see ``wants``)."""
        if not self.wants(tokens, nbytes):
            return False
        arr = np.asarray(tokens, dtype=np.int32)
        for key, e in list(self._entries.items()):  # states this one extends are redundant
            if len(e.tokens) <= len(arr) and common_prefix(e.tokens, arr) == len(e.tokens):
                del self._entries[key]
        while self._entries and self.nbytes + nbytes > self.max_bytes:
            self._entries.popitem(last=False)
        self._entries[self._next_id] = Entry(arr, data, nbytes)
        self._next_id += 1
        return True

    def best(self, seq: Sequence[int], held: int) -> Entry | None:
        """The kept state sharing the longest prefix with ``seq``, where that saves at least
        ``min_gain`` tokens over the ``held`` ones the KV cache already shares with it."""
        if not self._entries or len(seq) - held < self.min_gain:
            return None
        arr = np.asarray(seq, dtype=np.int32)
        best_key, best_len = None, held + self.min_gain - 1
        for key, e in self._entries.items():
            n = common_prefix(e.tokens, arr)
            if n > best_len:
                best_key, best_len = key, n
        if best_key is None:
            return None
        self._entries.move_to_end(best_key)
        return self._entries[best_key]

    def used(self, gain: int) -> None:
        """A restored state spared ``gain`` prefill tokens (for the statistics)."""
        self.hits += 1
        self.tokens_saved += gain

    def discard(self, entry: Entry) -> None:
        """Forget a state llama.cpp could not take back."""
        for key, e in list(self._entries.items()):
            if e is entry:
                del self._entries[key]

    def clear(self) -> None:
        self._entries.clear()
