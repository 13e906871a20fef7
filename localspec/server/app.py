"""The ASGI app: OpenAI-compatible routes over one engine worker.

Handlers never touch the engine: they validate, hand work to the ``EngineWorker`` thread and await
its events through an asyncio queue fed with ``loop.call_soon_threadsafe``, so the event loop
stays free for other clients while a generation runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..engine.decoder import Finished
from ..engine.text import TextChunk
from ..errors import (
    ChatTemplateError,
    ContextOverflowError,
    DraftSettingsError,
    LocalspecError,
    UnencodableTextError,
)
from ..requests import ChatOptions, build_request
from .access import authorize, http_error, read_body
from .config import ServerConfig
from .metrics import Metrics
from .openai_schema import (
    ApiError,
    Kind,
    ParsedRequest,
    chunk,
    fit_context,
    full_response,
    models_list,
    new_id,
    parse_request,
    request_options,
    sse,
    tool_error,
    usage_chunk,
)
from .queue import EngineUnavailableError, EngineWorker, Job, JobEvent, JobFailed, QueueFullError
from .tool_calls import (
    ToolCallStream,
    ToolError,
    ToolFormat,
    call_deltas,
    call_opener,
    call_tags,
    forced_calls,
    held_calls,
    tool_format,
)

if TYPE_CHECKING:
    from ..engine.decoder import GenerationRequest, SpeculativeEngine

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class ServerState:
    """What the handlers share: the worker, the settings, the counters."""

    worker: EngineWorker
    config: ServerConfig
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))
    _names: tuple[str, ...] | None = None

    def model_names(self) -> tuple[str, ...]:
        """The id first, then every other name a request may use."""
        if self._names is None:
            names = [self.config.model_id, *self.config.aliases]
            engine = self.worker.engine
            if engine is not None and self.worker.state == "ready":
                meta_name = engine.target.meta("general.name")
                names += [n for n in (meta_name, engine.target.path.stem, engine.target.path.name)
                          if n]
                self._names = tuple(dict.fromkeys(names))
            return tuple(dict.fromkeys(names))
        return self._names

    def model_meta(self) -> dict[str, Any]:
        engine = self.worker.engine
        if engine is None or self.worker.state != "ready":
            return {}
        return {"target": str(engine.target.path),
                "draft": str(engine.draft.path) if engine.draft is not None else None,
                "n_ctx": engine.target.n_ctx, "n_vocab": engine.target.n_vocab,
                "draft_mode": self.config.draft.mode, "placement": engine.placement,
                # Request fields newer than the first servers, which refuse them: a client
                # sends one only where its server says it takes it.
                "fit_max_tokens": True}

    def retry_after(self) -> str:
        waiting = self.worker.queued + 1
        return str(max(1, min(600, math.ceil(self.metrics.mean_generation_seconds() * waiting))))


def create_app(engine_or_factory: SpeculativeEngine | Callable[[], SpeculativeEngine],
               config: ServerConfig) -> Starlette:
    """The server app. A factory is called on the engine thread at startup (``/health`` says
    ``loading`` meanwhile) and its engine is closed at shutdown; a given engine is not closed."""
    config.validate()
    state = ServerState(EngineWorker(engine_or_factory, config.queue_size), config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        state.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.worker.close)

    routes = [
        Route("/health", _endpoint(_health, auth=False), methods=["GET"]),
        Route("/metrics", _endpoint(_metrics), methods=["GET"]),
        Route("/v1/models", _endpoint(_models), methods=["GET"]),
        Route("/v1/models/{model:path}", _endpoint(_model), methods=["GET"]),
        Route("/v1/chat/completions", _endpoint(_chat), methods=["POST"]),
        Route("/v1/completions", _endpoint(_completions), methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(_NoTrailingSlash)],
                    exception_handlers={HTTPException: http_error})  # type: ignore[dict-item]
    app.state.localspec = state
    return app


class _NoTrailingSlash:
    """Serves ``/v1/chat/completions/`` as ``/v1/chat/completions``. Starlette would answer a
    307 to the slashless URL built from the request's Host, which behind ``serve``'s front is
    the engine's private socket (``http://engine/...``): a client that follows it fails."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}
        await self.app(scope, receive, send)


# -- plumbing ----------------------------------------------------------------------------------
Handler = Callable[[Request, ServerState], Any]


class _ClientGone(Exception):
    """The client disconnected before its answer was ready: nothing to send, and not an error
    of the server's (its generation is counted as cancelled)."""


# nginx's "client closed request". Never sent (uvicorn drops writes to a closed connection);
# returning a response rather than raising keeps the exception out of uvicorn's error log.
_CLIENT_CLOSED = 499


def _endpoint(fn: Handler, auth: bool = True) -> Callable[[Request], Any]:
    """Wrap a handler: API key check, ApiError to an OpenAI error body (counted), a client
    that went away to one log line, and any other exception to a 500 body. Answering, rather
    than letting an exception reach uvicorn, keeps the connection usable for the next request."""
    async def handler(request: Request) -> Response:
        state: ServerState = request.app.state.localspec
        try:
            if auth:
                authorize(request, state.config)
            response: Response = await fn(request, state)
            return response
        except ApiError as err:
            state.metrics.error(err.status)
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        except ClientDisconnect:
            log.info("%s %s: the client disconnected while sending its request",
                     request.method, request.url.path)
            return Response(status_code=_CLIENT_CLOSED)
        except _ClientGone:
            return Response(status_code=_CLIENT_CLOSED)
        except Exception as exc:  # noqa: BLE001 - a bug must cost one request, not the connection
            internal = _internal_error(exc, f"{request.method} {request.url.path}")
            state.metrics.error(internal.status)
            return JSONResponse(internal.body(), status_code=internal.status)
    return handler


def _internal_error(exc: Exception, where: str) -> ApiError:
    """An unexpected exception: one log line (the traceback only at debug level)."""
    log.error("%s failed: %s: %s", where, type(exc).__name__, exc)
    log.debug("%s failed", where, exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", type="server_error")


async def _read_json(request: Request, config: ServerConfig) -> Any:
    body = await read_body(request, config)
    try:
        return json.loads(body)
    except RecursionError as exc:  # e.g. b"[" * 100_000: the decoder recurses per level
        raise ApiError(400, "the request body is not valid JSON (nested too deeply)") from exc
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from exc


async def _on_engine(state: ServerState, fn: Callable[[], T]) -> T:
    """Run a short function on the engine thread; engine errors become 4xx/5xx bodies."""
    try:
        fut = state.worker.call(fn)
    except EngineUnavailableError as exc:
        raise _unavailable(state, exc) from exc
    try:
        return await asyncio.wrap_future(fut)
    except EngineUnavailableError as exc:
        raise _unavailable(state, exc) from exc


def _unavailable(state: ServerState, exc: EngineUnavailableError) -> ApiError:
    return ApiError(503, exc.message, type="server_error", code="unavailable",
                    headers={"Retry-After": state.retry_after()})


def _failure(error: BaseException) -> ApiError:
    """An exception raised by the engine during a generation, as the client will see it."""
    if isinstance(error, ContextOverflowError):
        return ApiError(400, error.message, code="context_length_exceeded")
    if isinstance(error, ChatTemplateError):
        # The template is the model's, but what breaks it (roles out of the order it demands,
        # say) is in the request: the client can change its messages or send plain text.
        return ApiError(400, f"{error.problem} for these messages; /v1/completions takes the "
                             "prompt as plain text", param="messages", code="invalid_value")
    if isinstance(error, ValueError):
        return ApiError(400, str(error))
    if isinstance(error, UnencodableTextError):
        return ApiError(400, error.message, code="invalid_value")
    if isinstance(error, DraftSettingsError):
        return ApiError(400, error.message, param="draft_mode")
    if isinstance(error, LocalspecError):
        return ApiError(500, error.message, type="server_error")
    log.error("generation failed: %r", error)
    return ApiError(500, f"internal error: {type(error).__name__}", type="server_error")


class _Events:
    """The events of one job, moved from the engine thread onto the event loop."""

    def __init__(self, metrics: Metrics) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[JobEvent] = asyncio.Queue()
        self._metrics = metrics

    def sink(self, event: JobEvent) -> None:  # on the engine thread
        self.loop.call_soon_threadsafe(self._deliver, event)

    def _deliver(self, event: JobEvent) -> None:
        # Counted here, not by the reader: a disconnected client's generation still counts.
        if isinstance(event, Finished):
            self._metrics.observe(event)
        self.queue.put_nowait(event)


class _DisconnectWatch:
    """Cancels a job when its client goes away, freeing the engine for the next request, and
    remembers that it did: a generation cancelled for a departed client is not an error, one
    cancelled by the server (shutting down) is."""

    def __init__(self, request: Request, job: Job) -> None:
        self.client_gone = False
        self._task = asyncio.create_task(self._watch(request, job))

    async def _watch(self, request: Request, job: Job) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.client_gone = True
                if not job.cancel.is_set():
                    log.info("client disconnected; cancelling its generation")
                job.cancel.set()
                return

    def stop(self) -> None:
        self._task.cancel()


# -- routes ------------------------------------------------------------------------------------
async def _health(request: Request, state: ServerState) -> Response:
    worker = state.worker
    if worker.state == "ready":
        placement = worker.engine.placement if worker.engine is not None else None
        return JSONResponse({"status": "ok", "model": state.config.model_id,
                             "queue_waiting": worker.queued, "busy": worker.busy,
                             "placement": placement})
    if worker.state == "failed":
        # The title too: an engine process's owner raises the error as it was (a bad file is
        # "Invalid model file" in the chat app, whichever process found it).
        title = getattr(worker.load_error, "title", None)
        return JSONResponse({"status": "error", "error": str(worker.load_error),
                             **({"title": title} if title else {})}, status_code=500)
    return JSONResponse({"status": worker.state}, status_code=503,
                        headers={"Retry-After": "1"})


async def _metrics(request: Request, state: ServerState) -> Response:
    waiting, busy = state.worker.queued, state.worker.busy
    if request.query_params.get("format") == "json" \
            or "application/json" in request.headers.get("accept", ""):
        return JSONResponse(state.metrics.to_json(waiting, busy))
    return PlainTextResponse(state.metrics.to_prometheus(waiting, busy),
                             media_type="text/plain; version=0.0.4")


async def _models(request: Request, state: ServerState) -> Response:
    return JSONResponse(_listing(state))


def _listing(state: ServerState) -> dict[str, Any]:
    names = state.model_names()
    return models_list(names[0], names[1:], state.config.owned_by, state.created,
                       state.model_meta())


async def _model(request: Request, state: ServerState) -> Response:
    """``/v1/models/NAME`` (the SDKs' ``models.retrieve``): the model, by any name it answers
    to; 404 naming them otherwise."""
    _check_model(request.path_params["model"], state)
    return JSONResponse(_listing(state)["data"][0])


async def _chat(request: Request, state: ServerState) -> Response:
    return await _generate(request, state, "chat")


async def _completions(request: Request, state: ServerState) -> Response:
    return await _generate(request, state, "completion")


async def _generate(request: Request, state: ServerState, kind: Kind) -> Response:
    state.metrics.request(kind)
    parsed = parse_request(await _read_json(request, state.config), kind, state.config)
    model = _check_model(parsed.model, state)
    engine = state.worker.engine
    if engine is None or state.worker.state != "ready":
        raise _unavailable(state, EngineUnavailableError("the model is not loaded"))
    fmt: ToolFormat = "tagged"  # the calls' format, where tools were offered
    if parsed.tools or parsed.tool_turns:
        try:
            fmt = tool_format(engine.target.chat_template, model)
            tools = parsed.tool_request
            if tools.held:
                tags = call_tags(engine.target.special_token) if fmt == "tagged" else None
                output = forced_calls(tools, fmt, tags) if tools.forced else \
                    held_calls(tools, fmt, tags, call_opener(fmt, engine.target.control_token))
                parsed = replace(parsed, output=output)
        except ToolError as exc:
            raise tool_error(exc) from None
    options = request_options(parsed, state.config)
    try:
        built = await _on_engine(state, lambda: _build(engine, parsed, options))
    except (LocalspecError, ValueError) as exc:  # text the model cannot take is the asker's
        raise _failure(exc) from None
    gen = fit_context(built, parsed, engine.target.n_ctx, state.config)
    try:  # here, not on the engine thread: a stream's status line is still to be sent
        gen.draft.validate(engine.draft is not None)
    except DraftSettingsError as exc:
        raise _failure(exc) from None
    events = _Events(state.metrics)
    try:
        job = state.worker.submit(gen, events.sink)
    except QueueFullError as exc:
        raise ApiError(429, exc.message, type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": state.retry_after()}) from exc
    except EngineUnavailableError as exc:
        raise _unavailable(state, exc) from exc
    watch = _DisconnectWatch(request, job)
    rid = new_id(kind)
    if parsed.stream:
        return StreamingResponse(_stream(state, parsed, fmt, rid, model, job, events,
                                         watch),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})
    try:
        done = await _collect(events, watch)
    finally:
        watch.stop()
        job.cancel.set()  # no-op when finished; stops the engine if this handler is cancelled
    return JSONResponse(full_response(kind, rid, model, done, parsed.tool_names, fmt))


def _check_model(name: str | None, state: ServerState) -> str:
    names = state.model_names()
    if name is None:
        return names[0]
    if name in names:
        return name
    raise ApiError(404, f"the model '{name}' does not exist; this server serves "
                        f"'{names[0]}' (also known as: {', '.join(names[1:]) or 'nothing else'})",
                   param="model", code="model_not_found")


def _build(engine: SpeculativeEngine, parsed: ParsedRequest,
           options: ChatOptions) -> GenerationRequest:
    """On the engine thread (it tokenizes): the engine's request, as every front end builds
    it."""
    if parsed.messages is not None:
        return build_request(engine, parsed.messages, options)
    if parsed.prompt is not None:
        return build_request(engine, parsed.prompt, options)
    assert parsed.prompt_tokens is not None
    try:
        engine.check_prompt_tokens(parsed.prompt_tokens)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="prompt") from None
    return build_request(engine, parsed.prompt_tokens, options)


def _shutdown_cancelled() -> ApiError:
    return ApiError(503, "the generation was cancelled (server shutting down)",
                    type="server_error", code="cancelled")


async def _collect(events: _Events, watch: _DisconnectWatch) -> Finished:
    while True:
        event = await events.queue.get()
        if isinstance(event, Finished):
            if event.finish_reason == "cancelled":
                if watch.client_gone:
                    raise _ClientGone
                raise _shutdown_cancelled()
            return event
        if isinstance(event, JobFailed):
            raise _failure(event.error)


async def _stream(state: ServerState, parsed: ParsedRequest, fmt: ToolFormat, rid: str,
                  model: str, job: Job, events: _Events,
                  watch: _DisconnectWatch) -> AsyncIterator[bytes]:
    # The status line (200) is sent with the first event: an error from here on can only be
    # an error event, and is counted like an error status.
    kind = parsed.kind
    # Where the model was shown tools, a call is held back from the content and sent whole;
    # where a grammar holds the calls, each is sent as it is written.
    calling = ToolCallStream(parsed.tool_names, fmt, parsed.tool_request.held) \
        if parsed.tools else None
    try:
        if kind == "chat":
            yield sse(chunk(kind, rid, model, "", first=True))
        while True:
            event = await events.queue.get()
            if isinstance(event, TextChunk):
                text = calling.feed(event.text) if calling is not None else event.text
                if text:
                    yield sse(chunk(kind, rid, model, text, drafted=event.drafted))
                pieces = calling.pieces() if calling is not None else []
                if pieces:
                    yield sse(chunk(kind, rid, model, pieces=pieces))
                continue
            if isinstance(event, Finished) and event.finish_reason != "cancelled":
                tail, calls = calling.finish() if calling is not None else ("", [])
                if tail:
                    yield sse(chunk(kind, rid, model, tail))
                streamed = calling.streamed if calling is not None else 0
                if calls[streamed:]:
                    yield sse(chunk(kind, rid, model,
                                    pieces=call_deltas(calls[streamed:], streamed)))
                # Calls sent in pieces were calls, even where the whole did not read back as
                # them (cut short by max_tokens, which the finish says instead).
                called = bool(calls) or (streamed > 0 and event.finish_reason != "length")
                yield sse(chunk(kind, rid, model, done=event, called=called))
                if parsed.include_usage:
                    yield sse(usage_chunk(kind, rid, model, event))
                break
            if isinstance(event, Finished) and watch.client_gone:
                return  # nobody to tell; counted as cancelled when the event arrived
            err = _shutdown_cancelled() if isinstance(event, Finished) \
                else _failure(event.error)
            held = calling.release() if calling is not None else ""
            if held:  # what the model wrote is sent, call or not, before the error
                yield sse(chunk(kind, rid, model, held))
            state.metrics.error(err.status)
            yield sse(err.body())
            break
    except Exception as exc:  # noqa: BLE001 - as in _endpoint: one event, not a dropped stream
        internal = _internal_error(exc, f"streaming {rid}")
        state.metrics.error(internal.status)
        yield sse(internal.body())
    finally:
        # Reached also when the client disconnects (the response task is cancelled).
        job.cancel.set()
        watch.stop()
    yield sse("[DONE]")
