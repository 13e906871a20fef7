"""``config.toml``: the user's settings, read once and passed down; written by the settings screen.

The ``[chat]`` table holds :class:`localspec.options.Settings` (every key is a parameter of
``params.PARAMS``, validated there). ``run``, ``serve`` and the chat app read it; CLI flags win.
Nothing here runs at import.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from . import paths
from .errors import ConfigError
from .files import atomic_write
from .options import Settings, settings_from_mapping
from .params import PARAMS, InvalidOptionError

__all__ = ["InvalidConfigError", "config_path", "load_settings", "save_settings",
           "unknown_top_level"]

# The tables localspec reads from config.toml: [chat] here, [history] in history.load_config.
# Anything else is a typo whose settings would silently not apply, so it is refused.
_TABLES = ("[chat]", "[history]")

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


def _top_level_line(text: str, name: str) -> int | None:
    """The line of a top-level ``name = ...``, ``name.x = ...``, ``[name]`` or ``[[name]]``."""
    key = rf"(?:{re.escape(name)}|\"{re.escape(name)}\"|'{re.escape(name)}')"
    header, assignment = re.compile(rf"\s*\[\[?\s*{key}\s*[.\]]"), re.compile(rf"\s*{key}\s*[.=]")
    in_table = False  # a key under a header belongs to that table, not to the top level
    for number, line in enumerate(text.splitlines(), start=1):
        if header.match(line):
            return number
        if line.lstrip().startswith("["):
            in_table = True
        elif not in_table and assignment.match(line):
            return number
    return None


def unknown_top_level(data: Mapping[str, Any], text: str, tables: Sequence[str],
                      home: Callable[[str], str | None] = lambda key: None,
                      ) -> tuple[int | None, str] | None:
    """The first top-level name of ``data`` (parsed from ``text``) that is not one of ``tables``
    (written as in the file: ``[chat]``, ``[[pair]]``): its line and what is wrong, else None.
    ``home(key)``: the table a stray plain key belongs in, for the hint."""
    names = {table.strip("[]"): table for table in tables}
    found = sorted(((_top_level_line(text, name), name) for name in data if name not in names),
                   key=lambda item: (item[0] is None, item[0] or 0))
    if not found:
        return None
    line, name = found[0]
    value = data[name]
    known = f"(known: {', '.join(tables)})"
    if isinstance(value, dict) or (
            isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)):
        written = f"[{name}]" if isinstance(value, dict) else f"[[{name}]]"
        close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
        hint = f"; did you mean {names[close[0]]}?" if close else ""
        return line, f"unknown table {written} {known}{hint}"
    where = home(name)
    hint = f"; put it under {where}" if where else "; keys go in one of those tables"
    return line, f"unknown top-level key {name!r} {known}{hint}"


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
        text = raw.decode("utf-8-sig")  # a byte-order mark (Windows editors) is no setting
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (it is not UTF-8); fix or delete it") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib's message already ends with "(at line N, column M)".
        raise ConfigError(f"{path}: {exc}") from None
    unknown = unknown_top_level(
        data, text, _TABLES, lambda key: "[chat]" if key in PARAMS or key in _LEGACY_KEYS else None)
    if unknown:
        line, problem = unknown
        raise ConfigError(f"{path}, line {line}: {problem}" if line else f"{path}: {problem}")
    table = data.get("chat", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [chat] must be a table")

    def where(key: str) -> str:
        line = _line_of(text, "chat", key) or _line_of(
            text, "chat", next((k for k, v in _LEGACY_KEYS.items() if v == key), key))
        return f"{path}, line {line}" if line else str(path)

    for old, new in _LEGACY_KEYS.items():
        if old in table and new in table:  # which one meant? neither is dropped silently
            raise ConfigError(f"{where(old)}: {old} is the old name of {new}, which is set "
                              "too; keep one of them")
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
        # bytes: its line endings kept as written; a byte-order mark is dropped
        text = path.read_bytes().decode("utf-8-sig")
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
    newline = "\r\n" if "\r\n" in text else "\n"  # keys tomlkit adds come with "\n"
    atomic_write(path, tomlkit.dumps(doc).replace("\r\n", "\n").replace("\n", newline))
    return path
