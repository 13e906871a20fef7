"""The front's event loop: one harmless race in anyio's UNIX sockets kept out of the error log.

The front relays to its engine over a unix socket through httpx, whose asyncio backend (anyio's
``UNIXSocketStream``) waits for a read with ``loop.add_reader(sock, future.set_result, None)``.
When the task waiting on that future is cancelled (shutting down ends every relay at once) in
the same loop iteration as the socket turns readable (the engine was still streaming tokens),
the reader's callback is already queued and runs ``set_result`` on the cancelled future:
asyncio logs an ``InvalidStateError`` traceback on the way out. Closing the stream has the same
race by another path: its ``aclose`` ends the wait itself with ``set_result(None)``, and the
queued callback then meets a future already done. Nothing is lost (the reader stopped waiting
on purpose), but a traceback at every tenth SIGTERM reads like a crash to an operator. Seen
with anyio 4.16 on Python 3.11 (``tests/test_serve_lifecycle.py``, 2 runs in 21 under a 2-core
load for the cancel; once in a full suite and once in 6 loaded runs for the close).

Only that shape is dropped: a ``Future.set_result(None)`` callback on a future that was
cancelled or already holds None (anyio's waits carry nothing else). Everything else goes to
the handler that was there before (asyncio's default).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


def is_cancelled_future_result(context: dict[str, Any]) -> bool:
    """Whether ``context`` (asyncio's exception-handler context) is a queued
    ``Future.set_result(None)`` callback that met its wait already ended: cancelled, or
    resolved with None by the stream's close."""
    if not isinstance(context.get("exception"), asyncio.InvalidStateError):
        return False
    handle = context.get("handle")
    callback = getattr(handle, "_callback", None)
    future = getattr(callback, "__self__", None)
    if (getattr(callback, "__name__", "") != "set_result"
            or getattr(handle, "_args", None) != (None,)
            or not isinstance(future, asyncio.Future)):
        return False
    return future.cancelled() or (future.exception() is None and future.result() is None)


def ignore_cancelled_future_results(loop: asyncio.AbstractEventLoop) -> None:
    """Install on ``loop`` a handler that drops the race above and passes on the rest."""
    previous = loop.get_exception_handler()

    def handler(the_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if is_cancelled_future_result(context):
            log.debug("ignored a reader's result for a cancelled wait: %s",
                      context.get("handle"))
            return
        if previous is not None:
            previous(the_loop, context)
        else:
            the_loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
