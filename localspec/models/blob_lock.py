"""One writer per blob: a lock file per blob in the store, across processes and threads.

Whoever holds a blob's lock is the only one who may write, resume, verify, rename or discard
``blobs/sha256-<hex>`` and its ``.partial``; everyone else waits (reporting that they wait) and,
once in, looks again, since the blob may have been finished meanwhile.

The locks live in ``<store>/.localspec-locks/``, not beside the blobs: Ollama removes every file in
``blobs/`` whose name is not a digest when it starts (its blob pruning), and deleting a lock file
that someone holds would let a second writer lock a fresh file of the same name. Nothing lists
that folder (Ollama reads ``manifests/`` and ``blobs/`` only), and its dot keeps it out of sight.
The lock files are empty and stay after use: unlinking one while another process waits on it
would break the exclusion, and a file left by a killed process is harmless, since the kernel
drops a dead process's ``flock`` and the next pull takes it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from ..errors import PullError
from .ollama_store import blob_path

log = logging.getLogger(__name__)

LOCK_DIR = ".localspec-locks"
# How often a waiting pull looks at its cancel event (and reports that it still waits).
POLL_SECONDS = 0.2


def lock_path(store: Path, digest: str) -> Path:
    """The lock file guarding the blob ``digest`` in ``store``."""
    return store / LOCK_DIR / f"{blob_path(store, digest).name}.lock"


@contextmanager
def blob_lock(store: Path, digest: str, *, cancel: threading.Event | None = None,
              waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the lock of blob ``digest``; call ``waiting`` on every poll while another holds it.

    Raises PullError when ``cancel`` is set while waiting.
    """
    path = lock_path(store, digest)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PullError(f"cannot create {path.parent} ({exc.strerror}); check the store's "
                        "permissions") from exc
    # A fresh lock object per hold, not thread-local: filelock's locks are reentrant per object
    # (per thread by default), so an object shared between threads would let both in. Separate
    # objects open separate descriptors, and flock excludes those from each other even within
    # one process, so two threads of a chat app exclude each other like two processes do.
    lock = FileLock(str(path), thread_local=False)
    _acquire(lock, digest, cancel, waiting)
    try:
        yield
    finally:
        lock.release()


def _acquire(lock: FileLock, digest: str, cancel: threading.Event | None,
             waiting: Callable[[], None] | None) -> None:
    try:
        lock.acquire(timeout=0)
        return
    except Timeout:
        log.info("another pull is writing %s; waiting for it", digest)
    # Short timeouts in a loop rather than one blocking acquire: the wait stays cancellable.
    while True:
        if cancel is not None and cancel.is_set():
            raise PullError(f"pull cancelled while waiting for another pull of {digest[:19]}; "
                            "run it again later")
        if waiting is not None:
            waiting()
        try:
            lock.acquire(timeout=POLL_SECONDS)
            return
        except Timeout:
            continue
