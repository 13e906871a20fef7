"""GGUF metadata without loading weights, file validation, and the draft/target pair rule.

Everything here reads the file with the ``gguf`` package's reader (a memory map; no weights are
touched beyond their extents) so that nothing malformed ever reaches llama.cpp, which aborts the
whole process on some corrupt inputs instead of returning an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import GGUFError, IncompatiblePairError

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# llama.cpp's rule (common/speculative.cpp): ids below 5 are control tokens that may differ.
VOCAB_CHECK_START_ID = 5
VOCAB_MAX_SIZE_DIFFERENCE = 128
# Architectures that are not text generators even though they are GGUF files.
NON_TEXT_ARCHITECTURES = {"clip", "mmproj", "bert", "nomic-bert", "jina-bert-v2", "t5encoder"}


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
    tokens: tuple[bytes, ...] = field(repr=False, compare=False, default=())

    def kv_cache_bytes(self, n_ctx: int, bytes_per_value: int = 2) -> int:
        """K and V of every layer at ``n_ctx`` tokens (f16 cache), from the attention shape."""
        ratio = (self.head_count_kv / self.head_count
                 if self.head_count and self.head_count_kv else 1.0)
        return int(2 * (self.block_count or 0) * n_ctx * (self.embedding_length or 0) * ratio
                   * bytes_per_value)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (no token list)."""
        return {
            "path": str(self.path),
            "file_size": self.file_size,
            "architecture": self.architecture,
            "name": self.name,
            "parameter_count": self.parameter_count,
            "file_type": self.file_type,
            "context_length": self.context_length,
            "block_count": self.block_count,
            "embedding_length": self.embedding_length,
            "tokenizer_model": self.tokenizer_model,
            "tokenizer_pre": self.tokenizer_pre,
            "vocab_size": self.vocab_size,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "has_chat_template": self.has_chat_template,
            "head_count": self.head_count,
            "head_count_kv": self.head_count_kv,
        }


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


def _check_header(path: Path) -> int:
    if not path.exists():
        raise GGUFError(f"{path}: no such file")
    if not path.is_file():
        raise GGUFError(f"{path}: not a file")
    size = path.stat().st_size
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    return size


def _open_reader(path: Path) -> Any:
    # Imported here: gguf pulls in numpy, which `localspec --help` should not pay for.
    from gguf import GGUFReader

    try:
        return GGUFReader(path, "r")
    except Exception as exc:  # the reader raises many kinds on malformed input
        raise GGUFError(f"{path}: corrupt or truncated GGUF ({type(exc).__name__}: {exc})") from exc


def _scalar(reader: Any, key: str) -> Any:
    fld = reader.get_field(key)
    if fld is None:
        return None
    try:
        value = fld.contents()
    except Exception as exc:
        raise GGUFError(f"{reader.data.filename}: metadata key {key} is unreadable") from exc
    return value


def _file_type_name(value: Any) -> str | None:
    if value is None:
        return None
    from gguf import LlamaFileType

    try:
        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"type {int(value)}"


def _check_tensor_extents(path: Path, reader: Any, file_size: int) -> int:
    params = 0
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > file_size:
            raise GGUFError(
                f"{path}: truncated: tensor {tensor.name} ends at byte {end} but the file has "
                f"{file_size} bytes (an interrupted download?)"
            )
        params += int(tensor.n_elements)
    if not reader.tensors:
        raise GGUFError(f"{path}: the GGUF file holds no tensors (not a model)")
    return params


def _largest(value: Any) -> int | None:
    """Head counts are per-layer arrays in some architectures; the largest bounds the cache."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return max(int(v) for v in value) if value else None
    return int(value)


def _default_add_bos(tokenizer_model: str | None) -> bool:
    # llama.cpp's defaults when the key is absent: SPM-style vocabularies add BOS, BPE ones do not.
    return tokenizer_model in {"llama", "t5"}


def read_gguf_info(path: str | Path, *, with_tokens: bool = False) -> GGUFInfo:
    """Validate ``path`` and return its metadata. Raises GGUFError with a one-line reason."""
    path = Path(path).expanduser()
    size = _check_header(path)
    reader = _open_reader(path)
    params = _check_tensor_extents(path, reader, size)
    arch = _scalar(reader, "general.architecture")
    if not arch:
        raise GGUFError(f"{path}: no general.architecture in its metadata (not a model file)")
    if arch in NON_TEXT_ARCHITECTURES:
        raise GGUFError(f"{path}: a '{arch}' model (projector or encoder), not a text generator")
    tok_model = _scalar(reader, "tokenizer.ggml.model")
    tokens_field = reader.get_field("tokenizer.ggml.tokens")
    if tok_model is None or tokens_field is None:
        raise GGUFError(f"{path}: no tokenizer in its metadata; localspec cannot run it")
    tokens: tuple[bytes, ...] = ()
    if with_tokens:
        tokens = tuple(bytes(tokens_field.parts[i]) for i in tokens_field.data)
    add_bos = _scalar(reader, "tokenizer.ggml.add_bos_token")
    add_eos = _scalar(reader, "tokenizer.ggml.add_eos_token")
    return GGUFInfo(
        path=path,
        file_size=size,
        architecture=str(arch),
        name=_scalar(reader, "general.name"),
        parameter_count=params,
        file_type=_file_type_name(_scalar(reader, "general.file_type")),
        context_length=_scalar(reader, f"{arch}.context_length"),
        block_count=_scalar(reader, f"{arch}.block_count"),
        embedding_length=_scalar(reader, f"{arch}.embedding_length"),
        tokenizer_model=str(tok_model),
        tokenizer_pre=_scalar(reader, "tokenizer.ggml.pre"),
        vocab_size=len(tokens_field.data),
        bos_token_id=_scalar(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_scalar(reader, "tokenizer.ggml.eos_token_id"),
        add_bos_token=bool(add_bos) if add_bos is not None else _default_add_bos(str(tok_model)),
        add_eos_token=bool(add_eos) if add_eos is not None else False,
        has_chat_template=reader.get_field("tokenizer.chat_template") is not None,
        head_count=_largest(_scalar(reader, f"{arch}.attention.head_count")),
        head_count_kv=_largest(_scalar(reader, f"{arch}.attention.head_count_kv")),
        tokens=tokens,
    )


def _show(token: bytes) -> str:
    return repr(token.decode("utf-8", errors="replace"))


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
    if target.tokens and draft.tokens:
        limit = min(len(target.tokens), len(draft.tokens))
        for i in range(VOCAB_CHECK_START_ID, limit):
            if target.tokens[i] != draft.tokens[i]:
                problems.append(
                    f"token {i} differs ({_show(target.tokens[i])} vs {_show(draft.tokens[i])})"
                )
                break
    return PairReport(compatible=not problems, problems=tuple(problems[:max_problems]))


def validate_pair(target_path: str | Path, draft_path: str | Path) -> tuple[GGUFInfo, GGUFInfo]:
    """Validate both files and the pair rule; raise a LocalspecError with one line if refused."""
    target = read_gguf_info(target_path, with_tokens=True)
    draft = read_gguf_info(draft_path, with_tokens=True)
    check_pair(target, draft).raise_if_incompatible(target.path, draft.path)
    return target, draft
