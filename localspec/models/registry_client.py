"""Pull a model straight from an OCI / Docker distribution v2 registry into the Ollama store.

This is the protocol Ollama itself speaks (``GET /v2/<repo>/manifests/<tag>``, then
``GET /v2/<repo>/blobs/<digest>``), and the files land where Ollama puts them, so Ollama sees the
model later. Interrupt safety, in order of the steps:

* one writer per blob, across processes and threads: the blob's lock (:mod:`.blob_lock`) is held
  while its ``.partial`` is written, resumed, verified and renamed; a pull that finds the lock
  taken waits (saying so), then looks again and skips a blob the other pull completed;
* each blob is written to ``.localspec-partials/sha256-<hex>.partial`` and fsynced, its sha256
  checked, and only then renamed into ``blobs/``; a damaged download is deleted, never kept. The
  partial stays out of ``blobs/`` because Ollama deletes every file there whose name is not a
  digest when it starts (its blob pruning), which would pull a half-written blob from under us;
* a partial that vanishes all the same (deleted by hand) is one line, and the next pull restarts;
* an interrupted ``.partial`` is resumed with an HTTP range request (its bytes are re-hashed first);
* the manifest is written last, to a temporary name, fsynced and renamed, so a model never looks
  complete before all its blobs are.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ..errors import GGUFError, ModelNotFoundError, PullError
from ..files import atomic_write, fsync_dir
from .blob_lock import blob_lock
from .ollama_store import (
    MANIFEST_MEDIA_TYPE,
    ModelName,
    blob_path,
    blob_problem,
    blob_sizes,
    manifest_digests,
    manifest_path,
    model_layer,
)

log = logging.getLogger(__name__)

CHUNK_SIZE = 1 << 20
ACCEPT = f"{MANIFEST_MEDIA_TYPE}, application/vnd.oci.image.manifest.v1+json"


@dataclass(frozen=True, slots=True)
class PullProgress:
    """One progress report: a layer's digest (empty for whole-model steps) and its byte counts."""

    digest: str
    completed: int
    total: int
    status: str


ProgressCallback = Callable[[PullProgress], None]


PARTIAL_DIR = ".localspec-partials"


def partial_path(dest: Path) -> Path:
    """Where the blob ``dest`` (``<store>/blobs/<name>``) is downloaded and resumed before it is
    verified and renamed: beside ``blobs/``, on the same file system, out of Ollama's pruning."""
    return dest.parent.parent / PARTIAL_DIR / (dest.name + ".partial")


def waiting_reporter(report: ProgressCallback, digest: str, size: int,
                     dest: Path) -> Callable[[], None]:
    """What a pull waiting for another pull's lock on ``digest`` reports on each poll: a status
    line once, then the other pull's progress (the size of its ``.partial``)."""
    status = f"waiting for another pull of {digest[:19]}"
    partial = partial_path(dest)
    announced = False

    def waiting() -> None:
        nonlocal announced
        if not announced:
            report(PullProgress("", 0, 0, status))
            announced = True
        try:
            have = partial.stat().st_size
        except OSError:
            have = 0
        report(PullProgress(digest, min(have, size), size, status))

    return waiting


def registry_url(name: ModelName, registry: str | None, insecure: bool) -> str:
    """The base URL to pull ``name`` from: ``registry`` when given, else the name's host."""
    if registry:
        url = registry if "://" in registry else f"{'http' if insecure else 'https'}://{registry}"
    else:
        url = f"{'http' if insecure else 'https'}://{name.host}"
    refuse_plain_http(url, insecure)
    return url.rstrip("/")


def refuse_plain_http(url: str, insecure: bool) -> None:
    """A registry URL (or a name written as one) that says plain http needs ``--insecure``;
    never switched to https behind the user's back."""
    if url.strip().lower().startswith("http://") and not insecure:
        raise PullError(f"{url.strip()} is plain http; pass --insecure to pull from it")


_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')


class RegistryClient:
    """A minimal distribution-v2 client: manifests, blobs, and anonymous bearer tokens."""

    def __init__(self, base_url: str, *, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url
        self._http = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0),
                                  follow_redirects=True, transport=transport)
        self._token: str | None = None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = dict(extra or {})
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    def _authenticate(self, response: httpx.Response) -> bool:
        """Answer a ``WWW-Authenticate: Bearer`` challenge with an anonymous token."""
        challenge = response.headers.get("www-authenticate", "")
        if not challenge.lower().startswith("bearer") or self._token is not None:
            return False
        fields = dict(_CHALLENGE.findall(challenge))
        realm = fields.pop("realm", None)
        if not realm:
            return False
        try:
            reply = self._http.get(realm, params=fields)
        except httpx.InvalidURL as exc:
            raise PullError(f"{self.base_url} names a token service that is not a URL "
                            f"({realm})") from exc
        if reply.status_code != 200:
            return False
        body = _json_object(reply)
        if body is None:
            # A captive portal's login page, say: the registry was never reached.
            raise PullError(f"{realm} returned no token (not a JSON object)")
        token = body.get("token") or body.get("access_token")
        self._token = token if isinstance(token, str) and token else None
        return self._token is not None

    def _send(self, method: str, url: str, headers: dict[str, str]) -> httpx.Response:
        request = self._http.build_request(method, url, headers=self._headers(headers))
        response = self._http.send(request, stream=True)
        if response.status_code == 401 and self._authenticate(response):
            response.close()
            request = self._http.build_request(method, url, headers=self._headers(headers))
            response = self._http.send(request, stream=True)
        return response

    def get_manifest(self, name: ModelName) -> bytes:
        """The manifest bytes for ``name``'s tag; ModelNotFoundError when the tag is absent."""
        url = f"{self.base_url}/v2/{name.repository}/manifests/{name.tag}"
        try:
            response = self._send("GET", url, {"Accept": ACCEPT})
            try:
                response.read()
            finally:
                response.close()
        except httpx.HTTPError as exc:
            raise PullError(f"cannot reach {self.base_url} ({exc}); check the network or "
                            "--registry") from exc
        if response.status_code == 404:
            raise ModelNotFoundError(f"{name}: no such model or tag at {self.base_url}; check "
                                     "the name on ollama.com/library")
        if response.status_code in (401, 403):
            raise PullError(f"{name}: {self.base_url} refused access (HTTP "
                            f"{response.status_code}); is the model private?")
        if response.status_code != 200:
            raise PullError(f"{name}: {self.base_url} answered HTTP {response.status_code} for "
                            "its manifest")
        return response.content

    def download_blob(self, name: ModelName, digest: str, size: int, dest: Path,
                      progress: ProgressCallback | None = None,
                      cancel: threading.Event | None = None) -> None:
        """Download one blob to ``dest``, resuming ``dest.partial``; verify before renaming.

        The caller holds the blob's lock (:func:`.blob_lock.blob_lock`): the partial file is
        appended to, which only one writer may do.
        """
        partial = partial_path(dest)
        hasher = hashlib.sha256()
        offset = _rehash_partial(partial, hasher, size)
        report = progress or (lambda _p: None)
        report(PullProgress(digest, offset, size, "downloading"))
        url = f"{self.base_url}/v2/{name.repository}/blobs/{digest}"
        # A response that ends early without an error (a server or proxy closing the connection
        # cleanly, with no Content-Length to betray it) is resumed straight away, once.
        for _attempt in range(2):
            if offset >= size:
                break
            try:
                offset, hasher = self._stream_to(url, partial, offset, hasher, digest, size,
                                                 report, cancel)
            except httpx.HTTPError as exc:
                raise PullError(f"download of {digest[:19]} interrupted ({exc}); run the pull "
                                "again to resume") from exc
        if offset < size:
            # Short, not wrong: the bytes so far are kept for the next pull to resume.
            raise PullError(f"download of {digest[:19]} interrupted at {offset:,} of {size:,} "
                            "bytes; run the pull again to resume")
        report(PullProgress(digest, offset, size, "verifying"))
        actual = "sha256:" + hasher.hexdigest()
        if offset != size or actual != digest:
            partial.unlink(missing_ok=True)
            raise PullError(f"{name}: layer {digest[:19]} failed verification (got {offset} "
                            f"bytes, {actual[:19]}); the damaged download was discarded, pull "
                            "again or try another registry")
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(partial, dest)
        except FileNotFoundError as exc:
            raise PullError(f"the download of {digest[:19]} ({partial}) was deleted before it "
                            "reached the store; run the pull again") from exc
        except OSError as exc:
            raise _write_failed(dest, exc, "pull again") from exc
        fsync_dir(dest.parent)
        report(PullProgress(digest, size, size, "done"))

    def _stream_to(self, url: str, partial: Path, offset: int, hasher: Any, digest: str,
                   size: int, report: ProgressCallback,
                   cancel: threading.Event | None) -> tuple[int, Any]:
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        response = self._send("GET", url, headers)
        try:
            if response.status_code == 416:
                # Nothing past ``offset`` (always short of the manifest's size here): the
                # registry's blob is not the one declared, and resuming would fail forever.
                partial.unlink(missing_ok=True)
                raise PullError(f"{digest[:19]}: the registry has no bytes past {offset:,} of "
                                f"{size:,} (HTTP 416); the partial download was discarded, try "
                                "another registry")
            if response.status_code == 200 and offset:
                # The server ignored the range: start over rather than append a second copy.
                log.info("registry ignored the range request for %s; restarting it", digest)
                offset, hasher = 0, hashlib.sha256()
            elif response.status_code not in (200, 206):
                raise PullError(f"{digest[:19]}: the registry answered HTTP "
                                f"{response.status_code} for the blob")
            mode = "ab" if offset else "wb"
            try:
                partial.parent.mkdir(parents=True, exist_ok=True)
                with partial.open(mode) as fh:
                    for chunk in response.iter_bytes(CHUNK_SIZE):
                        if cancel is not None and cancel.is_set():
                            fh.flush()
                            os.fsync(fh.fileno())
                            raise PullError("pull cancelled; run it again to resume")
                        fh.write(chunk)
                        hasher.update(chunk)
                        offset += len(chunk)
                        if offset > size:
                            break  # more than the manifest declared: verification rejects it
                        report(PullProgress(digest, offset, size, "downloading"))
                    fh.flush()
                    os.fsync(fh.fileno())
            except OSError as exc:
                raise _write_failed(partial, exc, "pull again to resume") from exc
            return offset, hasher
        finally:
            response.close()


def _write_failed(path: Path, exc: OSError, then: str) -> PullError:
    """A failed write as one line whose advice fits the failure: space only when it ran out."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        remedy = "free some space and "
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        remedy = "make the store writable (or set OLLAMA_MODELS to one that is) and "
    else:
        remedy = ""
    reason = exc.strerror or type(exc).__name__
    return PullError(f"cannot write {path} ({reason}); {remedy}{then}")


def _json_object(reply: httpx.Response) -> dict[str, Any] | None:
    """The reply's body when it is a JSON object, else None."""
    try:
        body = reply.json()
    except ValueError:  # also a body that is not UTF-8
        return None
    return body if isinstance(body, dict) else None


def _rehash_partial(partial: Path, hasher: Any, size: int) -> int:
    """Feed an interrupted download's bytes to ``hasher``; return how many there are."""
    try:
        have = partial.stat().st_size
    except FileNotFoundError:
        return 0
    if have > size:
        partial.unlink()
        return 0
    with partial.open("rb") as fh:
        while chunk := fh.read(CHUNK_SIZE):
            hasher.update(chunk)
    return have


def parse_manifest(name: ModelName, raw: bytes, store: Path, source: str) -> dict[str, Any]:
    """Check a pulled manifest before any blob is fetched: it must name a runnable GGUF layer."""
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise PullError(f"{name}: {source} sent a manifest that is not JSON") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("layers"), list):
        raise PullError(f"{name}: {source} sent a manifest without layers (not an Ollama model)")
    try:
        model_layer(manifest, name, store, f"the manifest from {source}")
    except GGUFError as exc:
        raise PullError(str(exc)) from exc
    return manifest


def pull_direct(name: ModelName, store: Path, *, base_url: str,
                progress: ProgressCallback | None = None,
                cancel: threading.Event | None = None,
                transport: httpx.BaseTransport | None = None) -> Path:
    """Pull ``name`` from ``base_url`` into ``store``; return the manifest path written."""
    report = progress or (lambda _p: None)
    with RegistryClient(base_url, transport=transport) as client:
        report(PullProgress("", 0, 0, "pulling manifest"))
        raw = client.get_manifest(name)
        manifest = parse_manifest(name, raw, store, base_url)
        sizes = blob_sizes(manifest)
        for digest in manifest_digests(manifest):
            _fetch_blob(client, name, store, digest, sizes.get(digest, 0), report, cancel)
    # Every blob is present and verified (by this pull or another): only now the manifest. A
    # concurrent pull of the same model writes the same bytes; atomic_write's temporary name is
    # its own, so the two renames cannot mix.
    report(PullProgress("", 0, 0, "writing manifest"))
    target = manifest_path(store, name)
    try:
        atomic_write(target, raw)
    except OSError as exc:
        raise _write_failed(target, exc, "pull again") from exc
    report(PullProgress("", 0, 0, "success"))
    return target


def _fetch_blob(client: RegistryClient, name: ModelName, store: Path, digest: str, size: int,
                report: ProgressCallback, cancel: threading.Event | None) -> None:
    """Make the blob ``digest`` present and verified, downloaded here or by another pull."""
    if blob_problem(store, digest, size) is None:
        # Only verified blobs ever get their final name, so the right size means good.
        report(PullProgress(digest, size, size, "exists"))
        return
    dest = blob_path(store, digest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with blob_lock(store, digest, cancel=cancel,
                   waiting=waiting_reporter(report, digest, size, dest)):
        # Looked at again under the lock: another pull may have completed it while we waited.
        problem = blob_problem(store, digest, size)
        if problem is None:
            report(PullProgress(digest, size, size, "exists"))
            return
        _discard_wrong_size(dest, name, problem)
        client.download_blob(name, digest, size, dest, report, cancel)


def _discard_wrong_size(dest: Path, name: ModelName, problem: str) -> None:
    # Content-addressed: a blob of the wrong size can never be right, and nothing else may
    # replace it while we hold its lock. Deleted rather than kept aside: it is useless and may
    # be gigabytes that nothing would ever clean up.
    if not dest.exists():
        return
    log.warning("%s: %s; fetching it again", name, problem)
    try:
        dest.unlink()
    except OSError as exc:
        raise PullError(f"{name}: cannot remove the damaged blob {dest} ({exc.strerror}); "
                        "remove it and pull again") from exc
