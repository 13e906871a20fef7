"""Which ``localspec serve`` processes run on this machine, and what they serve.

Each ``serve`` writes a small file (readable by this user only: it may hold the API key) while it
runs. The chat app looks here before loading a pair: when a server already serves the same files,
it becomes that server's client instead of loading a second copy (on one GPU a second copy of a
7B + 1B pair does not fit beside the first).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from .. import paths
from ..files import atomic_write

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServedPair:
    pid: int
    url: str
    api_key: str | None
    model_id: str
    target: str  # file identities (gguf_meta.file_identity)
    draft: str | None
    # The history index its engine keeps ("serve", "chat": joined in config.toml; None: off,
    # or a server that predates the field). A chat app attached to it sends its conversations
    # to that index only where it is the chat app's own.
    history: str | None = None


def _folder() -> Path:
    return paths.cache_dir() / "servers"


def identity(path: Path | None) -> str | None:
    from ..gguf_meta import file_identity

    return file_identity(path) if path is not None else None


def register(served: ServedPair) -> Path:
    """Announce a running server (until :func:`unregister`)."""
    path = _folder() / f"{served.pid}.json"
    atomic_write(path, json.dumps(asdict(served)))
    os.chmod(path, 0o600)
    return path


def unregister(path: Path) -> None:
    path.unlink(missing_ok=True)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: it exists (someone else's counts) and is not a
    zombie, a killed server its parent has not reaped yet (Linux: state Z)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True  # no /proc (macOS): the pid is the best there is


def find(target: Path, draft: Path | None) -> ServedPair | None:
    """A running, healthy server of exactly these files (the same draft, or no draft)."""
    want = (identity(target), identity(draft))
    folder = _folder()
    for file in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            served = ServedPair(**json.loads(file.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            continue
        if not process_alive(served.pid):
            file.unlink(missing_ok=True)  # a server that was killed: its file is stale
            continue
        if (served.target, served.draft) != want:
            continue
        try:
            health = httpx.get(served.url.rstrip("/") + "/health", timeout=5.0)
        except httpx.HTTPError:
            continue
        if health.status_code == 200:
            return served
    return None
