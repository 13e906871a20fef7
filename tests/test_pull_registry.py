"""Direct pulls, end to end, from a real distribution registry (docker-registry) on loopback."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from localspec.errors import ModelNotFoundError, PullError
from localspec.models import ollama_store, registry_client
from localspec.models.pull import PullProgress, pull
from tests.ollama_helpers import (
    OllamaModel,
    RegistryServer,
    assert_runs,
    build_model,
    free_port,
    push_model,
    registry_or_skip,
)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    server = registry_or_skip(tmp_path_factory.mktemp("registry"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny(registry: RegistryServer, target_gguf: Path) -> OllamaModel:
    model = build_model(target_gguf)
    push_model(registry.url, "library/tiny", "latest", model)
    push_model(registry.url, "library/tiny", "1b", model)
    return model


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "ollama-models"


def _blob(store: Path, digest: str) -> Path:
    return store / "blobs" / digest.replace(":", "-")


def _leftovers(store: Path) -> list[Path]:
    return sorted(p for p in store.rglob("*") if p.name.endswith(".partial"))


def test_fresh_pull_through_mirror(registry: RegistryServer, tiny: OllamaModel,
                                   store: Path) -> None:
    events: list[PullProgress] = []
    resolved = pull("tiny", registry=registry.url, insecure=True, progress=events.append)
    assert resolved.name == "tiny:latest"
    # Stored where Ollama would put it: under the name's own host, not the mirror's.
    manifest = store / "manifests/registry.ollama.ai/library/tiny/latest"
    assert resolved.manifest_path == manifest
    assert manifest.read_bytes() == tiny.manifest
    for layer in tiny.blobs:
        assert _blob(store, layer.digest).read_bytes() == layer.data
    assert resolved.gguf_path == _blob(store, tiny.model_layer.digest)
    assert _leftovers(store) == []
    done = {e.digest for e in events if e.status == "done"}
    assert done == {layer.digest for layer in tiny.blobs}
    assert events[-1].status == "success"


def test_pull_by_host_name(registry: RegistryServer, tiny: OllamaModel, store: Path) -> None:
    name = f"{registry.host}/library/tiny:1b"
    resolved = pull(name, registry=None, insecure=True, progress=None, cancel=None)
    assert resolved.manifest_path == (
        store / "manifests" / registry.host / "library/tiny/1b")
    assert [m.name for m in ollama_store.list_local()] == [name]


def test_plain_http_needs_insecure(registry: RegistryServer, tiny: OllamaModel) -> None:
    with pytest.raises(PullError, match="--insecure"):
        pull("tiny", registry=registry.url, insecure=False)


def test_missing_tag(registry: RegistryServer, tiny: OllamaModel, store: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no such model or tag"):
        pull("tiny:70b", registry=registry.url, insecure=True)
    assert not (store / "manifests").exists()


def test_resume_after_interrupted_blob(registry: RegistryServer, tiny: OllamaModel, store: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_client, "CHUNK_SIZE", 32 * 1024)
    model_digest = tiny.model_layer.digest
    cancel = threading.Event()

    def interrupt(event: PullProgress) -> None:
        if event.digest == model_digest and event.completed >= 64 * 1024:
            cancel.set()

    with pytest.raises(PullError, match="cancelled"):
        pull("tiny", registry=registry.url, insecure=True, progress=interrupt, cancel=cancel)
    partial = _blob(store, model_digest).with_name(_blob(store, model_digest).name + ".partial")
    assert partial.is_file() and 0 < partial.stat().st_size < len(tiny.model_layer.data)
    # Nothing looks complete: no final blob, no manifest, and the store does not resolve it.
    assert not _blob(store, model_digest).exists()
    assert not (store / "manifests/registry.ollama.ai/library/tiny/latest").exists()
    with pytest.raises(ModelNotFoundError):
        ollama_store.resolve("tiny")

    kept = partial.stat().st_size
    events: list[PullProgress] = []
    resolved = pull("tiny", registry=registry.url, insecure=True, progress=events.append)
    first = next(e for e in events if e.digest == model_digest)
    assert first.completed == kept  # resumed with a range request, not restarted
    assert resolved.gguf_path.read_bytes() == tiny.model_layer.data
    assert _leftovers(store) == []


def test_resume_from_a_killed_process(registry: RegistryServer, tiny: OllamaModel,
                                      store: Path) -> None:
    # What a killed pull leaves behind: half a blob under its temporary name.
    data = tiny.model_layer.data
    partial = _blob(store, tiny.model_layer.digest).with_name(
        _blob(store, tiny.model_layer.digest).name + ".partial")
    partial.parent.mkdir(parents=True)
    partial.write_bytes(data[: len(data) // 2])
    resolved = pull("tiny", registry=registry.url, insecure=True)
    assert resolved.gguf_path.read_bytes() == data


def test_corrupted_blob_is_rejected_and_not_kept(registry: RegistryServer, store: Path,
                                                 random_draft_gguf: Path) -> None:
    model = build_model(random_draft_gguf, params={"note": "corrupt"})
    push_model(registry.url, "library/damaged", "latest", model)
    data_file = registry.blob_data_path(model.model_layer.digest)
    damaged = bytearray(data_file.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # same size, one flipped byte: only the sha256 tells
    data_file.write_bytes(bytes(damaged))

    with pytest.raises(PullError, match="failed verification"):
        pull("damaged", registry=registry.url, insecure=True)
    final = _blob(store, model.model_layer.digest)
    assert not final.exists()
    assert not final.with_name(final.name + ".partial").exists()
    assert not (store / "manifests/registry.ollama.ai/library/damaged").exists()


def test_present_model_needs_no_network(registry: RegistryServer, tiny: OllamaModel) -> None:
    pull("tiny", registry=registry.url, insecure=True)
    dead = f"http://127.0.0.1:{free_port()}"
    resolved = pull("tiny", registry=dead, insecure=True)
    assert resolved.name == "tiny:latest"


def test_pulled_model_runs(registry: RegistryServer, tiny: OllamaModel) -> None:
    from localspec.models.names import resolve_model

    pull("tiny", registry=registry.url, insecure=True)
    assert_runs(resolve_model("tiny"))
