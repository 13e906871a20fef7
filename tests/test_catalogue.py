"""The pair catalogue: shipped pairs, user pairs merged over them, validation, suggestions."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from localspec.errors import ConfigError, IncompatiblePairError, ModelNotFoundError
from localspec.models import catalogue
from localspec.models.catalogue import (
    add_user_pair,
    find_pair,
    load_pairs,
    pair_status,
    remove_user_pair,
    suggest_drafts,
    user_pairs_path,
)
from localspec.models.ollama_store import parse_name
from tests.ollama_helpers import install_gguf

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "ollama-models"


def test_shipped_catalogue_covers_families() -> None:
    pairs = catalogue.shipped_pairs()
    assert {"llama3.1-8b", "llama3.1-70b", "qwen2.5-7b", "qwen2.5-coder-32b",
            "gemma3-27b"} <= set(pairs)
    for pair in pairs.values():
        assert pair.source == "shipped" and pair.why and pair.draft_mode in catalogue.DRAFT_MODES
        # Every tag is a well-formed Ollama library name (model:tag, default namespace).
        for ref in (pair.target, pair.draft):
            parsed = parse_name(ref)
            assert parsed.namespace == "library" and ":" in ref, ref


def test_top_level_models_toml_is_the_shipped_file() -> None:
    top = REPO / "models.toml"
    assert top.is_symlink()
    assert top.resolve() == (REPO / "localspec" / "models" / "models.toml").resolve()
    tomllib.loads(top.read_text())


def test_find_pair_suggests_close_names() -> None:
    assert find_pair("qwen2.5-coder-32b").draft == "qwen2.5-coder:1.5b"
    with pytest.raises(ModelNotFoundError, match="did you mean .*qwen2.5-coder-32b"):
        find_pair("qwen2.5-coder-23b")


def test_user_pairs_win(store: Path, target_gguf: Path, draft_gguf: Path) -> None:
    install_gguf(store, "tiny:big", target_gguf)
    install_gguf(store, "tiny:small", draft_gguf)
    pair = add_user_pair("llama3.1-8b", "tiny:big", "tiny:small", draft_mode="lookup")
    assert pair.source == "user"
    merged = load_pairs()
    assert merged["llama3.1-8b"].target == "tiny:big"
    assert merged["llama3.1-8b"].draft_mode == "lookup"
    assert "qwen2.5-7b" in merged
    saved = tomllib.loads(user_pairs_path().read_text())
    assert saved["pair"][0]["draft"] == "tiny:small"
    assert not list(user_pairs_path().parent.glob("*.partial"))
    remove_user_pair("llama3.1-8b")
    assert load_pairs()["llama3.1-8b"].source == "shipped"


def test_add_pair_with_paths(target_gguf: Path, draft_gguf: Path) -> None:
    add_user_pair("mine", str(target_gguf), str(draft_gguf))
    assert find_pair("mine").target == str(target_gguf)


def test_add_incompatible_pair_is_refused(target_gguf: Path, other_vocab_gguf: Path) -> None:
    with pytest.raises(IncompatiblePairError):
        add_user_pair("bad", str(target_gguf), str(other_vocab_gguf))
    assert not user_pairs_path().exists()


def test_add_pair_with_absent_model(target_gguf: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="localspec pull"):
        add_user_pair("x", str(target_gguf), "absent:1b")


@pytest.mark.parametrize(("text", "match"), [
    ('[[pair]]\nname = "a"\ntarget = \n', r"line 3, column \d+: Invalid value"),
    ('[[pair]]\nname = "a"\n\n[[pair]]\nname = "b"\ntarget = "t"\n', r"line 1: .*'target'"),
    ('[[pair]]\nname = "a"\ntarget = "t"\ndraft = "d"\ndraft_mode = "fast"\n',
     r"line 1: draft_mode 'fast'"),
    ('pair = "nope"\n', "array of tables"),
])
def test_malformed_user_file(text: str, match: str) -> None:
    path = user_pairs_path()
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        load_pairs()
    assert str(path) in str(info.value)


def test_a_byte_order_mark_in_the_user_file_is_read_past() -> None:
    path = user_pairs_path()
    path.parent.mkdir(parents=True)
    path.write_bytes('\ufeff[[pair]]\nname = "mine"\ntarget = "a:1"\ndraft = "b:1"\n'
                     .encode("utf-8"))
    assert load_pairs()["mine"].target == "a:1"


def test_pair_status(store: Path, target_gguf: Path, draft_gguf: Path,
                     other_vocab_gguf: Path) -> None:
    install_gguf(store, "tiny:big", target_gguf)
    install_gguf(store, "tiny:small", draft_gguf)
    install_gguf(store, "other:1b", other_vocab_gguf)
    good = pair_status(catalogue.Pair("g", "tiny:big", "tiny:small"))
    assert good.compatible is True and good.target_path and good.draft_path
    bad = pair_status(catalogue.Pair("b", "tiny:big", "other:1b"))
    assert bad.compatible is False and bad.problems
    absent = pair_status(catalogue.Pair("a", "tiny:big", "nothing:1b"))
    assert absent.compatible is None and absent.draft_path is None
    assert absent.to_json()["target_present"] is True


def test_suggest_drafts(store: Path, target_gguf: Path, draft_gguf: Path,
                        random_draft_gguf: Path, other_vocab_gguf: Path) -> None:
    install_gguf(store, "tiny:big", target_gguf)
    install_gguf(store, "tiny:small", draft_gguf)
    install_gguf(store, "random:1b", random_draft_gguf)
    install_gguf(store, "other:1b", other_vocab_gguf)
    found = suggest_drafts("tiny:big")
    names = [s.name for s in found]
    assert "other:1b" not in names and "tiny:big" not in names
    assert set(names) == {"tiny:small", "random:1b"}
    assert all(s.size_ratio > 1 for s in found)
    assert found == sorted(found, key=lambda s: -s.size_ratio)
    assert suggest_drafts(str(target_gguf))  # a path works as the target too


def test_damaged_model_is_not_present(store: Path, target_gguf: Path, draft_gguf: Path) -> None:
    from localspec.models.library import DefaultLibrary, PairStatus

    model = install_gguf(store, "tiny:big", target_gguf)
    install_gguf(store, "tiny:small", draft_gguf)
    blob = store / "blobs" / model.model_layer.digest.replace(":", "-")
    with blob.open("ab") as fh:
        fh.write(b"trailing bytes")
    st = pair_status(catalogue.Pair("t", "tiny:big", "tiny:small"))
    assert st.target_path is None and st.draft_path is not None and st.compatible is None
    assert st.target_damage and blob.name[:19] in st.target_damage
    assert st.problems == (st.target_damage,)
    as_json = st.to_json()
    assert as_json["target_present"] is False and as_json["target_damaged"] is True
    assert as_json["draft_damaged"] is False

    lib = DefaultLibrary()
    checked = lib.check_pair(PairStatus("t", "tiny:big", "nothing:1b", "model"))
    assert checked.present is False and checked.damaged is True
    assert checked.problem is not None
    assert "localspec pull tiny:big" in checked.problem
    assert checked.problem.endswith("not in the Ollama store: nothing:1b")
    models = {m.name: m for m in lib.local_models()}
    assert models["tiny:big"].problem and blob.name[:19] in models["tiny:big"].problem
    assert models["tiny:small"].problem is None and models["tiny:small"].size > 0


def _user_file(text: str) -> Path:
    path = user_pairs_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


PAIR_A = '[[pair]]\nname = "a"\ntarget = "t:1"\ndraft = "d:1"\n'


@pytest.mark.parametrize(("text", "match"), [
    ('[[pairs]]\nname = "a"\ntarget = "t"\ndraft = "d"\n',
     r"line 1: unknown table \[\[pairs\]\] \(known: \[\[pair\]\]\); did you mean \[\[pair\]\]\?"),
    (f'{PAIR_A}\n[extra]\nx = 1\n', r"line 6: unknown table \[extra\]"),
    (f'name = "b"\n{PAIR_A}', r"line 1: unknown top-level key 'name' .*put it under \[\[pair\]\]"),
])
def test_unknown_top_level_names_in_user_file_are_refused(text: str, match: str) -> None:
    path = _user_file(text)
    with pytest.raises(ConfigError, match=match) as info:
        load_pairs()
    assert info.value.message.startswith(f"{path}: line ") and "\n" not in info.value.message


def test_duplicate_user_pair_names_are_refused() -> None:
    path = _user_file(f'{PAIR_A}\n[[pair]]\nname = "b"\ntarget = "t"\ndraft = "d"\n\n'
                      f'{PAIR_A.replace("t:1", "t:2")}')
    with pytest.raises(ConfigError) as info:
        load_pairs()
    assert info.value.message == (f"{path}: line 11: pair 'a' is defined twice (first at line 1);"
                                  " rename or remove one")


def test_pair_add_and_remove_edit_the_users_file_in_place(target_gguf: Path,
                                                          draft_gguf: Path) -> None:
    """Only the pair concerned changes: the user's comments, layout and other pairs stay."""
    mine = ("# my pairs, by hand\n\n"
            "[[pair]]\nname = \"a\"  # the old one\n# its target:\ntarget = 't:1'\n"
            "draft = \"d:1\"\n\n"
            "# b is for work\n"
            "[[pair]]\nname = \"b\"\ntarget = \"t:2\"\ndraft = \"d:2\"\n"
            "why = \"\"\"two\nlines\"\"\"\n")
    path = _user_file(mine)
    add_user_pair("new", str(target_gguf), str(draft_gguf), why="fresh")
    text = path.read_text()
    assert text.startswith(mine)
    assert tomllib.loads(text[len(mine):])["pair"] == [
        {"name": "new", "target": str(target_gguf), "draft": str(draft_gguf),
         "draft_mode": "model", "why": "fresh"}]

    with pytest.raises(ConfigError, match=r"already have a pair named 'a' \(t:1 \+ d:1\).*"
                                          "--replace"):
        add_user_pair("a", str(target_gguf), str(draft_gguf), why="replaced")
    assert path.read_text() == text  # refused: nothing written, its note kept
    add_user_pair("a", str(target_gguf), str(draft_gguf), draft_mode="lookup", why="replaced",
                  replace=True)
    replaced = path.read_text()
    assert replaced.startswith("# my pairs, by hand\n\n[[pair]]\nname = \"a\"  # the old one\n"
                               f"# its target:\ntarget = '{target_gguf}'\n")
    assert 'draft_mode = "lookup"\nwhy = "replaced"\n\n# b is for work\n' in replaced
    assert replaced.endswith(text[text.index("# b is for work"):])
    assert [p["name"] for p in tomllib.loads(replaced)["pair"]] == ["a", "b", "new"]

    remove_user_pair("a")
    removed = path.read_text()
    assert removed == "# my pairs, by hand\n\n" + replaced[replaced.index("# b is for work"):]
    assert set(catalogue.user_pairs()) == {"b", "new"}


@pytest.mark.parametrize("name", ["mine\n", "my pair", "a:b", "../x", "-x"])
def test_a_pair_name_that_is_not_one_is_refused_typed_or_in_the_file(
        name: str, target_gguf: Path, draft_gguf: Path) -> None:
    with pytest.raises(ConfigError, match="is not a pair name"):
        add_user_pair(name, str(target_gguf), str(draft_gguf))
    entry = 'name = """' + name + '"""' if "\n" in name else f"name = {name!r}"
    _user_file(f"[[pair]]\n{entry}\ntarget = 't:1'\ndraft = 'd:1'\n")
    with pytest.raises(ConfigError, match="line 1: .* is not a pair name"):
        catalogue.user_pairs()


@pytest.mark.parametrize(("text", "match"), [
    ('# mine\n[[pairs]]\nname = "a"\ntarget = "t"\ndraft = "d"\n', r"unknown table \[\[pairs\]\]"),
    ('# mine\npair = [{name = "a", target = "t", draft = "d"}]  # inline\n',
     r"cannot edit its pairs in place .*edit the file by hand"),
])
def test_pair_add_never_rewrites_a_file_it_cannot_edit(text: str, match: str, target_gguf: Path,
                                                       draft_gguf: Path) -> None:
    path = _user_file(text)
    with pytest.raises(ConfigError, match=match):
        add_user_pair("new", str(target_gguf), str(draft_gguf))
    with pytest.raises(ConfigError, match=match):
        remove_user_pair("a")
    assert path.read_text() == text
