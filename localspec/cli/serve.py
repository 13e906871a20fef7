"""``localspec serve``: the pair behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import socket
import sys
from pathlib import Path

from ..errors import LocalspecError
from ..params import PARAMS
from .common import add_draft_options, add_model_options, engine_spec, settings_from
from .params import cli_type


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="serve the pair over an OpenAI-compatible HTTP API",
                       description="Loads the pair once and answers /v1/chat/completions, "
                                   "/v1/completions and /v1/models (streaming or not), plus "
                                   "/health and /metrics. Requests queue for the one engine. "
                                   "Settings not given as options come from config.toml's "
                                   "[chat], whose values replace the defaults shown here.")
    p.add_argument("pair", nargs="?", help="pair name (or use --target/--draft)")
    add_model_options(p)
    add_draft_options(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", type=_host, default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=cli_type("port"), default=PARAMS["port"].default,
                   help=f"{PARAMS['port'].meaning} (default {PARAMS['port'].default})")
    g.add_argument("--api-key", default=os.environ.get("LOCALSPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $LOCALSPEC_API_KEY)")
    g.add_argument("--model-name", default=None,
                   help="the model id clients see (default: the pair name or the target's)")
    g.add_argument("--queue-size", type=_count("--queue-size", 0), default=16,
                   help="requests that may wait for the engine; more get 429 (default 16)")
    g.add_argument("--max-tokens-limit", type=_count("--max-tokens-limit", 1), default=4096,
                   help="largest max_tokens a request may ask for (default 4096)")
    g.add_argument("--max-body-bytes", type=_count("--max-body-bytes", 1024), default=1 << 20,
                   help="largest request body in bytes (default 1 MiB)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Deferred: the HTTP stack loads only when serving; the models load in the engine process.
    from dataclasses import replace

    from ..history import scope_for
    from ..loading import resolve_files
    from ..models.names import display_name
    from ..requests import draft_from_settings, fit_draft
    from ..server import ServerConfig
    from ..server.engine_process import EngineProcess
    from ..server.front import create_front_app
    from ..server.running import base_url, bound_port, serve

    settings = settings_from(args, read_config=True)
    # Its own index, apart from the chat app's, unless config.toml joins them.
    spec = replace(engine_spec(args, args.pair, settings), history=scope_for("serve", settings))
    model_id = args.model_name or spec.pair_name or display_name(spec.target)
    aliases = tuple(n for n in (spec.pair_name, display_name(spec.target)) if n)
    draft = fit_draft(draft_from_settings(settings, spec.draft_mode),
                      spec.draft_mode == "model" and spec.draft is not None)
    # One configuration for both processes: the front checks its key and body limit, the
    # engine process answers by the rest (with a key of its own).
    config = ServerConfig(model_id=model_id, aliases=aliases, api_key=args.api_key or None,
                          queue_size=args.queue_size, max_tokens_limit=args.max_tokens_limit,
                          default_max_tokens=settings.max_tokens,
                          max_body_bytes=args.max_body_bytes, draft=draft)
    config.validate()
    # Before loading: a taken port is reported in a moment, not after the models have loaded,
    # and the port stays ours while they load (the same sockets are served).
    sockets = _listen(args.host, args.port)
    target, draft_path = resolve_files(spec)  # a bad file: one line, before any process
    if not _is_loopback(args.host) and not args.api_key:
        print(f"localspec: warning: serving on {args.host} without --api-key: anyone who can "
              "reach this port can use the model", file=sys.stderr)
    url = base_url(args.host, bound_port(sockets))
    resolved = replace(spec, target=str(target), draft=str(draft_path) if draft_path else None)
    process = EngineProcess(resolved, config)
    announced: list[Path] = []

    def ready(restarts: int) -> None:
        if restarts:
            print(f"localspec: the engine process is serving again (restart {restarts})",
                  file=sys.stderr, flush=True)
            return
        # Findable first, then announced: whoever reads the line can attach at once.
        announced.append(_announce(url, args.api_key, model_id, target, draft_path,
                                   spec.history))
        print(f"localspec: serving '{model_id}' at {url}/v1 (Ctrl-C to stop)", file=sys.stderr,
              flush=True)

    failure: list[str] = []
    front = create_front_app(process, config, on_ready=ready, on_give_up=failure.append)
    try:
        # The address first: with --port 0 a script learns the port while the models load
        # (/health answers "loading" meanwhile).
        print(f"localspec: loading {spec.display_name} (listening on {url}) ...",
              file=sys.stderr, flush=True)
        serve(front, sockets, on_shutdown=front.state.supervisor.begin_shutdown,
              exit_when=lambda: bool(failure))
    finally:
        for sock in sockets:
            sock.close()
        for path in announced:
            from ..server.discovery import unregister

            unregister(path)
    if failure:
        # The first load failed: the file would fail every retry, so serve stops here.
        raise LocalspecError(failure[0])
    return 0


def _announce(url: str, api_key: str | None, model_id: str, target: Path,
              draft: Path | None, history: str | None) -> Path:
    """Let this machine's chat apps find this server (they attach instead of loading twice)."""
    from ..server.discovery import ServedPair, identity, register

    return register(ServedPair(pid=os.getpid(), url=url, api_key=api_key, model_id=model_id,
                               target=identity(target) or "", draft=identity(draft),
                               history=history))


def _count(flag: str, low: int):  # type: ignore[no-untyped-def]
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"{flag} must be a whole number >= {low}, "
                                             f"got {text!r}")
        return value

    return convert


def _host(text: str) -> str:
    """``--host``: an address or a name. A URL or ``host:port`` is a mistake worth naming now;
    whether the name resolves is checked when binding, still before anything loads."""
    host = text.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # an IPv6 address as written in URLs
    if not host or "/" in host or (":" in host and not _is_ipv6(host)):
        raise argparse.ArgumentTypeError(
            f"must be an IP address or a host name (the port goes in --port), got {text!r}")
    return host


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def _listen(host: str, port: int) -> list[socket.socket]:
    """The listening sockets for host:port, or one line saying why not.

    A bad ``--host`` is a ValueError (usage, exit 2); a port that is taken or forbidden is a
    LocalspecError (the machine's state, exit 1).
    """
    from ..server.running import listen_sockets

    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        return listen_sockets(host, port)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host} does not resolve to an address ({exc.strerror})") \
            from None
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ValueError(f"cannot listen on {where}: {host} is not an address of this "
                             "machine (check --host)") from None
        if exc.errno == errno.EADDRINUSE:
            message = f"{where} is already in use (another localspec serve? pick --port)"
        elif exc.errno == errno.EACCES:
            message = (f"no permission to listen on {where} (ports below 1024 need privileges; "
                       "pick --port)")
        else:
            message = f"cannot listen on {where}: {exc.strerror or exc}"
        raise LocalspecError(message) from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
