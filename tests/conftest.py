"""Shared fixtures: an isolated home for every test and tiny real GGUF models built once, in F32
and, through llama.cpp's own quantizer, in Q8_0 and Q4_K_M (what Ollama ships)."""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from localspec.engine import repack
from localspec.models.tiny import (
    QUANTIZABLE,
    TinyModelSpec,
    quantized_model,
    shallow_copy,
    write_tiny_model,
)

TARGET_SPEC = TinyModelSpec(seed=11, n_layer=4, layer_scale=0.2, name="tiny-target")
# The engine's paths run on every precision users run: F32, and llama.cpp's Q8_0 and Q4_K_M.
PRECISIONS = ("f32", "q8_0", "q4_k_m")


@pytest.fixture(scope="session")
def repack_verdict(tmp_path_factory: pytest.TempPathFactory,
                   pytestconfig: pytest.Config) -> Path:
    """This machine's real repack self-test, run once per session (in a child process, as the
    product runs it); every test's home gets the verdict so no test waits for or spawns one.
    Its tiny models are the same every time (seeded), so they are built once per checkout in
    pytest's cache folder: building them is most of the self-test's first run."""
    home = tmp_path_factory.mktemp("repack-verdict")
    cache = home / "repack-selftest.json"
    cache_plugin = getattr(pytestconfig, "cache", None)  # absent under -p no:cacheprovider
    models = (cache_plugin.mkdir("repack-selftest-models") if cache_plugin
              else home / "models")
    result = repack.run_selftest(repack.selftest_command(models))
    repack.write_cached(cache, repack.build_key(), result)
    return cache


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  repack_verdict: Path) -> Path:
    """Config, data and cache dirs (and the Ollama store) point into the test's tmp dir."""
    home = tmp_path / "localspec-home"
    monkeypatch.setenv("LOCALSPEC_HOME", str(home))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama-models"))
    monkeypatch.setenv("OLLAMA_HOST", "127.0.0.1:9")  # nothing listens there: no daemon
    logging.getLogger("localspec.llama_cpp").setLevel(logging.ERROR)
    cache = home / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    shutil.copy(repack_verdict, cache / repack_verdict.name)
    (cache / (repack_verdict.name + ".announced")).write_text(repack.build_key())
    return home


def run_cli(*args: str, stdin: str | bytes | None = None, timeout: float = 120,
            env: dict[str, str] | None = None, **kw: Any) -> subprocess.CompletedProcess[Any]:
    """``localspec ARGS`` in a child process. A child killed by a signal (a native crash in
    llama.cpp) fails the test loudly instead of passing as "a non-zero exit"."""
    text = not isinstance(stdin, bytes)
    if stdin is None:  # not the runner's own stdin: `run` reads text piped in beside its words
        kw.setdefault("stdin", subprocess.DEVNULL)
    proc = subprocess.run([sys.executable, "-m", "localspec", *args], capture_output=True,
                          text=text, input=stdin, timeout=timeout, env=env, **kw)
    assert_no_signal(proc.returncode, args, proc.stderr)
    return proc


def assert_no_signal(returncode: int, what: Sequence[str] | str, stderr: Any = "") -> None:
    if returncode < 0:
        name = signal.Signals(-returncode).name
        pytest.fail(f"`{what}` was killed by {name}: a native crash\n{stderr}", pytrace=False)


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


@pytest.fixture(scope="session")
def quantized_pairs(models_dir: Path) -> dict[str, tuple[Path, Path]]:
    """(target, draft) per precision. The quantized ones have 256-wide rows (Q4_K's block)."""
    draft_spec = shallow_copy(QUANTIZABLE, keep_layers=1)
    folder = models_dir / "quantized"
    pairs = {"f32": (write_tiny_model(folder / "q-target-f32.gguf", QUANTIZABLE),
                     write_tiny_model(folder / "q-draft-f32.gguf", draft_spec))}
    for quant in ("Q8_0", "Q4_K_M"):
        pairs[quant.lower()] = (quantized_model(folder, quant, QUANTIZABLE),
                                quantized_model(folder, quant, draft_spec))
    return pairs


@pytest.fixture(params=PRECISIONS)
def precision(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pair(precision: str, quantized_pairs: dict[str, tuple[Path, Path]]) -> tuple[Path, Path]:
    """The tiny target and its shallow draft in one precision (the test runs for each)."""
    return quantized_pairs[precision]
