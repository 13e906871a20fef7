"""A client for OpenAI-compatible servers: a localspec server (or the chat app's own engine
process), llama-server, vLLM. It implements :class:`localspec.chat_engine.ChatEngine`, so a front
end holding one cannot tell it from the in-process engine.

A localspec server streams two extension fields beside OpenAI's: ``localspec.drafted`` on each
text chunk (the text the target accepted from a drafter, for the chat app's colouring) and
``localspec.stats`` on the last chunk (every statistic of the in-process ``Finished``). Other
servers send neither; then the statistics come from ``usage`` and llama-server's ``timings``.

A stream is read on a thread of its own, so that a set ``cancel`` ends it at once in any phase
(waiting for the answer to start, the prompt being processed before the first line, between
lines) and shuts the connection down, which is how the server learns to stop generating.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import httpx

from .chat_engine import (
    ChatEvent,
    ChatMessage,
    ChatOptions,
    EngineInfo,
    EngineNotReadyError,
    EngineUnreachableError,
)
from .engine.decoder import DraftSettings, Finished
from .engine.sampling import SamplingParams
from .engine.stats import GenerationStats
from .engine.text import TextChunk
from .errors import ContextOverflowError, LocalspecError

log = logging.getLogger(__name__)
FINISH_REASONS = ("stop", "length", "cancelled")
# How often a stream's reader looks at ``cancel`` while it waits for the server: Esc must stop
# an answer well within a tenth of a second, whatever the server is doing.
CANCEL_POLL_SECONDS = 0.02


class RemoteError(LocalspecError):
    """The server answered with an error, or could not be reached (or broke off)."""

    title = "Server error"

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RemoteNotReadyError(RemoteError, EngineNotReadyError):
    """The server answered 503: its engine is loading or restarting; the request was not taken."""

    title = "Engine not ready"

    def __init__(self, message: str, status: int | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message, status)
        self.retry_after = retry_after


class RemoteUnreachableError(RemoteError, EngineUnreachableError):
    """Nothing accepts connections at the server's address."""

    title = "Server unreachable"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.retry_after = None


class RemoteContextOverflowError(RemoteError, ContextOverflowError):
    """The server refused the prompt as longer than its context (as the engine here would)."""

    title = "Prompt too long"


class RemoteEngine:
    """An OpenAI-compatible endpoint. ``url`` is the server's base, with or without ``/v1``;
    ``uds`` reaches it over a unix socket (the chat app's private engine process)."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 timeout: float = 600.0, client: httpx.Client | None = None,
                 uds: str | None = None, where: str | None = None,
                 history: bool = True) -> None:
        base = url.rstrip("/")
        # False: a localspec server whose history index is not this client's to add to (the
        # chat app attached to a `serve` that keeps its own): every request turns it off.
        self._history = history
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.model = model
        self._localspec: bool | None = None
        self._meta: dict[str, Any] = {}
        self._where = where or self.base_url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        transport = httpx.HTTPTransport(uds=uds) if uds else None
        self._client = client or httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0),
                                              headers=headers, transport=transport)

    def close(self) -> None:
        self._client.close()

    @property
    def model_pid(self) -> int | None:
        return None  # a server's: another program, maybe on another machine

    def stopped(self) -> str | None:
        return None  # another process's server: its supervision is its own

    def restart(self) -> None:
        pass

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the server serves -------------------------------------------------------------------
    def list_models(self) -> list[dict[str, Any]]:
        response = self._request("GET", "/models")
        data = response.json().get("data", [])
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]

    def resolved_model(self) -> str:
        """The model to ask for: the one given, else the server's first."""
        if self.model is None or self._localspec is None:
            models = self.list_models()
            if not models:
                raise RemoteError(f"{self.base_url} lists no models")
            chosen = next((m for m in models if m["id"] == self.model), models[0])
            self.model = self.model or chosen["id"]
            self._localspec = chosen.get("owned_by") == "localspec"
            self._meta = chosen.get("meta") or {}
        return self.model

    @property
    def info(self) -> EngineInfo:
        name = self.resolved_model()
        draft = self._meta.get("draft")
        return EngineInfo(name=name, target=str(self._meta.get("target") or name),
                          draft=str(draft) if draft else None, has_draft_model=bool(draft),
                          where=self._where, placement=self._meta.get("placement"))

    # -- generating -----------------------------------------------------------------------------
    def stream_chat(self, messages: Sequence[ChatMessage], options: ChatOptions,
                    cancel: threading.Event | None = None) -> Iterator[ChatEvent]:
        """Stream a chat completion. Setting ``cancel`` closes the connection (the server then
        stops generating)."""
        body: dict[str, Any] = {"messages": [dict(m) for m in messages]}
        return self._stream("/chat/completions", body, options, cancel)

    def stream_completion(self, prompt: str, options: ChatOptions,
                          cancel: threading.Event | None = None) -> Iterator[ChatEvent]:
        """Stream a plain completion (no chat template)."""
        return self._stream("/completions", {"prompt": prompt}, options, cancel)

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            response = self._client.request(method, self.base_url + path, **kw)
        except httpx.ConnectError as exc:
            raise RemoteUnreachableError(f"cannot reach {self._where}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise RemoteError(f"cannot reach {self._where}: {exc}") from exc
        if response.status_code >= 400:
            raise _error(response)
        return response

    def _body(self, fields: dict[str, Any], options: ChatOptions) -> dict[str, Any]:
        model = self.resolved_model()  # asks the server the first time
        body = {"model": model, **fields, "max_tokens": options.max_tokens,
                **sampling_fields(options.sampling), "stream": True,
                "stream_options": {"include_usage": True}}
        if options.stop:
            body["stop"] = list(options.stop)
        if options.output is not None:
            body["response_format"] = options.output.response_format()
        if self._localspec:
            if self._meta.get("fit_max_tokens"):  # a server that predates it refuses it
                # As the engine in process does: a long conversation gets the answer its
                # context still holds, not a refusal that takes the user's message back.
                body["fit_max_tokens"] = True
            draft = options.draft
            if draft is not None and not self._history:
                draft = without_history(draft)
            if draft is not None:
                body.update(draft_fields(draft))
            elif not self._history:
                body["history"] = "off"
        return body

    def _stream(self, path: str, fields: dict[str, Any], options: ChatOptions,
                cancel: threading.Event | None) -> Iterator[ChatEvent]:
        t0 = time.perf_counter()
        reader = _StreamReader(self._client, self.base_url + path,
                               lambda: self._body(fields, options))
        complete = False
        try:
            for event in _events(reader.lines(cancel, self._where), t0):
                complete = isinstance(event, Finished)
                yield event
        finally:
            # Broken off or abandoned: the connection goes, so the server stops generating. A
            # stream read to its end leaves the connection to the pool (a cancelled one has
            # been aborted already).
            if not complete:
                reader.abort()


def sampling_fields(sp: SamplingParams) -> dict[str, Any]:
    """SamplingParams as request fields. top_k and min_p are understood by localspec, llama-server
    and vLLM; repeat_penalty by localspec and llama-server (sent only when it is used)."""
    out: dict[str, Any] = {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
                           "min_p": sp.min_p}
    if sp.frequency_penalty:
        out["frequency_penalty"] = sp.frequency_penalty
    if sp.presence_penalty:
        out["presence_penalty"] = sp.presence_penalty
    if sp.repeat_penalty != 1.0:
        out["repeat_penalty"] = sp.repeat_penalty
    if sp.seed is not None:
        out["seed"] = sp.seed
    return out


def without_history(draft: DraftSettings) -> DraftSettings:
    """``draft`` with the history off; a mode that drafts from the history alone becomes the
    default one (the draft model, prompt lookup and the history, here without the history),
    where the server would refuse it."""
    from .engine import drafters

    mode = draft.mode
    if mode in drafters.names() and drafters.get(mode).needs_history:
        mode = DraftSettings().mode
    return replace(draft, history=False, mode=mode)


def draft_fields(draft: DraftSettings) -> dict[str, Any]:
    """localspec's request extension: how this request drafts (sent to localspec servers)."""
    fields: dict[str, Any] = {"draft_mode": draft.mode,
                              "k": "auto" if draft.k is None else draft.k,
                              "k_max": draft.k_max, "accept_rule": draft.rule,
                              "exact": draft.exact}
    if not draft.history:  # only when off: a server that predates the field refuses it
        fields["history"] = "off"
    return fields


def _error(response: httpx.Response) -> RemoteError:
    code: Any = None
    try:
        err = response.json().get("error")
        message = err.get("message") if isinstance(err, dict) else str(err)
        code = err.get("code") if isinstance(err, dict) else None
    except (ValueError, AttributeError):
        message = response.text.strip()[:300]
    status = response.status_code
    text = f"server answered {status}: {message}"
    if status == 400 and code == "context_length_exceeded":
        return RemoteContextOverflowError(text, status=status)
    # A localspec serve's "engine_stopped" means its engine died answering this request: it was
    # taken (and may be what killed it), so it is not one to send again by itself.
    if status == 503 and code != "engine_stopped":
        return RemoteNotReadyError(text, status=status,
                                   retry_after=_seconds(response.headers.get("retry-after")))
    return RemoteError(text, status=status)


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: not worth parsing for a hint


class _StreamReader:
    """One streamed POST, made and read on a thread of its own into a queue. The consumer waits
    on the queue a little at a time, so a set ``cancel`` is seen within CANCEL_POLL_SECONDS
    whether or not the server sends anything; ``abort()`` shuts the socket down, which wakes the
    blocked read and tells the server that the client has gone (before the answer has begun,
    the connection is closed as soon as it does)."""

    def __init__(self, client: httpx.Client, url: str,
                 body: Callable[[], dict[str, Any]]) -> None:
        self._items: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._aborted = False
        self._socket: socket.socket | None = None
        threading.Thread(target=self._read, args=(client, url, body), daemon=True,
                         name="localspec-remote-stream").start()

    def _read(self, client: httpx.Client, url: str, body: Callable[[], dict[str, Any]]) -> None:
        try:
            # The body too is made here: it may ask the server for its model list first.
            with client.stream("POST", url, json=body()) as response:
                if not self._hold(response):
                    return
                if response.status_code >= 400:
                    response.read()
                    self._items.put(("error", _error(response)))
                    return
                for line in response.iter_lines():
                    if self._aborted:
                        return
                    self._items.put(("line", line))
            self._items.put(("end", None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self._items.put(("error", exc))

    def _hold(self, response: httpx.Response) -> bool:
        """Keep the response's socket for abort(); False if aborted already (then leaving
        the ``with`` closes the connection)."""
        stream = response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        with self._lock:
            self._socket = sock
            return not self._aborted

    def lines(self, cancel: threading.Event | None, where: str) -> Iterator[str | None]:
        """The response's lines; None once ``cancel`` is set (then nothing more is read)."""
        while True:
            if cancel is not None and cancel.is_set():
                self.abort()  # now, not when the generator is collected
                yield None
                return
            try:
                kind, value = self._items.get(
                    timeout=CANCEL_POLL_SECONDS if cancel is not None else None)
            except queue.Empty:
                continue
            if kind == "end":
                return
            if kind == "error":
                raise _translated(value, where)
            yield value

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            sock = self._socket
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed by the other side
                sock.shutdown(socket.SHUT_RDWR)


def _translated(exc: BaseException, where: str) -> BaseException:
    if isinstance(exc, httpx.ConnectError):
        return RemoteUnreachableError(f"cannot reach {where}: {exc}")
    if isinstance(exc, httpx.HTTPError):
        return RemoteError(f"the connection to {where} broke off: {exc}")
    return exc


def _events(lines: Iterator[str | None], t0: float) -> Iterator[ChatEvent]:
    parts: list[str] = []
    reason = "stop"
    usage: dict[str, Any] = {}
    timings: dict[str, Any] | None = None
    stats: dict[str, Any] | None = None
    ttft = 0.0
    done = False
    for line in lines:
        if line is None:  # cancelled: the reader has shut the connection, the server stops
            reason, done = "cancelled", True
            break
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            err = event["error"]
            raise RemoteError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        usage = event.get("usage") or usage
        timings = event.get("timings") or timings
        ext = event.get("localspec") if isinstance(event.get("localspec"), dict) else {}
        stats = ext.get("stats") or stats
        for choice in event.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            if text:
                if not parts:
                    ttft = time.perf_counter() - t0
                parts.append(text)
                yield TextChunk(text, bool(ext.get("drafted")))
            reason = choice.get("finish_reason") or reason
    if not done:
        raise RemoteError("the server closed the stream before its end")
    total = time.perf_counter() - t0
    finished = _stats(usage, timings, stats, ttft, total)
    yield Finished(text="".join(parts), tokens=(),
                   finish_reason=reason if reason in FINISH_REASONS else "stop",  # type: ignore[arg-type]
                   stats=finished)


def _stats(usage: Mapping[str, Any], timings: Mapping[str, Any] | None,
           full: dict[str, Any] | None, ttft: float, total: float) -> GenerationStats:
    """A localspec server's own statistics when it sent them (times as measured here: what this
    client waited), else what usage and llama-server's timings give."""
    if full:
        stats = GenerationStats.from_json(full)
        stats.ttft_seconds, stats.total_seconds = ttft, total
        return stats
    t = timings or {}
    return GenerationStats(prompt_tokens=int(usage.get("prompt_tokens", t.get("prompt_n", 0))),
                           completion_tokens=int(usage.get("completion_tokens",
                                                           t.get("predicted_n", 0))),
                           drafted=int(t.get("draft_n", 0)),
                           accepted=int(t.get("draft_n_accepted", 0)),
                           draft_rounds=int(t.get("draft_rounds", 0)),
                           target_passes=int(t.get("target_passes", 0)),
                           prefill_seconds=float(t.get("prompt_ms", 0.0)) / 1000,
                           ttft_seconds=ttft, total_seconds=total)
