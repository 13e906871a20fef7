"""One engine, many clients: a single worker thread owns the engine and serves a bounded queue.

The engine is not thread-safe, and llama-cpp-python shares buffers between tokenizing, detokenizing
and decoding, so *everything* that touches the engine runs on this one thread: generations (one at
a time, from the queue) and short calls such as tokenizing a prompt (``call``), which run between
two decoding steps so that a request is validated without waiting for the current generation.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union

from ..engine.decoder import Finished, GenerationRequest
from ..engine.stats import GenerationStats
from ..engine.text import TextChunk
from ..errors import LocalspecError

if TYPE_CHECKING:
    from ..engine.decoder import SpeculativeEngine

log = logging.getLogger(__name__)

T = TypeVar("T")
WorkerState = Literal["loading", "ready", "failed", "closed"]


@dataclass(frozen=True, slots=True)
class JobFailed:
    """The last event of a job whose generation raised."""

    error: BaseException


JobEvent = Union[TextChunk, Finished, JobFailed]
Sink = Callable[[JobEvent], None]


class QueueFullError(LocalspecError):
    """Every queue slot is taken; the client should retry later."""

    title = "Server busy"


class EngineUnavailableError(LocalspecError):
    """The engine is still loading, failed to load, or the server is shutting down."""

    title = "Engine unavailable"


@dataclass(slots=True, eq=False)
class Job:
    """One queued generation. ``sink`` receives its events on the worker thread, in order,
    ending with one ``Finished`` or ``JobFailed``; setting ``cancel`` stops it at the next step."""

    request: GenerationRequest
    sink: Sink
    cancel: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.monotonic)


class EngineWorker:
    """The thread that owns the engine.

    ``engine_or_factory`` is a loaded engine (the caller keeps ownership and closes it) or a
    zero-argument callable that loads one on the worker thread (the worker then closes it).
    """

    def __init__(self, engine_or_factory: SpeculativeEngine | Callable[[], SpeculativeEngine],
                 queue_size: int, name: str = "localspec-engine") -> None:
        if callable(engine_or_factory):
            self._factory: Callable[[], SpeculativeEngine] | None = engine_or_factory
            self.engine: SpeculativeEngine | None = None
        else:
            self._factory = None
            self.engine = engine_or_factory
        self.queue_size = queue_size
        self.state: WorkerState = "loading"
        self.load_error: BaseException | None = None
        self.loaded = threading.Event()  # set once the state leaves "loading"
        self._cv = threading.Condition()
        self._jobs: collections.deque[Job] = collections.deque()
        self._calls: collections.deque[tuple[Callable[[], Any], Future[Any]]] = \
            collections.deque()
        self._current: Job | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- from any thread ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def queued(self) -> int:
        """Jobs waiting (not counting the one generating)."""
        with self._cv:
            return sum(not j.cancel.is_set() for j in self._jobs)

    @property
    def busy(self) -> bool:
        return self._current is not None

    def submit(self, request: GenerationRequest, sink: Sink) -> Job:
        """Queue a generation. Raises QueueFullError or EngineUnavailableError."""
        self._check_available()
        job = Job(request, sink)
        with self._cv:
            # A client that gave up while waiting must not hold its slot. Its job still ends
            # with an event, as every job does: its handler is waiting for one.
            given_up = [j for j in self._jobs if j.cancel.is_set()]
            self._jobs = collections.deque(j for j in self._jobs if not j.cancel.is_set())
            queued = len(self._jobs)
            full = queued + (self._current is not None) > self.queue_size
            if not full:
                self._jobs.append(job)
                self._cv.notify()
        for dropped in given_up:
            _emit(dropped, _cancelled(dropped))
        if full:
            raise QueueFullError(f"{queued} requests are already waiting for the engine; "
                                 "retry later")
        return job

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run a short function on the worker thread, between decoding steps (tokenizing, not
        generating: a generation in progress holds the engine)."""
        self._check_available()
        fut: Future[T] = Future()
        with self._cv:
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut

    def close(self, timeout: float | None = 30.0) -> None:
        """Cancel every job, stop the thread, and close the engine if this worker loaded it."""
        with self._cv:
            self._closing = True
            for job in self._jobs:
                job.cancel.set()
            if self._current is not None:
                self._current.cancel.set()
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.state = "closed"

    def _check_available(self) -> None:
        if self._closing or self.state == "closed":
            raise EngineUnavailableError("the server is shutting down")
        if self.state == "loading":
            raise EngineUnavailableError("the model is still loading; retry shortly")
        if self.state == "failed":
            raise EngineUnavailableError(f"the model failed to load: {self.load_error}")

    # -- on the worker thread -------------------------------------------------------------------
    def _run(self) -> None:
        if self._factory is not None:
            try:
                self.engine = self._factory()
            except BaseException as exc:  # noqa: BLE001 - reported through /health and 503s
                log.error("engine failed to load: %s", exc)
                self.load_error = exc
                self.state = "failed"
                self.loaded.set()
                return
        self.state = "ready"
        self.loaded.set()
        try:
            self._serve()
        finally:
            self._drain_jobs()
            if self._factory is not None and self.engine is not None:
                self.engine.close()

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not (self._calls or self._jobs or self._closing):
                    self._cv.wait()
                if self._closing:
                    break
                job = None if self._calls else self._jobs.popleft()
            if job is None:
                self._run_calls()
            else:
                self._generate(job)

    def _run_calls(self) -> None:
        while True:
            with self._cv:
                if not self._calls:
                    return
                fn, fut = self._calls.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    def _generate(self, job: Job) -> None:
        if job.cancel.is_set():
            _emit(job, _cancelled(job))
            return
        assert self.engine is not None
        self._current = job
        stream = self.engine.stream(job.request, job.cancel)
        try:
            for event in stream:
                _emit(job, event)
                if isinstance(event, Finished):
                    break  # close the stream (and free the engine) before any call runs
                self._run_calls()  # keep validation of new requests responsive
        except Exception as exc:  # noqa: BLE001 - the client gets it as an error body
            log.debug("generation failed", exc_info=True)
            _emit(job, JobFailed(exc))
        finally:
            stream.close()
            self._current = None

    def _drain_jobs(self) -> None:
        with self._cv:
            jobs, self._jobs = list(self._jobs), collections.deque()
            calls, self._calls = list(self._calls), collections.deque()
        for job in jobs:
            _emit(job, _cancelled(job))
        for _fn, fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineUnavailableError("the server is shutting down"))


def _cancelled(job: Job) -> Finished:
    return Finished(text="", tokens=(), finish_reason="cancelled",
                    stats=GenerationStats(prompt_tokens=len(job.request.prompt_tokens)))


def _emit(job: Job, event: JobEvent) -> None:
    try:
        job.sink(event)
    except Exception:  # noqa: BLE001 - a broken sink must not kill the engine thread
        log.exception("event sink failed; cancelling its job")
        job.cancel.set()
