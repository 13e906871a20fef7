"""The engine's history for its lifetime: a ``HistoryIndex``, the file it lives in, and when
it is written.

Each finished request adds one document (the end of its prompt, then its output). The file is
written on a timer thread at most every ``save_interval`` seconds after a change, and at
``close``: a request never waits for a disk. Before each write the file's header is read again,
because another process may hold the same file (the chat app's engine and a ``serve`` joined to
it) or ``localspec history clear`` may have emptied it: a new epoch there means cleared, and this
process forgets what it held too rather than writing it back; the same epoch with other
contents means another writer: the file's index is kept as it is (its evictions included) and
this process's documents written since its last save are added to it, newest last. The read,
the merge and the write hold the file's lock (``HistoryIndex.locked``), as a clear does, so no
writer's save lands between another's read and its write.

A save works on a copy of the index taken in memory, so the file's lock, the read and the
write happen outside the store's own lock: a request that finishes while another process holds
the file records its document at once, and the save puts it in the file next time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from .history_index import (
    MARK_UNKNOWN,
    Continuation,
    ContinuationTree,
    HistoryIndex,
    newest_that_fit,
)

_Document = tuple[list[int], list[int] | None]  # tokens and their marks (None: unknown)

log = logging.getLogger(__name__)

# Prompt tokens kept before each output. A chat's prompt resends its whole conversation each
# turn (already in the index as the earlier turns' documents) and the current prompt is prompt
# lookup's; what the history needs of it is the lead-in to the answer, which is what lets a
# repeated request match into its earlier answer.
PROMPT_TAIL = 256
SAVE_INTERVAL = 5.0


class HistoryStore:
    """An index of earlier requests, saved to ``path`` (None: this process's memory only)."""

    def __init__(self, index: HistoryIndex, path: Path | None = None, *,
                 prompt_tail: int = PROMPT_TAIL, save_interval: float = SAVE_INTERVAL) -> None:
        self.index = index
        self.path = path
        self.prompt_tail = prompt_tail
        self.save_interval = save_interval
        # Whether the index started empty for want of a usable file (missing, stale or
        # damaged): the caller may seed it (the chat app's saved conversations).
        self.fresh = not index.restored
        # Guards the index and the bookkeeping below; held for memory work only, never
        # across a disk or the file's lock, so recording never waits for either.
        self._lock = threading.Lock()
        self._saving = threading.Lock()  # one save at a time, held across the disk
        self._dirty = False
        self._timer: threading.Timer | None = None
        self._last_save = 0.0
        self._closed = False
        # What this process added or re-marked since its last save, oldest first: all it has
        # to add to a file another process wrote meanwhile.
        self._unsaved: list[_Document] = []
        self._recorded = 0  # documents ever put in _unsaved: the newest are at its end
        # (epoch, checksum) of the file as this process last read or wrote it; None: no file.
        self._file: tuple[str, str] | None = None
        if index.restored and path is not None:
            # As the file was when loaded: a header read again now could be of a save made
            # since, whose documents this index does not hold.
            self._file = (index.epoch, str(index.checksum))

    @classmethod
    def open(cls, path: Path, vocabulary: str, *, max_tokens: int = 1_000_000,
             max_bytes: int | None = None, note: str = "", n_vocab: int | None = None,
             save_interval: float = SAVE_INTERVAL) -> HistoryStore:
        """The store for the file at ``path`` (read now; a bad file is dropped, never trusted).
        ``n_vocab``: the vocabulary's size, past which a file's token is damage."""
        index = HistoryIndex.load(path, vocabulary, max_tokens, max_bytes, n_vocab)
        if note:
            index.note = note
        return cls(index, path, save_interval=save_interval)

    @classmethod
    def in_memory(cls, vocabulary: str = "", *, max_tokens: int = 1_000_000,
                  n_vocab: int | None = None) -> HistoryStore:
        """A store that writes nothing: this process's requests only."""
        return cls(HistoryIndex(vocabulary, max_tokens, n_vocab=n_vocab))

    def detached(self) -> HistoryStore:
        """A copy in memory that never touches the file (a benchmark's runs that must not
        teach the real history what they saw)."""
        with self._lock:
            copy = self.index.copy()
        return HistoryStore(copy, prompt_tail=self.prompt_tail)

    # -- using it -----------------------------------------------------------------------------
    def lookup(self, context: Sequence[int], budget: int) -> Continuation | None:
        return self.index.lookup(context, budget)

    def lookup_tree(self, context: Sequence[int], depth: int,
                    max_nodes: int) -> ContinuationTree | None:
        return self.index.lookup_tree(context, depth, max_nodes)

    def record(self, prompt: Sequence[int], output: Sequence[int],
               marks: Sequence[int] | None = None) -> None:
        """One finished request: the end of its prompt and its output, with the output
        tokens' marks (``history_index.MARK_*``: None, all unknown)."""
        if not output:
            return
        tail = list(prompt[-self.prompt_tail:]) if self.prompt_tail else []
        doc = [*tail, *output]
        doc_marks = None if marks is None else [MARK_UNKNOWN] * len(tail) + list(marks)
        with self._lock:
            if self.index.update(doc, doc_marks):
                self._keep_unsaved(doc, doc_marks)
                self._changed()

    def seed(self, documents: Iterable[Sequence[int]]) -> int:
        """Add documents from elsewhere (oldest first) and save; returns how many were new."""
        added = 0
        with self._lock:
            for doc in documents:
                if self.index.add(doc):
                    added += 1
                    self._keep_unsaved(list(doc), None)
            self.fresh = False
            if added:
                self._changed()
        return added

    # -- saving -------------------------------------------------------------------------------
    def _keep_unsaved(self, doc: list[int], marks: list[int] | None) -> None:
        """Under the lock: remember a document for merging into the file; a store with no
        file never merges, so it keeps none. Bounded like the index: where saves keep
        failing, documents older than the newest ``token_limit`` tokens would be evicted by
        the merge anyway."""
        if self.path is None:
            return
        self._unsaved.append((doc, marks))
        self._recorded += 1
        kept = newest_that_fit([len(d) for d, _ in self._unsaved], self.index.token_limit)
        del self._unsaved[:len(self._unsaved) - kept]

    def _changed(self) -> None:
        """Under the lock: the index changed; make sure a save is coming."""
        self._dirty = True
        if self.path is None or self._timer is not None or self._closed:
            return
        wait = max(0.0, self._last_save + self.save_interval - time.monotonic())
        timer = threading.Timer(wait, lambda: self._save_from_timer(timer))
        timer.name = "localspec-history-save"
        timer.daemon = True
        self._timer = timer
        timer.start()

    def _save_from_timer(self, timer: threading.Timer) -> None:
        with self._lock:
            if self._timer is not timer:
                return  # a flush in between saved, and cancelled this one
            self._timer = None
        try:
            self._write()
        except OSError as exc:  # a full or read-only cache costs only the history
            log.warning("cannot save the history index %s: %s", self.path, exc)

    def flush(self) -> None:
        """Write the index now, if it changed since the last write."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        self._write()

    def _write(self) -> None:
        """Save what changed. OSError (TimeoutError where another process holds the file's
        lock too long) leaves the changes unsaved, for the next write."""
        with self._saving:
            with self._lock:
                if not self._dirty or self.path is None:
                    return
                mine, unsaved, known = self.index.copy(), list(self._unsaved), self._file
                taken = self._recorded
            with HistoryIndex.locked(self.path):
                written, outcome = self._synced(self.path, mine, unsaved, known)
                written.save(self.path)
            with self._lock:
                self._saved(written, outcome, taken)

    def _saved(self, written: HistoryIndex, outcome: str, taken: int) -> None:
        """Under the lock, after a save of ``written``: make it the index, with what was
        recorded while it was being written (the documents past the ``taken``-th)."""
        since = self._recorded - taken
        later = self._unsaved[-since:] if since else []
        if outcome == "forgotten":
            # Cleared or removed on purpose: what was recorded meanwhile may predate the clear.
            later = []
        if outcome != "kept":
            for doc, marks in later:
                written.update(doc, marks)
            # A new index object, never the live one changed in place: the engine's thread
            # may be looking it up right now, without the lock.
            self.index = written
        # "kept": the live index is what was written plus ``later`` already.
        self._file = (written.epoch, str(written.checksum))
        self._unsaved = list(later)
        self._last_save = time.monotonic()
        self._dirty = False
        if later:
            self._changed()

    def _synced(self, path: Path, mine: HistoryIndex, unsaved: list[_Document],
                known: tuple[str, str] | None) -> tuple[HistoryIndex, str]:
        """Under the file's lock, before writing: the index to write, honouring a clear made
        since this process last read the file (``known``) and keeping what another process
        wrote there; and what that was: "kept" (``mine``), "merged" or "forgotten"."""
        header = HistoryIndex.read_header(path)
        if header is None or header.get("vocabulary") != mine.vocabulary:
            if known is not None:  # it was there and is gone: removed on purpose
                log.info("history index %s was removed; forgetting this process's too", path)
                return self._empty(mine), "forgotten"
            return mine, "kept"
        epoch, checksum = str(header.get("epoch")), str(header.get("sha256"))
        cleared = known is not None and epoch != known[0]
        if not cleared and known is not None and checksum == known[1]:
            return mine, "kept"  # nobody else wrote it
        other = HistoryIndex.load(path, mine.vocabulary, mine.max_tokens, mine.max_bytes,
                                  mine.n_vocab)
        if cleared:
            log.info("history index %s was cleared; forgetting this process's too", path)
            return (other if other.restored else self._empty(mine)), "forgotten"
        if not other.restored:  # damaged since: this process's index replaces it
            return mine, "kept"
        # The file as the other writer left it, then what this process added since its last
        # save: the newest documents, so evicted last. Documents of this process that the file
        # no longer holds were evicted there and stay evicted.
        other.note = mine.note
        for doc, marks in unsaved:
            other.update(doc, marks)
        return other, "merged"

    @staticmethod
    def _empty(mine: HistoryIndex) -> HistoryIndex:
        return HistoryIndex(mine.vocabulary, mine.max_tokens, mine.max_bytes, note=mine.note,
                            n_vocab=mine.n_vocab)

    def close(self) -> None:
        """Write what is unsaved and stop saving."""
        with self._lock:
            self._closed = True
        try:
            self.flush()
        except OSError as exc:
            log.warning("cannot save the history index %s: %s", self.path, exc)
