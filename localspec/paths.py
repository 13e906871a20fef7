"""Where localspec keeps things. Computed on demand (never at import) so tests can redirect them."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "localspec"


def home_override() -> Path | None:
    """``LOCALSPEC_HOME`` puts config, data and cache under one folder (tests, portable use)."""
    value = os.environ.get("LOCALSPEC_HOME")
    return Path(value).expanduser() if value else None


def config_dir() -> Path:
    home = home_override()
    return home / "config" if home else Path(platformdirs.user_config_dir(APP_NAME))


def data_dir() -> Path:
    home = home_override()
    return home / "data" if home else Path(platformdirs.user_data_dir(APP_NAME))


def cache_dir() -> Path:
    home = home_override()
    return home / "cache" if home else Path(platformdirs.user_cache_dir(APP_NAME))


def demo_models_dir() -> Path:
    return cache_dir() / "demo-models"
