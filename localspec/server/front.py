"""``serve``'s front: the public HTTP endpoint, supervising an engine process behind it.

Clients talk to this process; it checks their API key and relays each request, streamed, to the
engine process (which validates, queues and generates: see ``app.py``). When the engine process
dies, the requests it was answering end with a 503 OpenAI error body naming the cause (or, in a
stream, an error event), ``/health`` says ``restarting``, and a new engine process is started with
no operator action. Requests arriving meanwhile get a 503 with Retry-After. A first load that
fails is not retried (the file would fail again): the owner is told and stops serving.

Shutting down (SIGTERM or Ctrl-C) answers every request in flight at once, rather than letting
the server cut them after its graceful-shutdown wait: a stream ends with an error event and
``[DONE]``, a request still waiting for its answer gets a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import anyio
import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import LocalspecError
from .access import authorize, http_error, read_body
from .config import ServerConfig
from .engine_process import END_GRACE_SECONDS, EngineProcess, ProcessEnd
from .loop_errors import ignore_cancelled_future_results
from .openai_schema import ApiError, error_body, sse

log = logging.getLogger(__name__)

T = TypeVar("T")
State = Literal["loading", "ok", "restarting", "failed"]
_SHUTDOWN_MESSAGE = "the server is shutting down"
# What a relay's queue carries besides the engine's bytes.
_STOP, _END = object(), object()
# Not relayed: hop-by-hop headers, the engine's key, and the engine's date and server
# headers (the front's own server adds its own; a response with two of each confuses proxies).
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
                "authorization", "date", "server"}


@dataclass(slots=True)
class Supervisor:
    """The engine process and what is known about it."""

    process: EngineProcess
    on_ready: Callable[[int], None] | None = None  # called with the restart count
    on_give_up: Callable[[str], None] | None = None  # called with why the first load failed
    state: State = "loading"
    restarts: int = 0
    last_end: ProcessEnd | None = None
    error: str = ""
    ever_ready: bool = False
    gave_up: str = ""
    shutting_down: bool = False
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    streams: set[asyncio.Queue[Any]] = field(default_factory=set)  # the relays in flight

    def cause(self) -> str:
        return self.last_end.describe() if self.last_end else "unknown cause"

    async def run(self, poll: float = 0.1) -> None:
        """Start the engine, then restart it whenever it dies.

        A first load that fails (llama.cpp refuses the file, or dies loading it) gives up: the
        same file fails the same way every time, so ``on_give_up`` is told and nothing retries.
        A restart after a crash of an engine that had loaded is retried: the files loaded once
        (and a transient cause, such as memory taken meanwhile, can pass)."""
        while True:
            try:
                await asyncio.to_thread(self.process.start)
            except LocalspecError as exc:
                self.state, self.error = "failed", exc.message
                if not self.ever_ready:
                    self.gave_up = exc.message
                    log.info("engine process failed its first load: %s", exc.message)
                    if self.on_give_up is not None:
                        self.on_give_up(exc.message)
                    return
                log.error("engine process failed to restart: %s; retrying in 5 s", exc.message)
                await asyncio.sleep(5.0)
                continue
            self.state, self.error, self.ever_ready = "ok", "", True
            log.info("engine process %s serving", self.process.pid)
            if self.on_ready is not None:
                self.on_ready(self.restarts)
            while (end := self.process.end()) is None:
                await asyncio.sleep(poll)
            self.last_end, self.state = end, "restarting"
            self.restarts += 1
            log.warning("engine process stopped (%s); restarting", end.describe())

    def begin_shutdown(self) -> None:
        """The server stopped accepting connections: every relay in flight ends now, a stream
        with an error event and ``[DONE]``, a request still waiting with a 503 (on the event
        loop, before the server waits for its connections to close)."""
        self.shutting_down = True
        self.stopping.set()
        for queue in self.streams:
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(_STOP)  # a full queue is read soon, and the flag seen


@dataclass(slots=True)
class Front:
    """What the front's handlers share: the supervised engine process, the client that reaches
    it, and the settings (whose key and body limit ``access`` checks, as the engine's app does)."""

    supervisor: Supervisor
    client: httpx.AsyncClient
    config: ServerConfig


def create_front_app(process: EngineProcess, config: ServerConfig, *,
                     on_ready: Callable[[int], None] | None = None,
                     on_give_up: Callable[[str], None] | None = None) -> Starlette:
    """The public app over ``process`` (started and supervised by the app's lifespan), serving
    as ``config`` says (its model id, API key and body limit); ``on_ready(restarts)`` runs each
    time an engine process starts serving, ``on_give_up(why)`` once if the first load fails
    (nothing is retried then: the caller should stop serving). ``app.state.supervisor
    .begin_shutdown`` ends the relays in flight (see ``running.serve``)."""
    sup = Supervisor(process, on_ready, on_give_up)
    client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=process.socket_path),
                               base_url="http://engine", timeout=httpx.Timeout(None, connect=5.0),
                               headers={"Authorization": f"Bearer {process.key}"})
    routes = [Route("/health", _health, methods=["GET"]),
              Route("/metrics", _relay, methods=["GET"]),
              Route("/v1/{path:path}", _relay, methods=["GET", "POST"])]
    app = Starlette(routes=routes, lifespan=_lifespan,
                    exception_handlers={HTTPException: http_error})  # type: ignore[dict-item]
    app.state.front = Front(sup, client, config)
    app.state.supervisor = sup
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    front: Front = app.state.front
    ignore_cancelled_future_results(asyncio.get_running_loop())
    task = asyncio.create_task(front.supervisor.run())
    try:
        yield
    finally:
        task.cancel()
        await front.client.aclose()
        await asyncio.to_thread(front.supervisor.process.close)


def _front(request: Request) -> Front:
    front: Front = request.app.state.front
    return front


async def _health(request: Request) -> Response:
    front = _front(request)
    sup = front.supervisor
    body: dict[str, Any] = {"status": sup.state, "model": front.config.model_id,
                            "restarts": sup.restarts, "engine_pid": sup.process.pid}
    if sup.last_end is not None:
        body["last_stop"] = sup.cause()
    if sup.error:
        body["error"] = sup.error
    if sup.state != "ok":
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
    with contextlib.suppress(httpx.HTTPError, ValueError):
        inner = (await front.client.get("/health")).json()
        body.update({k: v for k, v in inner.items() if k in ("queue_waiting", "busy", "placement")})
    return JSONResponse(body)


def _unavailable(sup: Supervisor) -> Response:
    if sup.state == "restarting":
        message = f"the engine stopped ({sup.cause()}) and is restarting; retry shortly"
    elif sup.state == "failed":
        message = f"the engine failed to start: {sup.error}"
    else:
        message = "the model is still loading; retry shortly"
    return JSONResponse(error_body(message, "server_error", code="unavailable"),
                        status_code=503, headers={"Retry-After": "2"})


def _shutting_down() -> Response:
    return JSONResponse(error_body(_SHUTDOWN_MESSAGE, "server_error", code="shutting_down"),
                        status_code=503, headers={"Retry-After": "5"})


async def _stopped_during(sup: Supervisor, request_path: str, restarts_before: int) -> str:
    # The supervisor alone watches the process: a broken connection can arrive before it has
    # seen the exit, or after it has already started the next engine (whose end() is None),
    # so the question is whether an end was recorded since the request began.
    for _ in range(int(END_GRACE_SECONDS / 0.05)):
        if sup.restarts != restarts_before and sup.last_end is not None:
            return f"the engine stopped ({sup.last_end.describe()}) while answering; it " \
                   "restarts by itself: retry shortly"
        await asyncio.sleep(0.05)
    return f"the engine did not answer {request_path}"


async def _relay(request: Request) -> Response:
    front = _front(request)
    sup, client = front.supervisor, front.client
    try:
        authorize(request, front.config)
    except ApiError as err:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
    if sup.shutting_down:
        return _shutting_down()
    if sup.state != "ok":
        return _unavailable(sup)
    restarts_before = sup.restarts
    try:
        body = await read_body(request, front.config)
    except ClientDisconnect:
        log.info("%s %s: the client disconnected while sending its request",
                 request.method, request.url.path)
        return Response(status_code=499)
    except ApiError as err:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
    upstream_request = client.build_request(request.method, request.url.path,
                                            params=request.query_params, content=body,
                                            headers=headers)
    # A non-streamed answer's status line comes once it is generated: neither shutting down
    # nor a client that leaves (an SDK's timeout, before its retry) waits for that; the
    # request to the engine is dropped, which cancels its generation there.
    left = asyncio.Event()
    watch = asyncio.create_task(_watch_client(request, left))
    try:
        upstream = await _unless_set((sup.stopping, left),
                                     client.send(upstream_request, stream=True))
    except httpx.HTTPError:
        if sup.shutting_down:
            return _shutting_down()
        message = await _stopped_during(sup, request.url.path, restarts_before)
        return JSONResponse(error_body(message, "server_error", code="engine_stopped"),
                            status_code=503, headers={"Retry-After": "2"})
    finally:
        watch.cancel()
    if upstream is None:
        if left.is_set():
            log.info("%s %s: the client disconnected before its answer was ready",
                     request.method, request.url.path)
            return Response(status_code=499)
        return _shutting_down()
    streaming = upstream.headers.get("content-type", "").startswith("text/event-stream")
    out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
    return StreamingResponse(_forward(sup, upstream, streaming, request.url.path,
                                      restarts_before),
                             status_code=upstream.status_code, headers=out_headers)


async def _forward(sup: Supervisor, upstream: httpx.Response, streaming: bool, path: str,
                   restarts_before: int) -> AsyncIterator[bytes]:
    # A pump task reads the engine's answer into a queue, so that shutting down can end a
    # stream between two events (``begin_shutdown`` puts _STOP in the queue). A non-streamed
    # body is relayed whole: it was generated before its status line came.
    queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=64)
    pump = asyncio.create_task(_pump(upstream, queue))
    if streaming:
        sup.streams.add(queue)
    try:
        while True:
            piece = await queue.get()
            if streaming and (piece is _STOP or sup.shutting_down):
                yield sse(error_body(f"the generation was cancelled ({_SHUTDOWN_MESSAGE})",
                                     "server_error", code="shutting_down"))
                yield sse("[DONE]")
                return
            if piece is _END:
                return
            if isinstance(piece, httpx.HTTPError):
                message = _SHUTDOWN_MESSAGE if sup.shutting_down \
                    else await _stopped_during(sup, path, restarts_before)
                if streaming:  # the status line is gone: the error goes in the stream
                    yield sse(error_body(message, "server_error", code="engine_stopped"))
                    yield sse("[DONE]")
                return
            yield piece
    finally:
        sup.streams.discard(queue)
        # A client that left gets here in a cancelled scope, where an unshielded await ends at
        # once: the engine's connection stayed open, generating for no one. Closed first (the
        # engine then stops generating), then the pump, which may be inside a read of it.
        with anyio.CancelScope(shield=True):
            await upstream.aclose()
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump


async def _pump(upstream: httpx.Response, queue: asyncio.Queue[Any]) -> None:
    """The engine's answer into ``queue``, piece by piece, then _END (or the HTTPError)."""
    try:
        async for piece in upstream.aiter_raw():
            await queue.put(piece)
    except httpx.HTTPError as exc:
        await queue.put(exc)
        return
    await queue.put(_END)


async def _watch_client(request: Request, left: asyncio.Event) -> None:
    """Set ``left`` when the client disconnects (its request body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    left.set()


async def _unless_set(events: tuple[asyncio.Event, ...], work: Awaitable[T]) -> T | None:
    """``work``'s result, or None (``work`` cancelled) if one of ``events`` is set first."""
    task = asyncio.ensure_future(work)
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait({task, *waits}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
        if not task.done():
            task.cancel()  # also when this coroutine is cancelled
    try:
        return await task
    except asyncio.CancelledError:
        return None
