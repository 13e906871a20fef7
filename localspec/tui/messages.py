"""Messages the TUI's workers post: small dataclasses named as past events."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from textual.message import Message

from ..chat_engine import ChatEngine
from ..chat_store import ChatStore
from ..engine import Finished, TextChunk
from ..loading import EngineSpec
from ..models.library import LocalModel, PairStatus
from ..monitor import MachineSample


@dataclass
class ModelLoaded(Message):
    engine: ChatEngine
    spec: EngineSpec
    seconds: float


@dataclass
class ModelLoadFailed(Message):
    spec: EngineSpec
    error: Exception


@dataclass
class TokensArrived(Message):
    """A batch of streamed text (a few tokens or ~30 ms worth), in order."""

    generation: int
    chunks: tuple[TextChunk, ...]


@dataclass
class GenerationFinished(Message):
    generation: int
    finished: Finished


@dataclass
class GenerationFailed(Message):
    generation: int
    error: Exception


@dataclass
class GenerationWithdrawn(Message):
    """A message waiting for the engine was given up (Esc, or the engine did not come back)
    before anything was generated; it stays in the conversation, unanswered."""

    generation: int
    why: str


@dataclass
class EngineNotReady(Message):
    """A request was not taken (the engine is loading, restarting or gone): the generation
    waits and sends it again; the app restarts the engine if it has stopped."""

    generation: int
    reason: str


@dataclass
class EngineStopped(Message):
    """The engine process died (``reason`` says how); the app restarts it."""

    reason: str


@dataclass
class EngineRestarted(Message):
    error: Exception | None = None


@dataclass
class ChatHistoryMovedAside(Message):
    """A damaged chat database was moved to ``aside``; ``store`` is the new, empty one."""

    store: ChatStore
    aside: Path


@dataclass
class ChatHistoryMoveFailed(Message):
    error: Exception


@dataclass
class SampleTaken(Message):
    sample: MachineSample

    def can_replace(self, message: Message) -> bool:
        # Only the newest reading matters; a queued older one is dropped.
        return isinstance(message, SampleTaken)


@dataclass
class PairChecked(Message):
    pair: PairStatus


@dataclass
class PullProgressed(Message):
    name: str
    digest: str
    completed: int
    total: int
    status: str

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, PullProgressed) and message.digest == self.digest


@dataclass
class PullFinished(Message):
    name: str
    model: LocalModel | None  # None when cancelled
    error: Exception | None = None


@dataclass
class ModelsListed(Message):
    models: list[LocalModel]
    error: Exception | None = None


@dataclass
class InfoReady(Message):
    """Text for the model manager's detail pane (inspect or suggest-drafts results)."""

    title: str
    body: str


@dataclass
class WorkFailed(Message):
    """Something a screen did (a listing, a pull, an export) failed. Screens let it bubble up to
    the app, which shows it in a modal: errors are shown at one edge, not in every screen."""

    error: Exception


@dataclass
class ChatDeleted(Message):
    """A saved chat was deleted; the app has the chat screen start afresh if it showed it."""

    chat_id: int


@dataclass
class EstimateReady(Message):
    pair: str
    estimate: Any  # library.MemoryEstimate
