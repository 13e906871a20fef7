"""chat_store.py: chats survive reopening; rename, delete, export; measured rates."""

from __future__ import annotations

from pathlib import Path

from localspec.chat_store import ChatStore


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


def test_rates(tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "c.sqlite3")
    assert store.latest_rate("tiny") is None
    store.record_rate("tiny", "plain", 12.5)
    store.record_rate("tiny", "plain", 13.0)
    assert store.latest_rate("tiny") == 13.0


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
