"""The Ollama model store: where it is, how names map to manifests, and manifests to GGUF blobs.

localspec reads Ollama's store in place (no second copy of a 40 GB file). The layout is
``<store>/manifests/<host>/<namespace>/<model>/<tag>`` (a Docker v2 manifest in JSON) and
``<store>/blobs/sha256-<hex>`` (content-addressed layers). The layer whose media type is
``application/vnd.ollama.image.model`` is a plain GGUF file that llama.cpp loads as is.

A model whose manifest names a blob that is missing or whose size differs from the manifest's is
*damaged*: it is listed as such and never resolved for running. So is one whose manifest cannot be
read, or whose model blob lacks the GGUF magic. Only sizes and those four bytes are checked here
(a stat per blob); re-hashing is ``localspec pull --verify``'s job, far too slow for a listing.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DamagedModelError, GGUFError, ModelNotFoundError

log = logging.getLogger(__name__)

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
SERVICE_STORE = Path("/usr/share/ollama/.ollama/models")

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
TEMPLATE_MEDIA_TYPE = "application/vnd.ollama.image.template"
PARAMS_MEDIA_TYPE = "application/vnd.ollama.image.params"
PROJECTOR_MEDIA_TYPE = "application/vnd.ollama.image.projector"
ADAPTER_MEDIA_TYPE = "application/vnd.ollama.image.adapter"

# Ollama's own name rules (types/model/name.go): parts are letters, digits, '_', '-' and '.'.
_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,79}$")
# The host must also be one a URL can carry (DNS limits), or the first request fails cryptically.
_LABEL = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]{0,62}")
_PORT = re.compile(r"[0-9]{1,5}")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


class UnreadableManifestError(DamagedModelError):
    """A manifest that is not JSON or names no layers: only the registry has it again."""


class NotGGUFBlobError(DamagedModelError):
    """A model blob of the declared size without the GGUF magic: damaged bytes, or a model in a
    format localspec cannot run; only its sha256 tells which."""


@dataclass(frozen=True, slots=True)
class ModelName:
    """A fully qualified Ollama model name."""

    host: str = DEFAULT_HOST
    namespace: str = DEFAULT_NAMESPACE
    model: str = ""
    tag: str = DEFAULT_TAG

    @property
    def repository(self) -> str:
        """The registry repository path (``namespace/model``)."""
        return f"{self.namespace}/{self.model}"

    @property
    def manifest_relpath(self) -> Path:
        """Where the manifest lives under ``<store>/manifests``."""
        return Path(self.host, self.namespace, self.model, self.tag)

    @property
    def short(self) -> str:
        """The name as Ollama displays it: defaults left out, the tag always shown."""
        if self.host != DEFAULT_HOST:
            return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"
        if self.namespace != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.model}:{self.tag}"

    def __str__(self) -> str:
        return self.short


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """An Ollama model found in a store, with its GGUF blob ready for the engine."""

    name: str
    gguf_path: Path
    size: int
    manifest_path: Path
    template: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    digest: str = ""
    store: Path | None = None


@dataclass(frozen=True, slots=True)
class LocalEntry:
    """A model whose manifest is in a store: resolved when whole, else the damage found."""

    name: str
    manifest_path: Path
    store: Path
    model: ResolvedModel | None = None
    problem: str | None = None  # one line: which blob is missing or has the wrong size

    @property
    def damaged(self) -> bool:
        return self.model is None


def store_dirs() -> list[Path]:
    """Stores to search, in order. The first is where pulls write.

    Like Ollama: ``OLLAMA_MODELS`` alone when set; otherwise ``~/.ollama/models``, then the Linux
    service's store when it exists (a system install runs as the ``ollama`` user).
    """
    override = os.environ.get("OLLAMA_MODELS")
    if override:
        return [Path(override).expanduser()]
    dirs = [Path.home() / ".ollama" / "models"]
    if SERVICE_STORE.is_dir() and SERVICE_STORE not in dirs:
        dirs.append(SERVICE_STORE)
    return dirs


def parse_name(name: str) -> ModelName:
    """Parse ``model[:tag]``, ``namespace/model[:tag]`` or ``host/namespace/model[:tag]``."""
    text = name.strip()
    if text.startswith(("http://", "https://")):
        text = text.split("://", 1)[1]
    if "@" in text:
        raise ModelNotFoundError(f"{name!r}: pulling by digest is not supported; name a tag")
    parts = text.split("/")
    last = parts[-1]
    tag = DEFAULT_TAG
    if ":" in last:
        last, tag = last.rsplit(":", 1)
    parts[-1] = last
    if len(parts) == 1:
        parsed = ModelName(model=parts[0], tag=tag)
    elif len(parts) == 2:
        parsed = ModelName(namespace=parts[0], model=parts[1], tag=tag)
    elif len(parts) == 3:
        parsed = ModelName(host=parts[0], namespace=parts[1], model=parts[2], tag=tag)
    else:
        parsed = ModelName(model="")
    ok = (valid_host(parsed.host) and _PART.match(parsed.namespace)
          and _PART.match(parsed.model) and _PART.match(parsed.tag))
    if not ok:
        raise ModelNotFoundError(
            f"{name!r} is not an Ollama model name (expected model[:tag], namespace/model[:tag] "
            "or host/namespace/model[:tag]); a local model file is named by its .gguf path"
        )
    return parsed


def valid_host(host: str) -> bool:
    """True for ``hostname[:port]`` that a URL can carry (see valid_hostname, valid_port)."""
    hostname, colon, port = host.partition(":")
    return valid_hostname(hostname) and (not colon or valid_port(port))


def valid_hostname(hostname: str) -> bool:
    """True for a DNS-sized hostname (or IPv4 address): dot-separated labels of 1 to 63
    letters, digits, '_' or '-' (not first), 253 characters in all."""
    return (0 < len(hostname) <= 253
            and all(_LABEL.fullmatch(label) for label in hostname.split(".")))


def valid_port(port: str) -> bool:
    """True for a TCP port number, 1 to 65535."""
    return bool(_PORT.fullmatch(port)) and 1 <= int(port) <= 65535


def blob_path(store: Path, digest: str) -> Path:
    """The file of a content-addressed blob (``sha256:<hex>`` → ``blobs/sha256-<hex>``)."""
    if not _DIGEST.match(digest):
        raise GGUFError(f"malformed layer digest {digest!r} in a manifest")
    return store / "blobs" / digest.replace(":", "-")


def manifest_path(store: Path, name: ModelName) -> Path:
    return store / "manifests" / name.manifest_relpath


def read_manifest(path: Path) -> dict[str, Any]:
    """Parse a manifest file; a malformed one is an UnreadableManifestError naming the file,
    its ``problem`` the damage alone."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise _unreadable(path, exc.strerror or str(exc)) from exc
    if not raw.strip():
        raise _unreadable(path, "empty file")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise _unreadable(path, "not JSON") from exc
    if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
        raise _unreadable(path, "no layers")
    return data


def _unreadable(path: Path, reason: str) -> UnreadableManifestError:
    problem = f"unreadable Ollama manifest ({reason})"
    return UnreadableManifestError(f"{path}: {problem}; pull the model again", problem)


def manifest_digests(manifest: dict[str, Any]) -> list[str]:
    """Every blob a manifest references (config first, then layers)."""
    digests = []
    config = manifest.get("config")
    if isinstance(config, dict) and isinstance(config.get("digest"), str):
        digests.append(config["digest"])
    digests += [layer["digest"] for layer in manifest["layers"]
                if isinstance(layer, dict) and isinstance(layer.get("digest"), str)]
    return digests


def blob_sizes(manifest: dict[str, Any]) -> dict[str, int]:
    """The size the manifest declares for each blob it references (when it declares one)."""
    sizes: dict[str, int] = {}
    for desc in [manifest.get("config"), *manifest["layers"]]:
        if (isinstance(desc, dict) and isinstance(desc.get("digest"), str)
                and isinstance(desc.get("size"), int)):
            sizes[desc["digest"]] = desc["size"]
    return sizes


def blob_problem(store: Path, digest: str, size: int | None) -> str | None:
    """Why the blob ``digest`` cannot be right (missing, or not ``size`` bytes), else None.

    Blobs are content-addressed and get their final name only once verified, so a blob of the
    declared size is taken as good; any other size can never be (see ``pull --verify``).
    """
    path = blob_path(store, digest)
    try:
        have = path.stat().st_size
    except FileNotFoundError:
        return f"blob {blob_label(path)} is missing"
    except OSError as exc:
        return f"blob {blob_label(path)} is unreadable ({exc.strerror})"
    if size is not None and have != size:
        return f"blob {blob_label(path)} has {have:,} bytes, the manifest says {size:,}"
    return None


def blob_label(path: Path) -> str:
    """A blob file as messages name it: `sha256-` and the first 12 hex digits."""
    return f"{path.name[:19]}…"


def damaged_blobs(store: Path, manifest: dict[str, Any]) -> list[tuple[str, str]]:
    """``(digest, problem)`` for every blob of ``manifest`` that is missing or the wrong size."""
    sizes = blob_sizes(manifest)
    found = []
    for digest in manifest_digests(manifest):
        problem = blob_problem(store, digest, sizes.get(digest))
        if problem is not None:
            found.append((digest, problem))
    return found


def _check_blobs(store: Path, manifest: dict[str, Any], name: ModelName) -> None:
    damage = damaged_blobs(store, manifest)
    if not damage:
        return
    more = len(damage) - 1
    problem = damage[0][1] + (f" (and {more} more damaged blob{'s' if more > 1 else ''})"
                              if more else "")
    raise DamagedModelError(f"{name}: damaged, {problem}; run `localspec pull {name}` to repair "
                            "it", problem)


def _layers(manifest: dict[str, Any], media_type: str) -> list[dict[str, Any]]:
    return [layer for layer in manifest["layers"]
            if isinstance(layer, dict) and layer.get("mediaType") == media_type]


def _is_cloud(store: Path, manifest: dict[str, Any], name: ModelName) -> bool:
    # Ollama's cloud models are manifests whose config names a remote host and carry no weights.
    if name.tag.endswith("cloud"):
        return True
    config = manifest.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("digest"), str):
        return False
    try:
        data = json.loads(blob_path(store, config["digest"]).read_bytes())
    except (OSError, ValueError, GGUFError):
        return False
    return isinstance(data, dict) and bool(data.get("remote_host") or data.get("remote_model"))


def model_layer(manifest: dict[str, Any], name: ModelName, store: Path,
                where: str) -> dict[str, Any]:
    """The manifest's GGUF layer, or one line saying why this model cannot run here."""
    models = _layers(manifest, MODEL_MEDIA_TYPE)
    if not models:
        if _is_cloud(store, manifest, name):
            raise GGUFError(f"{name}: a cloud model (it runs on ollama.com, there are no weights "
                            "to load); choose a local tag")
        if _layers(manifest, PROJECTOR_MEDIA_TYPE):
            raise GGUFError(f"{name}: only a vision projector, no language model; localspec "
                            "needs a text model")
        raise GGUFError(f"{name}: {where} has no model layer; localspec cannot run it")
    if _layers(manifest, ADAPTER_MEDIA_TYPE):
        raise GGUFError(f"{name}: a LoRA adapter model; localspec runs plain GGUF models only "
                        "(use the base model)")
    return models[0]


def _read_text_layer(store: Path, manifest: dict[str, Any], media_type: str) -> str | None:
    layers = _layers(manifest, media_type)
    if not layers:
        return None
    try:
        return blob_path(store, layers[0]["digest"]).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, GGUFError, KeyError):
        log.debug("layer %s of a manifest in %s is unreadable", media_type, store)
        return None


def _read_params(store: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    text = _read_text_layer(store, manifest, PARAMS_MEDIA_TYPE)
    if text is None:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _check_gguf_blob(path: Path, name: ModelName) -> int:
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
        size = path.stat().st_size
    except FileNotFoundError:
        raise ModelNotFoundError(f"{name}: its manifest is present but the model blob {path.name} "
                                 f"is missing; run `localspec pull {name}` again") from None
    except OSError as exc:
        raise GGUFError(f"{name}: cannot read {path} ({exc.strerror})") from exc
    if magic != b"GGUF":
        problem = (f"model blob {blob_label(path)} is not a GGUF file (damaged, or a format "
                   "localspec cannot run)")
        raise NotGGUFBlobError(f"{name}: {problem}; run `localspec pull {name}` to repair it",
                               problem)
    return size


def resolve_in(store: Path, name: ModelName) -> ResolvedModel:
    """Resolve ``name`` in one store. Raises ModelNotFoundError when its manifest is absent,
    DamagedModelError when a blob it names is missing or has the wrong size, GGUFError when it
    is not a runnable GGUF model."""
    mpath = manifest_path(store, name)
    if not mpath.is_file():
        raise ModelNotFoundError(f"{name}: not in the Ollama store {store}; "
                                 f"run `localspec pull {name}`")
    try:
        manifest = read_manifest(mpath)
    except UnreadableManifestError as exc:
        raise UnreadableManifestError(f"{name}: damaged, {exc.problem}; run `localspec pull "
                                      f"{name}` to repair it", exc.problem) from exc
    layer = model_layer(manifest, name, store, f"manifest {mpath}")
    _check_blobs(store, manifest, name)
    gguf = blob_path(store, str(layer.get("digest")))
    size = _check_gguf_blob(gguf, name)
    return ResolvedModel(
        name=name.short,
        gguf_path=gguf,
        size=size,
        manifest_path=mpath,
        template=_read_text_layer(store, manifest, TEMPLATE_MEDIA_TYPE),
        params=_read_params(store, manifest),
        digest=str(layer["digest"]),
        store=store,
    )


def locate(name: ModelName) -> Path | None:
    """The first store holding ``name``'s manifest (the one ``resolve`` reads), or None."""
    for store in store_dirs():
        if manifest_path(store, name).is_file():
            return store
    return None


def resolve(name: str | ModelName) -> ResolvedModel:
    """Find ``name`` in the first store that has its manifest and return its GGUF blob."""
    parsed = name if isinstance(name, ModelName) else parse_name(name)
    store = locate(parsed)
    if store is not None:
        return resolve_in(store, parsed)
    where = " or ".join(str(s) for s in store_dirs())
    raise ModelNotFoundError(f"{parsed}: not in the Ollama store ({where}); "
                             f"run `localspec pull {parsed}`")


def _iter_manifests(store: Path) -> list[tuple[ModelName, Path]]:
    root = store / "manifests"
    found = []
    # Exactly four levels: host/namespace/model/tag; anything else is not a manifest. A file
    # whose name is no tag is not one either: Ollama ignores it too, and localspec's own
    # manifests being written (files.temporary_name: ".<tag>.<pid>-<thread>.partial") start
    # with a dot, which no tag may. A tag may end in ".partial", though: it is a model.
    for path in sorted(root.glob("*/*/*/*")):
        if not path.is_file() or not _PART.fullmatch(path.name):
            continue
        host, namespace, model, tag = path.relative_to(root).parts
        found.append((ModelName(host, namespace, model, tag), path))
    return found


def list_store() -> list[LocalEntry]:
    """Every model in the store(s) that resolves to a GGUF blob or is damaged, first store wins.

    Models that cannot run whatever their blobs hold (cloud, projector-only) are left out; a
    damaged one (a blob missing or of the wrong size, an unreadable manifest, a model blob
    without the GGUF magic) is listed with its problem, so it never passes for present.
    """
    seen: set[str] = set()
    entries = []
    for store in store_dirs():
        for name, mpath in _iter_manifests(store):
            if name.short in seen:
                continue
            try:
                entry = LocalEntry(name.short, mpath, store, model=resolve_in(store, name))
            except DamagedModelError as exc:
                entry = LocalEntry(name.short, mpath, store, problem=exc.problem)
            except (ModelNotFoundError, GGUFError) as exc:
                log.debug("skipping %s: %s", name, exc)
                continue
            entries.append(entry)
            seen.add(name.short)
    return entries


def list_local() -> list[ResolvedModel]:
    """Every whole model in the store(s) that resolves to a GGUF blob (damaged ones left out)."""
    return [entry.model for entry in list_store() if entry.model is not None]


def _referenced(store: Path) -> set[str] | None:
    """Every blob the store's manifests reference; None when one of them cannot be read, since
    its blobs are unknown and any blob may be one of them."""
    refs: set[str] = set()
    for _, path in _iter_manifests(store):
        try:
            refs.update(manifest_digests(read_manifest(path)))
        except UnreadableManifestError as exc:
            log.warning("kept the deleted model's blobs: %s may use them and cannot be read "
                        "(%s)", path, exc.problem)
            return None
    return refs


def delete(name: str | ModelName) -> None:
    """Remove a model's manifest and the blobs that no other manifest references; when another
    manifest cannot be read, the blobs are all kept, since it may reference any of them."""
    parsed = name if isinstance(name, ModelName) else parse_name(name)
    for store in store_dirs():
        mpath = manifest_path(store, parsed)
        if not mpath.is_file():
            continue
        try:
            digests = manifest_digests(read_manifest(mpath))
        except GGUFError:
            digests = []
        mpath.unlink()
        _prune_empty_dirs(mpath.parent, store / "manifests")
        still_used = _referenced(store)
        if still_used is None:
            return
        for digest in digests:
            if digest in still_used:
                continue
            try:
                blob_path(store, digest).unlink(missing_ok=True)
            except GGUFError:
                continue
        return
    raise ModelNotFoundError(f"{parsed}: not in the Ollama store; nothing to delete")


def _prune_empty_dirs(folder: Path, stop: Path) -> None:
    while folder != stop and folder.is_relative_to(stop):
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent
