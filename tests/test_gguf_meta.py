"""GGUF inspection, the pair rule, and validation of bad files before llama.cpp sees them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from localspec.errors import GGUFError, IncompatiblePairError
from localspec.gguf_meta import check_pair, read_gguf_info, validate_pair
from localspec.models.tiny import TinyModelSpec, write_tiny_model


def test_reads_metadata_without_loading(target_gguf: Path) -> None:
    info = read_gguf_info(target_gguf)
    assert info.architecture == "llama"
    assert info.name == "tiny-target"
    assert info.file_type == "F32"
    assert info.context_length == 4096
    assert info.block_count == 4
    assert info.tokenizer_model == "llama"
    assert info.vocab_size == 332
    assert (info.bos_token_id, info.eos_token_id) == (1, 2)
    assert info.add_bos_token is True and info.add_eos_token is False
    assert info.has_chat_template
    assert info.file_size == target_gguf.stat().st_size
    # 4 blocks of attention + FFN, embeddings and output: well over 100k parameters.
    assert info.parameter_count > 100_000
    assert "tokens" not in info.to_json()
    # K and V, 4 layers, 2 of 4 heads share KV: 2 * 4 * ctx * 64 * 0.5 * 2 bytes.
    assert (info.head_count, info.head_count_kv) == (4, 2)
    assert info.kv_cache_bytes(100) == 51_200


def test_shallow_draft_is_compatible(target_gguf: Path, draft_gguf: Path) -> None:
    t, d = validate_pair(target_gguf, draft_gguf)
    assert check_pair(t, d).compatible


def test_other_vocabulary_is_refused_naming_the_token(target_gguf: Path,
                                                      other_vocab_gguf: Path) -> None:
    t = read_gguf_info(target_gguf, with_tokens=True)
    o = read_gguf_info(other_vocab_gguf, with_tokens=True)
    report = check_pair(t, o)
    assert not report.compatible
    assert any(p.startswith("token 259 differs") for p in report.problems), report.problems
    with pytest.raises(IncompatiblePairError, match="cannot draft for target"):
        validate_pair(target_gguf, other_vocab_gguf)


def test_bos_mismatch_is_refused(tmp_path: Path, target_gguf: Path) -> None:
    t = read_gguf_info(target_gguf, with_tokens=True)
    other = read_gguf_info(target_gguf, with_tokens=True)
    from dataclasses import replace

    report = check_pair(t, replace(other, bos_token_id=7))
    assert not report.compatible and "BOS differs" in report.problems[0]


def test_vocab_size_rule(target_gguf: Path) -> None:
    from dataclasses import replace

    t = read_gguf_info(target_gguf, with_tokens=True)
    bigger = replace(t, vocab_size=t.vocab_size + 129, vocab=t.vocab)
    assert any("sizes differ by 129" in p for p in check_pair(t, bigger).problems)
    slightly = replace(t, vocab_size=t.vocab_size + 128)
    assert check_pair(t, slightly).compatible


@pytest.mark.parametrize("cut", [0, 10, 1000, -1000])
def test_truncated_files_are_refused(tmp_path: Path, target_gguf: Path, cut: int) -> None:
    data = target_gguf.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut] if cut >= 0 else data[:cut])
    with pytest.raises(GGUFError) as err:
        read_gguf_info(bad)
    assert str(bad) in str(err.value)
    assert "\n" not in str(err.value)


def test_not_gguf_missing_and_directory(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("hello world, not a model")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf_info(text)
    with pytest.raises(GGUFError, match="no such file"):
        read_gguf_info(tmp_path / "missing.gguf")
    with pytest.raises(GGUFError, match="not a file"):
        read_gguf_info(tmp_path)


def test_corrupt_header_bytes(tmp_path: Path, target_gguf: Path) -> None:
    data = bytearray(target_gguf.read_bytes())
    data[8:16] = (2**62).to_bytes(8, "little")  # absurd tensor count
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="corrupt or truncated"):
        read_gguf_info(bad)


def _bare_gguf(path: Path, arch: str, tensor: str) -> Path:
    """A GGUF with one tensor and no tokenizer."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_tensor(tensor, np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_projector_and_tokenizerless_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="projector or encoder"):
        read_gguf_info(_bare_gguf(tmp_path / "mmproj.gguf", "clip", "v.weight"))
    with pytest.raises(GGUFError, match="no tokenizer"):
        read_gguf_info(_bare_gguf(tmp_path / "bare.gguf", "llama", "token_embd.weight"))


def test_tiny_model_writer_is_deterministic(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a.gguf", TinyModelSpec(seed=5))
    b = write_tiny_model(tmp_path / "b.gguf", TinyModelSpec(seed=5))
    c = write_tiny_model(tmp_path / "c.gguf", TinyModelSpec(seed=6))
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert not list(tmp_path.glob("*.part"))


_BPE = (("tokenizer.ggml.model", "gpt2"), ("tokenizer.ggml.merges", ("a b",)))
_NO_KEYS = (("tokenizer.ggml.add_bos_token", None), ("tokenizer.ggml.add_eos_token", None))


@pytest.mark.parametrize("metadata", [
    _NO_KEYS,  # SentencePiece: BOS
    (*_BPE, ("tokenizer.ggml.pre", "llama-bpe"), *_NO_KEYS),  # Llama 3: BOS though BPE
    (*_BPE, ("tokenizer.ggml.pre", "qwen2"), *_NO_KEYS),  # most BPE: none
    (*_BPE, ("tokenizer.ggml.pre", "gemma4"), ("tokenizer.ggml.add_bos_token", False)),
    (("tokenizer.ggml.model", "t5"), *_NO_KEYS),  # Unigram: EOS, not BOS
    (*_BPE, ("tokenizer.ggml.pre", "qwen2"), ("tokenizer.ggml.add_bos_token", True),
     ("tokenizer.ggml.add_eos_token", True)),  # the keys, where given
], ids=["spm", "llama3-bpe", "qwen2-bpe", "gemma4-forced", "t5", "keys"])
def test_bos_and_eos_are_added_as_llama_cpp_adds_them(tmp_path: Path,
                                                      metadata: tuple[object, ...]) -> None:
    """Where the file has no add_bos/add_eos key llama.cpp decides by the vocabulary: the pair
    rule compares these, so a wrong default refuses a good pair (one file with the key, one
    without) and `inspect` shows the wrong thing."""
    import llama_cpp

    path = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(metadata=metadata))  # type: ignore[arg-type]
    info = read_gguf_info(path)
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, "llama.cpp refused the file"
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        ours = (info.add_bos_token, info.add_eos_token)
        assert ours == (llama_cpp.llama_vocab_get_add_bos(vocab),
                        llama_cpp.llama_vocab_get_add_eos(vocab))
    finally:
        llama_cpp.llama_model_free(model)
