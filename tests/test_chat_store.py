"""chat_store.py: chats survive reopening; rename, delete, export; measured rates; a damaged
database is a typed error and is moved aside, never deleted."""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path

import pytest

from localspec import chat_store
from localspec.chat_store import (
    MIGRATIONS,
    SCHEMA_VERSION,
    ChatStore,
    DamagedChatHistory,
    aside_path,
    move_aside,
)
from localspec.errors import ChatStoreError, DamagedChatStoreError


def test_messages_persist_across_reopen(tmp_path: Path) -> None:
    db = tmp_path / "chats.sqlite3"
    store = ChatStore(db)
    chat = store.create_chat("First", pair="tiny", system_prompt="Be brief.")
    store.add_message(chat.id, "user", "hi")
    store.add_message(chat.id, "assistant", "hello there", spans=[(6, True), (5, False)],
                      stats={"line": "2 tokens"})
    store.close()
    again = ChatStore(db)
    [c] = again.list_chats()
    assert (c.title, c.pair, c.system_prompt) == ("First", "tiny", "Be brief.")
    msgs = again.messages(c.id)
    assert [(m.role, m.content) for m in msgs] == [("user", "hi"), ("assistant", "hello there")]
    assert msgs[1].spans == ((6, True), (5, False)) and msgs[1].stats == {"line": "2 tokens"}


@pytest.mark.parametrize(("spans", "stats"), [
    ("[[6, tru", '{"line": '), ("[1, 2]", "[1]"), ("[[1]]", '"text"')])
def test_damaged_spans_or_stats_still_open_the_conversation(
        tmp_path: Path, spans: str, stats: str) -> None:
    db = tmp_path / "chats.sqlite3"
    store = ChatStore(db)
    chat = store.create_chat("First")
    store.add_message(chat.id, "user", "hi")
    store.add_message(chat.id, "assistant", "hello there", spans=[(6, True)],
                      stats={"line": "2 tokens"})
    store.close()
    with sqlite3.connect(db) as raw:  # damaged by hand, or by a disk
        raw.execute("UPDATE messages SET spans = ?, stats = ? WHERE role = 'assistant'",
                    (spans, stats))
    again = ChatStore(db)
    msgs = again.messages(chat.id)
    assert [(m.content, m.spans, m.stats) for m in msgs] == [("hi", (), None),
                                                             ("hello there", (), None)]
    assert "hello there" in again.export_markdown(chat.id)


def test_rename_delete_export(tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "c.sqlite3")
    a = store.create_chat("a")
    b = store.create_chat("b")
    store.add_message(b.id, "user", "question")
    store.add_message(b.id, "assistant", "```python\nprint(1)\n```")
    store.rename_chat(b.id, "Code chat")
    out = store.export_to(b.id, tmp_path / "exports")
    text = out.read_text()
    assert text.startswith("# Code chat") and "## Assistant" in text and "print(1)" in text
    store.delete_chat(a.id)
    assert [c.title for c in store.list_chats()] == ["Code chat"]
    store.delete_chat(b.id)
    assert store.messages(b.id) == []


def test_an_export_that_fails_leaves_the_earlier_one_whole(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """A full disk (faked: the write's fsync fails with ENOSPC, as a real full disk cannot be
    made safely here) leaves the last complete export under its name and no partial file."""
    import errno

    store = ChatStore(tmp_path / "c.sqlite3")
    chat = store.create_chat("notes")
    store.add_message(chat.id, "user", "first")
    out = store.export_to(chat.id, tmp_path / "exports")
    before = out.read_text()
    store.add_message(chat.id, "assistant", "x" * 100_000)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        store.export_to(chat.id, tmp_path / "exports")
    assert out.read_text() == before
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_rates(tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "c.sqlite3")
    assert store.latest_rate("tiny") is None
    store.record_rate("tiny", "plain", 12.5)
    store.record_rate("tiny", "plain", 13.0)
    assert store.latest_rate("tiny") == 13.0
    store.record_rate("tiny", "plain", 0.0)  # as an older version stored for an empty answer
    assert store.latest_rate("tiny") is None


def test_memory_estimate_of_a_real_pair(target_gguf: Path, draft_gguf: Path) -> None:
    from localspec.engine import ModelSettings
    from localspec.loading import EngineSpec
    from localspec.models.library import DefaultLibrary, kv_cache_bytes

    spec = EngineSpec(target=str(target_gguf), draft=str(draft_gguf),
                      target_settings=ModelSettings(n_ctx=1024))
    est = DefaultLibrary().estimate(spec, free=10, where="RAM")
    assert est.weights == target_gguf.stat().st_size + draft_gguf.stat().st_size
    assert est.kv_cache == kv_cache_bytes(target_gguf, 1024) + kv_cache_bytes(draft_gguf, 1024)
    assert est.kv_cache > 0 and est.fits is False


# -- damaged and unusable databases -----------------------------------------------------------
def test_random_bytes_are_a_damaged_store_naming_the_file(tmp_path: Path) -> None:
    db = tmp_path / "chats.sqlite3"
    original = os.urandom(8192)
    db.write_bytes(original)
    with pytest.raises(DamagedChatStoreError) as caught:
        ChatStore(db)
    err = caught.value
    assert err.path == db and err.reason == "file is not a database"
    assert str(err) == f"{db} is damaged (file is not a database)"
    assert db.read_bytes() == original  # looking is not touching
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "localspec-home") \
        == ["chats.sqlite3"]


def test_a_torn_page_is_damaged_and_checking_writes_nothing(tmp_path: Path) -> None:
    import shutil

    live = tmp_path / "live" / "chats.sqlite3"
    store = ChatStore(live)
    chat = store.create_chat("long")
    for i in range(300):
        store.add_message(chat.id, "user", f"message {i} " * 20)
    store.close()  # the last connection checkpoints the WAL into the file
    store = ChatStore(live)
    store.add_message(chat.id, "user", "the newest, only in the -wal")
    # A copy taken now is what a crash leaves: a database and a -wal not yet folded into it.
    crashed = tmp_path / "chats.sqlite3"
    shutil.copy(live, crashed)
    shutil.copy(f"{live}-wal", f"{crashed}-wal")
    store.close()
    data = bytearray(crashed.read_bytes())
    page = 4096  # SQLite's default page size; a middle page holds old rows, not in the -wal
    middle = len(data) // page // 2
    data[middle * page:(middle + 1) * page] = os.urandom(page)
    crashed.write_bytes(bytes(data))
    wal = Path(f"{crashed}-wal").read_bytes()
    with pytest.raises(DamagedChatStoreError) as caught:
        ChatStore(crashed)
    reason = caught.value.reason
    assert reason.startswith("integrity check failed: ") and "\n" not in reason
    # Neither the file nor its -wal was written: a read-write close would have folded the
    # -wal into the damaged file and deleted it.
    assert crashed.read_bytes() == bytes(data)
    assert Path(f"{crashed}-wal").read_bytes() == wal


def test_moving_aside_keeps_every_byte_and_a_fresh_store_works(tmp_path: Path) -> None:
    db = tmp_path / "chats.sqlite3"
    original, wal, shm = os.urandom(8192), os.urandom(4096), os.urandom(1024)
    db.write_bytes(original)
    (tmp_path / "chats.sqlite3-wal").write_bytes(wal)
    (tmp_path / "chats.sqlite3-shm").write_bytes(shm)
    with pytest.raises(DamagedChatStoreError) as caught:
        ChatStore(db)
    damaged = DamagedChatHistory(caught.value)
    assert re.fullmatch(r"chats\.sqlite3\.damaged-\d{8}-\d{6}", damaged.aside.name)
    store = damaged.recover()
    assert damaged.store is store
    assert damaged.aside.read_bytes() == original
    assert Path(f"{damaged.aside}-wal").read_bytes() == wal
    assert Path(f"{damaged.aside}-shm").read_bytes() == shm
    # The new database starts empty (the old -wal was not replayed into it) and works.
    assert store.list_chats() == []
    chat = store.create_chat("after")
    store.add_message(chat.id, "user", "still here")
    store.close()
    again = ChatStore(db)
    assert [m.content for m in again.messages(chat.id)] == ["still here"]
    again.close()


def test_moving_aside_never_overwrites(tmp_path: Path) -> None:
    db = tmp_path / "chats.sqlite3"
    db.write_bytes(b"damaged")
    now = 1_700_000_000.0
    first = aside_path(db, now)
    Path(f"{first}-shm").write_bytes(b"an older one")  # a side file alone takes the name too
    second = aside_path(db, now)
    assert second.name == f"{first.name}-2"
    first.write_bytes(b"older still")
    with pytest.raises(FileExistsError):
        move_aside(db, first)
    assert db.read_bytes() == b"damaged" and first.read_bytes() == b"older still"
    move_aside(db, second)
    assert second.read_bytes() == b"damaged" and not db.exists()


def test_another_readable_schema_is_not_damaged(tmp_path: Path) -> None:
    db = tmp_path / "chats.sqlite3"
    con = sqlite3.connect(db)  # a newer localspec: one more column, one more table
    con.executescript("CREATE TABLE chats (id INTEGER PRIMARY KEY, title TEXT NOT NULL, "
                      "pair TEXT, system_prompt TEXT NOT NULL DEFAULT '', created REAL NOT NULL,"
                      " updated REAL NOT NULL, folder TEXT);"
                      "CREATE TABLE folders (name TEXT); INSERT INTO folders VALUES ('work');")
    con.close()
    store = ChatStore(db)
    store.create_chat("works")
    assert [c.title for c in store.list_chats()] == ["works"]
    assert store._read("SELECT name FROM folders")[0][0] == "work"
    store.close()

    other = tmp_path / "other.sqlite3"
    con = sqlite3.connect(other)  # readable, but not ours: an error that offers no moving
    con.executescript("CREATE TABLE messages (id INTEGER PRIMARY KEY, body TEXT);")
    con.close()
    with pytest.raises(ChatStoreError) as caught:
        ChatStore(other)
    assert not isinstance(caught.value, DamagedChatStoreError)
    assert str(other) in str(caught.value) and "chat_id" in str(caught.value)


def test_a_folder_in_the_way_is_one_clear_error(tmp_path: Path) -> None:
    db = tmp_path / "chats.sqlite3"
    db.mkdir()
    with pytest.raises(ChatStoreError) as caught:
        ChatStore(db)
    assert not isinstance(caught.value, DamagedChatStoreError)
    assert str(caught.value) == (f"cannot open the chat history {db}: "
                                 "it is a folder, not a database file")
    blocked = tmp_path / "data"
    blocked.write_text("a file where the data folder should be")
    with pytest.raises(ChatStoreError, match="a file is in the way"):
        ChatStore(blocked / "chats.sqlite3")


# -- schema versions ---------------------------------------------------------------------------
FIXTURE = Path(__file__).parent / "fixtures" / "chats-before-versioning.sqlite3"


def _user_version(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        return int(db.execute("PRAGMA user_version").fetchone()[0])
    finally:
        db.close()


def test_a_history_from_before_versioning_opens_with_every_chat(tmp_path: Path) -> None:
    # The fixture was written by ChatStore as it was before schema versions (commit 65ac510).
    db = tmp_path / "chats.sqlite3"
    db.write_bytes(FIXTURE.read_bytes())
    assert _user_version(db) == 0
    store = ChatStore(db)
    chats = {c.title: c for c in store.list_chats()}
    assert set(chats) == {"Binary search in Rust", "Zweiter Chat — ünïcode"}
    rust = chats["Binary search in Rust"]
    assert (rust.pair, rust.system_prompt) == ("qwen2.5-coder-7b", "You are terse.")
    user, answer = store.messages(rust.id)
    assert (user.role, user.content) == ("user", "Write a binary search in Rust")
    assert answer.spans == ((20, False), (58, True)) and answer.stats is not None
    assert answer.stats["accepted"] == 22
    assert [m.content for m in store.messages(chats["Zweiter Chat — ünïcode"].id)] == [
        "Hallo 👋\nzweite Zeile", "Hi!"]
    assert store.latest_rate("qwen2.5-coder-7b") == 12.25
    store.add_message(rust.id, "user", "and in Go?")  # still writable after the upgrade
    store.close()
    assert _user_version(db) == SCHEMA_VERSION
    assert len(ChatStore(db).messages(rust.id)) == 3


def test_a_new_history_is_created_at_the_current_version(tmp_path: Path) -> None:
    db = tmp_path / "chats.sqlite3"
    ChatStore(db).close()
    assert _user_version(db) == SCHEMA_VERSION == len(MIGRATIONS)


def test_a_newer_history_is_refused_and_left_untouched(tmp_path: Path) -> None:
    db = tmp_path / "chats.sqlite3"
    db.write_bytes(FIXTURE.read_bytes())
    raw = sqlite3.connect(db)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.close()
    before = db.read_bytes()
    with pytest.raises(ChatStoreError) as err:
        ChatStore(db)
    assert not isinstance(err.value, DamagedChatStoreError)  # never offered to be moved aside
    line = str(err.value)
    assert "\n" not in line and "newer localspec" in line
    assert f"schema version {SCHEMA_VERSION + 1}" in line
    assert db.read_bytes() == before
    wal = tmp_path / "chats.sqlite3-wal"  # a read-only look at a WAL file may leave an empty one
    assert not wal.exists() or wal.stat().st_size == 0


def test_a_failing_migration_leaves_the_file_at_its_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "chats.sqlite3"
    db.write_bytes(FIXTURE.read_bytes())

    def broken(conn: sqlite3.Connection) -> None:
        conn.execute("ALTER TABLE chats ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0")
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(chat_store, "MIGRATIONS", (*MIGRATIONS, broken))
    monkeypatch.setattr(chat_store, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    with pytest.raises(ChatStoreError):
        ChatStore(db)
    monkeypatch.undo()
    assert _user_version(db) == SCHEMA_VERSION  # the base migration committed, the broken one not
    store = ChatStore(db)
    columns = [r[1] for r in store._read("PRAGMA table_info(chats)")]
    assert "pinned" not in columns and len(store.list_chats()) == 2
