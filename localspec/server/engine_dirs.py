"""The engine process's private folders (``/tmp/localspec-engine-*``: its socket, activity board
and stderr), and the clean-up of those whose owner died without removing its own.

The process that starts an engine (``serve`` or the chat app) removes the folder when it closes
the engine; a SIGKILL (an OOM killer, ``kill -9``) gives it no chance to. So each folder records
its owner (pid and start time, so a reused pid is not mistaken for it), and every new folder is
made after removing the ones whose owner is gone. A folder whose owner still runs, another
``serve`` or chat app, is never touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

PREFIX = "localspec-engine-"
OWNER_FILE = "owner"
SOCKET_NAME = "engine.sock"
# A folder with no owner record is either being made right now (the record follows mkdtemp by
# microseconds) or was left by a localspec from before owners were recorded: only one this old,
# whose socket nobody answers on, is taken for stale.
UNRECORDED_GRACE_SECONDS = 600.0


def make_engine_dir(parent: Path | None = None) -> Path:
    """A new private folder (mode 0700) owned by this process, after removing stale ones."""
    base = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    remove_stale_engine_dirs(base)
    path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base))
    os.chmod(path, 0o700)
    _write_owner(path, os.getpid())
    return path


def remove_stale_engine_dirs(parent: Path | None = None) -> list[Path]:
    """Remove the engine folders under ``parent`` (the temp folder) whose owner is gone;
    returns them. Never raises: a folder that cannot be read or removed is left alone."""
    base = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    removed: list[Path] = []
    try:
        candidates = [p for p in base.iterdir() if p.name.startswith(PREFIX)]
    except OSError:
        return removed
    for path in candidates:
        try:
            stale = _is_stale(path)
        except OSError:  # another user's folder, or one removed meanwhile
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                log.info("removed %s (its owner is gone)", path)
                removed.append(path)
    return removed


def _write_owner(path: Path, pid: int) -> None:
    # Written whole, then renamed: a reader never sees half a record.
    record = {"pid": pid, "started": _start_time(pid)}
    tmp = path / (OWNER_FILE + ".tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    tmp.replace(path / OWNER_FILE)


def _start_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def _is_stale(path: Path) -> bool:
    if path.is_symlink() or not path.is_dir():
        return False
    if path.stat().st_uid != os.getuid():
        return False  # not ours to judge (and not ours to remove)
    owner = path / OWNER_FILE
    if not owner.exists():
        young = time.time() - path.stat().st_mtime < UNRECORDED_GRACE_SECONDS
        return not young and not _socket_answers(path / SOCKET_NAME)
    try:
        record = json.loads(owner.read_text(encoding="utf-8"))
        pid, started = int(record["pid"]), record.get("started")
    except (ValueError, KeyError, TypeError):
        return False  # not a record this code wrote: leave it
    return not _alive(pid, started)


def _alive(pid: int, started: float | None) -> bool:
    """Whether the process that wrote the record still runs (a zombie does not)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        # Another process given the same pid later started later.
        return started is None or abs(proc.create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # access denied: it exists
        return True


def _socket_answers(path: Path) -> bool:
    if not path.exists():
        return False
    with contextlib.closing(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True
