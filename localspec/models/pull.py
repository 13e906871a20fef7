"""Pull a model into the Ollama store: through the Ollama daemon when one answers, else directly.

Through the daemon, Ollama itself downloads and registers the model. Without one, the registry
protocol in :mod:`localspec.registry_client` writes the same files in the same layout. Either way
the result is resolved from the store, and a model already present is returned without touching
the network.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import httpx

from ..errors import ModelNotFoundError, PullError
from . import ollama_store
from .ollama_store import ModelName, ResolvedModel
from .registry_client import PullProgress, pull_direct, registry_url

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


def _present(name: ModelName) -> ResolvedModel | None:
    # Only an absent model is pulled; a present one that cannot run (not a GGUF, a cloud or
    # projector-only model) raises its own message, since downloading again would not help.
    try:
        return ollama_store.resolve(name)
    except ModelNotFoundError:
        return None


def pull(name: str, *, registry: str | None = None, insecure: bool = False,
         progress: Callable[[PullProgress], None] | None = None,
         cancel: threading.Event | None = None) -> ResolvedModel:
    """Make ``name`` present in the Ollama store and return it resolved.

    Already present: returned with no network access. Otherwise an answering Ollama daemon pulls
    it (unless ``registry`` names a mirror, which only the direct path can use); with none, the
    registry is spoken to directly.
    """
    parsed = ollama_store.parse_name(name)
    found = _present(parsed)
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
