"""One way to name a model everywhere (run, bench, pairs): a ``.gguf`` path or an Ollama name."""

from __future__ import annotations

from pathlib import Path

from . import ollama_store
from .errors import GGUFError


def is_path_ref(ref: str) -> bool:
    """True when ``ref`` names a file rather than an Ollama model."""
    path = Path(ref).expanduser()
    return ref.lower().endswith(".gguf") or path.is_file()


def resolve_model(ref: str) -> Path:
    """The GGUF file for ``ref``: an existing file as is, otherwise an Ollama name's blob.

    Raises GGUFError for a missing ``.gguf`` path and ModelNotFoundError for an unknown name.
    """
    path = Path(ref).expanduser()
    if path.is_file():
        return path
    if ref.lower().endswith(".gguf"):
        raise GGUFError(f"{path}: no such file")
    return ollama_store.resolve(ref).gguf_path


def display_name(ref: str) -> str:
    """A short label: the file name for a path, Ollama's short form for a model name."""
    if is_path_ref(ref):
        return Path(ref).name
    try:
        return ollama_store.parse_name(ref).short
    except Exception:  # an unparsable name is still shown as the user typed it
        return ref
