"""Tiny, real llama-architecture GGUF models written with the ``gguf`` package.

They load in real llama.cpp in milliseconds, so tests and ``localspec demo`` exercise the real
engine on any machine with no download. Their text is noise: the weights are seeded random numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..files import replace_durably, temporary_name

# A small word list so tokenized prompts and detokenized output look like text, not only bytes.
_WORDS = (
    "the of and to in is that for it with as was on be by this are from or at an which have not "
    "def return import class self if else while print value list data code model token fast draft "
    "target speed local run test"
).split()
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True, slots=True)
class Typed:
    """A metadata value written as the GGUF type named (``gguf.GGUFValueType``'s name, such as
    "UINT64"), or, for a tuple, an array of that type: the types the defaults do not pick."""

    value: int | float | str | tuple[int | float | str, ...]
    type_name: str


MetadataValue = bool | int | float | str | tuple[int | float | str, ...] | Typed | None


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Shape and seed of a tiny model. ``keep_layers`` makes a shallow copy of a deeper model."""

    seed: int = 0
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_layer: int = 2
    context_length: int = 4096
    words: tuple[str, ...] = tuple(_WORDS)
    byte_tokens: bool = True
    output_scale: float = 1.0
    keep_layers: int | None = None
    # How much each block adds to the residual stream: small values make shallow copies agree
    # with the full model more often (a well-matched draft).
    layer_scale: float = 0.5
    # Scale of the control tokens' output rows: 0 makes EOS practically never chosen greedily.
    eos_scale: float = 0.0
    name: str = "tiny"
    # The architecture the file names (its keys are prefixed with it); the tensors stay llama's.
    architecture: str = "llama"
    # Metadata keys set after (and over) the ones written from the fields above, to craft files
    # with unusual or impossible hyperparameters: ints are written as u32 (as GGUF counts are;
    # negative ones as i32), floats as f32, strings and bools as such, tuples as arrays of
    # those; ``Typed`` for other types; None removes the key.
    metadata: tuple[tuple[str, MetadataValue], ...] = ()
    # Words (of ``words``, each once) that greedy decoding writes in this order after any other
    # token, then EOS: a real model whose answer is known, for what reads answers (a server
    # parsing tool calls). Its blocks add nothing, so each position's logits are its token's.
    script: tuple[str, ...] = ()
    # Tokens matched whole wherever they appear, as a template's tags are (Qwen's
    # ``<tool_call>``): written as user-defined tokens after the words. A script may name them.
    added_tokens: tuple[str, ...] = ()
    # Whether they are written as control tokens instead, whose text an answer shows as nothing
    # (as Mistral's ``[TOOL_CALLS]``).
    added_control: bool = False


def vocabulary(spec: TinyModelSpec) -> tuple[list[str], list[float], list[int]]:
    """SentencePiece-style vocabulary: control tokens, byte fallback, then words and letters."""
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    if spec.byte_tokens:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [TokenType.BYTE] * 256
    pieces = ["▁" + w for w in spec.words] + list("abcdefghijklmnopqrstuvwxyz") + ["▁"]
    tokens += pieces
    types += [TokenType.NORMAL] * len(pieces)
    # Longer pieces score higher so the SPM merge prefers whole words.
    scores = [0.0] * (len(tokens) - len(pieces)) + [float(len(p)) for p in pieces]
    tokens += spec.added_tokens
    added = TokenType.CONTROL if spec.added_control else TokenType.USER_DEFINED
    types += [added] * len(spec.added_tokens)
    scores += [0.0] * len(spec.added_tokens)
    return tokens, scores, [int(t) for t in types]


def _weights(spec: TinyModelSpec, n_vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    head_dim = spec.n_embd // spec.n_head
    n_kv = head_dim * spec.n_head_kv

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    embd = mat(n_vocab, spec.n_embd, float(np.sqrt(spec.n_embd)))
    w: dict[str, np.ndarray] = {"token_embd.weight": embd}
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = np.ones(spec.n_embd, dtype=np.float32)
        w[p + "attn_q.weight"] = mat(spec.n_embd, spec.n_embd)
        w[p + "attn_k.weight"] = mat(n_kv, spec.n_embd)
        w[p + "attn_v.weight"] = mat(n_kv, spec.n_embd)
        w[p + "attn_output.weight"] = mat(spec.n_embd, spec.n_embd, spec.layer_scale)
        w[p + "ffn_norm.weight"] = np.ones(spec.n_embd, dtype=np.float32)
        w[p + "ffn_gate.weight"] = mat(spec.n_ff, spec.n_embd)
        w[p + "ffn_up.weight"] = mat(spec.n_ff, spec.n_embd)
        w[p + "ffn_down.weight"] = mat(spec.n_embd, spec.n_ff, spec.layer_scale)
    w["output_norm.weight"] = np.ones(spec.n_embd, dtype=np.float32)
    w["output.weight"] = mat(n_vocab, spec.n_embd, 4.0 * spec.output_scale)
    w["output.weight"][:3] *= spec.eos_scale
    if spec.script:
        _scripted(w, spec, rng)
    return w


def _scripted(w: dict[str, np.ndarray], spec: TinyModelSpec, rng: np.random.Generator) -> None:
    """Make ``w`` write ``spec.script``: every other token shares one embedding, whose output
    row is the script's first word; each word's embedding is the output row of the next (the
    last one's, EOS's). Rows are unit vectors times a scale that leaves the next word's logit
    far above any other (random 64-dimensional directions overlap by ~1/8)."""
    tokens, _, _ = vocabulary(spec)
    ids = [tokens.index(word if word in spec.added_tokens else "▁" + word)
           for word in spec.script]
    if len(set(ids)) != len(ids):
        raise ValueError("a script's words must differ: the next word follows from the last")
    for name in w:
        if name.endswith(("attn_output.weight", "ffn_down.weight")):
            w[name][:] = 0.0
    unit = rng.standard_normal((len(ids) + 1, spec.n_embd))
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    embd = np.repeat(unit[:1], len(tokens), axis=0)
    embd[ids] = unit[1:]
    w["token_embd.weight"] = (embd * np.sqrt(spec.n_embd)).astype(np.float32)
    out = np.zeros_like(w["output.weight"])
    scale = 20.0 / np.sqrt(spec.n_embd)  # the norm's output has length sqrt(n_embd)
    for prev, nxt in zip(unit, [*ids, 2], strict=True):  # 2: EOS
        out[nxt] = prev * scale
    w["output.weight"] = out.astype(np.float32)


def write_tiny_model(path: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a tiny llama GGUF to ``path`` atomically (a temporary name, then a rename)."""
    from gguf import GGUFWriter, LlamaFileType

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, scores, types = vocabulary(spec)
    weights = _weights(spec, len(tokens))
    n_layer = spec.keep_layers if spec.keep_layers is not None else spec.n_layer
    tmp = temporary_name(path)
    writer = GGUFWriter(str(tmp), spec.architecture)
    writer.add_name(spec.name)
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(spec.n_embd // spec.n_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in spec.metadata:
        _set_key(writer, key, value)
    for name, array in weights.items():
        layer = name.split(".")[1] if name.startswith("blk.") else None
        if layer is not None and int(layer) >= n_layer:
            continue
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    replace_durably(tmp, path)
    return path


def _set_key(writer: Any, key: str, value: MetadataValue) -> None:
    from gguf import GGUFValueType

    writer.kv_data[0].pop(key, None)  # an override, not a duplicate key (the writer warns)
    if value is None:
        return
    if isinstance(value, Typed):
        vtype = GGUFValueType[value.type_name]
        if isinstance(value.value, tuple):
            writer.add_key_value(key, list(value.value), GGUFValueType.ARRAY, sub_type=vtype)
        else:
            writer.add_key_value(key, value.value, vtype)
        return
    if isinstance(value, tuple):
        if not value:
            raise ValueError(f"metadata {key}: an empty array")
        types = {_value_type(key, v) for v in value}
        if len(types) > 1:
            raise ValueError(f"metadata {key}: an array of mixed types {value!r}")
        writer.add_key_value(key, list(value), GGUFValueType.ARRAY, sub_type=types.pop())
        return
    writer.add_key_value(key, value, _value_type(key, value))


def _value_type(key: str, value: Any) -> Any:
    from gguf import GGUFValueType

    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if not isinstance(value, (int, float, str)):
        raise ValueError(f"metadata {key}: unsupported value {value!r}")
    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    return GGUFValueType.UINT32 if value >= 0 else GGUFValueType.INT32


def shallow_copy(spec: TinyModelSpec, keep_layers: int) -> TinyModelSpec:
    """The same model with only its first ``keep_layers`` blocks: a cheap, well-matched draft."""
    return replace(spec, keep_layers=keep_layers, name=f"{spec.name}-draft")


DEMO_TARGET = TinyModelSpec(seed=7, n_embd=256, n_head=8, n_head_kv=4, n_ff=768, n_layer=8,
                            layer_scale=0.15, name="localspec-demo-target")


def build_demo_pair(folder: Path) -> tuple[Path, Path]:
    """Build (once; later calls reuse the files) the demo's target and its shallow draft."""
    target = folder / "demo-target.gguf"
    draft = folder / "demo-draft.gguf"
    if not target.exists():
        write_tiny_model(target, DEMO_TARGET)
    if not draft.exists():
        write_tiny_model(draft, shallow_copy(DEMO_TARGET, keep_layers=2))
    return target, draft


# llama.cpp's quantization types by the names users know them (Ollama's tags, llama-quantize's).
QUANT_TYPES = ("F16", "Q8_0", "Q4_0", "Q4_K_M")
# Q4_K and friends quantize rows in blocks of 256 values: every matrix's column count (n_embd and
# n_ff here) must be a multiple of 256, or llama.cpp silently falls back to another type.
QUANTIZABLE = TinyModelSpec(seed=11, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_layer=2,
                            layer_scale=0.2, name="tiny-quantizable")


def quantize(src: Path, dst: Path, quant: str) -> Path:
    """Quantize a GGUF with llama.cpp's own quantizer (what produced every Ollama model).

    Atomic like ``write_tiny_model``; an unknown ``quant`` or a failed run raises ValueError."""
    import llama_cpp  # deferred: loads llama.cpp's shared library

    from ..engine.llama_backend import route_llama_logs_to_logging

    route_llama_logs_to_logging()  # the quantizer reports each tensor on stderr otherwise
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant.upper()}", None)
    if quant.upper() not in QUANT_TYPES or ftype is None:
        raise ValueError(f"unknown quantization {quant!r} (one of {', '.join(QUANT_TYPES)})")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(dst)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"llama.cpp could not quantize {src} to {quant}")
    replace_durably(tmp, dst)
    return dst


def quantized_model(folder: Path, quant: str, spec: TinyModelSpec = QUANTIZABLE) -> Path:
    """A tiny model in ``quant`` (built once in ``folder``, then reused)."""
    stem = f"{spec.name}-s{spec.seed}-l{spec.keep_layers or spec.n_layer}"
    out = folder / f"{stem}-{quant.lower()}.gguf"
    if not out.exists():
        base = folder / f"{stem}-f32.gguf"
        if not base.exists():
            write_tiny_model(base, spec)
        quantize(base, out, quant)
    return out
