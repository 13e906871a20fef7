"""GGUF metadata without loading weights, file validation, and the draft/target pair rule.

Files are parsed here, by a streaming reader, before llama.cpp ever sees them: llama.cpp aborts
the whole process on some malformed inputs instead of returning an error, so the hyperparameters
it asserts on (layer and expert counts, epsilons, head counts) are checked here too. The reader
reads only what it needs: no Python object per vocabulary token (a 152k-token vocabulary is
skipped or compared as raw bytes), so ``inspect`` on a real model takes milliseconds, not the
seconds the ``gguf`` package's reader takes building a numpy view per token. It reads with plain
file reads, never a memory map: a file truncated while it is read (a download being replaced)
is then a short read and one line, where a memory map would kill the process with SIGBUS.

Every command that judges a file (run, bench, serve, inspect, list, pair add, suggest, the chat
app's picker) calls :func:`read_gguf_info`, so they agree on what is valid. Results are cached per
file identity (path, size, mtime, inode): a changed file is read again, a stale or corrupt cache
entry is ignored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, BinaryIO

from . import paths
from .errors import GGUFError, IncompatiblePairError
from .files import atomic_write
from .gguf_architectures import KEY_IS_VALUE, KNOWN, ROPE_IS_HEAD

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# llama.cpp's rule (common/speculative.cpp): ids below 5 are control tokens that may differ.
VOCAB_CHECK_START_ID = 5
VOCAB_MAX_SIZE_DIFFERENCE = 128
# Architectures that are not text generators even though they are GGUF files.
NON_TEXT_ARCHITECTURES = {"clip", "mmproj", "bert", "nomic-bert", "jina-bert-v2", "t5encoder"}
# Weight types llama.cpp never repacks (see engine/repack.py): everything else is quantized.
UNQUANTIZED_TYPES = {"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"}
# Bumped whenever GGUFInfo or the validation changes: older cache entries are then ignored.
CACHE_VERSION = 6
_MAX_DIMS = 4  # GGML_MAX_DIMS
# llama.cpp's limits (src/llama-hparams.h, llama-cpp-python 0.3.36): past them, and on the other
# rules _check_hparams applies, llama_model_base::load_hparams or the graph builder fails a
# GGML_ASSERT, which aborts the whole process instead of returning an error.
LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 1024
# llama_rope_scaling_type_from_string's names; any other string is an assertion failure.
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
# Architectures for which llama.cpp turns an expert count of 0 or 1 into "no experts".
_EXPERTS_OPTIONAL = {"hunyuan-dense", "hunyuan_vl"}
# llama.cpp's add_bos / add_eos where the file has no key (llama-vocab.cpp), by tokenizer
# model; BPE vocabularies (gpt2 and its kin) add BOS for these pre-tokenizers alone.
_BPE_MODELS = frozenset({"gpt2", "hybriddna", "whitespace", "gemma4"})
_ADDS_BOS = {"llama": True, "bert": True, "t5": False, "rwkv": False}
_ADDS_EOS = {"t5": True}
_BPE_PRE_ADDING_BOS = frozenset({
    "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
    "jina-v5-nano", "tekken", "chameleon"})
_BPE_PRE_FORCING_BOS = frozenset({"gemma4", "granite-embed-multi-311m"})  # even if set false


@dataclass(frozen=True, slots=True)
class TokenTable:
    """A vocabulary as GGUF stores it: ``(u64 length, bytes)`` records, kept as one raw byte
    string and the offset of each record, so two vocabularies compare with ``bytes`` equality."""

    raw: bytes
    offsets: array  # len(tokens) + 1 entries into ``raw``

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def token(self, i: int) -> bytes:
        return self.raw[self.offsets[i] + 8:self.offsets[i + 1]]

    def span(self, start: int, stop: int) -> bytes:
        """Records ``start`` to ``stop - 1``, raw (lengths included)."""
        return self.raw[self.offsets[start]:self.offsets[stop]]


@dataclass(frozen=True, slots=True)
class GGUFInfo:
    """What a user (and the pair check) needs to know about a GGUF model file."""

    path: Path
    file_size: int
    architecture: str
    name: str | None
    parameter_count: int
    file_type: str | None
    context_length: int | None
    block_count: int | None
    embedding_length: int | None
    tokenizer_model: str | None
    tokenizer_pre: str | None
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    has_chat_template: bool
    head_count: int | None = None
    head_count_kv: int | None = None
    quantized: bool = False
    tensor_count: int = 0
    vocab: TokenTable | None = field(repr=False, compare=False, default=None)

    def kv_cache_bytes(self, n_ctx: int, bytes_per_value: int = 2) -> int:
        """K and V of every layer at ``n_ctx`` tokens (f16 cache), from the attention shape."""
        ratio = (self.head_count_kv / self.head_count
                 if self.head_count and self.head_count_kv else 1.0)
        return int(2 * (self.block_count or 0) * n_ctx * (self.embedding_length or 0) * ratio
                   * bytes_per_value)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (no token list)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "vocab"}
        out["path"] = str(self.path)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GGUFInfo:
        values = {f.name: data[f.name] for f in fields(cls) if f.name != "vocab"}
        values["path"] = Path(values["path"])
        return cls(**values)


@dataclass(frozen=True, slots=True)
class PairReport:
    """Outcome of the pair check: ``compatible`` and, when not, the first differences found."""

    compatible: bool
    problems: tuple[str, ...]

    def raise_if_incompatible(self, target: Path, draft: Path) -> None:
        if not self.compatible:
            raise IncompatiblePairError(
                f"draft {draft.name} cannot draft for target {target.name}: "
                + "; ".join(self.problems)
            )


# -- the streaming reader -----------------------------------------------------------------------
class _Corrupt(Exception):
    """Raised inside the parser; turned into one GGUFError line naming the file."""


_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# GGUF value types: (struct format, size) for scalars; 8 = string, 9 = array.
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4),
            5: ("<i", 4), 6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8),
            12: ("<d", 8)}
_STRING, _ARRAY = 8, 9
_KEEP_ARRAY_MAX = 4096  # numeric arrays kept as values (per-layer head counts); longer: skipped
_KEEP_STRING_MAX = 1 << 20  # strings kept as values (chat templates); longer: skipped
_CHUNK = 1 << 20  # read ahead this much: a real model's metadata is a few such reads


class _Reader:
    """Bounds-checked reads from the start of a GGUF file, loaded on demand in chunks.

    Only the metadata and the tensor table are read (the weights are never touched), into one
    growing buffer, so positions are file offsets."""

    def __init__(self, fh: BinaryIO, size: int) -> None:
        self.fh = fh
        self.size = size  # what stat said; the file may shrink while it is read
        self.buf = bytearray()
        self.pos = 0

    def load(self, end: int) -> None:
        """Have the file's bytes up to ``end`` in ``buf`` (callers checked ``end <= size``)."""
        have = len(self.buf)
        if end <= have:
            return
        # Geometric read-ahead: few reads and copies for a large vocabulary, one for a small.
        want = min(self.size, max(end, have + max(_CHUNK, have))) - have
        self.buf += self.fh.read(want)
        if len(self.buf) < end:
            raise _Corrupt(f"it ended at byte {len(self.buf)} while being read, though it had "
                           f"{self.size} bytes (it was truncated or replaced meanwhile)")

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Corrupt(f"it ends at byte {self.size} while reading {n} bytes at {self.pos}")
        self.load(self.pos + n)

    def u32(self) -> int:
        self.need(4)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(v)

    def u64(self) -> int:
        self.need(8)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return int(v)

    def string(self) -> bytes:
        n = self.u64()
        self.need(n)
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s

    def skip(self, n: int) -> None:
        self.need(n)
        self.pos += n

    def scalar(self, vtype: int) -> Any:
        fmt, n = _SCALARS[vtype]
        self.need(n)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string_array(self, count: int, keep_offsets: bool) -> TokenTable | None:
        """Walk ``count`` string records; return them as a TokenTable when asked."""
        start = self.pos
        unpack, buf, size = _U64.unpack_from, self.buf, self.size
        pos = start
        have = len(buf)
        offsets = array("Q", [0]) if keep_offsets else None
        for _ in range(count):
            if pos + 8 > have:
                if pos + 8 > size:
                    raise _Corrupt("a string array runs past the end of the file")
                self.load(pos + 8)  # grows ``buf`` in place
                have = len(buf)
            pos += 8 + unpack(buf, pos)[0]
            if offsets is not None:
                offsets.append(pos - start)
        if pos > size:
            raise _Corrupt("a string array runs past the end of the file")
        self.load(pos)
        self.pos = pos
        if offsets is None:
            return None
        with memoryview(buf) as view:  # one copy, not a bytearray slice and then bytes
            raw = bytes(view[start:pos])
        return TokenTable(raw, offsets)


def _value(r: _Reader, vtype: int, key: str, want_tokens: bool) -> Any:
    if vtype in _SCALARS:
        return r.scalar(vtype)
    if vtype == _STRING:
        n_start = r.pos
        n = r.u64()
        if n > _KEEP_STRING_MAX:
            r.skip(n)
            return "<long string>"
        r.pos = n_start
        return r.string().decode("utf-8", "replace")
    if vtype != _ARRAY:
        raise _Corrupt(f"metadata key {key} has unknown type {vtype}")
    item_type, count = r.u32(), r.u64()
    if item_type == _STRING:
        # Each record is at least 8 bytes: a count beyond that is corrupt, not a long loop.
        r.need(count * 8)
        table = r.string_array(count, keep_offsets=want_tokens and key == "tokenizer.ggml.tokens")
        return _ArrayInfo(count, table)
    if item_type not in _SCALARS:
        raise _Corrupt(f"metadata key {key} is an array of unknown type {item_type}")
    fmt, size = _SCALARS[item_type]
    r.need(count * size)
    if count <= _KEEP_ARRAY_MAX:
        values = list(struct.unpack_from(f"<{count}{fmt[1]}", r.buf, r.pos))
        r.pos += count * size
        return values
    r.skip(count * size)
    return _ArrayInfo(count, None)


@dataclass(frozen=True, slots=True)
class _ArrayInfo:
    count: int
    table: TokenTable | None


@dataclass(frozen=True, slots=True)
class _Tensor:
    name: str
    n_elements: int
    type_name: str
    offset: int
    n_bytes: int


def _ggml_sizes() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, values per block, bytes per block), from the gguf package."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # deferred: pulls in numpy

    return {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType
            if t in GGML_QUANT_SIZES}


def _tensor(r: _Reader, sizes: dict[int, tuple[str, int, int]]) -> _Tensor:
    name = r.string().decode("utf-8", "replace")
    n_dims = r.u32()
    if not 1 <= n_dims <= _MAX_DIMS:
        raise _Corrupt(f"tensor {name} has {n_dims} dimensions")
    dims = [r.u64() for _ in range(n_dims)]
    ttype = r.u32()
    offset = r.u64()
    if ttype not in sizes:
        raise _Corrupt(f"tensor {name} has unknown type {ttype}")
    type_name, block, block_bytes = sizes[ttype]
    n = 1
    for d in dims:
        if d == 0 or d > 1 << 40:
            raise _Corrupt(f"tensor {name} has an impossible shape {dims}")
        n *= d
    if dims[0] % block:
        raise _Corrupt(f"tensor {name}: {dims[0]} values per row do not fill {type_name} blocks")
    return _Tensor(name, n, type_name, offset, n // block * block_bytes)


# What llama.cpp refuses a file for (gguf.cpp, llama-vocab.cpp): (type, array item type), with
# _NOT_ARRAY for a scalar; tokens' scores and types must also cover every token.
_NOT_ARRAY = -1
_TYPED_KEYS: dict[str, tuple[tuple[int, int], ...]] = {
    "general.alignment": ((4, _NOT_ARRAY),),
    "tokenizer.ggml.scores": ((_ARRAY, 5), (_ARRAY, 6)),
    "tokenizer.ggml.token_type": ((_ARRAY, 5),),
}
_TYPE_NAMES = {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32", 7: "bool",
               8: "string", 9: "array", 10: "u64", 11: "i64", 12: "f64"}


def _kind(r: _Reader, vtype: int) -> tuple[int, int]:
    """(type, item type) of the value at the reader's position, which is left where it was."""
    if vtype != _ARRAY:
        return vtype, _NOT_ARRAY
    start = r.pos
    item_type = r.u32()
    r.pos = start
    return vtype, item_type


def _check_kinds(kinds: dict[str, tuple[int, int]]) -> None:
    for key, kind in kinds.items():
        allowed = _TYPED_KEYS[key]
        if kind not in allowed:
            want = " or ".join(_type_name(k) for k in allowed)
            raise _Corrupt(f"metadata key {key} is {_type_name(kind)}, not {want}")


def _type_name(kind: tuple[int, int]) -> str:
    vtype, item = kind
    if vtype == _ARRAY:
        return f"an array of {_TYPE_NAMES.get(item, f'type {item}')}"
    return f"a {_TYPE_NAMES.get(vtype, f'type {vtype}')}"


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _parse(path: Path, fh: BinaryIO, size: int, want_tokens: bool
           ) -> tuple[dict[str, Any], list[_Tensor]]:
    r = _Reader(fh, size)
    r.need(4)
    r.pos = 4  # magic, checked by the caller
    version = r.u32()
    if version not in (2, 3):
        raise _Corrupt(f"unsupported GGUF version {version}")
    n_tensors, n_kv = r.u64(), r.u64()
    # Every entry takes bytes: counts the file cannot hold are corruption, not long loops.
    if n_kv * 13 > size or n_tensors * 25 > size:
        raise _Corrupt(f"it claims {n_kv} metadata keys and {n_tensors} tensors")
    meta: dict[str, Any] = {}
    kinds: dict[str, tuple[int, int]] = {}  # the keys whose types llama.cpp checks
    for _ in range(n_kv):
        key = r.string().decode("utf-8", "replace")
        if not key:
            raise _Corrupt("a metadata key is empty")
        if key in meta:
            raise _Corrupt(f"metadata key {key} appears twice")
        vtype = r.u32()
        if key in _TYPED_KEYS:
            kinds[key] = _kind(r, vtype)
        meta[key] = _value(r, vtype, key, want_tokens)
    _check_kinds(kinds)
    sizes = _ggml_sizes()
    tensors = [_tensor(r, sizes) for _ in range(n_tensors)]
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise _Corrupt(f"tensor {twice} appears twice")
    alignment = meta.get("general.alignment", 32)
    if alignment <= 0 or alignment & (alignment - 1):  # a u32 by _check_kinds
        raise _Corrupt(f"general.alignment is {alignment!r}, not a power of two")
    # The size now, not at the start: a file cut in its weights while the header was read is
    # then "truncated" too.
    size = min(size, os.fstat(fh.fileno()).st_size)
    _check_layout(path, tensors, _align(r.pos, alignment), alignment, size)
    return meta, tensors


def _check_layout(path: Path, tensors: list[_Tensor], data_start: int, alignment: int,
                  file_size: int) -> None:
    """llama.cpp's own rule (tensor data back to back, each padded to the alignment), then that
    the data ends where the file ends: a file whose tensor count was lowered, or with bytes
    appended (a download written twice), is caught here, not by llama.cpp later."""
    expected = 0
    for t in tensors:
        if t.offset != expected:
            raise _Corrupt(f"tensor {t.name} starts at offset {t.offset}, expected {expected} "
                           "(a damaged tensor table)")
        end = data_start + t.offset + t.n_bytes
        if end > file_size:
            raise GGUFError(f"{path}: truncated: tensor {t.name} ends at byte {end} but the file "
                            f"has {file_size} bytes (an interrupted download?)")
        expected += _align(t.n_bytes, alignment)
    extra = file_size - (data_start + expected)
    if extra > 0:
        raise GGUFError(f"{path}: damaged: {extra} bytes after the last tensor belong to no "
                        "tensor (a wrong tensor count, or bytes appended to a download); "
                        "download it again")


# -- validation and metadata --------------------------------------------------------------------
def _check_header(path: Path) -> int:
    try:
        exists = path.exists()
    except OSError:
        # A name no file can have (longer than the file system allows) names no file.
        exists = False
    if not exists:
        raise GGUFError(f"{path}: no such file")
    if not path.is_file():
        raise GGUFError(f"{path}: not a file")
    size = path.stat().st_size
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read it ({exc.strerror})") from exc
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    return size


def _read_file(path: Path, size: int, want_tokens: bool) -> tuple[dict[str, Any], list[_Tensor]]:
    try:
        with path.open("rb") as fh:
            return _parse(path, fh, size, want_tokens)
    except _Corrupt as exc:
        raise GGUFError(f"{path}: corrupt or truncated GGUF ({exc})") from None
    except (ValueError, OSError, struct.error, UnicodeError, MemoryError) as exc:
        raise GGUFError(f"{path}: corrupt or truncated GGUF ({type(exc).__name__}: {exc})"
                        ) from None


def _array_length(value: Any) -> int | None:
    if isinstance(value, _ArrayInfo):
        return value.count
    return len(value) if isinstance(value, list) else None


def _file_type_name(value: Any) -> str | None:
    if not isinstance(value, int):
        return None
    from gguf import LlamaFileType

    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"type {value}"


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _largest(value: Any) -> int | None:
    """Head counts are per-layer arrays in some architectures; the largest bounds the cache."""
    if isinstance(value, list):
        return max((v for v in value if _int(v) is not None), default=None)
    return _int(value)


def _adds_bos(tokenizer_model: str, pre: Any, key: Any) -> bool:
    """Whether llama.cpp adds BOS: the file's key if set, else its default for the
    vocabulary; a Gemma 4 pre-tokenizer overrides a key that says no."""
    bpe = tokenizer_model in _BPE_MODELS
    if isinstance(key, bool):
        bos = key
    elif bpe:
        bos = pre in _BPE_PRE_ADDING_BOS
    else:
        bos = _ADDS_BOS.get(tokenizer_model, False)
    return bos or (bpe and pre in _BPE_PRE_FORCING_BOS)


def _adds_eos(tokenizer_model: str, key: Any) -> bool:
    return key if isinstance(key, bool) else _ADDS_EOS.get(tokenizer_model, False)


def _info(path: Path, size: int, meta: dict[str, Any], tensors: list[_Tensor]) -> GGUFInfo:
    if not tensors:
        raise GGUFError(f"{path}: the GGUF file holds no tensors (not a model)")
    arch = meta.get("general.architecture")
    if not arch or not isinstance(arch, str):
        raise GGUFError(f"{path}: no general.architecture in its metadata (not a model file)")
    if arch in NON_TEXT_ARCHITECTURES:
        raise GGUFError(f"{path}: a '{arch}' model (projector or encoder), not a text generator")
    if arch not in KNOWN:
        raise GGUFError(f"{path}: architecture {arch!r} is not one llama.cpp (as in "
                        "llama-cpp-python 0.3.36) can run")
    tok_model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tok_model, str) or not isinstance(tokens, _ArrayInfo):
        raise GGUFError(f"{path}: no tokenizer in its metadata; localspec cannot run it")
    if tok_model == "bert":
        # llama.cpp aborts on a byte token of a WordPiece vocabulary, and no text generator
        # uses one: it is an encoder's (BERT's) tokenizer.
        raise GGUFError(f"{path}: a BERT (WordPiece) vocabulary, an encoder's tokenizer; "
                        "localspec runs text generators")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        held = _array_length(meta.get(key))
        if held is not None and held < tokens.count:
            raise GGUFError(f"{path}: {key} holds {held} values for {tokens.count} tokens "
                            "(a damaged vocabulary)")
    _check_hparams(path, meta, arch)
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_eos = meta.get("tokenizer.ggml.add_eos_token")
    name = meta.get("general.name")
    pre = meta.get("tokenizer.ggml.pre")
    return GGUFInfo(
        path=path,
        file_size=size,
        architecture=arch,
        name=name if isinstance(name, str) else None,
        parameter_count=sum(t.n_elements for t in tensors),
        file_type=_file_type_name(meta.get("general.file_type")),
        context_length=_int(meta.get(f"{arch}.context_length")),
        block_count=_int(meta.get(f"{arch}.block_count")),
        embedding_length=_int(meta.get(f"{arch}.embedding_length")),
        tokenizer_model=tok_model,
        tokenizer_pre=pre if isinstance(pre, str) else None,
        vocab_size=tokens.count,
        bos_token_id=_int(meta.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_int(meta.get("tokenizer.ggml.eos_token_id")),
        add_bos_token=_adds_bos(tok_model, pre, add_bos),
        add_eos_token=_adds_eos(tok_model, add_eos),
        has_chat_template="tokenizer.chat_template" in meta,
        head_count=_largest(meta.get(f"{arch}.attention.head_count")),
        head_count_kv=_largest(meta.get(f"{arch}.attention.head_count_kv")),
        quantized=any(t.type_name not in UNQUANTIZED_TYPES for t in tensors),
        tensor_count=len(tensors),
        vocab=tokens.table,
    )


class _BadHparam(Exception):
    """A hyperparameter llama.cpp would abort on; the message names the key and the rule."""


def _count(meta: dict[str, Any], key: str, default: int | None = 0) -> int | None:
    """An integer hyperparameter (a count), ``default`` when absent. A value of another type is
    left to llama.cpp, which refuses a mistyped key with an error rather than an abort."""
    value = meta.get(key)
    return default if value is None else _int(value)


def _per_layer(meta: dict[str, Any], key: str, n_layer: int, default: list[int]) -> list[int]:
    """A count llama.cpp reads as a scalar for every layer or as one value per layer."""
    value = meta.get(key)
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    scalar = _int(value)
    return [scalar] * n_layer if scalar is not None else default


def _check_counts(meta: dict[str, Any], arch: str) -> int:
    """Layer and expert counts, as llama_model_base::load_hparams asserts them. Returns the
    layer count."""
    key = f"{arch}.block_count"
    n_layer = _count(meta, key, None)
    if n_layer is None:
        raise _BadHparam(f"no {key} (the layer count) in its metadata")
    if not 0 < n_layer <= LLAMA_MAX_LAYERS:
        raise _BadHparam(f"{key} is {n_layer}; llama.cpp allows 1 to {LLAMA_MAX_LAYERS} layers")
    nextn = _count(meta, f"{arch}.nextn_predict_layers")
    if nextn is not None and not 0 <= nextn <= n_layer:
        raise _BadHparam(f"{arch}.nextn_predict_layers is {nextn}, more than its {n_layer} "
                         "layers")
    n_expert = _count(meta, f"{arch}.expert_count") or 0
    used = max(_per_layer(meta, f"{arch}.expert_used_count", n_layer, [0]), default=0)
    groups = _count(meta, f"{arch}.expert_group_count") or 0
    group_used = _count(meta, f"{arch}.expert_group_used_count") or 0
    if arch in _EXPERTS_OPTIONAL and n_expert <= 1:
        n_expert, used = 0, 0  # what llama.cpp sets before asserting
    if not 0 <= n_expert <= LLAMA_MAX_EXPERTS:
        raise _BadHparam(f"{arch}.expert_count is {n_expert}; llama.cpp allows at most "
                         f"{LLAMA_MAX_EXPERTS} experts")
    if n_expert == 0:
        if used or groups:
            raise _BadHparam(f"{arch}.expert_used_count or expert_group_count is set but "
                             "there are no experts (no expert_count)")
        return n_layer
    if not 0 < used <= n_expert:
        raise _BadHparam(f"{arch}.expert_used_count is {used}; it must be 1 to the "
                         f"{n_expert} experts")
    if not 0 <= groups < n_expert:
        raise _BadHparam(f"{arch}.expert_group_count is {groups}, not fewer than the "
                         f"{n_expert} experts")
    if groups > 1 and (n_expert % groups or not 0 < group_used < groups):
        raise _BadHparam(f"{arch}: {n_expert} experts in {groups} groups with {group_used} "
                         "used do not fit (the groups must divide the experts, and fewer "
                         "than all be used)")
    return n_layer


def _check_heads(meta: dict[str, Any], arch: str, n_layer: int) -> None:
    """Head counts that divide the dimensions they split: llama.cpp derives the head size by
    integer division and the grouped-query attention assumes whole groups."""
    keys = (f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv")
    for key in keys:
        value = meta.get(key)
        if isinstance(value, list) and any(_int(v) is None for v in value):
            raise _BadHparam(f"{key} holds {_kind_of(value)}; head counts are whole numbers")
    n_head = _per_layer(meta, keys[0], n_layer, [])
    n_head_kv = _per_layer(meta, keys[1], n_layer, n_head)
    if any(h < 0 for h in n_head + n_head_kv):
        raise _BadHparam(f"{arch}.attention.head_count or head_count_kv is negative")
    # zip stops at the shorter: llama.cpp refuses per-layer arrays of a wrong length itself.
    for i, (h, kv) in enumerate(zip(n_head, n_head_kv, strict=False)):
        if h and kv and h % kv:
            where = f" in layer {i}" if any(isinstance(meta.get(k), list) for k in keys) else ""
            raise _BadHparam(f"{arch}.attention.head_count_kv {kv} does not divide "
                             f"head_count {h}{where}")
    n_embd = _count(meta, f"{arch}.embedding_length", None)
    first = n_head[0] if n_head else 0
    if first and n_embd is not None and f"{arch}.attention.key_length" not in meta \
            and n_embd % first:
        raise _BadHparam(f"{arch}.attention.head_count {first} does not divide "
                         f"embedding_length {n_embd} (and no key_length says the head size)")
    _check_head_sizes(meta, arch, n_embd // first if first and n_embd else None)


def _check_head_sizes(meta: dict[str, Any], arch: str, default: int | None) -> None:
    """The head sizes the architecture's graph asserts equal: keys' and values' (key_length,
    value_length; both default to embedding_length / head_count), and the RoPE dimension
    (rope.dimension_count, default the key size)."""
    k_key, v_key = f"{arch}.attention.key_length", f"{arch}.attention.value_length"
    head_k, head_v = _count(meta, k_key, default), _count(meta, v_key, default)
    rot_key = f"{arch}.rope.dimension_count"
    n_rot = _count(meta, rot_key, head_k)
    if arch in KEY_IS_VALUE and head_k and head_v and head_k != head_v:
        raise _BadHparam(f"{k_key} {head_k} and {v_key} {head_v} differ; llama.cpp's {arch} "
                         "needs one head size")
    if arch in ROPE_IS_HEAD and head_v and n_rot is not None and n_rot != head_v:
        raise _BadHparam(f"{rot_key} is {n_rot}, not the head size {head_v}; llama.cpp's "
                         f"{arch} rotates whole heads")


def _kind_of(value: list[Any]) -> str:
    odd = next(v for v in value if _int(v) is None)
    return f"{type(odd).__name__} values such as {odd!r}"


def _check_floats(meta: dict[str, Any], arch: str) -> None:
    """Normalisation epsilons (ggml asserts eps >= 0, and NaN fails it) and the RoPE scaling
    type (an unknown name fails an assertion)."""
    for key, value in meta.items():
        if not (key.startswith(arch + ".") and key.endswith("epsilon")):
            continue
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, (int, float)) and not (math.isfinite(v) and v > 0):
                raise _BadHparam(f"{key} is {v}; it must be a finite number above 0")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if isinstance(scaling, str) and scaling not in ROPE_SCALING_TYPES:
        raise _BadHparam(f"{arch}.rope.scaling.type is {scaling!r}, not one of "
                         f"{', '.join(ROPE_SCALING_TYPES)}")


def _check_hparams(path: Path, meta: dict[str, Any], arch: str) -> None:
    """Refuse, in one line, the hyperparameters llama.cpp would abort the process on."""
    try:
        n_layer = _check_counts(meta, arch)
        _check_heads(meta, arch, n_layer)
        _check_floats(meta, arch)
    except _BadHparam as exc:
        raise GGUFError(f"{path}: impossible model hyperparameters: {exc}") from None


def read_gguf_info(path: str | Path, *, with_tokens: bool = False) -> GGUFInfo:
    """Validate ``path`` and return its metadata. Raises GGUFError with a one-line reason.

    ``with_tokens`` also returns the vocabulary (for the pair rule); without it a validated
    file's metadata comes from the cache when the file is unchanged.
    """
    path = Path(path).expanduser()
    size = _check_header(path)
    identity = file_identity(path)
    if not with_tokens:
        cached = _cache_get("gguf", identity)
        if cached is not None:
            try:
                return GGUFInfo.from_json(cached)
            except (KeyError, TypeError, ValueError):
                pass  # an entry of another shape: read the file
    meta, tensors = _read_file(path, size, with_tokens)
    info = _info(path, size, meta, tensors)
    _cache_put("gguf", identity, info.to_json())
    return info


def has_quantized_weights(path: str | Path) -> bool:
    """Whether any tensor is quantized (what llama.cpp's repacking applies to)."""
    return read_gguf_info(path).quantized


# -- the pair rule ------------------------------------------------------------------------------
def _show(token: bytes) -> str:
    return repr(token.decode("utf-8", errors="replace"))


def _first_difference(a: TokenTable, b: TokenTable, start: int, stop: int) -> int | None:
    """The first id in [start, stop) whose token differs, comparing raw spans (no loop over
    tokens unless they differ; then a bisection over spans)."""
    if start >= stop or a.span(start, stop) == b.span(start, stop):
        return None
    lo, hi = start, stop  # the first difference is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a.span(lo, mid) == b.span(lo, mid):
            lo = mid
        else:
            hi = mid
    return lo


def check_pair(target: GGUFInfo, draft: GGUFInfo, max_problems: int = 3) -> PairReport:
    """llama.cpp's compatibility rule for speculative decoding, with readable reasons.

    Both infos must have been read ``with_tokens=True``.
    """
    problems: list[str] = []
    if target.tokenizer_model != draft.tokenizer_model:
        problems.append(
            f"vocabulary type differs ({target.tokenizer_model} vs {draft.tokenizer_model})"
        )
    if target.add_bos_token != draft.add_bos_token or (
        target.add_bos_token and target.bos_token_id != draft.bos_token_id
    ):
        problems.append(
            f"BOS differs (add_bos {target.add_bos_token}/{draft.add_bos_token}, "
            f"id {target.bos_token_id}/{draft.bos_token_id})"
        )
    if target.add_eos_token != draft.add_eos_token or (
        target.add_eos_token and target.eos_token_id != draft.eos_token_id
    ):
        problems.append(
            f"EOS differs (add_eos {target.add_eos_token}/{draft.add_eos_token}, "
            f"id {target.eos_token_id}/{draft.eos_token_id})"
        )
    diff = abs(target.vocab_size - draft.vocab_size)
    if diff > VOCAB_MAX_SIZE_DIFFERENCE:
        problems.append(
            f"vocabulary sizes differ by {diff} ({target.vocab_size} vs {draft.vocab_size}; "
            f"at most {VOCAB_MAX_SIZE_DIFFERENCE} allowed)"
        )
    if target.vocab is not None and draft.vocab is not None:
        limit = min(len(target.vocab), len(draft.vocab))
        i = _first_difference(target.vocab, draft.vocab, VOCAB_CHECK_START_ID, limit)
        if i is not None:
            problems.append(f"token {i} differs ({_show(target.vocab.token(i))} vs "
                            f"{_show(draft.vocab.token(i))})")
    return PairReport(compatible=not problems, problems=tuple(problems[:max_problems]))


def pair_report(target_path: str | Path, draft_path: str | Path) -> PairReport:
    """Validate both files and apply the pair rule; cached per pair of file identities.

    Raises GGUFError when either file is invalid."""
    target_path, draft_path = Path(target_path).expanduser(), Path(draft_path).expanduser()
    _check_header(target_path)
    _check_header(draft_path)
    identity = file_identity(target_path) + "\n" + file_identity(draft_path)
    cached = _cache_get("pair", identity)
    if cached is not None:
        try:
            return PairReport(bool(cached["compatible"]), tuple(map(str, cached["problems"])))
        except (KeyError, TypeError):
            pass
    report = check_pair(read_gguf_info(target_path, with_tokens=True),
                        read_gguf_info(draft_path, with_tokens=True))
    _cache_put("pair", identity, {"compatible": report.compatible,
                                  "problems": list(report.problems)})
    return report


def validate_pair(target_path: str | Path, draft_path: str | Path) -> tuple[GGUFInfo, GGUFInfo]:
    """Validate both files and the pair rule; raise a LocalspecError with one line if refused."""
    report = pair_report(target_path, draft_path)
    target, draft = read_gguf_info(target_path), read_gguf_info(draft_path)
    report.raise_if_incompatible(target.path, draft.path)
    return target, draft


# -- the cache ----------------------------------------------------------------------------------
def file_identity(path: Path) -> str:
    """What makes a cached judgement of a file still true: its path, size, mtime and inode."""
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_dev}"


def _cache_path(kind: str, identity: str) -> Path:
    digest = hashlib.sha256(f"{kind}\n{identity}".encode()).hexdigest()[:40]
    return paths.cache_dir() / "files" / f"{kind}-{digest}.json"


def _cache_get(kind: str, identity: str) -> dict[str, Any] | None:
    try:
        data = json.loads(_cache_path(kind, identity).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION \
            or data.get("identity") != identity or not isinstance(data.get("value"), dict):
        return None
    value: dict[str, Any] = data["value"]
    return value


def _cache_put(kind: str, identity: str, value: dict[str, Any]) -> None:
    try:
        atomic_write(_cache_path(kind, identity),
                     json.dumps({"version": CACHE_VERSION, "identity": identity,
                                 "value": value}))
    except OSError as exc:  # a read-only cache only costs speed
        log.debug("cannot cache %s: %s", kind, exc)


def iter_cache_files() -> Iterator[Path]:
    """Every cache file this module wrote (for tests and `doctor`)."""
    folder = paths.cache_dir() / "files"
    return iter(sorted(folder.glob("*.json"))) if folder.is_dir() else iter(())


__all__ = ["GGUFInfo", "PairReport", "TokenTable", "check_pair", "file_identity",
           "has_quantized_weights", "pair_report", "read_gguf_info", "validate_pair"]


def read_tensor_sizes(path: str | Path
                      ) -> tuple[GGUFInfo, dict[str, Any], tuple[tuple[str, int], ...]]:
    """A validated file's info, its metadata (long arrays such as the vocabulary left out) and
    each tensor's name and size in bytes, from the header alone: what GPU placement
    (engine/placement.py) sums layer by layer. Raises GGUFError with a one-line reason."""
    path = Path(path).expanduser()
    size = _check_header(path)
    meta, tensors = _read_file(path, size, want_tokens=False)
    info = _info(path, size, meta, tensors)
    plain = {k: v for k, v in meta.items() if not isinstance(v, _ArrayInfo)}
    return info, plain, tuple((t.name, t.n_bytes) for t in tensors)
