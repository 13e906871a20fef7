"""Pull a model into the Ollama store: through the Ollama daemon when one answers, else directly.

Through the daemon, Ollama itself downloads and registers the model. Without one, the registry
protocol in :mod:`localspec.registry_client` writes the same files in the same layout. Either way
the result is resolved from the store, and a model already present and whole is returned without
touching the network. Whole means every blob its manifest names is there with the declared size;
with ``verify``, also that every blob's bytes hash to its digest. The damaged blobs of a present
model are discarded (:mod:`.repair`) and the model pulled again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import httpx

from ..errors import DamagedModelError, ModelNotFoundError, PullError
from . import ollama_store
from .ollama_store import ModelName, ResolvedModel
from .registry_client import ProgressCallback, PullProgress, pull_direct, registry_url
from .repair import discard_damaged

log = logging.getLogger(__name__)

__all__ = ["PullProgress", "daemon_url", "daemon_available", "pull"]

DEFAULT_DAEMON = "127.0.0.1:11434"


def daemon_url() -> str:
    """The Ollama daemon's base URL from ``OLLAMA_HOST``, the way Ollama reads it."""
    host = os.environ.get("OLLAMA_HOST", "").strip() or DEFAULT_DAEMON
    scheme = "http"
    if "://" in host:
        scheme, host = host.split("://", 1)
    host = host.rstrip("/")
    hostname, _, port = host.rpartition(":") if ":" in host.rsplit("]", 1)[-1] else (host, "", "")
    if not port:
        port = "443" if scheme == "https" else "11434"
    # A server bound to every interface is reached on loopback.
    if hostname in ("", "0.0.0.0"):
        hostname = "127.0.0.1"
    return f"{scheme}://{hostname}:{port}"


def daemon_available(url: str | None = None, timeout: float = 0.5) -> bool:
    """True when an Ollama daemon answers at ``url`` (default: ``OLLAMA_HOST``)."""
    try:
        response = httpx.get(f"{url or daemon_url()}/api/version", timeout=timeout)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def _whole(name: ModelName, verify: bool, report: ProgressCallback,
           cancel: threading.Event | None) -> ResolvedModel | None:
    """``name`` resolved when present and whole; None when it must be pulled (absent, or its
    damaged blobs were just discarded)."""
    store = ollama_store.locate(name)
    if store is None:
        return None
    # A present model that cannot run (not a GGUF, a cloud or projector-only model) raises its
    # own message here, since downloading again would not help.
    try:
        found: ResolvedModel | None = ollama_store.resolve_in(store, name)
    except (DamagedModelError, ModelNotFoundError):  # ModelNotFound: a blob went meanwhile
        found = None
    if found is not None and not verify:
        return found  # sizes checked by resolve_in; the common case reads no blob
    manifest = ollama_store.read_manifest(ollama_store.manifest_path(store, name))
    damaged = discard_damaged(name, store, manifest, verify=verify, report=report, cancel=cancel)
    return None if damaged or found is None else found


def pull(name: str, *, registry: str | None = None, insecure: bool = False,
         progress: Callable[[PullProgress], None] | None = None,
         cancel: threading.Event | None = None, verify: bool = False) -> ResolvedModel:
    """Make ``name`` present and whole in the Ollama store and return it resolved.

    Already present with every blob of the declared size (and, with ``verify``, of the right
    sha256): returned with no network access. A present model with damaged blobs has them
    discarded and is pulled again. Pulling goes through an answering Ollama daemon (unless
    ``registry`` names a mirror, which only the direct path can use); with none, the registry
    is spoken to directly.
    """
    parsed = ollama_store.parse_name(name)
    report = progress or (lambda _p: None)
    found = _whole(parsed, verify, report, cancel)
    if found is not None:
        log.info("%s is already in the store at %s", parsed, found.gguf_path)
        return found
    if registry is None and daemon_available():
        _pull_with_daemon(parsed, insecure, progress, cancel)
        try:
            return ollama_store.resolve(parsed)
        except ModelNotFoundError as exc:
            raise PullError(
                f"{parsed}: the Ollama daemon pulled it but it is not in "
                f"{', '.join(map(str, ollama_store.store_dirs()))}; set OLLAMA_MODELS to the "
                "daemon's store") from exc
    store = ollama_store.store_dirs()[0]
    base = registry_url(parsed, registry, insecure)
    pull_direct(parsed, store, base_url=base, progress=progress, cancel=cancel)
    return ollama_store.resolve_in(store, parsed)


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
