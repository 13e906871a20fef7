"""history_index.py: lookups of the longest earlier match on known sequences, merging of
continuations by agreement, eviction of the oldest documents, and persistence that never trusts
a stale or damaged file."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from pathlib import Path

import numpy as np
import pytest

from localspec.engine.history_index import MARK_CLEAR, MARK_TIED, HistoryIndex


def test_the_longest_match_wins_over_a_more_recent_shorter_one() -> None:
    index = HistoryIndex("v")
    index.add([1, 2, 3, 4, 5, 6, 7, 8])          # matches "2 3 4 5" (4 tokens), then 6 7 8
    index.add([9, 9, 3, 4, 5, 60, 70, 80])       # more recent, matches "3 4 5" only
    found = index.lookup([0, 2, 3, 4, 5], budget=3)
    assert found is not None
    assert found.tokens == (6, 7, 8) and found.match_length == 4


def test_no_match_and_short_contexts_give_nothing() -> None:
    index = HistoryIndex("v")
    index.add([1, 2, 3, 4, 5])
    assert index.lookup([7, 8, 9], budget=4) is None
    assert index.lookup([3, 4], budget=4) is None  # shorter than a key
    assert index.lookup([1, 2, 3], budget=0) is None


def test_a_continuation_stops_at_the_end_of_its_document() -> None:
    index = HistoryIndex("v")
    index.add([1, 2, 3, 4])
    index.add([50, 51, 52, 53])
    found = index.lookup([1, 2, 3], budget=5)
    assert found is not None and found.tokens == (4,)  # never runs into the next document


def test_continuations_follow_the_majority_and_report_agreement() -> None:
    index = HistoryIndex("v")
    for n, tail in enumerate(([10, 11], [10, 12], [10, 11], [20, 21])):
        index.add([100 + n, 7, 8, 9, *tail])  # distinct documents with the same match
    found = index.lookup([7, 8, 9], budget=2)
    assert found is not None
    assert found.tokens == (10, 11)
    assert found.agreement == (0.75, 0.5) and found.matches == 4


def test_a_tree_holds_every_way_the_matches_went_most_recent_first() -> None:
    index = HistoryIndex("v")
    for n, tail in enumerate(([10, 11], [10, 12], [10, 11], [20, 21])):
        index.add([100 + n, 7, 8, 9, *tail])
    tree = index.lookup_tree([7, 8, 9], depth=2, max_nodes=16)
    assert tree is not None and tree.matches == 4 and tree.match_length == 3
    paths = {}
    for i, (tok, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
        paths[i] = (*paths[parent], tok) if parent >= 0 else (tok,)
    by_path = {paths[i]: tree.shares[i] for i in paths}
    assert by_path == {(10,): 0.75, (10, 11): 0.5, (10, 12): 0.25, (20,): 0.25,
                       (20, 21): 0.25}
    assert tree.tokens[:2] == (20, 21)  # the most recent document's way first
    small = index.lookup_tree([7, 8, 9], depth=2, max_nodes=3)
    assert small is not None and len(small.tokens) == 3
    assert index.lookup_tree([7, 8, 9], depth=0, max_nodes=8) is None
    assert index.lookup_tree([1, 2, 3], depth=2, max_nodes=8) is None


def test_a_tie_goes_to_the_most_recent() -> None:
    index = HistoryIndex("v")
    index.add([7, 8, 9, 10])
    index.add([7, 8, 9, 20])
    found = index.lookup([7, 8, 9], budget=1)
    assert found is not None and found.tokens == (20,)


def test_a_document_is_held_once() -> None:
    index = HistoryIndex("v")
    assert index.add([1, 2, 3, 4, 5]) is True
    assert index.add([1, 2, 3, 4, 5]) is False
    assert index.n_documents == 1 and index.n_tokens == 5


def test_the_oldest_documents_are_evicted_first() -> None:
    index = HistoryIndex("v", max_tokens=10)
    index.add([1, 2, 3, 4, 5])
    index.add([11, 12, 13, 14, 15])
    index.add([21, 22, 23, 24, 25])  # 15 tokens: the first document goes
    assert index.n_documents == 2 and index.n_tokens == 10
    assert index.lookup([1, 2, 3], budget=2) is None
    found = index.lookup([11, 12, 13], budget=2)
    assert found is not None and found.tokens == (14, 15)
    found = index.lookup([21, 22, 23], budget=2)
    assert found is not None and found.tokens == (24, 25)
    assert index.add([1, 2, 3, 4, 5]) is True  # evicted, so it may come back


def test_it_persists_across_a_restart_with_owner_only_permissions(tmp_path: Path) -> None:
    path = tmp_path / "history" / "vocab.idx"
    index = HistoryIndex("vocab-a")
    index.add([1, 2, 3, 4, 5, 6])
    index.add([3, 4, 5, 9])
    index.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".partial")]
    again = HistoryIndex.load(path, "vocab-a")
    assert again.n_documents == 2
    assert again.lookup([2, 3, 4, 5], budget=1) == index.lookup([2, 3, 4, 5], budget=1)
    found = again.lookup([0, 3, 4, 5], budget=1)
    assert found is not None and found.tokens == (9,)  # the most recent of two equal matches


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "other-vocab"])
def test_a_damaged_or_stale_file_is_dropped_not_trusted(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "vocab.idx"
    index = HistoryIndex("vocab-a")
    index.add([1, 2, 3, 4, 5, 6])
    index.save(path)
    raw = bytearray(path.read_bytes())
    vocabulary = "vocab-a"
    if damage == "truncate":
        path.write_bytes(bytes(raw[:-3]))
    elif damage == "flip":
        raw[-5] ^= 0xFF
        path.write_bytes(bytes(raw))
    elif damage == "garbage":
        path.write_bytes(os.urandom(200))
    else:
        vocabulary = "vocab-b"
    loaded = HistoryIndex.load(path, vocabulary)
    assert loaded.n_documents == 0 and loaded.lookup([1, 2, 3], budget=2) is None
    loaded.add([7, 8, 9, 10])
    loaded.save(path)  # the new index replaces the bad file
    assert HistoryIndex.load(path, vocabulary).n_documents == 1


def test_loading_respects_a_smaller_limit(tmp_path: Path) -> None:
    path = tmp_path / "vocab.idx"
    index = HistoryIndex("v")
    for start in range(0, 50, 10):
        index.add(list(range(start, start + 10)))
    index.save(path)
    small = HistoryIndex.load(path, "v", max_tokens=20)
    assert small.n_documents == 2
    assert small.lookup([40, 41, 42], budget=1) is not None
    assert small.lookup([0, 1, 2], budget=1) is None


# -- near-tie marks ----------------------------------------------------------------------------
def test_marks_follow_their_tokens_through_lookup_merge_and_eviction() -> None:
    index = HistoryIndex("v", max_tokens=16)
    index.add([1, 2, 3, 4, 5, 6], [0, 0, 0, MARK_CLEAR, MARK_TIED, MARK_CLEAR])
    found = index.lookup([1, 2, 3], budget=3)
    assert found is not None and found.tokens == (4, 5, 6)
    assert found.marks == (MARK_CLEAR, MARK_TIED, MARK_CLEAR)
    # Two matches agree on 4 5 and part at the third token: each token's mark is the most
    # recent agreeing match's.
    index.add([9, 1, 2, 3, 4, 5, 7], [0, 0, 0, 0, MARK_TIED, MARK_CLEAR, MARK_CLEAR])
    found = index.lookup([1, 2, 3], budget=3)
    assert found is not None and found.tokens[:2] == (4, 5)
    assert found.marks[:2] == (MARK_TIED, MARK_CLEAR)
    # The oldest document goes; the marks of the one kept stay with its tokens.
    index.add([20, 21, 22, 23, 24, 25], [MARK_TIED] * 6)
    assert index.n_documents == 2
    docs = list(index.marked_documents())
    assert [d.tolist() for d, _ in docs] == [[9, 1, 2, 3, 4, 5, 7], [20, 21, 22, 23, 24, 25]]
    assert docs[0][1].tolist() == [0, 0, 0, 0, MARK_TIED, MARK_CLEAR, MARK_CLEAR]
    assert docs[1][1].tolist() == [MARK_TIED] * 6


def test_a_held_document_written_again_takes_the_new_marks() -> None:
    """Recorded first by plain decoding (nothing marked), then by a drafting run."""
    index = HistoryIndex("v")
    assert index.update([1, 2, 3, 4, 5]) == "added"
    assert index.update([1, 2, 3, 4, 5]) == ""
    assert index.update([1, 2, 3, 4, 5], [0, 0, 0, MARK_TIED, 0]) == "remarked"
    assert index.update([1, 2, 3, 4, 5], [0, 0, 0, 0, MARK_CLEAR]) == "remarked"
    assert not index.add([1, 2, 3, 4, 5], [0, 0, 0, MARK_TIED, MARK_CLEAR])  # nothing new
    found = index.lookup([1, 2, 3], budget=2)
    assert found is not None and found.marks == (MARK_TIED, MARK_CLEAR)
    with pytest.raises(ValueError, match="3 marks for 5 tokens"):
        index.add([1, 2, 3, 4, 6], [0, 0, 0])


def test_marks_persist_and_a_format_1_file_loads_with_none(tmp_path: Path) -> None:
    path = tmp_path / "h.idx"
    index = HistoryIndex("v")
    index.add([1, 2, 3, 4, 5], [0, 0, MARK_CLEAR, MARK_TIED, MARK_CLEAR])
    index.save(path)
    back = HistoryIndex.load(path, "v")
    assert back.restored
    assert [m.tolist() for _, m in back.marked_documents()] == [[0, 0, 1, 2, 1]]
    # The format before marks: tokens and lengths only, every mark unknown once read.
    tokens = np.array([1, 2, 3, 4, 5, -1], "<i4").tobytes()
    body = tokens + np.array([5], "<i8").tobytes()
    meta = json.dumps({"format": 1, "vocabulary": "v", "tokens": 6, "documents": 1,
                       "sha256": hashlib.sha256(body).hexdigest(), "epoch": "e"}).encode()
    path.write_bytes(b"LSHIST1\n" + struct.pack("<I", len(meta)) + meta + body)
    old = HistoryIndex.load(path, "v")
    assert old.restored and old.n_documents == 1
    assert [m.tolist() for _, m in old.marked_documents()] == [[0, 0, 0, 0, 0]]
    found = old.lookup([1, 2, 3], budget=2)
    assert found is not None and found.tokens == (4, 5)


def test_a_file_with_impossible_marks_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "h.idx"
    index = HistoryIndex("v")
    index.add([1, 2, 3, 4, 5], [0, 0, 0, 1, 2])
    index.save(path)
    raw = bytearray(path.read_bytes())
    raw[-2] = 7  # a mark that does not exist, checksum made to match
    head_end = raw.index(b"}") + 1
    meta = json.loads(raw[len(b"LSHIST1\n") + 4:head_end])
    body = bytes(raw[head_end:])
    meta["sha256"] = hashlib.sha256(body).hexdigest()
    blob = json.dumps(meta).encode()
    path.write_bytes(b"LSHIST1\n" + struct.pack("<I", len(blob)) + blob + body)
    back = HistoryIndex.load(path, "v")
    assert not back.restored and back.n_documents == 0


def _documents(index: HistoryIndex) -> list[tuple[list[int], list[int]]]:
    return [(d.tolist(), m.tolist()) for d, m in index.marked_documents()]


def test_loading_under_lowered_limits_cuts_the_newest_document_as_update_does(
        tmp_path: Path) -> None:
    """The user lowered [history] max_tokens and max_bytes since the file was written."""
    path = tmp_path / "h.idx"
    big = np.arange(200_000, dtype=np.int32)
    marks = np.resize(np.array([0, MARK_CLEAR, MARK_TIED], np.int8), len(big))
    index = HistoryIndex("v")
    index.add(big, marks)
    index.save(path)
    loaded = HistoryIndex.load(path, "v", max_tokens=2000, max_bytes=64 << 10)
    at_run_time = HistoryIndex("v", max_tokens=2000, max_bytes=64 << 10)
    at_run_time.add(big, marks)
    assert loaded.restored and loaded.n_tokens == 2000 and loaded.n_bytes <= 64 << 10
    assert _documents(loaded) == _documents(at_run_time)
    assert _documents(loaded) == [(big[-2000:].tolist(), marks[-2000:].tolist())]
    found = loaded.lookup([199_990, 199_991, 199_992], budget=2)
    assert found is not None and found.tokens == (199_993, 199_994)
    assert loaded.lookup([0, 1, 2], budget=1) is None  # the cut-off start is not held


@pytest.mark.parametrize("max_tokens", [1024, 2600])
def test_loading_under_lowered_limits_keeps_what_update_would(tmp_path: Path,
                                                             max_tokens: int) -> None:
    path = tmp_path / "h.idx"
    docs = [list(range(n * 10_000, n * 10_000 + size))
            for n, size in enumerate((600, 900, 3000, 700, 1200))]
    index = HistoryIndex("v")
    for doc in docs:
        index.add(doc)
    index.save(path)
    at_run_time = HistoryIndex("v", max_tokens=max_tokens)
    for doc in docs:
        at_run_time.add(doc)
    loaded = HistoryIndex.load(path, "v", max_tokens=max_tokens)
    assert _documents(loaded) == _documents(at_run_time)
    assert loaded.n_tokens <= max_tokens


def _save_in_history(vocabulary: str, index: HistoryIndex) -> Path:
    from localspec import history

    path = history.index_path(history.CHAT, vocabulary)
    index.save(path)
    return path


def test_the_listing_calls_a_damaged_file_unreadable_and_clear_empties_it() -> None:
    from localspec import history

    index = HistoryIndex("vocab-a", note="m.gguf")
    for n in range(50):
        index.add(range(n * 1000, n * 1000 + 100))
    path = _save_in_history("vocab-a", index)
    (whole,) = history.index_files()
    assert (whole.documents, whole.tokens, whole.to_json()["readable"]) == (50, 5000, True)
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    assert not HistoryIndex.load(path, "vocab-a").restored
    (half,) = history.index_files()
    assert (half.documents, half.tokens, half.to_json()["readable"]) == (None, None, False)
    assert half.note == "m.gguf"  # the header is intact: it still says whose it was
    assert [f.path for f in history.clear()] == [path]
    emptied = HistoryIndex.load(path, "vocab-a")
    assert emptied.restored and emptied.n_documents == 0


def _header_without_documents(path: Path) -> None:
    """A header that is valid JSON, names the right vocabulary and matches its body's
    checksum, but has no ``documents`` (another version's, say)."""
    body = np.array([1, 2, 3, 4, 5, -1], "<i4").tobytes() + np.array([5], "<i8").tobytes()
    body += bytes(6)
    meta = json.dumps({"format": 2, "vocabulary": path.stem, "tokens": 6,
                       "sha256": hashlib.sha256(body).hexdigest(), "epoch": "e"}).encode()
    path.write_bytes(b"LSHIST1\n" + struct.pack("<I", len(meta)) + meta + body)


def test_a_header_without_documents_is_unreadable_everywhere_not_a_traceback() -> None:
    from localspec import history

    from .conftest import run_cli

    path = history.index_path(history.CHAT, "vocab-a")
    path.parent.mkdir(parents=True)
    _header_without_documents(path)
    loaded = HistoryIndex.load(path, "vocab-a")
    assert not loaded.restored and loaded.n_documents == 0
    (listed,) = history.index_files()
    assert listed.documents is None and listed.tokens is None
    shown = run_cli("history")
    assert shown.returncode == 0, shown.stderr
    assert "(unreadable: rebuilt at its next use)" in shown.stdout and not shown.stderr
    as_json = run_cli("history", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["indexes"][0]["readable"] is False
    cleared = run_cli("history", "clear")
    assert cleared.returncode == 0, cleared.stderr
    assert "cleared 1 index" in cleared.stdout
    emptied = HistoryIndex.load(path, "vocab-a")
    assert emptied.restored and emptied.n_documents == 0


@pytest.mark.parametrize("header", [{"tokens": None}, {"documents": [1]}, {"tokens": True},
                                    {"documents": -1}])
def test_a_header_with_impossible_sizes_is_dropped(tmp_path: Path,
                                                   header: dict[str, object]) -> None:
    path = tmp_path / "v.idx"
    index = HistoryIndex("v")
    index.add([1, 2, 3, 4, 5])
    index.save(path)
    raw = path.read_bytes()
    n_meta = struct.unpack_from("<I", raw, len(b"LSHIST1\n"))[0]
    at = len(b"LSHIST1\n") + 4
    meta = {**json.loads(raw[at:at + n_meta]), **header}
    blob = json.dumps(meta).encode()
    path.write_bytes(b"LSHIST1\n" + struct.pack("<I", len(blob)) + blob + raw[at + n_meta:])
    assert not HistoryIndex.load(path, "v").restored
    with pytest.raises(ValueError):
        HistoryIndex.verify(path, "v")


def test_a_file_whose_lengths_miss_its_separators_is_dropped(tmp_path: Path) -> None:
    """Lengths that add up but put a document's end where no separator is: read as they say,
    one document would start with a separator and the next run into it."""
    path = tmp_path / "v.idx"
    tokens = np.array([1, 2, 3, 4, -1, 5, 6, -1], "<i4").tobytes()
    body = tokens + np.array([3, 3], "<i8").tobytes() + bytes(8)
    meta = json.dumps({"format": 2, "vocabulary": "v", "tokens": 8, "documents": 2,
                       "sha256": hashlib.sha256(body).hexdigest(), "epoch": "e"}).encode()
    path.write_bytes(b"LSHIST1\n" + struct.pack("<I", len(meta)) + meta + body)
    loaded = HistoryIndex.load(path, "v")
    assert not loaded.restored and loaded.n_documents == 0


def _with_header(path: Path, meta: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"LSHIST1\n" + struct.pack("<I", len(meta)) + meta)


@pytest.mark.parametrize("meta", [b"[" * 200_000, b'{"format": 2, "tokens": ' + b"1" * 5000 + b"}"],
                         ids=["nested", "huge-number"])
def test_a_header_json_cannot_parse_is_unreadable_everywhere(meta: bytes) -> None:
    """Deep nesting (RecursionError) and a number past Python's digit limit (ValueError) came
    out of the reader as tracebacks: `run` failed for good, and `history clear` stopped at the
    file, leaving every other index as it was."""
    from localspec import history

    from .conftest import run_cli

    good = _save_in_history("vocab-a", _one_document("vocab-a"))
    bad = history.index_path(history.CHAT, "vocab-b")
    _with_header(bad, meta)
    assert HistoryIndex.read_header(bad) is None
    assert not HistoryIndex.load(bad, "vocab-b").restored
    shown = run_cli("history", "--json")
    assert shown.returncode == 0, shown.stderr
    readable = {i["vocabulary"]: i["readable"] for i in json.loads(shown.stdout)["indexes"]}
    assert readable == {"vocab-a": True, "vocab-b": False}
    cleared = run_cli("history", "clear")
    assert cleared.returncode == 0, cleared.stderr
    assert HistoryIndex.load(good, "vocab-a").n_documents == 0


def _one_document(vocabulary: str, doc: tuple[int, ...] = (1, 2, 3, 4, 5)) -> HistoryIndex:
    index = HistoryIndex(vocabulary)
    index.add(doc)
    return index


@pytest.mark.parametrize("token", [332, 400, -5], ids=["vocab-size", "past-it", "negative"])
def test_a_file_with_a_token_no_vocabulary_holds_is_dropped(tmp_path: Path, token: int) -> None:
    """Its checksum is right (written so on purpose, or by a bug): a token past the vocabulary
    failed the target's decode on every request that matched it, a negative one split a
    document."""
    path = tmp_path / "v.idx"
    tokens = np.array([1, 2, token, 4, 5, -1], "<i4").tobytes()
    body = tokens + np.array([5], "<i8").tobytes() + bytes(6)
    meta = json.dumps({"format": 2, "vocabulary": "v", "tokens": 6, "documents": 1,
                       "sha256": hashlib.sha256(body).hexdigest(), "epoch": "e"}).encode()
    path.write_bytes(b"LSHIST1\n" + struct.pack("<I", len(meta)) + meta + body)
    assert not HistoryIndex.load(path, "v", n_vocab=332).restored
    with pytest.raises(ValueError, match="damaged"):
        HistoryIndex.verify(path, "v", 332)
    fine = HistoryIndex.load(path, "v", n_vocab=10**6)
    assert fine.restored == (token >= 0)
    index = HistoryIndex("v", n_vocab=332)
    assert not index.add([1, 2, 3, 332]) and index.add([1, 2, 3, 331])
