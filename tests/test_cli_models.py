"""The model subcommands end to end: list, suggest, pair, pull (against a real registry)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from localspec.cli import main
from localspec.errors import ConfigError, ModelNotFoundError
from localspec.files import temporary_name
from localspec.models.catalogue import user_pairs_path
from tests.ollama_helpers import (
    RegistryServer,
    build_model,
    install_gguf,
    push_model,
    registry_or_skip,
)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "ollama-models"


@pytest.fixture
def tiny_pair(store: Path, target_gguf: Path, draft_gguf: Path, other_vocab_gguf: Path) -> None:
    install_gguf(store, "tiny:big", target_gguf)
    install_gguf(store, "tiny:small", draft_gguf)
    install_gguf(store, "other:1b", other_vocab_gguf)


def _user_file(text: str) -> Path:
    path = user_pairs_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_list_json(tiny_pair: None, capsys: pytest.CaptureFixture[str]) -> None:
    _user_file('[[pair]]\nname = "tiny"\ntarget = "tiny:big"\ndraft = "tiny:small"\n'
               '[[pair]]\nname = "mismatch"\ntarget = "tiny:big"\ndraft = "other:1b"\n')
    assert main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    pairs = {p["name"]: p for p in data["pairs"]}
    assert pairs["tiny"]["compatible"] is True and pairs["tiny"]["source"] == "user"
    assert pairs["mismatch"]["compatible"] is False and pairs["mismatch"]["problems"]
    assert pairs["qwen2.5-coder-32b"]["target_present"] is False
    assert pairs["qwen2.5-coder-32b"]["compatible"] is None
    models = {m["name"]: m for m in data["models"]}
    assert set(models) == {"tiny:big", "tiny:small", "other:1b"}
    assert models["tiny:big"]["quantization"] == "F32"
    assert models["tiny:big"]["size"] > models["tiny:small"]["size"] > 0


def test_list_text(tiny_pair: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-32b" in out and "tiny:big" in out and "F32" in out


def test_list_reports_malformed_user_file(capsys: pytest.CaptureFixture[str]) -> None:
    path = _user_file('[[pair]]\nname = "x"\ntarget = oops\n')
    assert main(["list"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(path) in err and "line 3" in err


def test_a_broken_pair_file_hides_only_the_users_pairs(
        tiny_pair: None, capsys: pytest.CaptureFixture[str]) -> None:
    from localspec.cli.pull import models_to_pull
    from localspec.models.catalogue import find_pair

    path = _user_file('[[pair]]\nname = "x"\ntarget = oops\n')
    assert main(["list"]) == 1
    out, err = capsys.readouterr()
    assert "tiny:big" in out and "qwen2.5-coder-32b" in out  # models and shipped pairs
    assert err.count("\n") == 1 and str(path) in err and "line 3" in err
    assert main(["list", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert "line 3" in data["pairs_error"] and data["models"]
    # A model name that no pair can have is resolved without the pair file.
    assert models_to_pull("tiny:big") == (["tiny:big"], False)
    assert models_to_pull("library/tiny") == (["library/tiny"], False)
    with pytest.raises(ModelNotFoundError):
        find_pair("tiny:big")
    with pytest.raises(ConfigError, match="line 3"):
        find_pair("tiny")  # could be a pair of that file: its error is said


def test_suggest(tiny_pair: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["suggest", "tiny:big"]) == 0
    out = capsys.readouterr().out
    assert "tiny:small" in out and "other:1b" not in out
    assert main(["suggest", "tiny:big", "--json"]) == 0
    assert [s["name"] for s in json.loads(capsys.readouterr().out)] == ["tiny:small"]


def test_pair_add_and_remove(tiny_pair: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pair", "add", "mine", "--target", "tiny:big", "--draft", "tiny:small"]) == 0
    assert "saved pair mine" in capsys.readouterr().out
    assert main(["list", "--json"]) == 0
    assert any(p["name"] == "mine" for p in json.loads(capsys.readouterr().out)["pairs"])
    assert main(["pair", "remove", "mine"]) == 0
    assert main(["pair", "remove", "mine"]) == 1


def test_list_says_why_a_pair_is_not_compatible(target_gguf: Path, other_vocab_gguf: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = user_pairs_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'[[pair]]\nname = "odd"\ntarget = "{target_gguf}"\n'
                    f'draft = "{other_vocab_gguf}"\n')
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("odd "))
    assert " NO " in row
    why = next(line for line in out.splitlines() if line.startswith("odd: not compatible: "))
    assert main(["list", "--json"]) == 0
    problems = json.loads(capsys.readouterr().out)["pairs"]
    assert why.endswith("; ".join(next(p for p in problems if p["name"] == "odd")["problems"]))


def test_pair_add_refuses_incompatible(tiny_pair: None,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pair", "add", "bad", "--target", "tiny:big", "--draft", "other:1b"]) == 1
    err = capsys.readouterr().err
    assert "cannot draft" in err and err.count("\n") == 1
    assert not user_pairs_path().exists()


def test_pull_unknown_pair_or_model_offline(capsys: pytest.CaptureFixture[str]) -> None:
    dead = "http://127.0.0.1:9"
    assert main(["pull", "tiny:1b", "--registry", dead, "--insecure"]) == 1
    assert "cannot reach" in capsys.readouterr().err


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    server = registry_or_skip(tmp_path_factory.mktemp("registry-cli"))
    yield server
    server.stop()


def test_pull_pair_from_registry(registry: RegistryServer, store: Path, target_gguf: Path,
                                 draft_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    push_model(registry.url, "library/tiny", "big", build_model(target_gguf))
    push_model(registry.url, "library/tiny", "small", build_model(draft_gguf))
    _user_file('[[pair]]\nname = "tiny"\ntarget = "tiny:big"\ndraft = "tiny:small"\n')
    assert main(["pull", "tiny", "--registry", registry.url, "--insecure"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in out] == ["tiny:big", "tiny:small"]
    assert all(Path(line.split("\t")[1]).is_file() for line in out)
    # Present now: a second pull needs no registry at all.
    assert main(["pull", "tiny", "--registry", "http://127.0.0.1:9", "--insecure"]) == 0
    assert main(["pull", "tiny:big"]) == 0


def test_run_a_single_ollama_model_by_name(store: Path, target_gguf: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A model name that is not a pair runs alone, drafting with prompt lookup."""
    install_gguf(store, "tiny", target_gguf)
    assert main(["run", "tiny", "hello", "-n", "6", "--ctx", "256", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["completion_tokens"] == 6
    assert main(["run", "no-such-thing", "hello"]) == 1
    assert "no pair named 'no-such-thing'" in capsys.readouterr().err


def test_pair_add_saves_paths_absolute_so_the_pair_runs_from_anywhere(
        tmp_path: Path, target_gguf: Path, draft_gguf: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    here, elsewhere = tmp_path / "models-here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    shutil.copy(target_gguf, here / "t.gguf")
    shutil.copy(draft_gguf, here / "d.gguf")
    monkeypatch.chdir(here)
    assert main(["pair", "add", "rel", "--target", "t.gguf", "--draft", "./d.gguf"]) == 0
    saved = tomllib.loads(user_pairs_path().read_text())["pair"][0]
    assert (saved["target"], saved["draft"]) == (str(here / "t.gguf"), str(here / "d.gguf"))
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["run", "rel", "hello", "-n", "3", "--ctx", "128", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["completion_tokens"] == 3


@contextlib.contextmanager
def _unwritable(folder: Path, how: str) -> Iterator[None]:
    """Make writes into ``folder`` fail for real. Read-only: chmod, or, as root (whom chmod
    does not stop), the immutable attribute. Full: the temporary file the write goes through
    is /dev/full, which fails every write with ENOSPC (a stand-in for a full disk)."""
    if how == "full":
        tmp = temporary_name(user_pairs_path())  # this process's and thread's temporary name
        tmp.symlink_to("/dev/full")
        try:
            yield
        finally:
            tmp.unlink(missing_ok=True)
        return
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("running as root on a file system without chattr +i: nothing read-only")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


@pytest.mark.parametrize("how", ["read-only", "full"])
def test_pair_add_and_remove_on_an_unwritable_folder_are_one_line(
        how: str, tiny_pair: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pair", "add", "kept", "--target", "tiny:big", "--draft", "tiny:small"]) == 0
    path = user_pairs_path()
    before = path.read_text()
    capsys.readouterr()
    errors = []
    for command in (["add", "mine", "--target", "tiny:big", "--draft", "tiny:small"],
                    ["remove", "kept"]):
        with _unwritable(path.parent, how):  # each: a failed write removes its temporary file
            assert main(["pair", *command]) == 1
        errors.append(capsys.readouterr().err)
    reason = "No space left on device" if how == "full" else (
        "Permission denied" if os.geteuid() != 0 else "Operation not permitted")
    for err in errors:
        assert err == f"localspec: error: cannot save your pairs to {path}: {reason}\n"
    assert path.read_text() == before  # nothing half-written, nothing lost
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_pull_of_local_files_says_there_is_nothing_to_pull(
        tmp_path: Path, target_gguf: Path, draft_gguf: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A pair of two .gguf paths pulled nothing and said nothing (exit 0, no output); a .gguf
    path was called "not a model name … nor an existing .gguf file" though it existed."""
    assert main(["pair", "add", "mine", "--target", str(target_gguf),
                 "--draft", str(draft_gguf)]) == 0
    capsys.readouterr()
    assert main(["pull", "mine"]) == 0
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == "mine: both models are local files; nothing to pull\n"
    assert main(["pull", str(target_gguf)]) == 0
    assert capsys.readouterr().err == f"{target_gguf}: a local file; nothing to pull\n"
    missing = tmp_path / "missing.gguf"
    assert main(["pull", str(missing)]) == 1
    assert capsys.readouterr().err == f"localspec: error: {missing}: no such file\n"


def test_list_shows_a_problem_from_a_file_escaped(tmp_path: Path, target_gguf: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The reason under the table quotes the files (a tokenizer's name): it is escaped, as
    every error line is, so a file cannot add a line or drive the terminal."""
    from localspec.models.tiny import TinyModelSpec, write_tiny_model

    odd = write_tiny_model(tmp_path / "odd.gguf", TinyModelSpec(
        metadata=(("tokenizer.ggml.model", "odd\n\x1b[2J"),)))
    path = user_pairs_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'[[pair]]\nname = "odd"\ntarget = "{target_gguf}"\ndraft = "{odd}"\n')
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    why = next(line for line in out.splitlines() if line.startswith("odd: not compatible: "))
    assert "odd\\n\\x1b[2J" in why and "\x1b" not in out
