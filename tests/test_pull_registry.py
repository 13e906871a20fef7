"""Direct pulls, end to end, from a real distribution registry (docker-registry) on loopback."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from localspec.cli import main
from localspec.errors import DamagedModelError, GGUFError, ModelNotFoundError, PullError
from localspec.models import ollama_store, registry_client
from localspec.models.pull import PullProgress, pull
from localspec.models.tiny import TinyModelSpec, write_tiny_model
from tests.ollama_helpers import (
    GatedProxy,
    OllamaModel,
    RegistryServer,
    assert_runs,
    build_model,
    free_port,
    push_model,
    registry_or_skip,
    write_model,
)

REPO = Path(__file__).resolve().parents[1]
# Several MB of weights: big enough that a pull is still writing it when a second one starts.
BIG_SPEC = TinyModelSpec(seed=21, n_embd=256, n_ff=512, n_layer=2, name="tiny-big")


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


@pytest.fixture(scope="module")
def big(registry: RegistryServer, tmp_path_factory: pytest.TempPathFactory) -> OllamaModel:
    gguf = write_tiny_model(tmp_path_factory.mktemp("big") / "big.gguf", BIG_SPEC)
    model = build_model(gguf, params={"note": "big"})
    assert len(model.model_layer.data) > 2 << 20
    push_model(registry.url, "library/big", "latest", model)
    return model


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "ollama-models"


def _blob(store: Path, digest: str) -> Path:
    return store / "blobs" / digest.replace(":", "-")


def _leftovers(store: Path) -> list[Path]:
    return sorted(p for p in store.rglob("*") if p.name.endswith(".partial"))


def _partial(store: Path, digest: str) -> Path:
    return registry_client.partial_path(_blob(store, digest))


def _sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def _assert_whole(store: Path, model: OllamaModel, name: str) -> None:
    """Every blob is there under its own digest, the manifest too, and nothing else in blobs/."""
    for layer in model.blobs:
        assert _sha256(_blob(store, layer.digest)) == layer.digest
    manifest = store / "manifests/registry.ollama.ai/library" / name.replace(":", "/")
    assert manifest.read_bytes() == model.manifest
    assert _leftovers(store) == []
    # Lock files are kept out of blobs/, where anything listing the store would see them.
    assert all(re.fullmatch(r"sha256-[0-9a-f]{64}", p.name) for p in (store / "blobs").iterdir())


def _wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def _localspec(*args: str) -> subprocess.Popen[str]:
    """``python -m localspec ARGS`` on this checkout, in this test's isolated environment."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "localspec", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str], label: str) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{label} did not finish within 120 s; its stderr:\n{err[-3000:]}")
    code = proc.returncode
    # A process killed by a signal is a failure whatever else it printed.
    assert code >= 0, f"{label} was killed by {signal.Signals(-code).name}:\n{err[-3000:]}"
    return code, out, err


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


def test_a_name_that_says_http_is_pulled_over_http_only_with_insecure(
        registry: RegistryServer, tiny: OllamaModel, store: Path) -> None:
    name = f"http://{registry.host}/library/tiny:1b"
    with pytest.raises(PullError, match=r"is plain http; pass --insecure"):
        pull(name)
    assert not (store / "manifests").exists()
    resolved = pull(name, insecure=True)
    assert resolved.gguf_path.read_bytes() == tiny.model_layer.data


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
    partial = _partial(store, model_digest)
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
    partial = _partial(store, tiny.model_layer.digest)
    partial.parent.mkdir(parents=True)
    partial.write_bytes(data[: len(data) // 2])
    resolved = pull("tiny", registry=registry.url, insecure=True)
    assert resolved.gguf_path.read_bytes() == data


def _prune_like_ollama(store: Path) -> None:
    """What Ollama's PruneLayers does when it starts: every file in blobs/ that is not named
    like a digest is deleted (the real daemon cannot run here)."""
    blobs = store / "blobs"
    for path in blobs.iterdir() if blobs.is_dir() else ():
        if not re.fullmatch(r"sha256-[0-9a-f]{64}", path.name):
            path.unlink()


def test_ollama_starting_mid_download_does_not_break_the_pull(
        registry: RegistryServer, tiny: OllamaModel, store: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_client, "CHUNK_SIZE", 32 * 1024)
    digest = tiny.model_layer.digest
    pruned: list[int] = []

    def prune_once(event: PullProgress) -> None:
        if event.digest == digest and event.completed >= 64 * 1024 and not pruned:
            pruned.append(event.completed)
            _prune_like_ollama(store)

    resolved = pull("tiny", registry=registry.url, insecure=True, progress=prune_once)
    assert pruned
    assert resolved.gguf_path.read_bytes() == tiny.model_layer.data
    assert _leftovers(store) == []


def test_a_download_deleted_before_its_rename_is_one_line(
        registry: RegistryServer, tiny: OllamaModel, store: Path) -> None:
    digest = tiny.model_layer.digest

    def delete_when_verifying(event: PullProgress) -> None:
        if event.digest == digest and event.status == "verifying":
            _partial(store, digest).unlink()

    with pytest.raises(PullError, match="was deleted before it reached the store; run the "
                                        "pull again"):
        pull("tiny", registry=registry.url, insecure=True, progress=delete_when_verifying)
    assert not _blob(store, digest).exists()
    # The next pull starts over and completes.
    assert pull("tiny", registry=registry.url, insecure=True).gguf_path.read_bytes() == \
        tiny.model_layer.data


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
    assert not _partial(store, model.model_layer.digest).exists()
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


def test_two_processes_pull_one_model_at_once(registry: RegistryServer, big: OllamaModel,
                                              store: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The adversarial report: two ``localspec pull`` processes into one store at once."""
    with GatedProxy(registry.url) as proxy:
        args = ("pull", "big", "--registry", proxy.url, "--insecure")
        first = _localspec(*args)
        # The proxy holds the first pull half way through the model blob until a second client
        # asks for the manifest: the second starts while the first is mid-download.
        partial = _partial(store, big.model_layer.digest)
        _wait_for(lambda: partial.exists() or first.poll() is not None)
        second = _localspec(*args)
        results = [_finish(first, "the first pull"), _finish(second, "the second pull")]
    for code, out, err in results:
        assert code == 0, err
        assert "failed verification" not in err
        assert out.startswith("big:latest\t")
    assert f"waiting for another pull of {big.model_layer.digest[:19]}" in results[1][2]
    # Each blob crossed the wire once: the second pull found the first one's work.
    assert len(proxy.blob_requests) == len(big.blobs)
    _assert_whole(store, big, "big:latest")
    capsys.readouterr()
    assert main(["list", "--json"]) == 0
    models = {m["name"]: m for m in json.loads(capsys.readouterr().out)["models"]}
    assert models["big:latest"]["damaged"] is False
    assert models["big:latest"]["problem"] is None
    assert models["big:latest"]["size"] == len(big.model_layer.data)


def test_two_threads_pull_one_model_at_once(registry: RegistryServer, big: OllamaModel,
                                            store: Path) -> None:
    """Two chat-app workers (threads of one process) pulling the same model."""
    events: tuple[list[PullProgress], list[PullProgress]] = ([], [])
    results: dict[int, ollama_store.ResolvedModel] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = pull("big", registry=proxy.url, insecure=True,
                              progress=events[i].append, cancel=threading.Event())
        except BaseException as exc:  # reported by the assertions below
            errors.append(exc)

    with GatedProxy(registry.url) as proxy:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        threads[0].start()
        partial = _partial(store, big.model_layer.digest)
        _wait_for(lambda: partial.exists() or not threads[0].is_alive())
        threads[1].start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a pull thread hung"
    assert errors == []
    assert results[0] == results[1]
    waited = [e for e in events[1] if e.status.startswith("waiting for another pull")]
    assert waited and waited[0].digest == ""  # announced as a status line first
    assert len(proxy.blob_requests) == len(big.blobs)
    _assert_whole(store, big, "big:latest")


def test_waiting_pull_honours_cancel(registry: RegistryServer, big: OllamaModel,
                                     store: Path) -> None:
    from localspec.models.blob_lock import blob_lock

    cancel = threading.Event()
    events: list[PullProgress] = []

    def progress(event: PullProgress) -> None:
        events.append(event)
        if event.status.startswith("waiting for another pull"):
            cancel.set()

    # Another writer (here, this test) holds the model blob's lock for the whole pull.
    with blob_lock(store, big.model_layer.digest):
        with pytest.raises(PullError, match="cancelled while waiting for another pull"):
            pull("big", registry=registry.url, insecure=True, progress=progress, cancel=cancel)
    assert not _blob(store, big.model_layer.digest).exists()
    assert not (store / "manifests/registry.ollama.ai/library/big").exists()


@pytest.mark.parametrize("change", ["truncate", "extend"])
def test_damaged_model_is_listed_refused_and_repaired(registry: RegistryServer,
                                                      tiny: OllamaModel, store: Path,
                                                      capsys: pytest.CaptureFixture[str],
                                                      change: str) -> None:
    assert main(["pull", "tiny", "--registry", registry.url, "--insecure"]) == 0
    blob = _blob(store, tiny.model_layer.digest)
    data = blob.read_bytes()
    damaged = data[: len(data) // 2] if change == "truncate" else data + b"\0" * 4096
    blob.write_bytes(damaged)
    problem = (f"blob {blob.name[:19]}… has {len(damaged):,} bytes, the manifest says "
               f"{len(data):,}")
    capsys.readouterr()

    assert main(["list", "--json"]) == 0
    entry = {m["name"]: m for m in json.loads(capsys.readouterr().out)["models"]}["tiny:latest"]
    assert entry["damaged"] is True and entry["problem"] == problem and entry["path"] is None
    assert main(["list"]) == 0
    assert f"DAMAGED ({problem}): run localspec pull tiny:latest" in capsys.readouterr().out

    with pytest.raises(DamagedModelError, match="localspec pull tiny:latest"):
        ollama_store.resolve("tiny")
    assert main(["run", "--target", "tiny", "hello", "-n", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and problem in err and "localspec pull tiny:latest" in err

    assert main(["pull", "tiny", "--registry", registry.url, "--insecure"]) == 0
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "damaged" in line] == [
        f"tiny:latest: damaged, {problem}; fetching it again"]
    assert _sha256(blob) == tiny.model_layer.digest
    assert ollama_store.resolve("tiny").gguf_path == blob


def test_verify_finds_same_size_corruption(registry: RegistryServer, tiny: OllamaModel,
                                           store: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pull", "tiny", "--registry", registry.url, "--insecure"]) == 0
    blob = _blob(store, tiny.model_layer.digest)
    corrupt = bytearray(blob.read_bytes())
    corrupt[len(corrupt) // 2] ^= 0xFF
    blob.write_bytes(bytes(corrupt))
    capsys.readouterr()

    # Without --verify only sizes are compared (as its help says): this goes unnoticed.
    assert main(["pull", "tiny", "--registry", registry.url, "--insecure"]) == 0
    assert "damaged" not in capsys.readouterr().err
    assert blob.read_bytes() == bytes(corrupt)

    assert main(["pull", "tiny", "--registry", registry.url, "--insecure", "--verify"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "damaged" in line]
    assert len(lines) == 1
    assert lines[0].startswith(f"tiny:latest: damaged, blob {blob.name[:19]}… does not match "
                               "its digest")
    assert _sha256(blob) == tiny.model_layer.digest
    # A whole model: --verify reads it all and finds nothing to fetch, even with no registry.
    dead = f"http://127.0.0.1:{free_port()}"
    assert main(["pull", "tiny", "--registry", dead, "--insecure", "--verify"]) == 0
    assert "damaged" not in capsys.readouterr().err


def _manifest(store: Path, name: str) -> Path:
    return store / "manifests/registry.ollama.ai/library" / name.replace(":", "/")


@pytest.mark.parametrize("verify", [False, True])
def test_unreadable_manifest_is_pulled_again(registry: RegistryServer, tiny: OllamaModel,
                                             store: Path, capsys: pytest.CaptureFixture[str],
                                             verify: bool) -> None:
    assert main(["pull", "tiny", "--registry", registry.url, "--insecure"]) == 0
    _manifest(store, "tiny:latest").write_bytes(b"")
    blob = _blob(store, tiny.model_layer.digest)
    if verify:  # its blobs can only be hashed once the manifest is back
        corrupt = bytearray(blob.read_bytes())
        corrupt[len(corrupt) // 2] ^= 0xFF
        blob.write_bytes(bytes(corrupt))
    capsys.readouterr()

    args = ["pull", "tiny", "--registry", registry.url, "--insecure"]
    assert main(args + (["--verify"] if verify else [])) == 0
    damaged = [line for line in capsys.readouterr().err.splitlines() if "damaged" in line]
    assert damaged[0] == ("tiny:latest: damaged, unreadable Ollama manifest (empty file); "
                          "fetching it again")
    if verify:
        assert damaged[1].startswith(f"tiny:latest: damaged, blob {blob.name[:19]}… does not "
                                     "match its digest")
    assert len(damaged) == 1 + verify
    _assert_whole(store, tiny, "tiny:latest")


@pytest.mark.parametrize("verify", [False, True])
def test_damaged_gguf_header_is_repaired(registry: RegistryServer, tiny: OllamaModel,
                                         store: Path, capsys: pytest.CaptureFixture[str],
                                         verify: bool) -> None:
    assert main(["pull", "tiny", "--registry", registry.url, "--insecure"]) == 0
    blob = _blob(store, tiny.model_layer.digest)
    with blob.open("r+b") as fh:
        fh.write(b"XXXX")  # the size is right: sizes alone would call it whole
    capsys.readouterr()

    args = ["pull", "tiny", "--registry", registry.url, "--insecure"]
    assert main(args + (["--verify"] if verify else [])) == 0
    damaged = [line for line in capsys.readouterr().err.splitlines() if "damaged" in line]
    assert len(damaged) == 1
    assert damaged[0].startswith(f"tiny:latest: damaged, blob {blob.name[:19]}… does not match "
                                 "its digest")
    _assert_whole(store, tiny, "tiny:latest")


def test_model_that_is_not_gguf_is_refused_without_network(store: Path) -> None:
    write_model(store, "zip", build_model(b"PK\x03\x04 a zip, not a gguf"))
    dead = f"http://127.0.0.1:{free_port()}"
    # Its bytes are what the manifest says: pulling again would fetch the same.
    with pytest.raises(GGUFError, match="its sha256 matches the manifest"):
        pull("zip", registry=dead, insecure=True)
    assert _blob(store, build_model(b"PK\x03\x04 a zip, not a gguf").model_layer.digest).is_file()


def test_verify_of_a_whole_model_needs_no_lock(store: Path, target_gguf: Path) -> None:
    write_model(store, "tiny", build_model(target_gguf))
    # Stands in for a store the user cannot write (root ignores permissions): no lock can be
    # made, and hashing needs none.
    (store / ".localspec-locks").write_bytes(b"")
    dead = f"http://127.0.0.1:{free_port()}"
    resolved = pull("tiny", registry=dead, insecure=True, verify=True)
    assert resolved.gguf_path.read_bytes() == target_gguf.read_bytes()


# -- registries that misbehave, faked in process ------------------------------------------------

FAKE_REGISTRY = "https://registry.test"


def _fake_registry(model: OllamaModel, blob: Callable[[bytes, str | None], tuple[int, bytes]],
                   ranges: list[str]) -> httpx.MockTransport:
    """A registry serving ``model``; ``blob(data, range)`` answers each blob request."""
    blobs = {layer.digest: layer.data for layer in model.blobs}

    def handle(request: httpx.Request) -> httpx.Response:
        if "/manifests/" in request.url.path:
            return httpx.Response(200, content=model.manifest)
        data = blobs[request.url.path.rsplit("/", 1)[1]]
        if data != model.model_layer.data:
            return httpx.Response(200, content=data)
        ranges.append(request.headers.get("range", "all"))
        status, body = blob(data, request.headers.get("range"))
        # Streamed: no Content-Length, so a short body ends like a whole one.
        return httpx.Response(status, content=iter([body]))

    return httpx.MockTransport(handle)


def _range_start(header: str | None) -> int:
    return int(header.removeprefix("bytes=").split("-")[0]) if header else 0


@pytest.mark.parametrize(("error", "advice"), [
    (errno.ENOSPC, "free some space and pull again to resume"),
    (errno.EROFS, "make the store writable (or set OLLAMA_MODELS to one that is) and pull again"),
    (errno.EACCES, "make the store writable (or set OLLAMA_MODELS to one that is) and pull again"),
])
def test_a_failed_write_advises_what_fits_it(store: Path, target_gguf: Path, error: int,
                                             advice: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_model(target_gguf)
    real_open = Path.open

    def failing_open(path: Path, mode: str = "r", *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        # A fake: a full disk or a read-only store cannot be made here (root writes anywhere).
        if path.name.endswith(".partial") and "b" in mode and ("w" in mode or "a" in mode):
            raise OSError(error, os.strerror(error))
        return real_open(path, mode, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "open", failing_open)
    with pytest.raises(PullError) as info:
        registry_client.pull_direct(ollama_store.parse_name("tiny"), store,
                                    base_url=FAKE_REGISTRY,
                                    transport=_fake_registry(model, lambda d, h: (200, d), []))
    message = str(info.value)
    assert message.startswith("cannot write ") and advice in message
    assert os.strerror(error) in message


def test_short_download_is_kept_and_resumed(store: Path, target_gguf: Path) -> None:
    model = build_model(target_gguf)
    name = ollama_store.parse_name("tiny")
    size = len(model.model_layer.data)
    ranges: list[str] = []

    def half_of_it(data: bytes, header: str | None) -> tuple[int, bytes]:
        rest = data[_range_start(header):]
        return (206 if header else 200), rest[: len(rest) // 2]

    with pytest.raises(PullError) as info:
        registry_client.pull_direct(name, store, base_url=FAKE_REGISTRY,
                                    transport=_fake_registry(model, half_of_it, ranges))
    half = size // 2
    kept = half + (size - half) // 2  # retried once at once, from where the first stopped
    assert ranges == ["all", f"bytes={half}-"]
    assert str(info.value) == (f"download of {model.model_layer.digest[:19]} interrupted at "
                               f"{kept:,} of {size:,} bytes; run the pull again to resume")
    partial = _partial(store, model.model_layer.digest)
    assert partial.read_bytes() == model.model_layer.data[:kept]
    assert not _blob(store, model.model_layer.digest).exists()
    assert not _manifest(store, "tiny:latest").exists()

    def all_of_it(data: bytes, header: str | None) -> tuple[int, bytes]:
        return (206 if header else 200), data[_range_start(header):]

    ranges.clear()
    registry_client.pull_direct(name, store, base_url=FAKE_REGISTRY,
                                transport=_fake_registry(model, all_of_it, ranges))
    assert ranges == [f"bytes={kept}-"]
    _assert_whole(store, model, "tiny:latest")


@pytest.mark.parametrize("body", [b"<html><body>Sign in to the Wi-Fi</body></html>", b"[]",
                                  b"\xff\xfe"])
def test_token_endpoint_without_a_json_object(store: Path, body: bytes) -> None:
    realm = "https://auth.test/token"

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "auth.test":
            return httpx.Response(200, content=body)
        return httpx.Response(401, headers={
            "WWW-Authenticate": f'Bearer realm="{realm}",service="registry.test"'})

    with pytest.raises(PullError) as info:
        registry_client.pull_direct(ollama_store.parse_name("tiny"), store,
                                    base_url=FAKE_REGISTRY, transport=httpx.MockTransport(handle))
    assert str(info.value) == f"{realm} returned no token (not a JSON object)"
