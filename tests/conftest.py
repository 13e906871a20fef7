"""Shared fixtures: an isolated home for every test and tiny real GGUF models built once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from localspec.models.tiny import TinyModelSpec, shallow_copy, write_tiny_model

TARGET_SPEC = TinyModelSpec(seed=11, n_layer=4, layer_scale=0.2, name="tiny-target")


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Config, data and cache dirs (and the Ollama store) point into the test's tmp dir."""
    home = tmp_path / "localspec-home"
    monkeypatch.setenv("LOCALSPEC_HOME", str(home))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama-models"))
    monkeypatch.setenv("OLLAMA_HOST", "127.0.0.1:9")  # nothing listens there: no daemon
    logging.getLogger("localspec.llama_cpp").setLevel(logging.ERROR)
    return home


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def target_gguf(models_dir: Path) -> Path:
    return write_tiny_model(models_dir / "target.gguf", TARGET_SPEC)


@pytest.fixture(scope="session")
def draft_gguf(models_dir: Path) -> Path:
    """A shallow copy of the target: same vocabulary, often (not always) the same guesses."""
    return write_tiny_model(models_dir / "draft.gguf", shallow_copy(TARGET_SPEC, keep_layers=1))


@pytest.fixture(scope="session")
def random_draft_gguf(models_dir: Path) -> Path:
    """Same vocabulary, unrelated weights: a poorly matched draft."""
    return write_tiny_model(models_dir / "random-draft.gguf",
                            TinyModelSpec(seed=99, n_layer=1, name="tiny-random"))


@pytest.fixture(scope="session")
def other_vocab_gguf(models_dir: Path) -> Path:
    """A model whose vocabulary differs from the target's (a different word list)."""
    words = tuple(f"w{i}" for i in range(60))
    return write_tiny_model(models_dir / "other-vocab.gguf",
                            TinyModelSpec(seed=3, words=words, name="tiny-other"))
