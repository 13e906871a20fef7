"""Pull a model into the Ollama store: through the Ollama daemon when one answers, else directly.

Through the daemon, Ollama itself downloads and registers the model. Without one, the registry
protocol in :mod:`localspec.registry_client` writes the same files in the same layout. Either way
the result is resolved from the store, and a model already present and whole is returned without
touching the network. Whole means every blob its manifest names is there with the declared size;
with ``verify``, also that every blob's bytes hash to its digest. The damaged blobs of a present
model are discarded (:mod:`.repair`) and the model pulled again.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import httpx

from ..errors import ConfigError, DamagedModelError, GGUFError, ModelNotFoundError, PullError
from . import ollama_store
from .ollama_store import ModelName, NotGGUFBlobError, ResolvedModel, UnreadableManifestError
from .registry_client import (
    ProgressCallback,
    PullProgress,
    pull_direct,
    refuse_plain_http,
    registry_url,
)
from .repair import discard_damaged

log = logging.getLogger(__name__)

__all__ = ["PullProgress", "daemon_url", "daemon_available", "pull"]

DEFAULT_DAEMON = "127.0.0.1:11434"


def daemon_url() -> str:
    """The Ollama daemon's base URL from ``OLLAMA_HOST``, the way Ollama reads it.

    Raises ConfigError when it is no ``[scheme://]host[:port][/path]``: no daemon can be there,
    and pulling from the registry instead would hide the typo.
    """
    setting = os.environ.get("OLLAMA_HOST", "").strip()
    scheme, sep, rest = (setting or DEFAULT_DAEMON).partition("://")
    if not sep:
        scheme, rest = "http", scheme
    host, slash, path = rest.partition("/")
    path = f"/{path}".rstrip("/") if slash else ""
    if _ipv6(host):  # bare, as Ollama allows: every colon is the address's own
        host = f"[{host}]"
    hostname, _, port = host.rpartition(":") if ":" in host.rsplit("]", 1)[-1] else (host, "", "")
    if not port:
        port = "443" if scheme == "https" else "11434"
    # A server bound to every interface is reached on loopback.
    if hostname in ("", "0.0.0.0"):
        hostname = "127.0.0.1"
    if scheme not in ("http", "https") or not _host_port(hostname, port):
        raise ConfigError(f"OLLAMA_HOST={setting}: not a host[:port]")
    return f"{scheme}://{hostname}:{port}{path}"


def _ipv6(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv6Address)
    except ValueError:
        return False


def _host_port(hostname: str, port: str) -> bool:
    """True for a hostname (or IP address, IPv6 in brackets) and a port from 1 to 65535."""
    if hostname.startswith("["):
        return (hostname.endswith("]") and _ipv6(hostname[1:-1])
                and ollama_store.valid_port(port))
    return ollama_store.valid_host(f"{hostname}:{port}")


def daemon_available(url: str | None = None, timeout: float = 0.5) -> bool:
    """True when an Ollama daemon answers at ``url`` (default: ``OLLAMA_HOST``)."""
    try:
        response = httpx.get(f"{url or daemon_url()}/api/version", timeout=timeout)
    except (httpx.HTTPError, httpx.InvalidURL):
        return False
    return response.status_code == 200


class _Presence(NamedTuple):
    """What the store holds of a model before it is pulled."""

    model: ResolvedModel | None  # present and whole: nothing to pull
    manifest_lost: bool = False  # its manifest was unreadable: its blobs went unchecked


def _whole(name: ModelName, verify: bool, report: ProgressCallback,
           cancel: threading.Event | None) -> _Presence:
    """``name`` resolved when present and whole; no model when it must be pulled (absent, its
    manifest unreadable, or its damaged blobs just discarded)."""
    store = ollama_store.locate(name)
    if store is None:
        return _Presence(None)
    not_gguf: NotGGUFBlobError | None = None
    # A present model that cannot run (a cloud or projector-only model) raises its own message
    # here, since downloading again would not help.
    try:
        found: ResolvedModel | None = ollama_store.resolve_in(store, name)
    except UnreadableManifestError as exc:
        _say(report, f"{name}: damaged, {exc.problem}; fetching it again")
        return _Presence(None, manifest_lost=True)
    except NotGGUFBlobError as exc:
        # Same size, wrong first bytes: only the sha256 tells damage from a foreign format.
        found, not_gguf, verify = None, exc, True
    except (DamagedModelError, ModelNotFoundError):  # ModelNotFound: a blob went meanwhile
        found = None
    if found is not None and not verify:
        return _Presence(found)  # sizes checked by resolve_in; the common case reads no blob
    manifest = ollama_store.read_manifest(ollama_store.manifest_path(store, name))
    damaged = discard_damaged(name, store, manifest, verify=verify, report=report, cancel=cancel)
    if not_gguf is not None and not damaged:
        raise GGUFError(f"{name}: {not_gguf.problem}, and its sha256 matches the manifest: the "
                        "model itself is not GGUF, localspec cannot run it")
    return _Presence(None if damaged or found is None else found)


def _say(report: ProgressCallback, line: str) -> None:
    log.info("%s", line)  # the user sees it as a progress status
    report(PullProgress("", 0, 0, line))


def pull(name: str, *, registry: str | None = None, insecure: bool = False,
         progress: Callable[[PullProgress], None] | None = None,
         cancel: threading.Event | None = None, verify: bool = False) -> ResolvedModel:
    """Make ``name`` present and whole in the Ollama store and return it resolved.

    Already present with every blob of the declared size (and, with ``verify``, of the right
    sha256): returned with no network access. A present model with damaged blobs has them
    discarded and is pulled again; one with an unreadable manifest is pulled again, then its
    blobs are checked against the new manifest. Pulling goes through an answering Ollama daemon
    (unless ``registry`` names a mirror, which only the direct path can use); with none, the
    registry is spoken to directly.
    """
    refuse_plain_http(name, insecure)
    parsed = ollama_store.parse_name(name)
    report = progress or (lambda _p: None)
    before = _whole(parsed, verify, report, cancel)
    if before.model is not None:
        log.info("%s is already in the store at %s", parsed, before.model.gguf_path)
        return before.model
    store = _fetch(parsed, registry, insecure, progress, cancel, before.manifest_lost)
    if before.manifest_lost:
        # Only now is there a manifest to check the blobs that were already here against.
        after = _whole(parsed, verify, report, cancel)
        if after.model is not None:
            return after.model
        store = _fetch(parsed, registry, insecure, progress, cancel, False)
    return _resolve_pulled(parsed, store)


def _fetch(name: ModelName, registry: str | None, insecure: bool,
           progress: Callable[[PullProgress], None] | None, cancel: threading.Event | None,
           manifest_lost: bool) -> Path | None:
    """Pull ``name`` through the daemon (None) or directly (the store written)."""
    if registry is None and daemon_available():
        if manifest_lost:
            _drop_unreadable_manifests(name)
        _pull_with_daemon(name, insecure, progress, cancel)
        return None
    store = ollama_store.store_dirs()[0]
    base = registry_url(name, registry, insecure)
    pull_direct(name, store, base_url=base, progress=progress, cancel=cancel)
    return store


def _resolve_pulled(name: ModelName, store: Path | None) -> ResolvedModel:
    if store is not None:
        return ollama_store.resolve_in(store, name)
    try:
        return ollama_store.resolve(name)
    except ModelNotFoundError as exc:
        raise PullError(
            f"{name}: the Ollama daemon pulled it but it is not in "
            f"{', '.join(map(str, ollama_store.store_dirs()))}; set OLLAMA_MODELS to the "
            "daemon's store") from exc


def _drop_unreadable_manifests(name: ModelName) -> None:
    # The daemon reads the old manifest before it pulls (to prune the layers it replaces) and
    # fails on one it cannot parse; it is useless anyway, and the blobs stay.
    for store in ollama_store.store_dirs():
        path = ollama_store.manifest_path(store, name)
        if not path.is_file():
            continue
        try:
            ollama_store.read_manifest(path)
        except UnreadableManifestError:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("cannot remove the unreadable manifest %s (%s)", path, exc.strerror)


def _pull_with_daemon(name: ModelName, insecure: bool,
                      progress: Callable[[PullProgress], None] | None,
                      cancel: threading.Event | None) -> None:
    # Imported here: the ollama client is only needed when a daemon answers.
    import ollama

    client = ollama.Client(host=daemon_url())
    stream = client.pull(name.short, insecure=insecure, stream=True)
    try:
        for update in stream:
            if cancel is not None and cancel.is_set():
                raise PullError("pull cancelled; the Ollama daemon keeps what it has, run it "
                                "again to resume")
            if progress is not None:
                progress(PullProgress(
                    digest=update.digest or "",
                    completed=int(update.completed or 0),
                    total=int(update.total or 0),
                    status=update.status or "",
                ))
    except ollama.ResponseError as exc:
        message = str(exc.error)
        if exc.status_code == 404 or "file does not exist" in message or "not found" in message:
            raise ModelNotFoundError(f"{name}: the Ollama daemon cannot find it ({message}); "
                                     "check the name on ollama.com/library") from exc
        raise PullError(f"{name}: the Ollama daemon failed to pull it ({message})") from exc
    except httpx.HTTPError as exc:
        raise PullError(f"{name}: lost the Ollama daemon at {daemon_url()} ({exc})") from exc
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
