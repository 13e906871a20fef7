"""Errors with a user-facing title and message, rendered only at the edges (CLI, TUI, server)."""

from __future__ import annotations

from pathlib import Path


class LocalspecError(Exception):
    """An error a user can act on. ``str(err)`` is one line that says what to do."""

    title = "localspec error"

    def __init__(self, message: str, title: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if title is not None:
            self.title = title

    def __str__(self) -> str:
        return self.message


class GGUFError(LocalspecError):
    """A file is not a usable GGUF model (missing, truncated, corrupt, wrong kind)."""

    title = "Invalid model file"


class DamagedModelError(GGUFError):
    """A model's manifest is present but a blob it names is missing or has the wrong size.

    ``problem`` is the damage alone (which blob, what is wrong), for listings that add their own
    advice; ``str(err)`` is the whole line, naming the model and the repair.
    """

    title = "Damaged model"

    def __init__(self, message: str, problem: str = "") -> None:
        super().__init__(message)
        self.problem = problem or message


class IncompatiblePairError(LocalspecError):
    """Draft and target do not share a vocabulary, so the draft cannot propose target tokens."""

    title = "Incompatible pair"


class ModelLoadError(LocalspecError):
    """llama.cpp refused to load a model that passed validation (e.g. out of memory)."""

    title = "Model failed to load"


class ChatTemplateError(LocalspecError):
    """A model's chat template that Jinja cannot compile or render. ``problem`` says what failed;
    ``message`` adds what the command line can do about it (a server says its own remedy)."""

    title = "Chat template"

    def __init__(self, problem: str, remedy: str) -> None:
        super().__init__(f"{problem}; {remedy}")
        self.problem = problem


class ContextOverflowError(LocalspecError):
    """The prompt (plus the requested tokens) does not fit the context window."""

    title = "Prompt too long"


class UnencodableTextError(LocalspecError):
    """Text with a character that the model's SentencePiece vocabulary has no token for and no
    byte-fallback token either: llama.cpp aborts the process on it, so it is refused first."""

    title = "Text outside the vocabulary"


class DraftSettingsError(LocalspecError):
    """A request's drafting settings that cannot apply to the models loaded (a drafter that
    needs the history this request turns off, or a draft model there is none of): the
    asker's to change, so a 400 from the server."""

    title = "Drafting settings"


class ConfigError(LocalspecError):
    """A configuration or catalogue file is malformed."""

    title = "Configuration error"


class ModelNotFoundError(LocalspecError):
    """A model name resolves to nothing (no file, no Ollama manifest, no catalogue pair)."""

    title = "Model not found"


class PullError(LocalspecError):
    """Pulling a model failed (network, registry, checksum, disk)."""

    title = "Pull failed"


class ChatStoreError(LocalspecError):
    """The chat database cannot be opened (a folder in its place, no permission, locked)."""

    title = "Chat history unavailable"


class DamagedChatStoreError(ChatStoreError):
    """The chat database is not one SQLite can read (random bytes, a torn page).

    ``path`` and ``reason`` stay apart from the message so the app can ask what to do with the
    file; ``hint`` (optional) ends the one line with what the user can run.
    """

    title = "Damaged chat history"

    def __init__(self, path: Path, reason: str, hint: str = "") -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path} is damaged ({reason})" + (f"; {hint}" if hint else ""))


class EngineStoppedError(LocalspecError):
    """The engine process died; the message says how (signal, phase, model)."""

    title = "Engine stopped"
