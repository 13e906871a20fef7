"""The history drafter through the product: an engine-lifetime index of earlier requests that
drafts without changing a greedy token, persists per vocabulary and scope, keeps serve's index
apart from the chat app's, is really off when turned off, and is emptied by `history clear`."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from localspec import history
from localspec.chat_store import ChatStore
from localspec.engine import (
    DraftSettings,
    GenerationRequest,
    ModelSettings,
    SpeculativeEngine,
)
from localspec.engine.calibration import Calibration
from localspec.engine.drafters import DraftContext, HistoryDrafter, TreeRequest
from localspec.engine.history_index import HistoryIndex
from localspec.engine.history_store import HistoryStore
from localspec.errors import ConfigError, LocalspecError
from localspec.loading import EngineSpec, load_engine
from localspec.options import Settings
from localspec.server import ServerConfig
from localspec.server.app import create_app
from localspec.server.running import BackgroundServer

from .conftest import run_cli
from .engine_helpers import PROMPTS

N = 48  # tokens per request


def _ask(engine: SpeculativeEngine, prompt: str, mode: str = "history", k: int | None = 8,
         history_on: bool = True) -> tuple[tuple[int, ...], dict[str, dict[str, int]]]:
    engine.clear_caches()  # cold: a comparison with plain decoding needs the same prefill
    req = GenerationRequest(prompt_tokens=engine.tokenize(prompt, chat=False), max_tokens=N,
                            draft=DraftSettings(mode=mode, k=k, history=history_on))
    done = engine.generate(req)
    return done.tokens, {n: d.to_json() for n, d in done.stats.drafters.items()}


def _files(scope: str) -> list[Path]:
    folder = history.history_dir() / scope
    return sorted(folder.glob("*.idx")) if folder.is_dir() else []


def _documents(path: Path) -> int:
    header = HistoryIndex.read_header(path)
    assert header is not None, path
    return int(header["documents"])


# -- drafting --------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["f32", "q4_k_m"])
def test_greedy_output_is_the_targets_with_the_history_drafting(
        precision: str, quantized_pairs: dict[str, tuple[Path, Path]]) -> None:
    target, draft = quantized_pairs[precision]
    store = HistoryStore.in_memory(history.vocabulary_id(target))
    drafted = 0
    with SpeculativeEngine.load(target, draft, ModelSettings(n_ctx=512), history=store) as eng:
        for prompt in PROMPTS:
            plain, _ = _ask(eng, prompt, mode="none", history_on=False)
            # The first asking fills the history, the next ones draft from it: with the
            # history alone at a fixed K, and beside the draft model and lookup under auto.
            for mode, k in (("model", None), ("history", 8), ("model", None), ("lookup", None)):
                tokens, by = _ask(eng, prompt, mode=mode, k=k)
                assert tokens == plain, (precision, prompt, mode, k)
                drafted += by.get("history", {}).get("drafted", 0)
    assert drafted > 0  # the history did draft (and changed nothing)


def test_a_repeated_request_is_drafted_mostly_from_the_history(target_gguf: Path) -> None:
    store = HistoryStore.in_memory(history.vocabulary_id(target_gguf))
    with SpeculativeEngine.load(target_gguf, None, ModelSettings(n_ctx=512),
                                history=store) as eng:
        first, by_first = _ask(eng, PROMPTS[0])
        assert "history" not in by_first  # nothing seen before
        again, by = _ask(eng, PROMPTS[0])
    assert again == first
    mine = by["history"]
    assert mine["accepted"] >= len(again) * 3 // 4, by
    assert mine["accepted"] == mine["drafted"]  # the same request: every token is right


# -- resuming a copy where the target's text rejoins it -----------------------------------------
OLD = list(range(100, 140))  # an earlier answer: 40 distinct tokens


def _history_of(*docs: list[int]) -> HistoryStore:
    store = HistoryStore.in_memory("v", max_tokens=1000)
    for doc in docs:
        store.index.add(doc)
    return store


def _drafts(store: HistoryStore, *steps: list[int], budget: int = 8) -> list[list[int]]:
    """What one request's history drafter proposes at each of ``steps`` (the context so far,
    step after step)."""
    drafter = HistoryDrafter()
    return [drafter.propose(DraftContext(seq=seq, history=store), budget).tokens
            for seq in steps]


@pytest.mark.parametrize(("change", "resumed_at"), [
    ([999, OLD[13]], 14),  # one token replaced (a name renamed)
    ([998, 999, OLD[12]], 13),  # two tokens put in (a word added)
    ([999, OLD[14]], 15),  # two taken out and one put in
])
def test_a_copy_that_parts_is_resumed_where_the_target_rejoins_it(
        change: list[int], resumed_at: int) -> None:
    store = _history_of(OLD)
    head = [1, 2, *OLD[:12]]
    steps = [head[:k] for k in range(10, len(head) + 1)]
    steps += [head + change[:k] for k in range(1, len(change) + 1)]
    drafts = _drafts(store, *steps)
    assert drafts[len(head) - 10] == OLD[12:20]  # copying
    # The target's new tokens are in no earlier text: nothing matches the context's end.
    assert all(d == [] for d in drafts[len(head) - 9:-1])
    # Once it writes a token the earlier text holds just past the change, the copy goes on.
    assert drafts[-1] == OLD[resumed_at:resumed_at + 8]
    # Without the copy it followed, the same context's end matches nothing.
    assert _drafts(store, steps[-1]) == [[]]


def test_a_resumed_copy_goes_on_where_it_was_accepted_to() -> None:
    # An earlier text with a token that comes back (a comma, a bracket): the copy resumed
    # after the change goes on from where the target got to, not from that token's first use.
    old = [150, 7, 151, 7, 152, 153, 154, 155, 156, 157]
    store = _history_of([140, 141, 142, 143, 144, *old])
    head = [1, 140, 141, 142, 143, 144]
    drafts = _drafts(store, head, head + [999], head + [999, 7], head + [999, 7, 151, 7])
    assert drafts[2] == [151, 7, 152, 153, 154, 155, 156, 157]  # 999 took 150's place
    assert drafts[3] == [152, 153, 154, 155, 156, 157]


def test_a_copys_confidences_are_each_given_the_tokens_before_it_held() -> None:
    """The controller multiplies a copy's confidences into the chance of reaching each
    token, so each is given the ones before it: a match that held on is longer, and once the
    matches that went the other way are behind, the one left is not doubted for them again."""
    # Two earlier texts after the same three tokens: they agree for two tokens, then part.
    store = _history_of([140, 141, 142, 160, 161, 162, 163, 164],
                        [140, 141, 142, 160, 161, 170, 171, 172])
    prop = HistoryDrafter().propose(DraftContext(seq=[1, 140, 141, 142], history=store), 5)
    assert prop.tokens == [160, 161, 170, 171, 172]  # the more recent way
    c = prop.confidences
    assert c[0] < c[1]  # a three-token match that held on for one more is likelier right
    assert c[2] < c[1]  # where the matches part, half went the other way
    assert c[3] > c[1] and c[4] > c[3]  # past it, one way is left


def test_a_trees_confidences_are_each_given_the_node_above_it() -> None:
    store = _history_of([140, 141, 142, 160, 161, 162, 163, 164],
                        [140, 141, 142, 160, 161, 170, 171, 172])
    tree = HistoryDrafter().propose_tree(
        DraftContext(seq=[1, 140, 141, 142], history=store),
        TreeRequest(nodes=8, depth=4, branches=2, width=2, floor=0.0, estimate=lambda c: c))
    conf = dict(zip(tree.tokens, tree.confidences, strict=True))
    assert conf[160] < conf[161]  # the match held on for one more token
    assert conf[170] < conf[161] and conf[162] < conf[161]  # the two ways part
    assert conf[171] > conf[161] and conf[163] > conf[161]  # on either way, it is the only one


def test_a_copy_is_resumed_only_near_where_it_parted() -> None:
    store = _history_of(OLD)
    head = [1, 2, *OLD[:12]]
    new = list(range(500, 500 + HistoryDrafter.RESUME_WINDOW))  # a long passage of new text
    steps = [head, *(head + new[:k] for k in range(1, len(new) + 1)),
             head + new + [OLD[12]]]
    assert _drafts(store, *steps)[-1] == []
    # And a short match is no copy to resume: three tokens (the least a match takes) matched.
    short = [7, *OLD[9:12]]
    assert _drafts(store, short, short + [999], short + [999, OLD[13]])[-1] == []


def test_greedy_output_is_the_targets_where_a_copy_parts_and_resumes(
        quantized_pairs: dict[str, tuple[Path, Path]]) -> None:
    """Earlier answers that are the target's own but for one token: each copy parts there and
    resumes after it, and the text is the target's, in fewer passes than without resuming."""
    target, _ = quantized_pairs["q4_k_m"]
    passes = {}
    for window in (HistoryDrafter.RESUME_WINDOW, 0):
        store = HistoryStore.in_memory(history.vocabulary_id(target))
        with SpeculativeEngine.load(target, None, ModelSettings(n_ctx=512),
                                    history=store) as eng, pytest.MonkeyPatch.context() as mp:
            plain = {p: _ask(eng, p, mode="none", history_on=False)[0] for p in PROMPTS}
            for p, tokens in plain.items():
                changed = list(tokens)
                changed[N // 2] += 1  # the one change
                store.record(eng.tokenize(p, chat=False), changed)
            mp.setattr(HistoryDrafter, "RESUME_WINDOW", window)
            passes[window] = 0
            for p, tokens in plain.items():
                eng.clear_caches()
                done = eng.generate(GenerationRequest(
                    prompt_tokens=eng.tokenize(p, chat=False), max_tokens=N,
                    draft=DraftSettings(mode="history", k=8)))
                assert done.tokens == tokens, (p, window)
                passes[window] += done.stats.target_passes
    resuming, not_resuming = passes.values()
    assert resuming < not_resuming, passes


def test_auto_takes_long_history_drafts_where_the_draft_model_does_not_pay(
        target_gguf: Path, draft_gguf: Path) -> None:
    # A compute-bound target (each token in a pass costs 40% of a step) with a draft model
    # whose token costs half a step: drafting with the model loses, the history's drafts of a
    # repeated answer win. Fixed costs (learn=False), so nothing here depends on this machine.
    bound = Calibration({1: 0.010, 2: 0.014, 13: 0.058}, 0.005, 0.0)
    store = HistoryStore.in_memory(history.vocabulary_id(target_gguf))
    with SpeculativeEngine.load(target_gguf, draft_gguf, ModelSettings(n_ctx=512),
                                history=store) as eng:
        eng.use_calibration(bound, learn=False)
        plain, _ = _ask(eng, PROMPTS[3], mode="none")  # recorded: the history has it now
        results = [_ask(eng, PROMPTS[3], mode="model", k=None) for _ in range(5)]
    for tokens, _ in results:
        assert tokens == plain
    _, by = results[-1]
    assert by.get("history", {}).get("accepted", 0) >= len(plain) // 3, by
    assert by.get("model", {}).get("drafted", 0) <= by["history"]["drafted"] // 4, by
    rounds, accepted = by["history"]["rounds"], by["history"]["accepted"]
    # Long drafts, not a token at a time, once the history's own acceptance model has seen
    # its drafts accepted (it starts from a prior of 0.5).
    assert accepted / rounds >= 4, by


def test_an_unproven_history_is_proven_at_plain_steps_where_its_capped_copy_cannot_pay(
        quantized_pairs: dict[str, tuple[Path, Path]]) -> None:
    # The curve of Q4_K_M on a 2-core AVX-512 CPU: two tokens cost two passes, 32 cost 9.5.
    # Until a request bears its drafter out, a copy is capped at what a rejection may cost
    # (UNPROVEN_LOSS): here one token, which never pays, so the copy was never verified,
    # never proven, and auto decoded the repeated answer plainly to its end.
    steep = Calibration({1: 0.010, 2: 0.020, 3: 0.026, 8: 0.060, 16: 0.070, 32: 0.095,
                         64: 0.17}, 0.005, 0.0)
    target, draft = quantized_pairs["q4_k_m"]
    store = HistoryStore.in_memory(history.vocabulary_id(target))
    with SpeculativeEngine.load(target, draft, ModelSettings(n_ctx=512), history=store) as eng:
        eng.use_calibration(steep, learn=False)
        plain, _ = _ask(eng, PROMPTS[3], mode="none")  # recorded: the history has it now
        again, by = _ask(eng, PROMPTS[3], mode="model", k=None)
    assert again == plain
    # Its first tokens, scored at plain steps against the target's, prove it within EARLY.
    assert by.get("history", {}).get("accepted", 0) >= len(plain) // 3, by


def test_a_copy_runs_past_k_max_where_the_measured_passes_make_it_pay(
        target_gguf: Path, draft_gguf: Path) -> None:
    # k_max bounds what the draft model decodes; a copy from the history costs nothing to
    # draft, so on a flat curve measured to 64 tokens a repeated answer goes in long rounds.
    flat = Calibration({1: 0.010, 2: 0.0105, 13: 0.012, 16: 0.0125, 32: 0.014, 64: 0.02},
                       0.005, 0.0)
    store = HistoryStore.in_memory(history.vocabulary_id(target_gguf))
    with SpeculativeEngine.load(target_gguf, draft_gguf, ModelSettings(n_ctx=512),
                                history=store) as eng:
        eng.use_calibration(flat, learn=False)
        plain, _ = _ask(eng, PROMPTS[3], mode="none")
        results = [_ask(eng, PROMPTS[3], mode="model", k=None) for _ in range(3)]
    assert all(tokens == plain for tokens, _ in results)
    _, by = results[-1]
    assert eng.k_max == 12
    assert by["history"]["accepted"] / by["history"]["rounds"] > eng.k_max, by


def test_plain_steps_bring_a_carried_near_tie_rate_back_down(
        quantized_pairs: dict[str, tuple[Path, Path]]) -> None:
    # On a quantized target (tie margin 0.2 logits) a near-tie rate carried high from earlier
    # requests makes auto decode plainly; the plain steps' own margins must bring it down, or
    # no copy is priced as worth it again (a rename on Q4_K_M decoded plainly for 90 tokens
    # of a file it copied).
    target, draft = quantized_pairs["q4_k_m"]
    bound = Calibration({1: 0.010, 2: 0.014, 13: 0.058}, 0.005, 0.0)
    store = HistoryStore.in_memory(history.vocabulary_id(target))
    with SpeculativeEngine.load(target, draft, ModelSettings(n_ctx=512), history=store) as eng:
        eng.use_calibration(bound, learn=False)
        assert eng.tie_margin > 0
        ties = eng._learned[True].ties
        ties.prior = 0.6  # as if every position lately had been a near-tie
        _ask(eng, PROMPTS[3], mode="model", k=None)
        # Left alone, the rate would stay at 0.6 (auto decoding plainly never meets a tie);
        # this text's own rate is near 0.13.
        assert ties.rate < 0.3
        assert ties.prior < 0.5  # and the next request starts from it


def test_where_earlier_answers_went_different_ways_the_history_drafts_a_tree(
        target_gguf: Path) -> None:
    """An earlier answer, then a more recent one that left it after 5 tokens: a chain
    follows the most recent and is rejected there; a tree offers both ways and the target
    takes the right one in the same pass. Costs of a memory-bound device (a pass over 64
    tokens costs 1.25 of one), fixed, where the planner drafts trees."""
    flat = Calibration({1: 0.010, **{n: 0.010 + 0.00005 * n for n in range(2, 14)},
                        16: 0.0109, 32: 0.0115, 64: 0.0125, 128: 0.014}, 0.0005, 0.0)
    store = HistoryStore.in_memory(history.vocabulary_id(target_gguf))
    with SpeculativeEngine.load(target_gguf, None, ModelSettings(n_ctx=512),
                                history=store) as eng:
        eng.use_calibration(flat, learn=False)
        prompt = eng.tokenize(PROMPTS[3], chat=False)
        plain, _ = _ask(eng, PROMPTS[3], mode="none")
        store.record(prompt, [*plain[:5], *(t + 1 for t in plain[5:])])
        done = {}
        for tree in (False, True):
            eng.clear_caches()
            # 8 tokens: one step past the first token, as a tree; two as a chain.
            req = GenerationRequest(prompt_tokens=prompt, max_tokens=8,
                                    draft=DraftSettings(mode="history", tree=tree))
            with eng.separate_learning():
                done[tree] = eng.generate(req)
    for res in done.values():
        assert res.tokens == plain[:8]
    chain, tree = done[False].stats, done[True].stats
    assert chain.tree_rounds == 0 < tree.tree_rounds
    assert tree.target_passes < chain.target_passes
    assert tree.drafters["history"].accepted > chain.drafters["history"].accepted


def test_beside_the_draft_model_the_historys_winning_draft_is_a_tree_too(
        target_gguf: Path, random_draft_gguf: Path) -> None:
    """As above under auto with a draft model that is rarely right (a random one, its token
    priced dear): the history's draft wins the step, and where the earlier answers parted it
    goes to the target as a tree of both ways, not as the most recent one's chain."""
    flat = Calibration({1: 0.010, **{n: 0.010 + 0.00005 * n for n in range(2, 14)},
                        16: 0.0109, 32: 0.0115, 64: 0.0125, 128: 0.014}, 0.008, 0.0)
    store = HistoryStore.in_memory(history.vocabulary_id(target_gguf))
    with SpeculativeEngine.load(target_gguf, random_draft_gguf, ModelSettings(n_ctx=512),
                                history=store) as eng:
        eng.use_calibration(flat, learn=False)
        prompt = eng.tokenize(PROMPTS[3], chat=False)
        plain, _ = _ask(eng, PROMPTS[3], mode="none")
        store.record(prompt, [*plain[:5], *(t + 1 for t in plain[5:])])
        done = {}
        for tree in (False, True):
            eng.clear_caches()
            req = GenerationRequest(prompt_tokens=prompt, max_tokens=8,
                                    draft=DraftSettings(mode="model", tree=tree))
            with eng.separate_learning():
                done[tree] = eng.generate(req)
    for res in done.values():
        assert res.tokens == plain[:8]
    chain, tree = done[False].stats, done[True].stats
    assert tree.tree_rounds > 0 and tree.drafters["history"].rounds > 0
    assert "model" not in tree.drafters  # the history's tree, not the model's with grafts
    assert tree.drafters["history"].accepted > chain.drafters["history"].accepted


def test_off_in_the_request_neither_drafts_nor_records(target_gguf: Path) -> None:
    store = HistoryStore.in_memory(history.vocabulary_id(target_gguf))
    with SpeculativeEngine.load(target_gguf, None, ModelSettings(n_ctx=512),
                                history=store) as eng:
        _ask(eng, PROMPTS[1], mode="lookup", k=None, history_on=False)
        assert store.index.n_documents == 0
        _ask(eng, PROMPTS[1], mode="lookup", k=None)
        assert store.index.n_documents == 1
        _, by = _ask(eng, PROMPTS[1], mode="lookup", k=None, history_on=False)
        assert "history" not in by
        with pytest.raises(LocalspecError, match="turns off"):
            _ask(eng, PROMPTS[1], mode="history", history_on=False)


# -- persistence and scopes ------------------------------------------------------------------------
def test_it_persists_across_an_engine_restart_owner_only(target_gguf: Path) -> None:
    spec = EngineSpec(target=str(target_gguf), draft_mode="lookup",
                      target_settings=ModelSettings(n_ctx=512), history=history.SERVE)
    with load_engine(spec) as eng:
        first, _ = _ask(eng, PROMPTS[2])
    (path,) = _files(history.SERVE)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(history.history_dir().stat().st_mode) == 0o700
    assert _documents(path) == 1
    with load_engine(spec) as eng:  # a new process would read the same file
        again, by = _ask(eng, PROMPTS[2])
    assert again == first and by["history"]["accepted"] >= len(first) // 2, by


def _save_chat(answer: str) -> None:
    store = ChatStore()
    chat = store.create_chat("a saved chat")
    store.add_message(chat.id, "user", "tell me about the model")
    store.add_message(chat.id, "assistant", answer)
    store.close()


def test_serves_index_is_apart_from_the_chat_apps(target_gguf: Path) -> None:
    _save_chat("the draft and the target of this test")
    settings = ModelSettings(n_ctx=512)
    chat = EngineSpec(target=str(target_gguf), draft_mode="lookup", target_settings=settings,
                      history=history.scope_for("chat", Settings()))
    serve = EngineSpec(target=str(target_gguf), draft_mode="lookup", target_settings=settings,
                       history=history.scope_for("serve", Settings()))
    assert (chat.history, serve.history) == ("chat", "serve")
    with load_engine(chat) as eng:
        assert eng.history is not None and eng.history.index.n_documents == 1  # the saved chat
        _ask(eng, PROMPTS[4])
    with load_engine(serve) as eng:
        assert eng.history is not None and eng.history.index.n_documents == 0  # not the chats
        _ask(eng, PROMPTS[5])
        _ask(eng, PROMPTS[6])
    (chat_file,), (serve_file,) = _files("chat"), _files("serve")
    assert chat_file.name == serve_file.name  # one vocabulary, two scopes
    assert (_documents(chat_file), _documents(serve_file)) == (2, 2)


def test_config_can_join_serve_to_the_chat_index(isolated_home: Path) -> None:
    config = isolated_home / "config" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text("[history]\nserve_scope = \"chat\"\nmax_tokens = 5000\n")
    assert history.scope_for("serve", Settings()) == "chat"
    assert history.load_config().max_tokens == 5000
    assert history.scope_for("serve", Settings(history="off")) is None
    config.write_text("[history]\nserve_scope = \"everyone\"\n")
    with pytest.raises(ConfigError, match=r"config\.toml, line 2: history serve_scope must be "
                                          r"one of chat, serve, got 'everyone'"):
        history.scope_for("serve", Settings())


def test_a_damaged_index_file_is_rebuilt_from_the_saved_chats(target_gguf: Path) -> None:
    _save_chat("print print print print and the model")
    spec = EngineSpec(target=str(target_gguf), draft_mode="lookup",
                      target_settings=ModelSettings(n_ctx=512), history=history.CHAT)
    with load_engine(spec) as eng:
        _ask(eng, PROMPTS[0])
    (path,) = _files("chat")
    assert _documents(path) == 2
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF  # a flipped byte: the checksum no longer matches
    path.write_bytes(bytes(raw))
    with load_engine(spec) as eng:
        assert eng.history is not None and eng.history.fresh is False  # seeded already
        assert eng.history.index.n_documents == 1  # the chat again; the request was lost
    assert _documents(path) == 1  # rewritten whole, not trusted


# -- the store: several writers, and a clear behind a process's back -------------------------------
def test_two_processes_on_one_file_keep_each_others_documents(tmp_path: Path) -> None:
    path = tmp_path / "v.idx"
    a = HistoryStore.open(path, "v", save_interval=3600)
    b = HistoryStore.open(path, "v", save_interval=3600)
    a.record([1, 2, 3], [4, 5, 6, 7])
    a.flush()
    b.record([9, 8, 7], [6, 5, 4, 3])
    b.close()
    assert HistoryIndex.load(path, "v").n_documents == 2
    a.record([1, 1, 1], [2, 2, 2, 2])
    a.close()
    merged = HistoryIndex.load(path, "v")
    assert merged.n_documents == 3
    assert merged.lookup([9, 8, 7, 6], budget=2) is not None


def test_a_clear_is_honoured_by_a_process_holding_the_index() -> None:
    path = history.index_path("serve", "v")
    path.parent.mkdir(parents=True)
    held = HistoryStore.open(path, "v", save_interval=3600)
    held.record([1, 2, 3], [4, 5, 6, 7])
    held.flush()
    held.record([1, 2, 3], [4, 5, 6, 8])  # unsaved when the clear comes
    assert [f.documents for f in history.clear()] == [1]
    held.close()  # must not write back what the user cleared
    assert HistoryIndex.load(path, "v").n_documents == 0
    assert held.index.n_documents == 0


def test_writers_sharing_a_file_evict_the_oldest_documents_whoever_wrote_them(
        tmp_path: Path) -> None:
    """Room for three documents; answers recorded a1 b2 b3 b4 a5 b6 by two processes, each
    saving after each: the file holds the newest three. Before, a merge put the other
    process's documents after this one's own, so b6 (just written) was evicted and b3 came
    back."""
    path = tmp_path / "v.idx"
    stores = {name: HistoryStore.open(path, "v", max_tokens=30, save_interval=3600)
              for name in "ab"}
    order = []
    for i, name in enumerate("abbbab", start=1):
        doc = [100 * i + j for j in range(10)]  # ten tokens, all its own
        stores[name].record([], doc)
        stores[name].flush()
        order.append(doc[0])
        held = [int(d[0]) for d in HistoryIndex.load(path, "v", max_tokens=30).documents()]
        assert held == order[-3:], (i, held)
    for store in stores.values():
        store.close()


def test_a_save_made_while_another_process_opens_the_file_is_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A saves just after B has read the file: B must know its copy is older than the file,
    not take the file's header as read later for its own, and write A's document away."""
    path = tmp_path / "v.idx"
    a = HistoryStore.open(path, "v", save_interval=3600)
    a.record([], [100, 1, 2, 3])
    a.flush()
    real_load = HistoryIndex.load

    def load_then_a_saves(*args: object, **kwargs: object) -> HistoryIndex:
        index = real_load(*args, **kwargs)  # type: ignore[arg-type]
        a.record([], [200, 1, 2, 3])
        a.flush()
        return index

    monkeypatch.setattr(HistoryIndex, "load", load_then_a_saves)
    b = HistoryStore.open(path, "v", save_interval=3600)
    monkeypatch.setattr(HistoryIndex, "load", real_load)
    b.record([], [300, 1, 2, 3])
    b.close()
    a.close()
    held = sorted(int(d[0]) for d in HistoryIndex.load(path, "v").documents())
    assert held == [100, 200, 300]


_WRITER = """
import sys
from pathlib import Path
from localspec.engine.history_store import HistoryStore
store = HistoryStore.open(Path(sys.argv[1]), "v", save_interval=3600)
base = int(sys.argv[2])
for i in range(int(sys.argv[3])):
    store.record([], [base + i, 1, 2, 3, 4])
    store.flush()
store.close()
"""


def test_two_processes_saving_at_once_lose_nothing(tmp_path: Path) -> None:
    """Each save reads the file, merges and writes it; without the file's lock a save landing
    between another's read and write was overwritten (a third of the documents lost)."""
    path = tmp_path / "v.idx"
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(base), "60"])
               for base in (1000, 2000)]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    held = {int(d[0]) for d in HistoryIndex.load(path, "v").documents()}
    assert held == {*range(1000, 1060), *range(2000, 2060)}


def test_a_clear_waits_for_a_save_in_progress_and_is_refused_past_the_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A clear and a save share the file's lock: a running process's save cannot write the
    cleared documents back between its read of the header and its write."""
    from localspec.engine import history_index

    path = history.index_path("serve", "v")
    store = HistoryStore.open(path, "v", save_interval=3600)
    store.record([1, 2, 3], [4, 5, 6, 7])
    store.flush()
    monkeypatch.setattr(history_index, "LOCK_SECONDS", 0.2)
    with HistoryIndex.locked(path):  # another process's save, in progress
        with pytest.raises(LocalspecError, match="being written by another localspec"):
            history.clear()
        store.record([1, 2, 3], [4, 5, 6, 8])
        with pytest.raises(TimeoutError):
            store.flush()  # left unsaved, for the next write
    assert HistoryIndex.load(path, "v").n_documents == 1
    store.close()
    assert HistoryIndex.load(path, "v").n_documents == 2
    history.clear()
    assert HistoryIndex.load(path, "v").n_documents == 0


def test_a_request_records_at_once_while_another_process_holds_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save waiting for the file's lock must not hold up the request that finishes
    meanwhile: before, the store kept its own lock across the wait, so ``record`` (run at the
    end of every request) waited up to LOCK_SECONDS for another process's save."""
    from localspec.engine import history_index

    monkeypatch.setattr(history_index, "LOCK_SECONDS", 60.0)
    path = tmp_path / "v.idx"
    store = HistoryStore.open(path, "v", save_interval=3600)
    store.record([], [100, 1, 2, 3])
    store.flush()  # the first save is at once; the next one not for an hour
    store.record([], [150, 1, 2, 3])
    real_locked = HistoryIndex.locked
    waiting = threading.Event()

    @contextlib.contextmanager
    def locked_noting_the_wait(p: Path, timeout: float | None = None) -> Iterator[None]:
        waiting.set()
        with real_locked(p, timeout):
            yield

    with real_locked(path):  # another process's save, in progress
        monkeypatch.setattr(HistoryIndex, "locked", staticmethod(locked_noting_the_wait))
        saver = threading.Thread(target=store.flush)
        saver.start()
        assert waiting.wait(timeout=30)
        recorder = threading.Thread(target=store.record, args=([], [200, 1, 2, 3]))
        recorder.start()
        recorder.join(timeout=5)
        assert not recorder.is_alive(), "record waited for another process's lock"
        assert store.index.n_documents == 3
    saver.join(timeout=30)
    assert _held(path) == [100, 150]  # the save in flight took what there was when it began
    store.close()
    assert _held(path) == [100, 150, 200]


def _held(path: Path) -> list[int]:
    return [int(d[0]) for d in HistoryIndex.load(path, "v").documents()]


def _during_the_next_save(monkeypatch: pytest.MonkeyPatch, act: Callable[[], None]) -> None:
    """Run ``act`` once inside the next save, after it has taken the file's lock."""
    real = HistoryIndex.read_header

    def read_then_act(path: Path) -> dict[str, object] | None:
        monkeypatch.setattr(HistoryIndex, "read_header", staticmethod(real))
        header = real(path)
        act()
        return header

    monkeypatch.setattr(HistoryIndex, "read_header", staticmethod(read_then_act))


def test_documents_recorded_during_a_merging_save_are_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "v.idx"
    a = HistoryStore.open(path, "v", save_interval=3600)
    a.record([], [50, 1, 2, 3])
    a.flush()  # the first save is at once; the next one not for an hour
    b = HistoryStore.open(path, "v", save_interval=3600)
    b.record([], [100, 1, 2, 3])
    b.close()
    a.record([], [200, 1, 2, 3])
    _during_the_next_save(monkeypatch, lambda: a.record([], [300, 1, 2, 3]))
    a.flush()  # merges b's document in: a new index, which must still get 300
    assert [int(d[0]) for d in a.index.documents()] == [50, 100, 200, 300]
    assert _held(path) == [50, 100, 200]
    a.close()
    assert _held(path) == [50, 100, 200, 300]


def test_documents_recorded_during_a_save_that_finds_a_clear_are_forgotten_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """They may predate the clear: keeping them could write cleared text back."""
    path = history.index_path("serve", "v")
    held = HistoryStore.open(path, "v", save_interval=3600)
    held.record([], [100, 1, 2, 3])
    held.flush()
    held.record([], [200, 1, 2, 3])
    history.clear()
    _during_the_next_save(monkeypatch, lambda: held.record([], [300, 1, 2, 3]))
    held.close()
    assert held.index.n_documents == 0
    assert _held(path) == []


def test_a_file_store_that_cannot_save_keeps_no_more_than_its_index_holds(
        tmp_path: Path) -> None:
    """Documents kept for the next merge are bounded by the index's own limit: older ones
    would be evicted by the merge anyway, and a cache that stays read-only for a long-running
    serve must not grow them without end."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    store = HistoryStore.open(blocker / "v.idx", "v", max_tokens=30, save_interval=3600)
    for i in range(20):
        store.record([], [1000 + i, *range(9)])
        with pytest.raises(OSError):
            store.flush()
    assert store.index.n_documents == 3
    assert sum(len(doc) for doc, _ in store._unsaved) <= 30  # noqa: SLF001
    assert [doc[0] for doc, _ in store._unsaved] == [1017, 1018, 1019]  # noqa: SLF001


def test_a_file_system_that_cannot_lock_still_saves_and_clears(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A fake for a file system without flock (some network mounts), where filelock 3 raises
    NotImplementedError: before, that escaped the save timer and ``history clear``."""
    import filelock

    def no_flock(self: object, *args: object, **kwargs: object) -> object:
        raise NotImplementedError("FileSystem does not appear to support flock")

    monkeypatch.setattr(filelock.FileLock, "acquire", no_flock)
    path = history.index_path("serve", "v")
    store = HistoryStore.open(path, "v", save_interval=3600)
    with caplog.at_level("WARNING"):
        store.record([], [100, 1, 2, 3])
        store.flush()
    assert _held(path) == [100]
    assert "writing it unlocked" in caplog.text
    assert [f.documents for f in history.clear()] == [1]
    store.record([], [200, 1, 2, 3])  # unsaved when the clear came, as far as it can tell
    store.close()  # the clear is honoured without a lock too
    assert _held(path) == []


# -- the front ends --------------------------------------------------------------------------------
@pytest.fixture()
def served(target_gguf: Path) -> Iterator[tuple[BackgroundServer, HistoryStore]]:
    store = HistoryStore.in_memory(history.vocabulary_id(target_gguf))
    eng = SpeculativeEngine.load(target_gguf, None, ModelSettings(n_ctx=512), history=store)
    srv = BackgroundServer(create_app(eng, ServerConfig(
        model_id="tiny", draft=DraftSettings(mode="lookup", k=8)))).start()
    yield srv, store
    srv.stop()
    eng.close()


def test_the_request_field_turns_it_off_for_one_request(
        served: tuple[BackgroundServer, HistoryStore]) -> None:
    srv, store = served

    def ask(**extra: object) -> dict:
        body = {"prompt": PROMPTS[3], "max_tokens": 24, "temperature": 0, **extra}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["localspec"]["stats"]

    ask(history="off")
    assert store.index.n_documents == 0
    ask(history=True)
    assert store.index.n_documents == 1
    assert "history" not in ask(history="off", k=8, draft_mode="lookup")["drafters"]
    r = httpx.post(srv.url + "/v1/completions", timeout=60,
                   json={"prompt": "x", "max_tokens": 2, "history": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "history"
    # Drafting from the history with the history off is the asker's mistake: a 400 before
    # anything streams, not a 500 (or a 200 and an error event).
    for stream in (False, True):
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "prompt": "x", "max_tokens": 2, "draft_mode": "history", "history": "off",
            "stream": stream})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "draft_mode" and "turns off" in error["message"]


@pytest.mark.parametrize(("server_history", "shared"), [("serve", False), (None, False),
                                                         ("chat", True)])
def test_a_chat_app_attached_to_serve_keeps_out_of_its_own_index(
        served: tuple[BackgroundServer, HistoryStore], target_gguf: Path,
        server_history: str | None, shared: bool) -> None:
    """The chat app attaches to a `serve` of its pair rather than load a second copy. Its
    conversations go into that server's index only where config.toml joined the two (the
    server keeps the chat's index); a server with its own (or an older one, which does not
    say) gets them with the history turned off, and a chat set to draft from the history
    alone is answered with the other drafters rather than refused."""
    from localspec.chat_engine import ChatOptions
    from localspec.served_engine import ServedChatEngine

    srv, store = served
    spec = EngineSpec(target=str(target_gguf), pair_name="tiny", history="chat")
    engine = ServedChatEngine(spec, srv.url, os.getpid(), model="tiny",
                              server_history=server_history)
    try:
        messages = [{"role": "user", "content": PROMPTS[3]}]
        for mode in ("model", "history"):
            options = ChatOptions(max_tokens=16, draft=DraftSettings(mode=mode))
            done = list(engine.stream_chat(messages, options))[-1]
            assert done.stats.completion_tokens > 0
            if not shared:  # neither drafted from nor added to
                assert "history" not in done.stats.drafters
    finally:
        engine.close()
    assert (store.index.n_documents > 0) == shared


def test_the_flag_and_config_turn_it_off_and_history_clear_empties_it(
        target_gguf: Path, isolated_home: Path) -> None:
    base = ("run", "--target", str(target_gguf), "--ctx", "512", "-n", "16", "--raw")
    off = run_cli(*base, "--history", "off", "the model and the draft")
    assert off.returncode == 0, off.stderr
    assert not history.history_dir().exists()
    config = isolated_home / "config" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('[chat]\nhistory = "off"\n')
    assert run_cli(*base, "the model and the draft").returncode == 0
    assert not history.history_dir().exists()
    on = run_cli(*base, "--history", "on", "the model and the draft")  # the flag wins
    assert on.returncode == 0, on.stderr
    (path,) = _files("chat")
    assert _documents(path) == 1

    shown = run_cli("history", "--json")
    assert shown.returncode == 0, shown.stderr
    (entry,) = json.loads(shown.stdout)["indexes"]
    assert (entry["scope"], entry["documents"], entry["file_bytes"]) == (
        "chat", 1, path.stat().st_size)
    assert entry["tokens"] > 0 and entry["model"] == target_gguf.name
    table = run_cli("history")
    assert entry["vocabulary"] in table.stdout and "chat" in table.stdout
    cleared = run_cli("history", "clear")
    assert cleared.returncode == 0 and "cleared 1 index" in cleared.stdout
    assert _documents(path) == 0 and os.path.exists(path)
    bad = run_cli("history", "--scope", "everyone")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
