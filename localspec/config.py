"""``config.toml``: the user's settings, read once and passed down; written by the settings screen.

The ``[chat]`` table holds :class:`localspec.options.Settings` (every key is a parameter of
``params.PARAMS``, validated there). ``run``, ``serve`` and the chat app read it; CLI flags win.
Nothing here runs at import.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

from . import paths
from .errors import ConfigError
from .files import atomic_write
from .options import Settings, settings_from_mapping
from .params import PARAMS, InvalidOptionError

__all__ = ["InvalidConfigError", "config_path", "load_settings", "save_settings"]

# Keys written by localspec before the parameters were unified, and what they mean now.
_LEGACY_KEYS = {"gpu_layers_target": "gpu_layers", "gpu_layers_draft": "draft_gpu_layers"}
_LEGACY_DRAFT_MODES = {"auto": "model", "fixed": "model", "off": "none"}


class InvalidConfigError(ConfigError, InvalidOptionError):
    """A value in config.toml outside its range: named with the file and line; exit code 2."""

    title = "Configuration error"

    def __init__(self, message: str, param: str) -> None:
        InvalidOptionError.__init__(self, message, param)


def config_path() -> Path:
    return paths.config_dir() / "config.toml"


def _line_of(text: str, table: str, key: str) -> int | None:
    """The line where ``key`` is set inside ``[table]`` (tomllib reports no positions)."""
    in_table = False
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("["):
            in_table = stripped.replace(" ", "") == f"[{table}]"
        elif in_table and re.match(rf"^\s*['\"]?{re.escape(key)}['\"]?\s*=", line):
            return number
    return None


def _migrate(table: dict[str, Any]) -> dict[str, Any]:
    """Translate the settings of older localspec versions (draft_mode auto/fixed/off)."""
    out = {_LEGACY_KEYS.get(k, k): v for k, v in table.items()}
    mode = out.get("draft_mode")
    if isinstance(mode, str) and mode in _LEGACY_DRAFT_MODES:
        out["draft_mode"] = _LEGACY_DRAFT_MODES[mode]
        if mode != "fixed":
            out["k"] = None
    return out


def load_settings(path: Path | None = None) -> Settings:
    """Read settings; a missing file means defaults. Anything wrong is one line naming the file
    (and the line and the parameter, for a bad value)."""
    path = path or config_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Settings()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (it is not UTF-8); fix or delete it") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib's message already ends with "(at line N, column M)".
        raise ConfigError(f"{path}: {exc}") from None
    table = data.get("chat", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [chat] must be a table")

    def where(key: str) -> str:
        line = _line_of(text, "chat", key) or _line_of(
            text, "chat", next((k for k, v in _LEGACY_KEYS.items() if v == key), key))
        return f"{path}, line {line}" if line else str(path)

    try:
        return settings_from_mapping(_migrate(table), where)
    except InvalidOptionError as exc:
        raise InvalidConfigError(exc.message, exc.param) from None


def save_settings(settings: Settings, path: Path | None = None) -> Path:
    """Write settings into the file's ``[chat]`` table, atomically (a crash never leaves half a
    file). The user's other tables (``[history]``, ...), their comments and their layout are
    kept: the file is theirs to edit, the settings screen only updates what it shows."""
    import tomlkit  # deferred: only the settings screen writes
    from tomlkit.exceptions import TOMLKitError

    path = path or config_path()
    settings.validate()
    table = {k: ("auto" if PARAMS[k].kind == "k" and v is None else v)
             for k, v in dataclasses.asdict(settings).items()
             if v is not None or PARAMS[k].kind == "k"}
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8"
        raise ConfigError(f"cannot save settings: cannot read {path} ({reason})") from None
    try:
        doc = tomlkit.parse(text)
    except TOMLKitError as exc:
        raise ConfigError(f"cannot save settings: {path} has an error ({exc}); "
                          "fix or delete it") from None
    chat = doc.get("chat")
    if not isinstance(chat, dict):
        chat = doc["chat"] = tomlkit.table()
    for key in [k for k in chat if k in PARAMS or k in _LEGACY_KEYS]:
        if key not in table:
            del chat[key]  # unset now, or written under an older name
    for key, value in table.items():
        chat[key] = value
    atomic_write(path, tomlkit.dumps(doc))
    return path
