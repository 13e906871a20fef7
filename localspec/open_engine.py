"""The chat app's engine for a pair: a ``localspec serve`` that already serves it, else an engine
process of the app's own.

Kept apart from ``chat_engine`` (the contract): it picks among the implementations, which import
the contract, so the contract cannot import them.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .chat_engine import ChatEngine
from .loading import EngineSpec, resolve_paths
from .served_engine import ServedChatEngine


def open_chat_engine(spec: EngineSpec, log_file: Path | None = None) -> ChatEngine:
    """The chat app's engine for ``spec``: the ``localspec serve`` on this machine that already
    serves the same files (no second copy in memory; if it goes away, a private engine process
    takes over), else a private engine process."""
    # Deferred: the server package is a front end (Starlette); this module imports without it.
    from .server import discovery
    from .server.config import ServerConfig
    from .server.engine_process import ProcessChatEngine

    # Validated once, where the engine loads (in its process): a bad file comes back from it
    # as one line with its title, and a served pair's files were the server's to check.
    target, draft = resolve_paths(spec)
    resolved = replace(spec, target=str(target), draft=str(draft) if draft else None)
    served = discovery.find(target, draft)
    if served is not None:
        return ServedChatEngine(resolved, served.url, served.pid, api_key=served.api_key,
                                model=served.model_id, log_file=log_file,
                                server_history=served.history)
    return ProcessChatEngine(resolved, ServerConfig.private(spec.display_name),
                             log_file=log_file)
