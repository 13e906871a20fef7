"""history_index.py: lookups of the longest earlier match on known sequences, merging of
continuations by agreement, eviction of the oldest documents, and persistence that never trusts
a stale or damaged file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from localspec.engine.history_index import HistoryIndex


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
