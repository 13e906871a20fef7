"""config.py: TOML round trip, malformed files named with their line, engine mappings."""

from __future__ import annotations

from pathlib import Path

import pytest

from localspec.config import (
    Settings,
    draft_settings,
    load_settings,
    model_settings,
    save_settings,
)
from localspec.errors import ConfigError


def test_defaults_when_missing_and_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    assert load_settings(path) == Settings()
    s = Settings(draft_mode="fixed", k=6, temperature=0.7, threads=4, last_pair="tiny")
    save_settings(s, path)
    assert load_settings(path) == s


def test_default_path_is_under_config_dir(isolated_home: Path) -> None:
    where = save_settings(Settings(k=3))
    assert where == isolated_home / "config" / "config.toml"
    assert load_settings().k == 3


def test_malformed_toml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[chat]\nk = 3\ntemperature = = 1\n")
    with pytest.raises(ConfigError, match=r"config.toml.*line 3"):
        load_settings(path)


@pytest.mark.parametrize("body, word", [("k = 99", "k"), ("tempo = 1", "tempo"),
                                        ("k = 'four'", "k")])
def test_bad_values_are_named(tmp_path: Path, body: str, word: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f"[chat]\n{body}\n")
    with pytest.raises(ConfigError, match=word):
        load_settings(path)


def test_engine_mappings() -> None:
    assert draft_settings(Settings(draft_mode="auto"), True).mode == "model"
    assert draft_settings(Settings(draft_mode="auto"), False).mode == "lookup"
    fixed = draft_settings(Settings(draft_mode="fixed", k=5), True)
    assert (fixed.mode, fixed.k) == ("model", 5)
    assert draft_settings(Settings(draft_mode="off"), True).mode == "none"
    t, d = model_settings(Settings(ctx=2048, gpu_layers_draft=0))
    assert (t.n_ctx, t.n_gpu_layers, d.n_gpu_layers) == (2048, -1, 0)
