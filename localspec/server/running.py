"""Running the app under uvicorn: in the foreground (the CLI) or on a background thread (tests,
benchmarks, and anything that embeds a server next to its own work)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


def serve(app: Any, host: str, port: int, log_level: str = "warning") -> None:
    """Serve until interrupted (Ctrl-C); uvicorn handles the signals."""
    import uvicorn  # deferred: only serving needs it

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run()


class BackgroundServer:
    """Uvicorn on a daemon thread, on an already-bound socket (port 0 picks a free one).

    Use as a context manager; ``url`` is the base URL (``http://host:port``).
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        import uvicorn

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level,
                                                     timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]},
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
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
