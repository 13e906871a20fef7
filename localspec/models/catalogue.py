"""The pair catalogue: curated target/draft pairs shipped in the package, plus the user's own.

The shipped ``models.toml`` is read with importlib.resources; the user's file lives in
``<config dir>/models.toml`` and is merged over it (a user pair replaces a shipped one of the same
name). Both use the same format::

    [[pair]]
    name = "qwen2.5-coder-32b"
    target = "qwen2.5-coder:32b"
    draft = "qwen2.5-coder:1.5b"
    draft_mode = "model"
    why = "..."
"""

from __future__ import annotations

import difflib
import logging
import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from .. import paths
from ..errors import ConfigError, DamagedModelError, GGUFError, LocalspecError, ModelNotFoundError
from ..files import atomic_write
from ..gguf_meta import pair_report, read_gguf_info, validate_pair
from ..options import DRAFT_MODES
from . import ollama_store
from .names import display_name, resolve_model

log = logging.getLogger(__name__)

_PAIR_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
Source = Literal["shipped", "user"]


@dataclass(frozen=True, slots=True)
class Pair:
    """A target model, the draft that speeds it up, and how to draft."""

    name: str
    target: str
    draft: str
    draft_mode: str = "model"
    why: str = ""
    source: Source = "shipped"

    def to_toml(self) -> dict[str, str]:
        return {"name": self.name, "target": self.target, "draft": self.draft,
                "draft_mode": self.draft_mode, "why": self.why}


@dataclass(frozen=True, slots=True)
class Suggestion:
    """A local model that can draft for a target, and how much smaller it is."""

    name: str
    gguf_path: Path
    size: int
    parameter_count: int
    quantization: str | None
    size_ratio: float  # target size / draft size


@dataclass(frozen=True, slots=True)
class PairStatus:
    """Whether a pair's models are present and, when both are, whether they are compatible.

    A damaged model (a blob missing or of the wrong size) is not present; its ``*_damage`` line
    says why, and is among ``problems`` too.
    """

    pair: Pair
    target_path: Path | None
    draft_path: Path | None
    compatible: bool | None
    problems: tuple[str, ...] = ()
    target_damage: str | None = None
    draft_damage: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            **self.pair.to_toml(),
            "source": self.pair.source,
            "target_present": self.target_path is not None,
            "draft_present": self.draft_path is not None,
            "target_damaged": self.target_damage is not None,
            "draft_damaged": self.draft_damage is not None,
            "target_path": str(self.target_path) if self.target_path else None,
            "draft_path": str(self.draft_path) if self.draft_path else None,
            "compatible": self.compatible,
            "problems": list(self.problems),
        }


def user_pairs_path() -> Path:
    """The user's pair file (merged over the shipped catalogue)."""
    return paths.config_dir() / "models.toml"


def _toml_error(label: str, exc: tomllib.TOMLDecodeError) -> ConfigError:
    # Python 3.11's TOMLDecodeError has no lineno attribute; its message ends "(at line L, ...)".
    text = str(exc)
    match = re.search(r"^(.*) \(at line (\d+), column (\d+)\)$", text)
    if match:
        what, line, column = match.groups()
        return ConfigError(f"{label}: line {line}, column {column}: {what}")
    return ConfigError(f"{label}: {text}")


def _pair_line(text: str, index: int) -> int:
    """The line of the ``index``-th ``[[pair]]`` header, for error messages."""
    seen = -1
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip().replace(" ", "").startswith("[[pair]]"):
            seen += 1
            if seen == index:
                return number
    return 1


def parse_pairs(text: str, label: str, source: Source) -> dict[str, Pair]:
    """Parse catalogue TOML; any problem is a ConfigError naming ``label``, the line and why."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _toml_error(label, exc) from exc
    entries = data.get("pair", [])
    if not isinstance(entries, list):
        raise ConfigError(f"{label}: 'pair' must be an array of tables ([[pair]] sections)")
    pairs: dict[str, Pair] = {}
    for index, entry in enumerate(entries):
        where = f"{label}: line {_pair_line(text, index)}"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: each [[pair]] must be a table")
        for key in ("name", "target", "draft"):
            if not isinstance(entry.get(key), str) or not entry[key].strip():
                raise ConfigError(f"{where}: the pair needs a '{key}' string")
        mode = entry.get("draft_mode", "model")
        if mode not in DRAFT_MODES:
            raise ConfigError(f"{where}: draft_mode {mode!r} is not one of "
                              f"{', '.join(DRAFT_MODES)}")
        unknown = set(entry) - {"name", "target", "draft", "draft_mode", "why"}
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        pairs[entry["name"]] = Pair(name=entry["name"], target=entry["target"],
                                    draft=entry["draft"], draft_mode=mode,
                                    why=str(entry.get("why", "")), source=source)
    return pairs


def shipped_pairs() -> dict[str, Pair]:
    """The curated catalogue shipped inside the package."""
    text = resources.files("localspec.models").joinpath("models.toml").read_text(encoding="utf-8")
    return parse_pairs(text, "localspec/models.toml (shipped)", "shipped")


def user_pairs() -> dict[str, Pair]:
    """The user's own pairs; none when the file does not exist."""
    path = user_pairs_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from exc
    return parse_pairs(text, str(path), "user")


def load_pairs() -> dict[str, Pair]:
    """Shipped pairs merged with the user's (a user pair wins over a shipped one)."""
    return {**shipped_pairs(), **user_pairs()}


def find_pair(name: str) -> Pair:
    """The pair called ``name``; ModelNotFoundError listing close names when there is none."""
    pairs = load_pairs()
    if name in pairs:
        return pairs[name]
    close = difflib.get_close_matches(name, list(pairs), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else "; `localspec list` shows them"
    raise ModelNotFoundError(f"no pair named {name!r}{hint}")


def _write_user_pairs(pairs: dict[str, Pair]) -> None:
    import tomli_w

    path = user_pairs_path()
    body = tomli_w.dumps({"pair": [p.to_toml() for p in pairs.values()]})
    header = "# localspec user pairs (`localspec pair add`); merged over the shipped catalogue.\n"
    atomic_write(path, header + body)


def add_user_pair(name: str, target: str, draft: str, draft_mode: str = "model",
                  why: str = "") -> Pair:
    """Validate the pair on its real files, then save it to the user's catalogue."""
    if not _PAIR_NAME.match(name) or ":" in name:
        raise ConfigError(f"{name!r} is not a pair name (letters, digits, '.', '_', '-')")
    if draft_mode not in DRAFT_MODES:
        raise ConfigError(f"draft mode {draft_mode!r} is not one of {', '.join(DRAFT_MODES)}")
    validate_pair(resolve_model(target), resolve_model(draft))
    pair = Pair(name=name, target=target, draft=draft, draft_mode=draft_mode,
                why=why or f"added with `localspec pair add` ({display_name(draft)} drafts for "
                           f"{display_name(target)})", source="user")
    pairs = user_pairs()
    pairs[name] = pair
    _write_user_pairs(pairs)
    return pair


def remove_user_pair(name: str) -> Pair:
    """Delete a user pair (shipped pairs cannot be removed, only overridden)."""
    pairs = user_pairs()
    if name not in pairs:
        raise ModelNotFoundError(f"no user pair named {name!r} in {user_pairs_path()}")
    pair = pairs.pop(name)
    _write_user_pairs(pairs)
    return pair


def _present(ref: str) -> tuple[Path | None, str | None]:
    """The model's file when it is usable, else None and, when it is damaged, the damage."""
    try:
        return resolve_model(ref), None
    except DamagedModelError as exc:
        return None, str(exc)
    except (ModelNotFoundError, GGUFError):
        return None, None


def pair_status(pair: Pair) -> PairStatus:
    """Presence of both models and, when both are present, the pair check on the real files."""
    (target, target_damage), (draft, draft_damage) = _present(pair.target), _present(pair.draft)
    if target is None or draft is None:
        # dict.fromkeys: a lookup pair names its target twice, and its damage once is enough.
        damage = tuple(dict.fromkeys(d for d in (target_damage, draft_damage) if d))
        return PairStatus(pair, target, draft, None, damage, target_damage, draft_damage)
    try:
        report = pair_report(target, draft)
    except LocalspecError as exc:
        return PairStatus(pair, target, draft, False, (str(exc),))
    return PairStatus(pair, target, draft, report.compatible, report.problems)


def suggest_drafts(target_ref: str) -> list[Suggestion]:
    """Local models that can draft for ``target_ref``, the smallest (fastest) first."""
    target_path = resolve_model(target_ref)
    target = read_gguf_info(target_path)
    suggestions = []
    for model in ollama_store.list_local():
        if model.gguf_path.resolve() == target_path.resolve() or model.size >= target.file_size:
            continue
        try:
            info = read_gguf_info(model.gguf_path)
            if not pair_report(target_path, model.gguf_path).compatible:
                continue
        except GGUFError as exc:
            log.debug("not suggesting %s: %s", model.name, exc)
            continue
        suggestions.append(Suggestion(
            name=model.name, gguf_path=model.gguf_path, size=info.file_size,
            parameter_count=info.parameter_count, quantization=info.file_type,
            size_ratio=target.file_size / max(1, info.file_size)))
    suggestions.sort(key=lambda s: (-s.size_ratio, s.name))
    return suggestions
