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
from ..config import unknown_top_level
from ..errors import ConfigError, DamagedModelError, GGUFError, LocalspecError, ModelNotFoundError
from ..files import atomic_write
from ..gguf_meta import pair_report, read_gguf_info, validate_pair
from ..options import DRAFT_MODES
from . import ollama_store
from .names import display_name, resolve_model

log = logging.getLogger(__name__)

# Matched whole (fullmatch: "$" would let a trailing newline through). No ':' or '/': a pair's
# name must never read as an Ollama name or a path.
_PAIR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


def can_name_pair(name: str) -> bool:
    """Whether ``name`` could be a pair's: an Ollama name with a tag or a namespace, or a .gguf
    file, never is, so it is resolved without reading the pair files (a broken one of which
    must not block models that are no pair)."""
    return _PAIR_NAME.fullmatch(name) is not None and not name.lower().endswith(".gguf")


def _check_pair_name(name: str, where: str) -> None:
    if not can_name_pair(name):
        raise ConfigError(f"{where}{name!r} is not a pair name (letters, digits, '.', '_', '-', "
                          "starting with a letter or digit, not ending in .gguf)")


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


_PAIR_HEADER = re.compile(r"""\s*\[\[\s*(pair|"pair"|'pair')\s*\]\]""")
_NEW_FILE = "# localspec user pairs (`localspec pair add`); merged over the shipped catalogue.\n"
_KEYS = ("name", "target", "draft", "draft_mode", "why")
_DEFAULTS = {"draft_mode": "model", "why": ""}  # keys an entry may leave out


def _pair_headers(lines: list[str]) -> list[int]:
    """The indexes of the ``[[pair]]`` header lines (tomllib reports no positions)."""
    return [number for number, line in enumerate(lines) if _PAIR_HEADER.match(line)]


def _pair_line(text: str, index: int) -> int:
    """The line of the ``index``-th ``[[pair]]`` header, for error messages."""
    headers = _pair_headers(text.splitlines())
    return headers[index] + 1 if index < len(headers) else 1


def parse_pairs(text: str, label: str, source: Source) -> dict[str, Pair]:
    """Parse catalogue TOML; any problem is a ConfigError naming ``label``, the line and why."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _toml_error(label, exc) from exc
    stray = unknown_top_level(data, text, ("[[pair]]",),
                              lambda key: "[[pair]]" if key in _KEYS else None)
    if stray:
        line, problem = stray
        raise ConfigError(f"{label}: line {line}: {problem}" if line else f"{label}: {problem}")
    entries = data.get("pair", [])
    if not isinstance(entries, list):
        raise ConfigError(f"{label}: 'pair' must be an array of tables ([[pair]] sections)")
    pairs: dict[str, Pair] = {}
    lines: dict[str, int] = {}
    for index, entry in enumerate(entries):
        line = _pair_line(text, index)
        where = f"{label}: line {line}"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: each [[pair]] must be a table")
        for key in ("name", "target", "draft"):
            if not isinstance(entry.get(key), str) or not entry[key].strip():
                raise ConfigError(f"{where}: the pair needs a '{key}' string")
        mode = entry.get("draft_mode", "model")
        if mode not in DRAFT_MODES:
            raise ConfigError(f"{where}: draft_mode {mode!r} is not one of "
                              f"{', '.join(DRAFT_MODES)}")
        unknown = set(entry) - set(_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        _check_pair_name(entry["name"], f"{where}: ")
        if entry["name"] in pairs:
            # Not last-wins: which of the two the user meant is theirs to say.
            raise ConfigError(f"{where}: pair {entry['name']!r} is defined twice (first at line "
                              f"{lines[entry['name']]}); rename or remove one")
        lines[entry["name"]] = line
        pairs[entry["name"]] = Pair(name=entry["name"], target=entry["target"],
                                    draft=entry["draft"], draft_mode=mode,
                                    why=str(entry.get("why", "")), source=source)
    return pairs


def shipped_pairs() -> dict[str, Pair]:
    """The curated catalogue shipped inside the package."""
    text = resources.files("localspec.models").joinpath("models.toml").read_text(encoding="utf-8")
    return parse_pairs(text, "localspec/models.toml (shipped)", "shipped")


def _read_user_file(path: Path) -> str | None:
    """The user's pair file as written (its line endings kept); None when there is none."""
    try:
        return path.read_bytes().decode("utf-8-sig")  # a byte-order mark is no TOML
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from exc


def user_pairs() -> dict[str, Pair]:
    """The user's own pairs; none when the file does not exist."""
    path = user_pairs_path()
    text = _read_user_file(path)
    return {} if text is None else parse_pairs(text, str(path), "user")


def load_pairs() -> dict[str, Pair]:
    """Shipped pairs merged with the user's (a user pair wins over a shipped one)."""
    return {**shipped_pairs(), **user_pairs()}


def find_pair(name: str) -> Pair:
    """The pair called ``name``; ModelNotFoundError listing close names when there is none."""
    if not can_name_pair(name):
        raise ModelNotFoundError(f"no pair named {name!r}; `localspec list` shows them")
    pairs = load_pairs()
    if name in pairs:
        return pairs[name]
    close = difflib.get_close_matches(name, list(pairs), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else "; `localspec list` shows them"
    raise ModelNotFoundError(f"no pair named {name!r}{hint}")


def _is_content(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


def _render(pair: Pair, newline: str) -> str:
    import tomlkit  # deferred: only `pair add` and `pair remove` write

    return tomlkit.dumps({"pair": [pair.to_toml()]}).replace("\n", newline)


def _updated(entry_text: str, pair: Pair) -> str:
    """One ``[[pair]]`` table's text with ``pair``'s values: its keys stay where they are, with
    their comments; a left-out key is added only when its value is not the default."""
    import tomlkit

    doc = tomlkit.parse(entry_text)
    table = doc["pair"][0]
    for key, value in pair.to_toml().items():
        if table.get(key, _DEFAULTS.get(key)) != value:
            table[key] = value
    return tomlkit.dumps(doc)


def _edited(text: str, pairs: dict[str, Pair], name: str, pair: Pair | None) -> str:
    """``text`` with the ``[[pair]]`` table called ``name`` replaced by ``pair`` (appended when
    there is none), or removed when ``pair`` is None. Everything else is kept as written: the
    user's comments, layout and other pairs; comments after a removed table stay too, as they
    may be about the next one."""
    lines = text.splitlines(keepends=True)
    newline = "\r\n" if "\r\n" in text else "\n"
    headers = _pair_headers(lines)
    if len(headers) != len(pairs):  # `pair = [...]`, or a header inside a multi-line string
        raise ConfigError(f"{user_pairs_path()}: cannot edit its pairs in place (they are not "
                          "all [[pair]] tables); edit the file by hand")
    index = list(pairs).index(name) if name in pairs else None
    if index is None:
        assert pair is not None
        if text.strip():
            text += "" if text.endswith("\n") else newline
            text += "" if text.endswith(newline * 2) else newline
        else:
            text = _NEW_FILE.replace("\n", newline) + newline
        return text + _render(pair, newline)
    start = headers[index]
    end = headers[index + 1] if index + 1 < len(headers) else len(lines)
    # The table ends at its last key: comments and blank lines after it lead to what follows.
    while end > start + 1 and not _is_content(lines[end - 1]):
        end -= 1
    entry = "".join(lines[start:end])
    if pair is not None:
        updated = _updated(entry, pair).replace("\r\n", "\n").replace("\n", newline)
        return "".join(lines[:start]) + updated + "".join(lines[end:])
    while end < len(lines) and not lines[end].strip():
        end += 1  # the blank lines that set the removed table apart
    return "".join(lines[:start] + lines[end:])


def _write_user_pairs(name: str, pair: Pair | None) -> Pair | None:
    """Add, replace (``pair``) or remove (None) the user's pair ``name`` by editing their file
    in place, atomically; the pair it replaced or removed, if any."""
    path = user_pairs_path()
    text = _read_user_file(path) or ""
    pairs = parse_pairs(text, str(path), "user")  # a file in error is never rewritten
    old = pairs.get(name)
    if pair is None and old is None:
        raise ModelNotFoundError(f"no user pair named {name!r} in {path}")
    new_text = _edited(text, pairs, name, pair)
    expected = {k: v for k, v in pairs.items() if k != name}
    if pair is not None:
        expected[name] = pair
    # The edit works on lines; a file it misread is refused rather than written wrong.
    if parse_pairs(new_text, str(path), "user") != expected:
        raise ConfigError(f"{path}: cannot edit its pairs in place; edit the file by hand")
    atomic_write(path, new_text)
    return old


def add_user_pair(name: str, target: str, draft: str, draft_mode: str = "model",
                  why: str = "", replace: bool = False) -> Pair:
    """Validate the pair on its real files, then save it to the user's catalogue. A pair of
    the same name already there is replaced only when asked (``replace``): it may carry a note
    the user wrote."""
    _check_pair_name(name, "")
    old = None if replace else user_pairs().get(name)
    if old is not None:
        raise ConfigError(f"you already have a pair named {name!r} ({old.target} + "
                          f"{old.draft}) in {user_pairs_path()}; add --replace to replace it")
    if draft_mode not in DRAFT_MODES:
        raise ConfigError(f"draft mode {draft_mode!r} is not one of {', '.join(DRAFT_MODES)}")
    validate_pair(resolve_model(target), resolve_model(draft))
    pair = Pair(name=name, target=target, draft=draft, draft_mode=draft_mode,
                why=why or f"added with `localspec pair add` ({display_name(draft)} drafts for "
                           f"{display_name(target)})", source="user")
    _write_user_pairs(name, pair)
    return pair


def remove_user_pair(name: str) -> Pair:
    """Delete a user pair (shipped pairs cannot be removed, only overridden)."""
    pair = _write_user_pairs(name, None)
    assert pair is not None  # _write_user_pairs refuses to remove a pair that is not there
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
