"""Store resolution against store trees built the way Ollama writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localspec.errors import DamagedModelError, GGUFError, ModelNotFoundError
from localspec.models import ollama_store
from localspec.models.names import display_name, resolve_model
from localspec.models.ollama_store import PROJECTOR_MEDIA_TYPE, ModelName, parse_name
from tests.ollama_helpers import (
    PARAMS,
    TEMPLATE,
    Layer,
    assert_runs,
    build_model,
    install_gguf,
    write_model,
)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "ollama-models"  # what isolated_home points OLLAMA_MODELS at


@pytest.mark.parametrize(("text", "expected"), [
    ("qwen2.5-coder:1.5b", ModelName(model="qwen2.5-coder", tag="1.5b")),
    ("llama3.1", ModelName(model="llama3.1", tag="latest")),
    ("user/model:tag", ModelName(namespace="user", model="model", tag="tag")),
    ("hf.co/bartowski/Qwen2.5-GGUF:Q4_K_M",
     ModelName("hf.co", "bartowski", "Qwen2.5-GGUF", "Q4_K_M")),
    ("127.0.0.1:5000/library/tiny:v1", ModelName("127.0.0.1:5000", "library", "tiny", "v1")),
])
def test_parse_name(text: str, expected: ModelName) -> None:
    assert parse_name(text) == expected


@pytest.mark.parametrize("bad", ["", "a/b/c/d", "bad name", "model@sha256:abc", ":tag"])
def test_parse_name_rejects(bad: str) -> None:
    with pytest.raises(ModelNotFoundError):
        parse_name(bad)


@pytest.mark.parametrize("host", ["a" * 300, "a..b", "a.", "a" * 64 + ".com", "h:0",
                                  "h:65536"])
def test_parse_name_rejects_impossible_hosts(host: str) -> None:
    # Refused by name, before any request: otherwise httpx fails later, cryptically (idna).
    with pytest.raises(ModelNotFoundError, match="is not an Ollama model name"):
        parse_name(f"{host}/ns/m")


def test_parse_name_accepts_dns_sized_hosts() -> None:
    longest = ".".join(["a" * 63] * 3 + ["a" * 61])  # 253 characters
    for host in [longest, "a" * 63 + ".com", "h:65535", "my_registry-1:1"]:
        assert parse_name(f"{host}/ns/m").host == host


def test_short_names() -> None:
    assert parse_name("llama3.1").short == "llama3.1:latest"
    assert parse_name("user/m:t").short == "user/m:t"
    assert parse_name("h:1/ns/m:t").short == "h:1/ns/m:t"


def test_store_dirs_follow_ollama(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "x"))
    assert ollama_store.store_dirs() == [tmp_path / "x"]
    monkeypatch.delenv("OLLAMA_MODELS")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ollama_store.store_dirs()[0] == tmp_path / ".ollama" / "models"


def test_resolve_reads_manifest_blob_template_params(store: Path, target_gguf: Path) -> None:
    model = install_gguf(store, "tiny:1b", target_gguf)
    resolved = ollama_store.resolve("tiny:1b")
    assert resolved.name == "tiny:1b"
    assert resolved.gguf_path == store / "blobs" / model.model_layer.digest.replace(":", "-")
    assert resolved.gguf_path.read_bytes() == target_gguf.read_bytes()
    assert resolved.size == target_gguf.stat().st_size
    assert resolved.manifest_path == store / "manifests/registry.ollama.ai/library/tiny/1b"
    assert resolved.template == TEMPLATE
    assert resolved.params == PARAMS


def test_latest_and_namespaced_names(store: Path, target_gguf: Path) -> None:
    install_gguf(store, "tiny", target_gguf)
    install_gguf(store, "someone/tiny:q4", target_gguf)
    install_gguf(store, "example.com:8080/team/tiny:v2", target_gguf)
    assert ollama_store.resolve("tiny").name == "tiny:latest"
    assert ollama_store.resolve("tiny:latest").gguf_path.is_file()
    assert ollama_store.resolve("someone/tiny:q4").name == "someone/tiny:q4"
    assert ollama_store.resolve("example.com:8080/team/tiny:v2").gguf_path.is_file()


def test_missing_manifest_says_pull(store: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"localspec pull nothing:latest"):
        ollama_store.resolve("nothing")


def test_a_folder_or_stray_file_in_the_cwd_does_not_hide_the_model(
        store: Path, target_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_gguf(store, "tiny", target_gguf)
    work = tmp_path / "work"
    (work / "tiny").mkdir(parents=True)  # a project folder named like the model
    (work / "tiny:latest").write_text("notes")  # a stray file named like it
    (work / "mine").write_bytes(target_gguf.read_bytes())  # a model file with no .gguf
    monkeypatch.chdir(work)
    in_store = ollama_store.resolve("tiny").gguf_path
    assert resolve_model("tiny") == in_store
    assert resolve_model("tiny:latest") == in_store
    assert resolve_model("./tiny:latest") == Path("./tiny:latest")  # a path reaches the file
    assert resolve_model("mine") == Path("mine")  # no such model: the file it names


def test_missing_blob_says_pull(store: Path, target_gguf: Path) -> None:
    model = install_gguf(store, "tiny", target_gguf)
    (store / "blobs" / model.model_layer.digest.replace(":", "-")).unlink()
    with pytest.raises(DamagedModelError, match=r"blob sha256-\w{12}… is missing; run "
                                                r"`localspec pull tiny:latest`"):
        ollama_store.resolve("tiny")


@pytest.mark.parametrize("change", ["truncate", "extend", "config"])
def test_wrong_size_blob_is_damaged_not_present(store: Path, target_gguf: Path,
                                                draft_gguf: Path, change: str) -> None:
    model = install_gguf(store, "tiny", target_gguf)
    # Its own config and params blobs: nothing shared with tiny's damaged blob.
    install_gguf(store, "other", draft_gguf, params={"note": "other"},
                 config={"model_format": "gguf", "model_family": "other"})
    layer = model.config if change == "config" else model.model_layer
    blob = store / "blobs" / layer.digest.replace(":", "-")
    data = blob.read_bytes()
    blob.write_bytes(data[:-100] if change == "truncate" else data + b"\0" * 100)
    have = len(data) + (-100 if change == "truncate" else 100)
    with pytest.raises(DamagedModelError) as info:
        ollama_store.resolve("tiny")
    message = str(info.value)
    assert "\n" not in message
    assert f"blob {blob.name[:19]}… has {have:,} bytes, the manifest says {len(data):,}" in message
    assert "localspec pull tiny:latest" in message
    # Listed as damaged, with the problem; never among the models that resolve.
    entries = {e.name: e for e in ollama_store.list_store()}
    assert entries["tiny:latest"].damaged and entries["tiny:latest"].model is None
    assert entries["tiny:latest"].problem == info.value.problem
    assert not entries["other:latest"].damaged
    assert [m.name for m in ollama_store.list_local()] == ["other:latest"]


def test_temporary_names_are_per_writer(tmp_path: Path) -> None:
    import threading

    from localspec.files import temporary_name

    target = tmp_path / "manifest"
    names: list[Path] = []
    thread = threading.Thread(target=lambda: names.append(temporary_name(target)))
    thread.start()
    thread.join()
    mine = temporary_name(target)
    assert mine != names[0]
    assert mine.name.startswith(".manifest.") and mine.name.endswith(".partial")


def test_blob_that_is_not_gguf(store: Path) -> None:
    write_model(store, "junk", build_model(b"PK\x03\x04 not a gguf at all"))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        ollama_store.resolve("junk")


def test_projector_only_model(store: Path) -> None:
    model = build_model(with_model=False, extra_layers=(Layer(PROJECTOR_MEDIA_TYPE, b"GGUF..."),))
    write_model(store, "proj", model)
    with pytest.raises(GGUFError, match="projector"):
        ollama_store.resolve("proj")


def test_cloud_model(store: Path) -> None:
    config = {"remote_host": "https://ollama.com:443", "remote_model": "gpt-oss:120b"}
    write_model(store, "gpt-oss:120b-cloud", build_model(with_model=False, config=config))
    with pytest.raises(GGUFError, match="cloud model"):
        ollama_store.resolve("gpt-oss:120b-cloud")


def test_malformed_manifest(store: Path) -> None:
    path = store / "manifests/registry.ollama.ai/library/broken/latest"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(GGUFError, match="unreadable Ollama manifest"):
        ollama_store.resolve("broken")


def test_unreadable_manifest_and_non_gguf_blob_are_listed_damaged(store: Path, target_gguf: Path,
                                                                   draft_gguf: Path) -> None:
    install_gguf(store, "whole", draft_gguf)
    install_gguf(store, "empty", target_gguf)
    (store / "manifests/registry.ollama.ai/library/empty/latest").write_bytes(b"")
    model = install_gguf(store, "header", target_gguf, params={"note": "header"})
    blob = store / "blobs" / model.model_layer.digest.replace(":", "-")
    with blob.open("r+b") as fh:
        fh.write(b"XXXX")  # same size: only the magic (or the sha256) tells

    entries = {e.name: e for e in ollama_store.list_store()}
    assert not entries["whole:latest"].damaged
    assert entries["empty:latest"].damaged
    assert entries["empty:latest"].problem == "unreadable Ollama manifest (empty file)"
    assert entries["header:latest"].damaged
    assert entries["header:latest"].problem == (
        f"model blob {blob.name[:19]}… is not a GGUF file (damaged, or a format localspec "
        "cannot run)")
    for name in ("empty", "header"):
        with pytest.raises(DamagedModelError, match=f"run `localspec pull {name}:latest`"):
            ollama_store.resolve(name)


def test_list_local_skips_unrunnable(store: Path, target_gguf: Path, draft_gguf: Path) -> None:
    install_gguf(store, "tiny:big", target_gguf)
    install_gguf(store, "tiny:small", draft_gguf)
    write_model(store, "junk", build_model(b"nope"))
    (store / "manifests/registry.ollama.ai/library/tiny/.x.partial").write_text("{}")
    names = sorted(m.name for m in ollama_store.list_local())
    assert names == ["tiny:big", "tiny:small"]


def test_delete_keeps_shared_blobs(store: Path, target_gguf: Path, draft_gguf: Path) -> None:
    shared = install_gguf(store, "a", target_gguf)
    install_gguf(store, "b", target_gguf)
    own = install_gguf(store, "c", draft_gguf)
    ollama_store.delete("a")
    assert not (store / "manifests/registry.ollama.ai/library/a").exists()
    assert ollama_store.resolve("b").gguf_path.is_file()  # still referenced by b
    ollama_store.delete("c")
    assert not (store / "blobs" / own.model_layer.digest.replace(":", "-")).exists()
    assert (store / "blobs" / shared.model_layer.digest.replace(":", "-")).exists()
    with pytest.raises(ModelNotFoundError):
        ollama_store.delete("c")


def test_delete_keeps_blobs_of_a_tag_ending_in_partial(store: Path, target_gguf: Path) -> None:
    # A legal Ollama tag, not one of localspec's temporary manifests (".<tag>.<pid>-<tid>.partial").
    shared = install_gguf(store, "a:rc.partial", target_gguf)
    install_gguf(store, "b", target_gguf)
    (store / "manifests/registry.ollama.ai/library/a/.rc.1-2.partial").write_bytes(b"{")
    assert [e.name for e in ollama_store.list_store()] == ["a:rc.partial", "b:latest"]
    ollama_store.delete("b")
    for layer in shared.blobs:
        assert (store / "blobs" / layer.digest.replace(":", "-")).is_file()
    assert ollama_store.resolve("a:rc.partial").gguf_path.is_file()


def test_delete_keeps_every_blob_when_a_manifest_is_unreadable(
        store: Path, target_gguf: Path, draft_gguf: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    own = install_gguf(store, "b", draft_gguf, params={"note": "b only"})
    install_gguf(store, "c", target_gguf)
    unreadable = store / "manifests/registry.ollama.ai/library/c/latest"
    unreadable.write_text("{not json")  # it may name any blob, b's too
    with caplog.at_level("WARNING", logger="localspec.models.ollama_store"):
        ollama_store.delete("b")
    assert not (store / "manifests/registry.ollama.ai/library/b").exists()
    for layer in own.blobs:
        assert (store / "blobs" / layer.digest.replace(":", "-")).is_file()
    assert str(unreadable) in caplog.text and "kept the deleted model's blobs" in caplog.text


def test_manifest_is_real_ollama_format(store: Path, target_gguf: Path) -> None:
    install_gguf(store, "tiny", target_gguf)
    data = json.loads((store / "manifests/registry.ollama.ai/library/tiny/latest").read_text())
    assert data["schemaVersion"] == 2
    assert data["config"]["mediaType"] == "application/vnd.docker.container.image.v1+json"


def test_resolve_model_paths_and_names(store: Path, target_gguf: Path, tmp_path: Path) -> None:
    install_gguf(store, "tiny", target_gguf)
    assert resolve_model(str(target_gguf)) == target_gguf
    assert resolve_model("tiny").read_bytes()[:4] == b"GGUF"
    with pytest.raises(GGUFError, match="no such file"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotFoundError):
        resolve_model("absent:7b")
    assert display_name(str(target_gguf)) == "target.gguf"
    assert display_name("tiny") == "tiny:latest"


def test_pulled_store_model_runs(store: Path, target_gguf: Path) -> None:

    install_gguf(store, "tiny", target_gguf)
    assert_runs(resolve_model("tiny"))
