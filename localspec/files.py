"""Writing files so that a crash or a full disk never leaves half of one under its real name."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable: the directory entry must reach the disk too."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # not every platform opens directories; the rename itself still happened
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(path: Path) -> Path:
    """Where a file is written before it is renamed to ``path``. The leading dot keeps it out
    of listings (and out of Ollama's tag namespace when ``path`` is a manifest).

    The name is this writer's own (process and thread): two pulls of one model write the same
    manifest at once, and with a shared temporary name one would truncate the file the other is
    about to rename, or find it already renamed away.
    """
    return path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.partial")


def replace_durably(tmp: Path, path: Path) -> None:
    """Rename a fully written ``tmp`` over ``path`` after flushing it to disk."""
    with tmp.open("rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write(path: Path, data: bytes | str, mode: int = 0o666) -> None:
    """Write ``data`` to a temporary name next to ``path``, fsync it, then rename it over
    ``path``: readers see the old file or the new one, never a mix. The temporary file is
    removed when writing fails (a full disk, say). ``mode`` (less the umask) is the file's
    permissions from its creation on: 0o600 for what holds users' text."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
