"""``serve``'s front: the public HTTP endpoint, supervising an engine process behind it.

Clients talk to this process; it checks their API key and relays each request, streamed, to the
engine process (which validates, queues and generates: see ``app.py``). When the engine process
dies, the requests it was answering end with a 503 OpenAI error body naming the cause (or, in a
stream, an error event), ``/health`` says ``restarting``, and a new engine process is started with
no operator action. Requests arriving meanwhile get a 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import LocalspecError
from .engine_process import END_GRACE_SECONDS, EngineProcess, ProcessEnd
from .openai_schema import error_body, sse

log = logging.getLogger(__name__)

State = Literal["loading", "ok", "restarting", "failed"]
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
                "authorization"}


@dataclass(slots=True)
class Supervisor:
    """The engine process and what is known about it."""

    process: EngineProcess
    on_ready: Callable[[int], None] | None = None  # called with the restart count
    state: State = "loading"
    restarts: int = 0
    last_end: ProcessEnd | None = None
    error: str = ""
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def cause(self) -> str:
        return self.last_end.describe() if self.last_end else "unknown cause"

    async def run(self, poll: float = 0.1) -> None:
        """Start the engine, then restart it whenever it dies."""
        while True:
            try:
                await asyncio.to_thread(self.process.start)
            except LocalspecError as exc:
                # A load that fails (a file deleted, out of memory) is reported, then retried.
                self.state, self.error = "failed", exc.message
                log.error("engine process failed to start: %s", exc.message)
                await asyncio.sleep(5.0)
                continue
            self.state, self.error = "ok", ""
            log.info("engine process %s serving", self.process.pid)
            if self.on_ready is not None:
                self.on_ready(self.restarts)
            while (end := self.process.end()) is None:
                await asyncio.sleep(poll)
            self.last_end, self.state = end, "restarting"
            self.restarts += 1
            log.warning("engine process stopped (%s); restarting", end.describe())


def create_front_app(process: EngineProcess, *, api_key: str | None, model_id: str,
                     max_body_bytes: int,
                     on_ready: Callable[[int], None] | None = None) -> Starlette:
    """The public app over ``process`` (started and supervised by the app's lifespan);
    ``on_ready(restarts)`` runs each time an engine process starts serving."""
    sup = Supervisor(process, on_ready)
    client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=process.socket_path),
                               base_url="http://engine", timeout=httpx.Timeout(None, connect=5.0),
                               headers={"Authorization": f"Bearer {process.key}"})

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(sup.run())
        try:
            yield
        finally:
            task.cancel()
            await client.aclose()
            await asyncio.to_thread(process.close)

    async def health(request: Request) -> Response:
        body: dict[str, Any] = {"status": sup.state, "model": model_id,
                                "restarts": sup.restarts, "engine_pid": process.pid}
        if sup.last_end is not None:
            body["last_stop"] = sup.cause()
        if sup.error:
            body["error"] = sup.error
        if sup.state != "ok":
            return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        with contextlib.suppress(httpx.HTTPError, ValueError):
            inner = (await client.get("/health")).json()
            body.update({k: v for k, v in inner.items() if k in ("queue_waiting", "busy")})
        return JSONResponse(body)

    def unavailable() -> Response:
        if sup.state == "restarting":
            message = f"the engine stopped ({sup.cause()}) and is restarting; retry shortly"
        elif sup.state == "failed":
            message = f"the engine failed to start: {sup.error}"
        else:
            message = "the model is still loading; retry shortly"
        return JSONResponse(error_body(message, "server_error", code="unavailable"),
                            status_code=503, headers={"Retry-After": "2"})

    async def stopped_during(request_path: str, restarts_before: int) -> str:
        # The supervisor alone watches the process: a broken connection can arrive before it
        # has seen the exit, or after it has already started the next engine (whose end() is
        # None), so the question is whether an end was recorded since the request began.
        for _ in range(int(END_GRACE_SECONDS / 0.05)):
            if sup.restarts != restarts_before and sup.last_end is not None:
                return f"the engine stopped ({sup.last_end.describe()}) while answering; it " \
                       "restarts by itself: retry shortly"
            await asyncio.sleep(0.05)
        return f"the engine did not answer {request_path}"

    async def relay(request: Request) -> Response:
        if api_key is not None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                     api_key.encode()):
                return JSONResponse(error_body("invalid or missing API key (send "
                                               "'Authorization: Bearer KEY')",
                                               code="invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
        if sup.state != "ok":
            return unavailable()
        restarts_before = sup.restarts
        try:
            body = await _read(request, max_body_bytes)
        except ClientDisconnect:
            log.info("%s %s: the client disconnected while sending its request",
                     request.method, request.url.path)
            return Response(status_code=499)
        if body is None:
            return JSONResponse(error_body(f"the request body is larger than this server's "
                                           f"limit of {max_body_bytes} bytes (--max-body-bytes)",
                                           code="request_too_large"), status_code=413)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        upstream_request = client.build_request(request.method, request.url.path,
                                                params=request.query_params, content=body,
                                                headers=headers)
        try:
            upstream = await client.send(upstream_request, stream=True)
        except httpx.HTTPError:
            message = await stopped_during(request.url.path, restarts_before)
            return JSONResponse(error_body(message, "server_error", code="engine_stopped"),
                                status_code=503, headers={"Retry-After": "2"})
        streaming = upstream.headers.get("content-type", "").startswith("text/event-stream")

        async def forward() -> AsyncIterator[bytes]:
            try:
                async for piece in upstream.aiter_raw():
                    yield piece
            except httpx.HTTPError:
                message = await stopped_during(request.url.path, restarts_before)
                if streaming:  # the status line is gone: the error goes in the stream
                    yield sse(error_body(message, "server_error", code="engine_stopped"))
                    yield sse("[DONE]")
            finally:
                await upstream.aclose()  # a client that left: the engine stops generating

        out_headers = {k: v for k, v in upstream.headers.items()
                       if k.lower() not in _HOP_HEADERS}
        return StreamingResponse(forward(), status_code=upstream.status_code,
                                 headers=out_headers)

    routes = [Route("/health", health, methods=["GET"]),
              Route("/metrics", relay, methods=["GET"]),
              Route("/v1/{path:path}", relay, methods=["GET", "POST"])]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.supervisor = sup
    return app


async def _read(request: Request, limit: int) -> bytes | None:
    """The whole body, or None when it is over ``limit``."""
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            return None
        parts.append(part)
    return b"".join(parts)
