"""One way to name a model everywhere (run, bench, pairs): a ``.gguf`` path or an Ollama name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import DamagedModelError, GGUFError, LocalspecError
from . import ollama_store


def is_path_ref(ref: str) -> bool:
    """True when ``ref`` names a file rather than an Ollama model: it looks like a path (see
    ``looks_like_path``), or it is a file here and no model in the store has that name. A
    folder never is, and a stray file named like a model (``./llama3``) does not hide the model:
    ``./llama3`` reaches the file."""
    if looks_like_path(ref):
        return True
    return _on_disk(Path(ref).expanduser(), Path.is_file) and not _in_store(ref)


def _in_store(ref: str) -> bool:
    """Whether the Ollama store has a model called ``ref`` (whole or damaged)."""
    try:
        ollama_store.resolve(ref)
    except DamagedModelError:
        return True
    except (LocalspecError, ValueError):
        return False
    return True


def looks_like_path(ref: str) -> bool:
    """True when ``ref`` is written as a file, whatever is on disk: it ends in ``.gguf`` or
    starts like a path (``/``, ``./``, ``../``, ``~``)."""
    return ref.lower().endswith(".gguf") or ref.startswith(("/", "./", "../", "~"))


def _on_disk(path: Path, check: Callable[[Path], bool] = Path.exists) -> bool:
    # A name no file can have (too long, a NUL byte in it) is not a file, not an error: a
    # prompt typed where a pair name goes must get the usual "no such pair" line.
    try:
        return check(path)
    except (OSError, ValueError):
        return False


def resolve_model(ref: str) -> Path:
    """The GGUF file for ``ref``: a path as is, otherwise an Ollama name's blob in the store.

    The one resolver every command uses. Raises GGUFError for a path that is missing or not a
    file, ModelNotFoundError for a name that is not in the store. The file itself is validated
    by ``gguf_meta`` before llama.cpp sees it.
    """
    if is_path_ref(ref):
        path = Path(ref).expanduser()
        if not _on_disk(path):
            raise GGUFError(f"{path}: no such file")
        if not path.is_file():
            raise GGUFError(f"{path}: not a file")
        return path
    return ollama_store.resolve(ref).gguf_path


def display_name(ref: str) -> str:
    """A short label: the file name for a path, Ollama's short form for a model name."""
    if is_path_ref(ref):
        return Path(ref).name
    try:
        return ollama_store.parse_name(ref).short
    except Exception:  # an unparsable name is still shown as the user typed it
        return ref
