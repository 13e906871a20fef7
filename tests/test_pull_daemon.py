"""The daemon path of ``pull``, against a STAND-IN for the Ollama daemon.

The real ``ollama`` binary cannot be installed here, so ``FakeOllamaDaemon`` is a small HTTP
server that follows Ollama's documented API (docs/api.md): ``GET /api/version`` and a streaming
``POST /api/pull`` answering newline-delimited JSON (``pulling manifest``, one ``pulling <digest>``
line per layer with ``digest``/``total``/``completed``, ``verifying sha256 digest``, ``writing
manifest``, ``success``; a failure is an ``{"error": ...}`` line). Like the daemon, it writes the
model into the store. Everything else is tested against a real registry in test_pull_registry.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from localspec.errors import ModelNotFoundError, PullError
from localspec.models import pull as pull_module
from localspec.models.pull import PullProgress, daemon_url, pull
from tests.ollama_helpers import OllamaModel, build_model, write_model


class _QuietServer(ThreadingHTTPServer):
    # A client that hangs up mid-stream (the cancel test) is expected here, not a traceback.
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


class FakeOllamaDaemon:
    """A stand-in for ``ollama serve``: knows some models, 'pulls' them into ``store``."""

    def __init__(self, store: Path, models: dict[str, OllamaModel], write: bool = True) -> None:
        self.store = store
        self.models = models
        self.write = write
        self.requests: list[dict[str, Any]] = []
        self.blobs_at_request: list[set[str]] = []  # what the store held when asked to pull
        self.manifests_at_request: list[set[str]] = []
        self.server = _QuietServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        daemon = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send_json_lines(self, lines: list[dict[str, Any]]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/x-ndjson")
                self.end_headers()
                for line in lines:
                    self.wfile.write(json.dumps(line).encode() + b"\n")
                    self.wfile.flush()

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path == "/api/version":
                    self._send_json_lines([{"version": "0.0.0-standin"}])
                else:
                    self.send_error(404)

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                daemon.requests.append(body)
                daemon.blobs_at_request.append(
                    {p.name for p in (daemon.store / "blobs").glob("*")})
                daemon.manifests_at_request.append(
                    {p.name for p in daemon.store.glob("manifests/*/*/*/*")})
                model = daemon.models.get(body["model"])
                if self.path != "/api/pull":
                    self.send_error(404)
                elif model is None:
                    self._send_json_lines([{"status": "pulling manifest"},
                                           {"error": "pull model manifest: file does not exist"}])
                else:
                    self._send_json_lines(daemon.pull_lines(body["model"], model))

        return Handler

    def pull_lines(self, name: str, model: OllamaModel) -> list[dict[str, Any]]:
        lines: list[dict[str, Any]] = [{"status": "pulling manifest"}]
        for layer in model.blobs:
            size = len(layer.data)
            for done in (0, size // 2, size):
                lines.append({"status": f"pulling {layer.digest[7:19]}", "digest": layer.digest,
                              "total": size, "completed": done})
        if self.write:
            write_model(self.store, name, model)
        lines += [{"status": "verifying sha256 digest"}, {"status": "writing manifest"},
                  {"status": "success"}]
        return lines

    def __enter__(self) -> FakeOllamaDaemon:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "ollama-models"


@pytest.fixture
def daemon(store: Path, target_gguf: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeOllamaDaemon]:
    with FakeOllamaDaemon(store, {"tiny:latest": build_model(target_gguf)}) as fake:
        monkeypatch.setenv("OLLAMA_HOST", fake.host)
        yield fake


def test_daemon_url_reads_ollama_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OLLAMA_HOST")
    assert daemon_url() == "http://127.0.0.1:11434"
    monkeypatch.setenv("OLLAMA_HOST", "0.0.0.0")
    assert daemon_url() == "http://127.0.0.1:11434"
    monkeypatch.setenv("OLLAMA_HOST", "https://gpu-box:8443/")
    assert daemon_url() == "https://gpu-box:8443"
    monkeypatch.setenv("OLLAMA_HOST", "::1")
    assert daemon_url() == "http://[::1]:11434"


@pytest.mark.parametrize("host", ["127.0.0.1:abc", "127.0.0.1:0", "127.0.0.1:65536", "a..b",
                                  "bad host:1", "[::1", "ftp://gpu-box"])
def test_bad_ollama_host_is_one_line(host: str, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    from localspec.cli import main

    monkeypatch.setenv("OLLAMA_HOST", host)

    def no_pull(*args: object, **kwargs: object) -> Path:
        raise AssertionError("pulled past a bad OLLAMA_HOST")

    monkeypatch.setattr(pull_module, "pull_direct", no_pull)
    assert main(["pull", "foo:bar"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"localspec: error: OLLAMA_HOST={host}: not a host[:port]"]


def test_pull_through_daemon(daemon: FakeOllamaDaemon, store: Path) -> None:
    events: list[PullProgress] = []
    resolved = pull("tiny", progress=events.append)
    assert daemon.requests and daemon.requests[0]["model"] == "tiny:latest"
    assert daemon.requests[0]["stream"] is True
    assert resolved.gguf_path.parent == store / "blobs"
    model = daemon.models["tiny:latest"]
    layer_events = [e for e in events if e.digest == model.model_layer.digest]
    assert [e.completed for e in layer_events] == [0, len(model.model_layer.data) // 2,
                                                   len(model.model_layer.data)]
    assert layer_events[-1].total == len(model.model_layer.data)
    assert events[-1].status == "success"


def test_daemon_unknown_model(daemon: FakeOllamaDaemon) -> None:
    with pytest.raises(ModelNotFoundError, match="cannot find it"):
        pull("nope:1b")


def test_present_model_skips_the_daemon(daemon: FakeOllamaDaemon, store: Path,
                                        target_gguf: Path) -> None:
    write_model(store, "tiny", build_model(target_gguf))
    pull("tiny")
    assert daemon.requests == []


def test_damaged_model_is_pulled_again_through_the_daemon(daemon: FakeOllamaDaemon,
                                                           store: Path,
                                                           target_gguf: Path) -> None:
    model = daemon.models["tiny:latest"]
    write_model(store, "tiny", model)
    blob = store / "blobs" / model.model_layer.digest.replace(":", "-")
    blob.write_bytes(blob.read_bytes()[:1000])  # truncated: damaged, not present
    events: list[PullProgress] = []
    resolved = pull("tiny", progress=events.append)
    assert [r["model"] for r in daemon.requests] == ["tiny:latest"]
    # Ollama skips a blob file that exists whatever its size: it had to be gone when asked.
    assert blob.name not in daemon.blobs_at_request[0]
    assert any(e.status.startswith("tiny:latest: damaged, blob ") for e in events)
    assert resolved.gguf_path == blob and blob.read_bytes() == model.model_layer.data


def test_unreadable_manifest_is_pulled_again_through_the_daemon(daemon: FakeOllamaDaemon,
                                                                 store: Path) -> None:
    model = daemon.models["tiny:latest"]
    manifest = write_model(store, "tiny", model)
    manifest.write_bytes(b"")
    events: list[PullProgress] = []
    resolved = pull("tiny", progress=events.append)
    assert [r["model"] for r in daemon.requests] == ["tiny:latest"]
    # Ollama reads the old manifest before pulling and fails on one it cannot parse.
    assert daemon.manifests_at_request == [set()]
    assert any(e.status == "tiny:latest: damaged, unreadable Ollama manifest (empty file); "
               "fetching it again" for e in events)
    assert manifest.read_bytes() == model.manifest
    assert resolved.gguf_path.read_bytes() == model.model_layer.data


def test_no_daemon_means_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    # isolated_home points OLLAMA_HOST at a dead port; the direct path is taken instead.
    assert not pull_module.daemon_available()
    called: list[str] = []

    def fake_direct(name: object, store: Path, **kwargs: object) -> Path:
        called.append(str(kwargs["base_url"]))
        raise ModelNotFoundError("stop here")

    monkeypatch.setattr(pull_module, "pull_direct", fake_direct)
    with pytest.raises(ModelNotFoundError):
        pull("tiny")
    assert called == ["https://registry.ollama.ai"]


def test_cancel_during_daemon_pull(daemon: FakeOllamaDaemon) -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(PullError, match="cancelled"):
        pull("tiny", cancel=cancel)
