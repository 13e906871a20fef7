"""Running the app under uvicorn: in the foreground (the CLI) or on a background thread (tests,
benchmarks, and anything that embeds a server next to its own work).

Both listen on sockets bound here first (``listen_sockets``), so the address is checked, and held,
before anything slow (loading models) happens. This module imports uvicorn: import it only to
serve.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

log = logging.getLogger(__name__)

# uvicorn's default backlog (it calls listen() again with its own when it starts serving).
_BACKLOG = 2048


def listen_sockets(host: str, port: int) -> list[socket.socket]:
    """Bind and listen on every address ``host`` resolves to, as uvicorn would.

    The options are asyncio's ``create_server``'s (uvicorn's own bind path): SO_REUSEADDR, so a
    port left in TIME_WAIT by a previous server is reusable but one another server listens on is
    not, and IPV6_V6ONLY, so ``0.0.0.0`` and ``::`` can both be bound. The sockets listen at once:
    on Linux a bound socket that does not listen yet does not keep a second SO_REUSEADDR server
    off the port. Port 0 picks one free port for all the addresses. Raises ``OSError``
    (``socket.gaierror`` when the host does not resolve).
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    addresses = list(dict.fromkeys((family, str(sockaddr[0])) for family, *_, sockaddr in infos))
    sockets: list[socket.socket] = []
    try:
        for family, address in addresses:
            chosen = bound_port(sockets) if sockets else port
            sockets.append(_listen_one(family, address, chosen))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _listen_one(family: int, address: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((address, port))
        sock.listen(_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def bound_port(sockets: list[socket.socket]) -> int:
    """The port the sockets listen on (the one picked, when 0 was asked for)."""
    return int(sockets[0].getsockname()[1])


def base_url(host: str, port: int) -> str:
    """``http://host:port``, with an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn's server, telling its owner when it accepts connections and when it stops
    accepting them, and stopping by itself when its owner says so.

    ``on_tick``, ``shutdown`` and ``servers`` are uvicorn's own, not documented API (checked
    against uvicorn 0.54); they are used here only."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None] | None = None,
                 on_shutdown: Callable[[], None] | None = None,
                 exit_when: Callable[[], bool] | None = None) -> None:
        super().__init__(config)
        self._on_started = on_started
        self._on_shutdown = on_shutdown
        self._exit_when = exit_when

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self._on_started is not None:
            self._on_started()

    async def on_tick(self, counter: int) -> bool:
        # uvicorn's main loop asks this every 0.1 s whether to stop.
        stop = await super().on_tick(counter)
        return stop or (self._exit_when is not None and self._exit_when())

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Before uvicorn waits (timeout_graceful_shutdown) for the requests in flight: the
        # owner ends them now, each with an answer, instead of having them cut after the wait.
        for server in self.servers:
            server.close()  # stop accepting first (uvicorn does it again, harmlessly)
        if self._on_shutdown is not None:
            self._on_shutdown()
        await super().shutdown(sockets=sockets)


def serve(app: Any, sockets: list[socket.socket], log_level: str = "warning",
          on_started: Callable[[], None] | None = None,
          on_shutdown: Callable[[], None] | None = None,
          exit_when: Callable[[], bool] | None = None) -> None:
    """Serve on ``sockets`` (from ``listen_sockets``) until interrupted; uvicorn handles the
    signals. ``on_started`` runs once the app has started and the server accepts requests,
    ``on_shutdown`` once it has stopped accepting them (on the event loop), and ``exit_when``
    is polled to stop without a signal. Ctrl-C (SIGINT) ends in KeyboardInterrupt as usual;
    SIGTERM, what systemd and docker stop a service with, is a normal return: the shutdown it
    asks for has been done. The sockets are closed on return."""
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    server = _Server(config, on_started, on_shutdown, exit_when)
    in_main = threading.current_thread() is threading.main_thread()

    def terminated(signum: int, frame: FrameType | None) -> None:
        # uvicorn re-raises the signal it stopped for once its own handlers are gone: this
        # takes SIGTERM instead of the default action (killing the process, status -15). One
        # that came before uvicorn installed its handlers asks for the same shutdown.
        server.should_exit = True

    previous = signal.signal(signal.SIGTERM, terminated) if in_main else None
    try:
        server.run(sockets=sockets)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for sock in sockets:
            sock.close()


class BackgroundServer:
    """Uvicorn on a daemon thread, on an already-bound socket (port 0 picks a free one).

    Use as a context manager; ``url`` is the base URL (``http://host:port``).
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        self._sockets = listen_sockets(host, port)
        self.host, self.port = host, bound_port(self._sockets)
        self.url = base_url(host, self.port)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level,
                                                     timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": self._sockets},
                                        name="localspec-server", daemon=True)

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        """Start serving and wait until it accepts connections (a second call is a no-op)."""
        if not self._thread.is_alive():
            self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        for sock in self._sockets:
            sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
