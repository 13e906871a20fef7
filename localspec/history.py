"""Where the history drafter's indexes live, whose they are, and what seeds them.

One index per vocabulary (every model with the same token table shares it: token ids mean the
same text there) and per scope, each a file under the user's cache folder, owner-only:

  ``<cache>/history/chat/<vocabulary>.idx``   the chat app and ``run``: the user's own requests,
                                              seeded from the chat app's saved conversations
                                              whenever the file is new or was dropped (damaged)
  ``<cache>/history/serve/<vocabulary>.idx``  ``serve``: its clients' requests, apart from the
                                              chat app's conversations

``config.toml`` can join them: ``[history] serve_scope = "chat"`` makes ``serve`` draft from and
add to the chat index. The same table bounds every index: ``max_tokens`` (default a million) and
``max_bytes`` (memory, default 32 MiB; about 20 bytes a token). ``bench`` keeps its history in
memory only (a benchmark is its command line), and ``--history off`` (a flag, ``history = "off"``
in ``[chat]``, or a request's ``history`` field) neither drafts from an index nor adds to one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tomllib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from . import paths
from .engine.history_index import BYTES_PER_TOKEN, HistoryIndex
from .engine.history_store import HistoryStore
from .errors import ConfigError, LocalspecError

if TYPE_CHECKING:
    from .options import Settings

log = logging.getLogger(__name__)

CHAT, SERVE, PROCESS = "chat", "serve", "process"
SCOPES = (CHAT, SERVE)  # the scopes kept in files (PROCESS: this process's memory only)
SUFFIX = ".idx"
DEFAULT_MAX_TOKENS = 1_000_000
DEFAULT_MAX_BYTES = 32 << 20


@dataclass(frozen=True, slots=True)
class HistoryConfig:
    """``config.toml``'s ``[history]`` table."""

    serve_scope: str = SERVE
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_bytes: int = DEFAULT_MAX_BYTES


def load_config(path: Path | None = None) -> HistoryConfig:
    """The ``[history]`` table (defaults where the file or the table is missing); a bad value is
    one line naming the file, the line and the key."""
    from .config import _line_of, config_path  # the table's lines are found as [chat]'s are

    path = path or config_path()
    try:
        text = path.read_text(encoding="utf-8-sig")
        table = tomllib.loads(text).get("history", {})
    except FileNotFoundError:
        return HistoryConfig()
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return HistoryConfig()  # load_settings, which runs first, names what is wrong
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [history] must be a table")

    def bad(key: str, rule: str) -> ConfigError:
        line = _line_of(text, "history", key)
        where = f"{path}, line {line}" if line else str(path)
        return ConfigError(f"{where}: history {key} must be {rule}, got {table[key]!r}")

    values: dict[str, Any] = {}
    for key, value in table.items():
        if key == "serve_scope":
            if value not in SCOPES:
                raise bad(key, f"one of {', '.join(SCOPES)}")
        elif key in ("max_tokens", "max_bytes"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1024:
                raise bad(key, "a whole number >= 1024")
        else:
            raise ConfigError(f"{path}: unknown history setting {key!r} (known: serve_scope, "
                              "max_tokens, max_bytes)")
        values[key] = value
    return HistoryConfig(**values)


def scope_for(front: str, settings: Settings, config: HistoryConfig | None = None) -> str | None:
    """The index a front end's engine keeps: None where the settings turn the history off.
    ``front``: ``chat`` (the chat app, ``run``), ``serve`` or ``bench``."""
    if settings.history != "on":
        return None
    config = config or load_config()  # read here too: a bad value stops the command at once
    if front == "bench":
        return PROCESS
    if front == SERVE:
        return config.serve_scope
    return CHAT


# -- files -----------------------------------------------------------------------------------------
def history_dir() -> Path:
    return paths.cache_dir() / "history"


def index_path(scope: str, vocabulary: str) -> Path:
    if scope not in SCOPES:
        raise ValueError(f"no history file for scope {scope!r}")
    return history_dir() / scope / f"{vocabulary}{SUFFIX}"


def _private_dirs(scope: str) -> Path:
    """The scope's folder, created owner-only (the indexes hold users' text)."""
    folder = history_dir() / scope
    folder.mkdir(parents=True, exist_ok=True)
    for f in (history_dir(), folder):
        os.chmod(f, 0o700)
    return folder


def vocabulary_id(gguf_path: str | Path) -> str:
    """A name for a GGUF file's vocabulary: the same for every model with the same tokenizer
    and token table, whatever else differs (sizes, quantizations)."""
    from .gguf_meta import read_gguf_info

    info = read_gguf_info(gguf_path, with_tokens=True)
    digest = hashlib.sha256(f"{info.tokenizer_model}\n{info.vocab_size}\n".encode())
    if info.vocab is not None:
        digest.update(info.vocab.raw)
    return f"{info.tokenizer_model or 'vocab'}-{info.vocab_size}-{digest.hexdigest()[:16]}"


def vocabulary_size(vocabulary: str) -> int | None:
    """The size a ``vocabulary_id`` names (None for a name not of that form)."""
    parts = vocabulary.rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def open_store(scope: str, target: str | Path,
               config: HistoryConfig | None = None) -> HistoryStore:
    """The history of ``scope`` for the target's vocabulary (read now; a bad file is dropped)."""
    config = config or load_config()
    vocabulary = vocabulary_id(target)
    n_vocab = vocabulary_size(vocabulary)
    if scope == PROCESS:
        store = HistoryStore.in_memory(vocabulary, max_tokens=config.max_tokens,
                                       n_vocab=n_vocab)
        store.index.max_bytes = config.max_bytes
        return store
    _private_dirs(scope)
    return HistoryStore.open(index_path(scope, vocabulary), vocabulary,
                             max_tokens=config.max_tokens, max_bytes=config.max_bytes,
                             note=Path(target).name, n_vocab=n_vocab)


# -- seeding from the chat app's saved conversations -----------------------------------------------
class Encoder(Protocol):
    """What seeding needs of the engine: its chat template and tokenizer."""

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> str: ...

    def tokenize(self, text: str, *, chat: bool) -> tuple[int, ...]: ...


def chat_documents(engine: Encoder, token_limit: int,
                   store_path: Path | None = None) -> list[tuple[int, ...]]:
    """The saved conversations as the target sees them (each through its chat template), the
    newest that fit in ``token_limit`` tokens, oldest first. Nothing where there are none or the
    chat history cannot be read (the chat app says why when it opens it)."""
    from .chat_store import ChatStore, default_path

    store_path = store_path or default_path()
    if not store_path.is_file():
        return []  # opening would create it
    try:
        store = ChatStore(store_path)
    except LocalspecError as exc:
        log.warning("history not seeded from the saved chats: %s", exc)
        return []
    docs: list[tuple[int, ...]] = []
    total = 0
    try:
        for chat in store.list_chats():  # most recent first
            messages = [{"role": "system", "content": chat.system_prompt}] \
                if chat.system_prompt else []
            messages += [{"role": m.role, "content": m.content}
                         for m in store.messages(chat.id) if m.role in ("user", "assistant")]
            if not any(m["role"] == "assistant" for m in messages):
                continue
            try:
                tokens = engine.tokenize(engine.chat_prompt(messages), chat=True)
            except Exception as exc:  # a template that fails on one chat skips that chat
                log.info("history: chat %d not seeded: %s", chat.id, exc)
                continue
            docs.append(tokens)
            total += len(tokens)
            if total >= token_limit:
                break
    finally:
        store.close()
    return docs[::-1]


def seed_from_chats(store: HistoryStore, engine: Encoder, store_path: Path | None = None) -> int:
    """Seed a new (or rebuilt) chat index from the saved conversations; returns how many."""
    docs = chat_documents(engine, store.index.token_limit, store_path)
    added = store.seed(docs)
    if added:
        log.info("history: seeded %s with %d saved chats", store.path, added)
    return added


# -- what `localspec history` shows and clears -----------------------------------------------------
@dataclass(frozen=True, slots=True)
class IndexFile:
    """One index file as ``localspec history`` lists it."""

    scope: str
    vocabulary: str
    path: Path
    file_bytes: int
    documents: int | None  # None: not a readable index (dropped at its next use)
    tokens: int | None
    note: str

    @property
    def memory_bytes(self) -> int | None:
        return None if self.tokens is None else self.tokens * BYTES_PER_TOKEN

    def to_json(self) -> dict[str, Any]:
        return {"scope": self.scope, "vocabulary": self.vocabulary, "path": str(self.path),
                "file_bytes": self.file_bytes, "documents": self.documents,
                "tokens": self.tokens, "memory_bytes": self.memory_bytes, "model": self.note,
                "readable": self.documents is not None}


def index_files(scopes: Iterable[str] = SCOPES) -> Iterator[IndexFile]:
    for scope in scopes:
        folder = history_dir() / scope
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob(f"*{SUFFIX}")):
            try:
                size = path.stat().st_size
            except OSError:
                continue
            docs, tokens = _loadable_size(path)
            header = HistoryIndex.read_header(path)
            yield IndexFile(scope, path.stem, path, size, docs, tokens,
                            str(header.get("note", "")) if header else "")


def _loadable_size(path: Path) -> tuple[int | None, int | None]:
    """(documents, tokens) of an index file as ``HistoryIndex.load`` would read it; (None,
    None) where load would drop it, so the listing never calls a damaged file readable."""
    try:
        return HistoryIndex.verify(path, path.stem, vocabulary_size(path.stem))
    except (OSError, ValueError) as exc:
        log.debug("history index %s unreadable: %s", path, exc)
        return None, None


def clear(scopes: Iterable[str] = SCOPES) -> list[IndexFile]:
    """Empty every index of ``scopes``: each file is replaced by an empty index under a new
    epoch, which a process holding it notices before it writes again (it forgets its copy).
    Returns the files as they were."""
    cleared = []
    for info in list(index_files(scopes)):
        empty = HistoryIndex(info.vocabulary, note=info.note)
        try:
            # Under the file's lock: a running process's save cannot land between this and
            # its own read of the header, writing the cleared documents back.
            with HistoryIndex.locked(info.path):
                empty.save(info.path)
        except TimeoutError:
            raise LocalspecError(f"{info.path} is being written by another localspec process "
                                 "and stays locked; try again") from None
        cleared.append(info)
    return cleared
