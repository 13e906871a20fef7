"""Chats in SQLite under the user data dir: reopened, renamed, deleted, exported to Markdown.

Each message is committed as soon as it is complete (WAL mode, one transaction per message), so a
crash or kill loses at most the answer being generated. Also keeps measured decoding rates per
pair, so the TUI can show plain decoding's speed beside speculative decoding's.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import paths

SCHEMA = """
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


class ChatStore:
    """One SQLite database. Safe to call from any thread (calls are serialised)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)

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
                              tuple((int(n), bool(d)) for n, d in json.loads(r["spans"])),
                              json.loads(r["stats"]) if r["stats"] else None) for r in rows]

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
        out.write_text(self.export_markdown(chat_id), encoding="utf-8")
        return out

    # -- measured rates -----------------------------------------------------------------------
    def record_rate(self, pair: str, mode: str, tokens_per_second: float) -> None:
        """Remember a measured decoding rate (``mode`` "plain" for decoding without drafts)."""
        self._write("INSERT OR REPLACE INTO rates VALUES (?, ?, ?, ?)",
                    (pair, mode, float(tokens_per_second), time.time()))

    def latest_rate(self, pair: str, mode: str = "plain") -> float | None:
        rows = self._read("SELECT tokens_per_second FROM rates WHERE pair = ? AND mode = ?",
                          (pair, mode))
        return float(rows[0][0]) if rows else None


def _chat(r: sqlite3.Row) -> Chat:
    return Chat(r["id"], r["title"], r["pair"], r["system_prompt"], r["created"], r["updated"])
