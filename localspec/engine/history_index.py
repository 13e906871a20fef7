"""An index of token sequences seen before (earlier answers and their prompts), for drafting
the continuation of the longest earlier match of the current context: suffix decoding.

Layout: every document's tokens in one int32 array, each followed by a -1 separator, and for
every position where three tokens end, the key of those three tokens (exact: 21 bits a token,
so no hash collisions for any vocabulary under two million) sorted together with the position
after them. A lookup is one binary search for the context's last three tokens, then a
vectorised comparison backwards from each hit to find how far it matches; the continuations of
the longest matches are merged into one draft, each token weighted by how many of them agree.
About 20 bytes a token in memory (BYTES_PER_TOKEN): a million tokens is 20 MB, and a lookup
tens of microseconds.

Each token carries a mark (``MARK_*``): whether the target, when it wrote that token, met a
near-tie there (its top two choices closer than batched logits can decide, so verification
stopped and a one-token pass decided it), decided it clearly, or was not asked (a prompt, a
saved conversation, plain decoding). A copy of an earlier answer meets the same near-ties at the
same places, so the history drafter stops its draft just before one and auto prices a copy by
where its ties are rather than by a rate averaged over the text (Q4_K_M here, one-token passes
on the built-in prompts: 3-20% of positions on code under its guard, 37-48% on prose; the
longest clear stretch of code 18-118 tokens).

Persistence keeps only the token array, the marks and the document lengths (the keys are
rebuilt on load in milliseconds), behind a header with a format version, the vocabulary it
belongs to and a checksum: a stale or damaged file is dropped and the index starts over, never
trusted (a format-1 file, from before the marks, is read with every mark unknown). The header
also carries an ``epoch``, drawn anew whenever an index starts empty (created, cleared, or
rebuilt after a bad file): a process holding an index can tell from the header alone that the
file was cleared behind it (``localspec history clear``) rather than saved by another process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..files import atomic_write

log = logging.getLogger(__name__)

KEY_TOKENS = 3
_BITS = 21
_MASK = (1 << _BITS) - 1
SEPARATOR = -1
MAX_MATCH = 64  # how far back a match is compared: longer matches all rank alike
MAX_HITS = 64  # the most recent hits of one key that are compared
FORMAT = 2  # 2: a mark per token; a format-1 file is read with every mark unknown
_READABLE_FORMATS = (1, 2)
_MAGIC = b"LSHIST1\n"
# Memory a held token costs: 4 bytes in the token array, 1 for its mark, 16 for its key and
# position.
BYTES_PER_TOKEN = 21

# How long a save or a clear waits for another process's save of the same file (milliseconds,
# normally): past it the save is left for later, the clear refused.
LOCK_SECONDS = 10.0

# A token's mark: what the target's choice there was when it wrote it.
MARK_UNKNOWN, MARK_CLEAR, MARK_TIED = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Continuation:
    """A drafted continuation: its tokens, how many context tokens the matches agreed on, and
    per token the share of the longest matches that continued with it."""

    tokens: tuple[int, ...]
    match_length: int
    agreement: tuple[float, ...]
    matches: int
    # Per token, its mark (MARK_*) where the most recent match that continued with it
    # wrote it.
    marks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ContinuationTree:
    """The continuations of the longest earlier matches as one trie: node i is ``tokens[i]``
    after node ``parents[i]`` (-1: the context's end), parents first and the most recent
    match's path first; ``shares[i]``: the share of the matches that continued through it."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    shares: tuple[float, ...]
    match_length: int
    matches: int


def _keys(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keys of every three-token window that holds no separator, and the position that
    follows each window."""
    n = len(tokens)
    if n < KEY_TOKENS:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    t = tokens.astype(np.int64)
    a, b, c = t[:-2], t[1:-1], t[2:]
    keys = (a << (2 * _BITS)) | ((b & _MASK) << _BITS) | (c & _MASK)
    follow = np.arange(KEY_TOKENS, n + 1, dtype=np.int64)
    ok = (a >= 0) & (b >= 0) & (c >= 0)
    return keys[ok], follow[ok]


def _digest(doc: np.ndarray) -> bytes:
    return hashlib.blake2b(doc.tobytes(), digest_size=16).digest()


def _key_of(three: Sequence[int]) -> int:
    a, b, c = (int(x) for x in three)
    return (a << (2 * _BITS)) | ((b & _MASK) << _BITS) | (c & _MASK)


def _new_epoch() -> str:
    return secrets.token_hex(8)


class HistoryIndex:
    """Token sequences seen before, bounded to ``max_tokens`` and to about ``max_bytes`` of
    memory (the oldest documents go first).

    Not thread-safe for writers: one thread adds (the engine's) and lookups only read; every
    array is replaced, never changed in place, so a reader sees one state or the next. A save
    from another thread writes a ``copy``, as the document lists do change in place.
    ``note`` is free text kept in the file for people (which model it was last saved for).
    """

    def __init__(self, vocabulary: str, max_tokens: int = 1_000_000,
                 max_bytes: int | None = None, note: str = "",
                 n_vocab: int | None = None) -> None:
        self.vocabulary = vocabulary
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self.note = note
        # The vocabulary's size where known: a token past it is no token of this vocabulary
        # (a damaged file, or a bug), and drafting it would fail the target's decode.
        self.n_vocab = n_vocab
        self.epoch = _new_epoch()
        # Whether ``load`` found it in a file (False: new, or the file was dropped).
        self.restored = False
        # The sha256 of the file it was last loaded from or saved to (None: neither): with the
        # epoch, what tells a holder whether another process wrote the file since.
        self.checksum: str | None = None
        self._tokens = np.empty(0, np.int32)
        self._marks = np.empty(0, np.int8)  # parallel to _tokens (a separator's: unknown)
        self._doc_lengths: list[int] = []  # each without its separator
        self._doc_digests: list[bytes] = []  # parallel to _doc_lengths: no document twice
        self._digest_set: set[bytes] = set()
        self._keys = np.empty(0, np.int64)
        self._follow = np.empty(0, np.int64)

    # -- size -------------------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        """Tokens held, separators excluded."""
        return int(len(self._tokens)) - len(self._doc_lengths)

    @property
    def n_documents(self) -> int:
        return len(self._doc_lengths)

    @property
    def n_bytes(self) -> int:
        """Memory held by the arrays (the file is about a fifth of it)."""
        return int(self._tokens.nbytes + self._marks.nbytes + self._keys.nbytes
                   + self._follow.nbytes)

    @property
    def token_limit(self) -> int:
        """The most tokens held: ``max_tokens``, or fewer where ``max_bytes`` says so."""
        if self.max_bytes is None:
            return self.max_tokens
        return max(KEY_TOKENS + 1, min(self.max_tokens, self.max_bytes // BYTES_PER_TOKEN))

    def documents(self) -> Iterator[np.ndarray]:
        """The documents held, oldest first."""
        for doc, _ in self.marked_documents():
            yield doc

    def marked_documents(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The documents held with their tokens' marks, oldest first."""
        start = 0
        tokens, marks = self._tokens, self._marks
        for length in list(self._doc_lengths):
            yield tokens[start:start + length], marks[start:start + length]
            start += length + 1

    # -- adding -----------------------------------------------------------------------------
    def add(self, tokens: Sequence[int] | np.ndarray,
            marks: Sequence[int] | np.ndarray | None = None) -> bool:
        """Add one document (an answer, with the end of the prompt before it) and its tokens'
        marks (MARK_*; None: all unknown). A document already held is not added twice: what
        the new marks know replaces what the held ones said. Returns whether it was added."""
        return self.update(tokens, marks) == "added"

    def update(self, tokens: Sequence[int] | np.ndarray,
               marks: Sequence[int] | np.ndarray | None = None) -> str:
        """``add``, saying what changed: "added", "remarked" (held, with new marks) or ""."""
        doc = np.asarray(tokens, dtype=np.int32)
        if marks is None:
            mk = np.zeros(len(doc), np.int8)
        else:
            mk = np.asarray(marks, dtype=np.int8)
            if mk.shape != doc.shape:
                raise ValueError(f"{len(mk)} marks for {len(doc)} tokens")
        if len(doc) < KEY_TOKENS + 1 or (doc < 0).any() or (
                self.n_vocab is not None and (doc >= self.n_vocab).any()):
            return ""
        doc, mk = _cut(doc, mk, self.token_limit)
        digest = _digest(doc)
        if digest in self._digest_set:
            return "remarked" if self._remark(digest, mk) else ""
        base = len(self._tokens)
        self._append(doc, digest, mk)
        keys, follow = _keys(doc)
        self._merge(keys, follow + base)
        self._evict()
        return "added"

    def _remark(self, digest: bytes, marks: np.ndarray) -> bool:
        """A held document written again: its known marks replace the held ones (an answer
        first recorded by plain decoding, which marks nothing, then by a drafting run).
        Returns whether a mark changed."""
        if not marks.any():
            return False
        i = self._doc_digests.index(digest)
        start = sum(self._doc_lengths[:i]) + i
        held = self._marks[start:start + len(marks)]
        merged = np.where(marks != MARK_UNKNOWN, marks, held).astype(np.int8)
        if np.array_equal(merged, held):
            return False
        self._marks = np.concatenate([self._marks[:start], merged,
                                      self._marks[start + len(marks):]])
        return True

    def _append(self, doc: np.ndarray, digest: bytes, marks: np.ndarray) -> None:
        self._tokens = np.concatenate([self._tokens, doc, np.array([SEPARATOR], np.int32)])
        self._marks = np.concatenate([self._marks, marks, np.zeros(1, np.int8)])
        self._doc_lengths.append(len(doc))
        self._doc_digests.append(digest)
        self._digest_set.add(digest)

    def _merge(self, keys: np.ndarray, follow: np.ndarray) -> None:
        if not len(keys):
            return
        order = np.lexsort((follow, keys))
        keys, follow = keys[order], follow[order]
        # New positions are all later than held ones, so among equal keys they go last:
        # inserting at the right edge keeps each key's positions in ascending order.
        at = np.searchsorted(self._keys, keys, side="right")
        self._keys = np.insert(self._keys, at, keys)
        self._follow = np.insert(self._follow, at, follow)

    def copy(self) -> HistoryIndex:
        """An index holding what this one holds now, which later adds to either leave alone.
        Cheap: the arrays are shared, as nothing changes them in place."""
        twin = HistoryIndex(self.vocabulary, self.max_tokens, self.max_bytes, self.note,
                            self.n_vocab)
        twin.epoch, twin.restored, twin.checksum = self.epoch, self.restored, self.checksum
        twin._tokens, twin._marks = self._tokens, self._marks
        twin._keys, twin._follow = self._keys, self._follow
        twin._doc_lengths = list(self._doc_lengths)
        twin._doc_digests = list(self._doc_digests)
        twin._digest_set = set(self._digest_set)
        return twin

    def _evict(self) -> None:
        drop_docs = len(self._doc_lengths) - newest_that_fit(self._doc_lengths,
                                                              self.token_limit)
        if not drop_docs:
            return
        cut = sum(self._doc_lengths[:drop_docs]) + drop_docs  # with their separators
        self._digest_set.difference_update(self._doc_digests[:drop_docs])
        del self._doc_digests[:drop_docs]
        del self._doc_lengths[:drop_docs]
        keep = self._follow > cut
        self._keys = self._keys[keep]
        self._follow = self._follow[keep] - cut
        self._tokens = self._tokens[cut:]
        self._marks = self._marks[cut:]

    def clear(self) -> None:
        """Forget every document (under a new epoch: see the module's docstring)."""
        self.epoch = _new_epoch()
        self._tokens = np.empty(0, np.int32)
        self._marks = np.empty(0, np.int8)
        self._doc_lengths.clear()
        self._doc_digests.clear()
        self._digest_set.clear()
        self._keys = np.empty(0, np.int64)
        self._follow = np.empty(0, np.int64)

    # -- looking up -------------------------------------------------------------------------
    def lookup(self, context: Sequence[int], budget: int, min_match: int = KEY_TOKENS,
               ) -> Continuation | None:
        """The continuation of the longest earlier match of ``context``'s end, at most
        ``budget`` tokens, where at least ``min_match`` tokens matched."""
        found = self._longest_matches(context, min_match) if budget > 0 else None
        return None if found is None else self._merge_continuations(*found, budget)

    def lookup_tree(self, context: Sequence[int], depth: int, max_nodes: int,
                    min_match: int = KEY_TOKENS) -> ContinuationTree | None:
        """Every continuation of the longest earlier matches of ``context``'s end, at most
        ``depth`` tokens each, as one trie of at most ``max_nodes`` nodes. Each ends just
        before its first position marked tied: a verification stops there whichever branch
        the target takes, so nodes past it would be checked for nothing."""
        found = (self._longest_matches(context, min_match)
                 if depth > 0 and max_nodes > 0 else None)
        if found is None:
            return None
        starts, match = found
        rows = [row[:marks.index(MARK_TIED)] if MARK_TIED in marks else row
                for row, marks in self._marked_rows(starts, depth)[::-1]]  # the newest first
        tokens: list[int] = []
        parents: list[int] = []
        counts: list[int] = []
        child: dict[tuple[int, int], int] = {}
        for row in rows:
            node = -1
            for tok in row:
                nxt = child.get((node, tok))
                if nxt is None:
                    if len(tokens) >= max_nodes:
                        break
                    nxt = child[(node, tok)] = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                    counts.append(0)
                counts[nxt] += 1
                node = nxt
        if not tokens:
            return None
        return ContinuationTree(tuple(tokens), tuple(parents),
                                tuple(c / len(rows) for c in counts), match, len(rows))

    def _longest_matches(self, context: Sequence[int],
                         min_match: int) -> tuple[np.ndarray, int] | None:
        """Where the continuations of the longest earlier matches of ``context``'s end start
        (ascending), and how many tokens they matched; None below ``min_match``."""
        if len(context) < KEY_TOKENS or not len(self._keys):
            return None
        key = _key_of(context[-KEY_TOKENS:])
        lo = int(np.searchsorted(self._keys, key, side="left"))
        hi = int(np.searchsorted(self._keys, key, side="right"))
        if lo == hi:
            return None
        hits = self._follow[max(lo, hi - MAX_HITS):hi]  # the most recent ones
        span = min(MAX_MATCH, len(context))
        back = np.asarray(context[-span:][::-1], dtype=np.int32)
        idx = hits[:, None] - 1 - np.arange(span)[None, :]
        valid = idx >= 0
        seen = np.where(valid, self._tokens[np.clip(idx, 0, None)], SEPARATOR)
        equal = seen == back[None, :]
        lengths = np.where(equal.all(axis=1), span, equal.argmin(axis=1))
        best = int(lengths.max())
        if best < min_match:
            return None
        return hits[lengths == best], best

    def _marked_rows(self, starts: np.ndarray,
                     budget: int) -> list[tuple[list[int], list[int]]]:
        """Up to ``budget`` tokens from each start, each cut at its document's end, with
        each token's mark."""
        rows = []
        tokens, marks = self._tokens, self._marks  # one state, whatever a writer does
        for start in starts.tolist():
            row = tokens[start:start + budget].tolist()
            if SEPARATOR in row:
                row = row[:row.index(SEPARATOR)]
            rows.append((row, marks[start:start + len(row)].tolist()))
        return rows

    def _merge_continuations(self, starts: np.ndarray, match: int,
                             budget: int) -> Continuation | None:
        # Depth by depth, follow the token most of the remaining matches continue with (the
        # most recent one on a tie), and drop the matches that went elsewhere. Plain Python:
        # a few dozen short rows, where each numpy call would cost more than the work; the
        # usual cases (one match, or matches that agree) skip the counting.
        marked = self._marked_rows(starts, budget)
        total = len(marked)
        if total == 1:
            only, only_marks = marked[0]
            return (Continuation(tuple(only), match, (1.0,) * len(only), 1, tuple(only_marks))
                    if only else None)
        rows = [row for row, _ in marked]
        row_marks = [mk for _, mk in marked]
        tokens: list[int] = []
        agreement: list[float] = []
        marks: list[int] = []
        for d in range(budget):
            # Rows in ascending position: the last one is the most recent.
            column = [row[d] for row in rows if d < len(row)]
            if not column:
                break
            tok = column[-1]
            top = column.count(tok)
            if top < len(column):
                counts: dict[int, int] = {}
                for t in column:
                    counts[t] = counts.get(t, 0) + 1
                top = max(counts.values())
                tok = next(t for t in reversed(column) if counts[t] == top)
            if top < len(rows):
                kept = [i for i, row in enumerate(rows) if d < len(row) and row[d] == tok]
                rows = [rows[i] for i in kept]
                row_marks = [row_marks[i] for i in kept]
            tokens.append(tok)
            agreement.append(top / total)
            marks.append(row_marks[-1][d])  # the most recent row that goes on with tok
        if not tokens:
            return None
        return Continuation(tuple(tokens), match, tuple(agreement), total, tuple(marks))

    # -- persistence ------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Write the index atomically with owner-only permissions (it holds users' text)."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        lengths = np.asarray(self._doc_lengths, dtype=np.int64)
        body = (self._tokens.astype("<i4").tobytes() + lengths.astype("<i8").tobytes()
                + self._marks.astype("i1").tobytes())
        checksum = hashlib.sha256(body).hexdigest()
        meta = json.dumps({"format": FORMAT, "vocabulary": self.vocabulary,
                           "tokens": int(len(self._tokens)), "documents": len(lengths),
                           "sha256": checksum, "epoch": self.epoch,
                           "note": self.note}).encode()
        atomic_write(path, _MAGIC + struct.pack("<I", len(meta)) + meta + body, mode=0o600)
        self.checksum = checksum

    @staticmethod
    @contextlib.contextmanager
    def locked(path: Path, timeout: float | None = None) -> Iterator[None]:
        """Hold the lock of the index file at ``path`` (a ``.lock`` file beside it) across a
        read, a merge and a write, so two processes' saves and a clear never interleave.
        TimeoutError where another process holds it ``timeout`` (default ``LOCK_SECONDS``)
        seconds."""
        from filelock import FileLock  # deferred: only writers take it

        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Not thread-local: one lock object per hold, so two threads exclude each other too.
        lock = FileLock(f"{path}.lock", mode=0o600, thread_local=False)
        try:
            lock.acquire(timeout=LOCK_SECONDS if timeout is None else timeout)
        except TimeoutError:  # filelock's Timeout is one
            raise
        except (OSError, NotImplementedError) as exc:
            # A file system that cannot lock (filelock 3 raises NotImplementedError where
            # flock is missing): writing unlocked, as before there was a lock, costs at
            # worst a document another process wrote at the same moment; refusing would
            # cost the whole history.
            log.warning("cannot lock the history index %s (%s); writing it unlocked",
                        path, str(exc) or type(exc).__name__)
            yield
            return
        try:
            yield
        finally:
            lock.release()

    @staticmethod
    def read_header(path: Path) -> dict[str, Any] | None:
        """The header of the file at ``path`` (format, vocabulary, sizes, checksum, epoch,
        note), without reading its tokens; None where there is no readable header."""
        try:
            with path.open("rb") as fh:
                head = fh.read(len(_MAGIC) + 4)
                if not head.startswith(_MAGIC) or len(head) < len(_MAGIC) + 4:
                    return None
                (n_meta,) = struct.unpack_from("<I", head, len(_MAGIC))
                if n_meta > 1 << 20:
                    return None
                meta = _json(fh.read(n_meta))
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) else None

    @classmethod
    def load(cls, path: Path, vocabulary: str, max_tokens: int = 1_000_000,
             max_bytes: int | None = None, n_vocab: int | None = None) -> HistoryIndex:
        """The index saved at ``path``, or an empty one where the file is missing, of another
        format or vocabulary, or damaged (logged, and replaced at the next save). ``restored``
        on the result says which."""
        index = cls(vocabulary, max_tokens, max_bytes, n_vocab=n_vocab)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return index
        except OSError as exc:
            log.warning("history index %s unreadable (%s); starting a new one", path, exc)
            return index
        try:
            tokens, marks, lengths, meta = _parse(raw, vocabulary, n_vocab)
        except ValueError as exc:
            log.warning("history index %s dropped: %s", path, exc)
            return index
        index.restored = True
        index.checksum = str(meta.get("sha256"))
        index.epoch = str(meta.get("epoch") or index.epoch)
        index.note = str(meta.get("note") or "")
        index._restore(tokens, marks, lengths)
        return index

    @staticmethod
    def verify(path: Path, vocabulary: str, n_vocab: int | None = None) -> tuple[int, int]:
        """(documents, tokens) of the file at ``path`` after every check ``load`` makes: a
        listing that trusted the header alone would show a damaged file as whole. ValueError
        says why ``load`` would drop it, OSError that it cannot be read."""
        _, _, lengths, _ = _parse(path.read_bytes(), vocabulary, n_vocab)
        return len(lengths), sum(lengths)

    def _restore(self, tokens: np.ndarray, marks: np.ndarray, lengths: list[int]) -> None:
        """Into an empty index: a file's documents, left as ``update`` would have left them
        under today's limits (which the user may have lowered since the file was written):
        each cut to the limit, then the oldest dropped. Built in one go, not document by
        document: that would copy the arrays once per document."""
        limit = self.token_limit
        docs: list[tuple[np.ndarray, np.ndarray]] = []
        start = 0
        for length in lengths:
            docs.append(_cut(tokens[start:start + length], marks[start:start + length], limit))
            start += length + 1
        held: list[tuple[np.ndarray, np.ndarray, bytes]] = []
        seen: set[bytes] = set()
        for doc, doc_marks in docs:
            digest = _digest(doc)
            if digest not in seen:  # two documents may end alike once cut
                seen.add(digest)
                held.append((doc, doc_marks, digest))
        kept = held[len(held) - newest_that_fit([len(d) for d, _, _ in held], limit):]
        self._digest_set = {digest for _, _, digest in kept}
        self._doc_digests = [digest for _, _, digest in kept]
        self._doc_lengths = [len(doc) for doc, _, _ in kept]
        separator, unmarked = np.array([SEPARATOR], np.int32), np.zeros(1, np.int8)
        self._tokens = np.concatenate(
            [self._tokens, *(part for doc, _, _ in kept for part in (doc, separator))])
        self._marks = np.concatenate(
            [self._marks, *(part for _, mk, _ in kept for part in (mk, unmarked))])
        keys, follow = _keys(self._tokens)
        order = np.lexsort((follow, keys))
        self._keys, self._follow = keys[order], follow[order]


def _cut(doc: np.ndarray, marks: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """A document longer than the index holds keeps its end (the answer, not the prompt)."""
    if len(doc) > limit:
        return doc[-limit:], marks[-limit:]
    return doc, marks


def newest_that_fit(lengths: Sequence[int], limit: int) -> int:
    """How many of the newest documents fit in ``limit`` tokens together; at least one where
    there are any (``update`` cuts a document to the limit before it is added)."""
    total, kept = 0, 0
    for length in reversed(lengths):
        if kept and total + length > limit:
            break
        total += length
        kept += 1
    return kept


def _json(raw: bytes) -> Any:
    """A header's JSON; ValueError for anything that is not one (json also raises
    RecursionError for deep nesting)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deep") from None


def _parse(raw: bytes, vocabulary: str, n_vocab: int | None = None,
           ) -> tuple[np.ndarray, np.ndarray, list[int], dict[str, Any]]:
    if not raw.startswith(_MAGIC) or len(raw) < len(_MAGIC) + 4:
        raise ValueError("not a localspec history index")
    (n_meta,) = struct.unpack_from("<I", raw, len(_MAGIC))
    at = len(_MAGIC) + 4
    try:
        meta = _json(raw[at:at + n_meta])
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors too
        raise ValueError(f"damaged header ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") not in _READABLE_FORMATS:
        raise ValueError("another format version")
    if meta.get("vocabulary") != vocabulary:
        raise ValueError("another vocabulary")
    n_tok, n_doc = _count(meta, "tokens"), _count(meta, "documents")
    body = raw[at + n_meta:]
    if hashlib.sha256(body).hexdigest() != meta.get("sha256"):
        raise ValueError("checksum mismatch (damaged)")
    n_marks = n_tok if meta["format"] >= 2 else 0
    if len(body) != 4 * n_tok + 8 * n_doc + n_marks:
        raise ValueError("size mismatch (damaged)")
    tokens = np.frombuffer(body, dtype="<i4", count=n_tok).astype(np.int32)
    lengths = np.frombuffer(body, dtype="<i8", count=n_doc, offset=4 * n_tok).tolist()
    if any(n < 0 for n in lengths) or sum(lengths) + n_doc != n_tok:
        raise ValueError("document lengths do not add up (damaged)")
    if n_doc and (tokens[np.cumsum(np.asarray(lengths, np.int64) + 1) - 1] != SEPARATOR).any():
        raise ValueError("documents not separated where their lengths say (damaged)")
    if int((tokens < 0).sum()) != n_doc:
        raise ValueError("a negative token inside a document (damaged)")
    if n_vocab is not None and n_tok and int(tokens.max()) >= n_vocab:
        raise ValueError(f"a token past the vocabulary's {n_vocab} (damaged)")
    if n_marks:
        marks = np.frombuffer(body, dtype="i1", count=n_tok, offset=4 * n_tok + 8 * n_doc)
        if ((marks < MARK_UNKNOWN) | (marks > MARK_TIED)).any():
            raise ValueError("unknown token marks (damaged)")
        marks = marks.astype(np.int8)
    else:
        marks = np.zeros(n_tok, np.int8)
    return tokens, marks, [int(x) for x in lengths], meta


def _count(meta: dict[str, Any], key: str) -> int:
    """A size field of the header; ValueError where it is missing or no count (another
    version's header, or a damaged one: JSON's true is an int to Python)."""
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"no {key} count in the header")
    return value
