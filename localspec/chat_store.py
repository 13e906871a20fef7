"""Chats in SQLite under the user data dir: reopened, renamed, deleted, exported to Markdown.

Each message is committed as soon as it is complete (WAL mode, one transaction per message), so a
crash or kill loses at most the answer being generated. Also keeps measured decoding rates per
pair, so the TUI can show plain decoding's speed beside speculative decoding's.

Opening checks the file: one SQLite cannot read raises DamagedChatStoreError, and
``DamagedChatHistory`` moves it aside (never deletes it) once the user or a flag says so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import paths
from .errors import ChatStoreError, DamagedChatStoreError
from .files import atomic_write, fsync_dir

log = logging.getLogger(__name__)

# The schema as version 1 wrote it. Files from before versioning (user_version 0) hold exactly
# these tables, which is why migration 1 says IF NOT EXISTS: it adopts them as they are.
_SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS chats (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    pair TEXT,
    system_prompt TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    spans TEXT NOT NULL DEFAULT '[]',
    stats TEXT,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_chat ON messages(chat_id, id);
CREATE TABLE IF NOT EXISTS rates (
    pair TEXT NOT NULL,
    mode TEXT NOT NULL,
    tokens_per_second REAL NOT NULL,
    measured REAL NOT NULL,
    PRIMARY KEY (pair, mode)
);
"""


def _m001_base_schema(db: sqlite3.Connection) -> None:
    for statement in _SCHEMA_V1.split(";"):
        if statement.strip():
            db.execute(statement)


# Ordered migrations: MIGRATIONS[i] takes a file from schema version i to i + 1. Append only;
# never edit one that has shipped (files in the wild already ran it).
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_m001_base_schema,)
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass(frozen=True, slots=True)
class Chat:
    id: int
    title: str
    pair: str | None
    system_prompt: str
    created: float
    updated: float


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """A complete message. ``spans`` are (length, drafted) runs over ``content``."""

    id: int
    chat_id: int
    role: str
    content: str
    spans: tuple[tuple[int, bool], ...] = ()
    stats: dict[str, Any] | None = None


def default_path() -> Path:
    return paths.data_dir() / "chats.sqlite3"


# The spans and stats are decoration (which text was drafted, the answer's speed): damaged ones
# (an edit by hand, a disk error) are dropped with a warning, so the conversation still opens.
def _spans(text: Any, message_id: int) -> tuple[tuple[int, bool], ...]:
    try:
        return tuple((int(n), bool(d)) for n, d in json.loads(text))
    except (TypeError, ValueError) as exc:
        log.warning("message %d: its drafted spans are damaged (%s); shown without them",
                    message_id, exc)
        return ()


def _stats(text: Any, message_id: int) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        stats = json.loads(text)
    except (TypeError, ValueError):
        stats = None
    if not isinstance(stats, dict):
        log.warning("message %d: its statistics are damaged; shown without them", message_id)
        return None
    return stats


class ChatStore:
    """One SQLite database. Safe to call from any thread (calls are serialised)."""

    def __init__(self, path: Path | None = None) -> None:
        """Open (or create) the database at ``path``.

        Raises DamagedChatStoreError when SQLite cannot read the file, ChatStoreError when it
        cannot be opened at all (a folder in its place, no permission, locked by another
        program); never a bare sqlite3 or OS error.
        """
        self.path = path or default_path()
        self._lock = threading.Lock()
        self._db = _open(self.path)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, args: Sequence[Any] = ()) -> sqlite3.Cursor:
        with self._lock, self._db:  # one transaction, committed on exit
            return self._db.execute(sql, args)

    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- chats --------------------------------------------------------------------------------
    def create_chat(self, title: str = "New chat", pair: str | None = None,
                    system_prompt: str = "") -> Chat:
        now = time.time()
        cur = self._write("INSERT INTO chats (title, pair, system_prompt, created, updated) "
                          "VALUES (?, ?, ?, ?, ?)", (title, pair, system_prompt, now, now))
        return Chat(int(cur.lastrowid or 0), title, pair, system_prompt, now, now)

    def get_chat(self, chat_id: int) -> Chat | None:
        rows = self._read("SELECT * FROM chats WHERE id = ?", (chat_id,))
        return _chat(rows[0]) if rows else None

    def list_chats(self) -> list[Chat]:
        """Most recently used first."""
        return [_chat(r) for r in self._read("SELECT * FROM chats ORDER BY updated DESC, id DESC")]

    def rename_chat(self, chat_id: int, title: str) -> None:
        self._write("UPDATE chats SET title = ?, updated = ? WHERE id = ?",
                    (title.strip() or "Untitled", time.time(), chat_id))

    def set_pair(self, chat_id: int, pair: str | None) -> None:
        self._write("UPDATE chats SET pair = ? WHERE id = ?", (pair, chat_id))

    def delete_chat(self, chat_id: int) -> None:
        self._write("DELETE FROM chats WHERE id = ?", (chat_id,))

    # -- messages -----------------------------------------------------------------------------
    def add_message(self, chat_id: int, role: str, content: str,
                    spans: Sequence[tuple[int, bool]] = (),
                    stats: dict[str, Any] | None = None) -> StoredMessage:
        """Append one complete message and commit it."""
        now = time.time()
        with self._lock, self._db:
            cur = self._db.execute(
                "INSERT INTO messages (chat_id, role, content, spans, stats, created) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (chat_id, role, content, json.dumps([[n, int(d)] for n, d in spans]),
                 json.dumps(stats) if stats is not None else None, now))
            self._db.execute("UPDATE chats SET updated = ? WHERE id = ?", (now, chat_id))
        return StoredMessage(int(cur.lastrowid or 0), chat_id, role, content,
                             tuple((int(n), bool(d)) for n, d in spans), stats)

    def delete_message(self, message_id: int) -> None:
        self._write("DELETE FROM messages WHERE id = ?", (message_id,))

    def messages(self, chat_id: int) -> list[StoredMessage]:
        rows = self._read("SELECT * FROM messages WHERE chat_id = ? ORDER BY id", (chat_id,))
        return [StoredMessage(r["id"], r["chat_id"], r["role"], r["content"],
                              _spans(r["spans"], r["id"]), _stats(r["stats"], r["id"]))
                for r in rows]

    # -- export -------------------------------------------------------------------------------
    def export_markdown(self, chat_id: int) -> str:
        chat = self.get_chat(chat_id)
        if chat is None:
            raise KeyError(chat_id)
        lines = [f"# {chat.title}", ""]
        if chat.pair:
            lines += [f"*Pair: {chat.pair}*", ""]
        if chat.system_prompt:
            lines += ["## System", "", chat.system_prompt, ""]
        for m in self.messages(chat_id):
            lines += [f"## {m.role.capitalize()}", "", m.content, ""]
        return "\n".join(lines)

    def export_to(self, chat_id: int, folder: Path) -> Path:
        """Write the chat as Markdown into ``folder``; returns the file written."""
        chat = self.get_chat(chat_id)
        if chat is None:
            raise KeyError(chat_id)
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", chat.title).strip("-")[:60] or "chat"
        folder.mkdir(parents=True, exist_ok=True)
        out = folder / f"{slug}-{chat.id}.md"
        # Atomically: a full disk must not leave half a chat (or half of an earlier, complete
        # export of it) under the name.
        atomic_write(out, self.export_markdown(chat_id))
        return out

    # -- measured rates -----------------------------------------------------------------------
    def record_rate(self, pair: str, mode: str, tokens_per_second: float) -> None:
        """Remember a measured decoding rate (``mode`` "plain" for decoding without drafts)."""
        self._write("INSERT OR REPLACE INTO rates VALUES (?, ?, ?, ?)",
                    (pair, mode, float(tokens_per_second), time.time()))

    def latest_rate(self, pair: str, mode: str = "plain") -> float | None:
        rows = self._read("SELECT tokens_per_second FROM rates WHERE pair = ? AND mode = ?",
                          (pair, mode))
        # One no measurement could give (0 or less, from an older version) is none.
        return float(rows[0][0]) if rows and float(rows[0][0]) > 0 else None


# -- opening and checking --------------------------------------------------------------------
# SQLite's result codes for a file it cannot read as a database. Other errors while opening
# (SQLITE_CANTOPEN, SQLITE_READONLY, SQLITE_BUSY, "no such column" from another program's schema)
# say nothing against the file, so it is never offered to be moved aside for them.
_DAMAGE_CODES = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})
SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite 3 database


def _open(path: Path) -> sqlite3.Connection:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = ("a file is in the way" if isinstance(exc, (FileExistsError, NotADirectoryError))
               else exc.strerror or str(exc))
        raise ChatStoreError(f"cannot create the folder {path.parent} for the chat history: "
                             f"{why}") from exc
    _check(path)
    try:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    except sqlite3.Error as exc:
        raise _open_error(path, exc) from exc
    try:
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA foreign_keys=ON")
        migrate(db, path)
    except sqlite3.Error as exc:
        db.close()
        raise _open_error(path, exc) from exc
    except BaseException:
        db.close()
        raise
    return db


def _check(path: Path) -> None:
    """Raise DamagedChatStoreError unless SQLite reads the file's schema and every page's
    structure (quick_check: integrity_check without comparing index contents, milliseconds for
    a chat history), so damage shows here and not halfway through a chat.

    The check never writes: closing a read-write connection to a damaged file checkpoints its
    -wal into it and deletes the -wal and -shm (measured with SQLite 3.40, even with a valid
    -wal), and those belong with the damaged file. A file without SQLite's header is refused
    before SQLite opens it at all, which leaves even its -shm as it was.
    """
    try:
        with path.open("rb") as fh:
            head = fh.read(len(SQLITE_HEADER))
    except FileNotFoundError:
        return  # a new database
    except OSError:
        head = b""  # a folder, no permission: the connection below says what is wrong
    if head and head != SQLITE_HEADER:  # empty is fine: SQLite starts a database in it
        raise DamagedChatStoreError(path, "file is not a database")  # SQLite's words for it
    try:
        check = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)
        try:
            rows = check.execute("PRAGMA quick_check(1)").fetchall()
            version = int(check.execute("PRAGMA user_version").fetchone()[0])
        finally:
            check.close()
    except sqlite3.Error as exc:
        raise _open_error(path, exc) from exc
    if rows != [("ok",)]:
        raise DamagedChatStoreError(path, _first_problem(rows))
    _refuse_newer(path, version)


def _refuse_newer(path: Path, version: int) -> None:
    # Checked on a read-only connection before anything opens the file for writing: a newer
    # localspec's history is left exactly as it was (not even its journal mode is touched).
    if version > SCHEMA_VERSION:
        raise ChatStoreError(
            f"the chat history {path} was written by a newer localspec (schema version "
            f"{version}; this one reads up to {SCHEMA_VERSION}): upgrade localspec, or set "
            "LOCALSPEC_HOME to use another folder")


def migrate(db: sqlite3.Connection, path: Path) -> None:
    """Bring the database up to SCHEMA_VERSION, one migration per transaction.

    Each step re-reads the version inside an immediate (write-locked) transaction, so two apps
    opening one old file at once never run a migration twice.
    """
    while True:
        db.execute("BEGIN IMMEDIATE")
        try:
            version = int(db.execute("PRAGMA user_version").fetchone()[0])
            if version < SCHEMA_VERSION:
                MIGRATIONS[version](db)
                db.execute(f"PRAGMA user_version = {version + 1}")  # a PRAGMA takes no "?"
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        if version >= SCHEMA_VERSION:
            _refuse_newer(path, version)  # another program may have written it since the check
            return


def _first_problem(rows: list[Any]) -> str:
    # quick_check reports "*** in database main ***" then the problem, on several lines.
    lines = [line.strip() for row in rows for line in str(row[0]).splitlines()]
    found = [line for line in lines if line and not line.startswith("***")]
    return f"integrity check failed: {found[0] if found else 'no detail'}"


def _open_error(path: Path, exc: sqlite3.Error) -> ChatStoreError:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None and code & 0xFF in _DAMAGE_CODES:  # extended codes keep the primary low
        return DamagedChatStoreError(path, str(exc))
    return ChatStoreError(f"cannot open the chat history {path}: {_why_unopenable(path, exc)}")


def _why_unopenable(path: Path, exc: sqlite3.Error) -> str:
    # SQLite says "unable to open database file" for most of these; name the usual causes.
    with contextlib.suppress(OSError):
        if path.is_dir():
            return "it is a folder, not a database file"
        if path.exists() and not os.access(path, os.R_OK | os.W_OK):
            return "no permission to read and write it"
        if not os.access(path.parent, os.W_OK):
            return f"{path.parent} is not writable"
    return str(exc)


# -- moving a damaged database aside ----------------------------------------------------------
# SQLite's side files. They must move with the database: a -wal left behind would be replayed
# into the new, empty database created under the same name ("mispairing database files and hot
# journals" in SQLite's "How To Corrupt An SQLite Database File").
SIDE_SUFFIXES = ("-wal", "-shm")


def _with_side_files(path: Path) -> list[Path]:
    return [path, *(path.with_name(path.name + s) for s in SIDE_SUFFIXES)]


def aside_path(path: Path, now: float | None = None) -> Path:
    """A free name beside ``path`` for it once damaged: ``chats.sqlite3.damaged-YYYYmmdd-HHMMSS``
    (with ``-2``, ``-3``... when that is taken, side files included)."""
    stem = f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"
    candidate, n = path.with_name(stem), 1
    while any(p.exists() for p in _with_side_files(candidate)):
        n += 1
        candidate = path.with_name(f"{stem}-{n}")
    return candidate


def move_aside(path: Path, aside: Path) -> None:
    """Rename ``path`` and its -wal/-shm files (where present) to ``aside`` and its side names.

    Nothing is deleted or overwritten: a name already taken raises FileExistsError. A file
    already moved (a retry after a failure part way) is skipped.
    """
    for src, dst in zip(_with_side_files(path), _with_side_files(aside), strict=True):
        if not src.exists():
            continue
        if dst.exists():
            raise FileExistsError(f"{dst} already exists")
        os.rename(src, dst)
    fsync_dir(path.parent)


class DamagedChatHistory:
    """A chat database that failed its check, left where it is until someone agrees to move it.

    ``aside`` is fixed when the damage is found, so the name shown in a question is the name
    used. ``store`` is the fresh store once ``recover`` has run, None before (the user declined
    or has not answered).
    """

    def __init__(self, error: DamagedChatStoreError) -> None:
        self.error = error
        self.path = error.path
        self.aside = aside_path(error.path)
        self.store: ChatStore | None = None

    def recover(self) -> ChatStore:
        """Move the damaged file (and its side files) aside and open a new, empty store in its
        place. Raises ChatStoreError when the move or the new database fails."""
        try:
            move_aside(self.path, self.aside)
        except OSError as exc:
            raise ChatStoreError(f"cannot move {self.path} aside to {self.aside}: "
                                 f"{exc.strerror or exc}") from exc
        self.store = ChatStore(self.path)
        return self.store


def _chat(r: sqlite3.Row) -> Chat:
    return Chat(r["id"], r["title"], r["pair"], r["system_prompt"], r["created"], r["updated"])
