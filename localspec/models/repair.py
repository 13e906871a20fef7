"""Find a present model's damaged blobs and discard them, so that pulling it again repairs it.

Damaged means missing or of a size other than the manifest's (a stat per blob), or, when asked
to verify, bytes that do not hash to the blob's digest (reads every byte: minutes for a large
model). A damaged blob is deleted, under its lock so that no pull is writing it meanwhile:
content-addressed, it can never become right, and keeping it aside would only hold disk space
that nothing cleans up. Whichever way the model is then pulled fetches the missing blobs again
(Ollama's daemon too: it skips a blob file that exists, whatever its size).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from typing import Any

from ..errors import PullError
from .blob_lock import blob_lock
from .ollama_store import (
    ModelName,
    blob_label,
    blob_path,
    blob_problem,
    blob_sizes,
    manifest_digests,
)
from .registry_client import CHUNK_SIZE, ProgressCallback, PullProgress, waiting_reporter

log = logging.getLogger(__name__)


def discard_damaged(name: ModelName, store: Path, manifest: dict[str, Any], *, verify: bool,
                    report: ProgressCallback,
                    cancel: threading.Event | None = None) -> list[str]:
    """Delete every damaged blob of ``manifest``; return one line per damaged blob found.

    Each line is also reported as a status, so the CLI prints it and the chat app shows it.
    Blobs are judged without their lock (reading needs none, and a store the user cannot write
    is still checked); the lock is taken only to delete one.
    """
    sizes = blob_sizes(manifest)
    found = []
    for digest in manifest_digests(manifest):
        size = sizes.get(digest)
        dest = blob_path(store, digest)
        seen = _identity(dest)
        problem = _problem(store, digest, size, verify, report, cancel)
        if problem is None:
            continue
        with blob_lock(store, digest, cancel=cancel,
                       waiting=waiting_reporter(report, digest, size or 0, dest)):
            # Another pull may have put a verified copy in its place meanwhile: judged again.
            if _identity(dest) != seen:
                problem = _problem(store, digest, size, verify, report, cancel)
                if problem is None:
                    continue
            line = f"{name}: damaged, {problem}; fetching it again"
            log.info("%s", line)  # the line reaches the user as a progress status
            report(PullProgress("", 0, 0, line))
            found.append(line)
            _delete(dest)
    return found


def _problem(store: Path, digest: str, size: int | None, verify: bool,
             report: ProgressCallback, cancel: threading.Event | None) -> str | None:
    """Why the blob ``digest`` is damaged (missing, wrong size, with ``verify`` wrong bytes)."""
    problem = blob_problem(store, digest, size)
    if problem is None and verify:
        problem = _hash_problem(blob_path(store, digest), digest, report, cancel)
    return problem


def _identity(path: Path) -> tuple[int, int, int, int] | None:
    """Which file ``path`` is now (None: none): a rename over it changes the answer."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _hash_problem(path: Path, digest: str, report: ProgressCallback,
                  cancel: threading.Event | None) -> str | None:
    """Why ``path``'s bytes are not the blob ``digest`` (a different sha256), else None."""
    hasher = hashlib.sha256()
    done = 0
    try:
        total = path.stat().st_size
        with path.open("rb") as fh:
            while chunk := fh.read(CHUNK_SIZE):
                if cancel is not None and cancel.is_set():
                    raise PullError(f"pull cancelled while verifying {digest[:19]}; nothing was "
                                    "changed")
                hasher.update(chunk)
                done += len(chunk)
                report(PullProgress(digest, done, total, "verifying sha256 digest"))
    except OSError as exc:
        return f"blob {blob_label(path)} is unreadable ({exc.strerror})"
    actual = "sha256:" + hasher.hexdigest()
    if actual == digest:
        return None
    return f"blob {blob_label(path)} does not match its digest (its bytes hash to {actual[:19]}…)"


def _delete(dest: Path) -> None:
    try:
        dest.unlink(missing_ok=True)
    except OSError as exc:
        # Not ours to delete (the Ollama service's store, say): the pull goes on, and the model
        # is reported damaged again afterwards if the blob is still there.
        log.warning("cannot remove the damaged blob %s (%s)", dest, exc.strerror)
