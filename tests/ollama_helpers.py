"""Write models into an Ollama-format store exactly as Ollama lays them out (for tests)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from localspec.models.ollama_store import (
    CONFIG_MEDIA_TYPE,
    MANIFEST_MEDIA_TYPE,
    MODEL_MEDIA_TYPE,
    PARAMS_MEDIA_TYPE,
    TEMPLATE_MEDIA_TYPE,
    parse_name,
)

TEMPLATE = "{{ if .System }}<|system|>{{ .System }}\n{{ end }}<|user|>{{ .Prompt }}\n<|assistant|>"
PARAMS = {"stop": ["<|user|>"], "temperature": 0.7}


@dataclass(frozen=True, slots=True)
class Layer:
    media_type: str
    data: bytes

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.data).hexdigest()

    def descriptor(self) -> dict[str, object]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": len(self.data)}


@dataclass(frozen=True, slots=True)
class OllamaModel:
    """The blobs and manifest of one Ollama model, ready to write to a store or push."""

    config: Layer
    layers: tuple[Layer, ...]

    @property
    def manifest(self) -> bytes:
        return json.dumps({
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": self.config.descriptor(),
            "layers": [layer.descriptor() for layer in self.layers],
        }, indent=2).encode()

    @property
    def model_layer(self) -> Layer:
        return next(la for la in self.layers if la.media_type == MODEL_MEDIA_TYPE)

    @property
    def blobs(self) -> tuple[Layer, ...]:
        return (self.config, *self.layers)


def build_model(gguf: bytes | Path | None = None, *, template: str | None = TEMPLATE,
                params: dict[str, object] | None = None,
                extra_layers: tuple[Layer, ...] = (), with_model: bool = True,
                config: dict[str, object] | None = None) -> OllamaModel:
    """An Ollama model from GGUF bytes (or a file), with optional template and params layers."""
    layers: list[Layer] = []
    if with_model:
        data = gguf.read_bytes() if isinstance(gguf, Path) else (gguf or b"")
        layers.append(Layer(MODEL_MEDIA_TYPE, data))
    if template is not None:
        layers.append(Layer(TEMPLATE_MEDIA_TYPE, template.encode()))
    layers.append(Layer(PARAMS_MEDIA_TYPE, json.dumps(params or PARAMS).encode()))
    layers += extra_layers
    cfg = config or {"model_format": "gguf", "model_family": "llama", "file_type": "F32",
                     "architecture": "amd64", "os": "linux", "rootfs": {"type": "layers"}}
    return OllamaModel(Layer(CONFIG_MEDIA_TYPE, json.dumps(cfg).encode()), tuple(layers))


def write_model(store: Path, name: str, model: OllamaModel) -> Path:
    """Write ``model``'s blobs and manifest into ``store`` under ``name``; return the manifest."""
    blobs = store / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    for layer in model.blobs:
        (blobs / layer.digest.replace(":", "-")).write_bytes(layer.data)
    manifest = store / "manifests" / parse_name(name).manifest_relpath
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_bytes(model.manifest)
    return manifest


def install_gguf(store: Path, name: str, gguf: Path, **kwargs: object) -> OllamaModel:
    """Put a GGUF file into ``store`` as the Ollama model ``name``."""
    model = build_model(gguf, **kwargs)  # type: ignore[arg-type]
    write_model(store, name, model)
    return model


# -- a real distribution registry on loopback ---------------------------------------------------

REGISTRY_BINARY = "/usr/bin/docker-registry"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(slots=True)
class RegistryServer:
    """A running ``docker-registry`` (distribution 2.8) with a filesystem store in ``root``."""

    url: str
    root: Path
    process: object

    @property
    def host(self) -> str:
        return self.url.removeprefix("http://")

    def blob_data_path(self, digest: str) -> Path:
        """Where distribution's filesystem driver keeps a blob (to damage it on purpose)."""
        hexdigest = digest.removeprefix("sha256:")
        return self.root / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest / "data"

    def stop(self) -> None:
        import subprocess

        proc = self.process
        assert isinstance(proc, subprocess.Popen)
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_registry(root: Path, binary: str = REGISTRY_BINARY) -> RegistryServer:
    """Start distribution on a free loopback port and wait until ``/v2/`` answers."""
    import subprocess
    import time

    import httpx

    port = free_port()
    config = root / "config.yml"
    root.mkdir(parents=True, exist_ok=True)
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: error\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {root}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    log = (root / "registry.log").open("wb")
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"docker-registry exited: {(root / 'registry.log').read_text()}")
        try:
            if httpx.get(f"{url}/v2/", timeout=0.5).status_code == 200:
                return RegistryServer(url, root, proc)
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("docker-registry did not start within 15 s")


def push_model(registry_url: str, repository: str, tag: str, model: OllamaModel) -> None:
    """Push blobs then the manifest through the distribution v2 API (monolithic uploads)."""
    import httpx

    with httpx.Client(base_url=registry_url, timeout=30) as http:
        for layer in model.blobs:
            if http.head(f"/v2/{repository}/blobs/{layer.digest}").status_code == 200:
                continue
            start = http.post(f"/v2/{repository}/blobs/uploads/")
            assert start.status_code == 202, start.text
            location = start.headers["location"]
            # Append the digest to the upload URL's own query (its _state must be kept).
            sep = "&" if "?" in location else "?"
            done = http.put(f"{location}{sep}digest={layer.digest}", content=layer.data,
                            headers={"Content-Type": "application/octet-stream"})
            assert done.status_code == 201, done.text
        reply = http.put(f"/v2/{repository}/manifests/{tag}", content=model.manifest,
                         headers={"Content-Type": MANIFEST_MEDIA_TYPE})
        assert reply.status_code == 201, reply.text


def registry_or_skip(root: Path) -> RegistryServer:
    """Start Debian's docker-registry in ``root``, or skip the test when it is not installed."""
    import shutil

    import pytest

    if shutil.which(REGISTRY_BINARY) is None:
        pytest.skip(f"{REGISTRY_BINARY} is missing: apt-get install docker-registry "
                    "(.ci/run installs it)")
    return start_registry(root)


def assert_runs(model_path: Path, n_tokens: int = 8) -> None:
    """The model loads in the real engine and generates ``n_tokens`` tokens."""
    from localspec.engine import DraftSettings, GenerationRequest, ModelSettings, SpeculativeEngine

    eng = SpeculativeEngine.load(model_path, None, ModelSettings(n_ctx=256))
    try:
        out = eng.generate(GenerationRequest(prompt_tokens=eng.tokenize("hello", chat=False),
                                             max_tokens=n_tokens,
                                             draft=DraftSettings(mode="none")))
    finally:
        eng.close()
    assert len(out.tokens) == n_tokens


class GatedProxy:
    """A loopback HTTP proxy in front of a registry that makes two pulls overlap for certain.

    Blob bodies are sent in small chunks with a pause between them, and the first blob response
    larger than ``hold_bytes`` stops half way until a second client has asked for a manifest
    (at most ``hold_timeout`` seconds): the first pull is then mid-download, holding half of that
    blob, when the second one reaches it.
    """

    def __init__(self, upstream: str, *, chunk: int = 64 * 1024, delay: float = 0.03,
                 hold_bytes: int = 1 << 20, hold_timeout: float = 30.0) -> None:
        import threading
        from http.server import ThreadingHTTPServer

        self.upstream = upstream
        self.chunk, self.delay = chunk, delay
        self.hold_bytes, self.hold_timeout = hold_bytes, hold_timeout
        self.manifest_requests = 0
        self.blob_requests: list[str] = []
        self.second_client = threading.Event()
        self._held = False
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> GatedProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.second_client.set()  # release a held response so its thread can end
        self.server.shutdown()
        self.server.server_close()

    def _should_hold(self, size: int) -> bool:
        with self._lock:
            if self._held or size <= self.hold_bytes:
                return False
            self._held = True
            return True

    def _handler(self) -> type:
        import time
        from http.server import BaseHTTPRequestHandler

        import httpx

        proxy = self
        passed = ("content-type", "content-length", "content-range", "docker-content-digest",
                  "accept-ranges")

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                is_blob = "/blobs/" in self.path
                with proxy._lock:
                    if "/manifests/" in self.path:
                        proxy.manifest_requests += 1
                        if proxy.manifest_requests >= 2:
                            proxy.second_client.set()
                    if is_blob:
                        proxy.blob_requests.append(self.headers.get("Range", "all"))
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() in ("range", "accept")}
                with httpx.Client(timeout=30) as http, \
                        http.stream("GET", proxy.upstream + self.path, headers=headers) as up:
                    self.send_response(up.status_code)
                    for key, value in up.headers.items():
                        if key.lower() in passed:
                            self.send_header(key, value)
                    self.end_headers()
                    size = int(up.headers.get("content-length", 0))
                    hold = is_blob and proxy._should_hold(size)
                    sent = 0
                    try:
                        for chunk in up.iter_bytes(proxy.chunk):
                            if hold and sent >= size // 2:
                                proxy.second_client.wait(proxy.hold_timeout)
                                hold = False
                            self.wfile.write(chunk)
                            sent += len(chunk)
                            if is_blob:
                                time.sleep(proxy.delay)
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the client gave up (a cancelled pull): not this proxy's problem

        return Handler
