"""A small client for OpenAI-compatible servers: a localspec server, llama-server, vLLM.

It lets ``bench`` and the TUI point at a running server (``--url``) and stream the same events
as the in-process engine: ``TextChunk``s, then one ``RemoteFinished``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from .engine.sampling import SamplingParams
from .engine.stats import GenerationStats
from .engine.text import TextChunk
from .errors import LocalspecError

log = logging.getLogger(__name__)
_GREEDY = SamplingParams()


class RemoteError(LocalspecError):
    """The server answered with an error, or could not be reached."""

    title = "Server error"

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class RemoteFinished:
    """The last event of a remote stream.

    ``stats`` combines what the server reported (usage; ``timings`` from localspec or
    llama-server, absent from vLLM) with the times measured here (TTFT, total).
    ``timings`` is the server's own dict, or None.
    """

    text: str
    finish_reason: str
    stats: GenerationStats = field(compare=False)
    timings: dict[str, Any] | None = field(default=None, compare=False)


class RemoteEngine:
    """An OpenAI-compatible endpoint. ``url`` is the server's base, with or without ``/v1``."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 timeout: float = 600.0, client: httpx.Client | None = None) -> None:
        base = url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = client or httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0),
                                              headers=headers)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def list_models(self) -> list[str]:
        """The model ids the server lists."""
        response = self._request("GET", "/models")
        return [m["id"] for m in response.json().get("data", [])]

    def resolved_model(self) -> str:
        """The model to ask for: the one given, else the server's first."""
        if self.model is None:
            models = self.list_models()
            if not models:
                raise RemoteError(f"{self.base_url} lists no models")
            self.model = models[0]
        return self.model

    def stream_chat(self, messages: Sequence[Mapping[str, str]], max_tokens: int = 256,
                    sampling: SamplingParams = _GREEDY, stop: Sequence[str] = (),
                    cancel: threading.Event | None = None
                    ) -> Iterator[TextChunk | RemoteFinished]:
        """Stream a chat completion. Setting ``cancel`` closes the connection (the server then
        stops generating)."""
        body = {"messages": [dict(m) for m in messages]}
        return self._stream("/chat/completions", body, max_tokens, sampling, stop, cancel)

    def stream_completion(self, prompt: str, max_tokens: int = 256,
                          sampling: SamplingParams = _GREEDY, stop: Sequence[str] = (),
                          cancel: threading.Event | None = None
                          ) -> Iterator[TextChunk | RemoteFinished]:
        """Stream a plain completion (no chat template)."""
        return self._stream("/completions", {"prompt": prompt}, max_tokens, sampling, stop,
                            cancel)

    # -- internals ----------------------------------------------------------------------------
    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            response = self._client.request(method, self.base_url + path, **kw)
        except httpx.HTTPError as exc:
            raise RemoteError(f"cannot reach {self.base_url}: {exc}") from exc
        if response.status_code >= 400:
            raise _error(response)
        return response

    def _stream(self, path: str, body: dict[str, Any], max_tokens: int,
                sampling: SamplingParams, stop: Sequence[str],
                cancel: threading.Event | None) -> Iterator[TextChunk | RemoteFinished]:
        body = {"model": self.resolved_model(), **body, "max_tokens": max_tokens,
                **sampling_fields(sampling), "stream": True,
                "stream_options": {"include_usage": True}}
        if stop:
            body["stop"] = list(stop)
        t0 = time.perf_counter()
        try:
            with self._client.stream("POST", self.base_url + path, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _error(response)
                yield from _events(response, t0, cancel)
        except httpx.HTTPError as exc:
            raise RemoteError(f"connection to {self.base_url} failed: {exc}") from exc


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


def _error(response: httpx.Response) -> RemoteError:
    try:
        err = response.json().get("error")
        message = err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        message = response.text.strip()[:300]
    return RemoteError(f"server answered {response.status_code}: {message}",
                       status=response.status_code)


def _events(response: httpx.Response, t0: float,
            cancel: threading.Event | None) -> Iterator[TextChunk | RemoteFinished]:
    parts: list[str] = []
    reason = "stop"
    usage: dict[str, Any] = {}
    timings: dict[str, Any] | None = None
    ttft = 0.0
    for line in response.iter_lines():
        if cancel is not None and cancel.is_set():
            reason = "cancelled"
            break  # leaving the `with` closes the connection: the server cancels
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            err = event["error"]
            raise RemoteError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        usage = event.get("usage") or usage
        timings = event.get("timings") or timings
        for choice in event.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            if text:
                if not parts:
                    ttft = time.perf_counter() - t0
                parts.append(text)
                yield TextChunk(text)
            reason = choice.get("finish_reason") or reason
    total = time.perf_counter() - t0
    yield RemoteFinished(text="".join(parts), finish_reason=reason,
                         stats=_stats(usage, timings, ttft, total), timings=timings)


def _stats(usage: Mapping[str, Any], timings: Mapping[str, Any] | None, ttft: float,
           total: float) -> GenerationStats:
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
