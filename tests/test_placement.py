"""GPU placement (engine/placement.py) from GGUF headers of real models' shapes (Llama 3.x and
Qwen2.5 in llama.cpp's Q4_K_M mix), against a fake NVML (named a fake: there is no GPU here)
reporting 8, 12, 24 and 48 GB. Every decision is checked against a hand computation written out
in the test from the shapes alone, never from the parsed files. The headers are sparse files: the
data region is a hole, so a 42 GB 70B takes no disk. The compute-buffer and KV estimates are
checked against real llama.cpp's own dry run (``no_alloc``) of the same headers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from localspec.engine.decoder import TREE_BRANCHES
from localspec.engine.placement import (
    ENGINE_SEQUENCES,
    GpuBudget,
    ModelMemory,
    allocation_error_line,
    compute_buffer_bytes,
    place_model,
    plan_placement,
)
from localspec.formatting import human_bytes
from localspec.gguf_meta import read_gguf_info
from localspec.monitor import SystemMonitor
from tests.fake_pynvml import make_fake_pynvml

GIB, MIB = 1 << 30, 1 << 20
# Bytes per block of 256 weights of llama.cpp's k-quants (ggml-common.h: block_q4_K and so on).
Q4K, Q5K, Q6K = 144, 176, 210
CTX = 4096
DESKTOP = 512 * MIB  # what the fake NVML reports as used by others (a desktop's share)


# -- the shapes, as their config.json files give them --------------------------------------------
@dataclass(frozen=True)
class Shape:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    tied: bool  # no output.weight: llama.cpp uses token_embd for the output too
    qkv_bias: bool = False

    @property
    def kv_width(self) -> int:  # K (or V) values per token per layer
        return self.n_embd // self.n_head * self.n_head_kv


LLAMA_1B = Shape("llama", 16, 2048, 32, 8, 8192, 128256, tied=True)  # Llama 3.2 1B
LLAMA_8B = Shape("llama", 32, 4096, 32, 8, 14336, 128256, tied=False)  # Llama 3.1 8B
LLAMA_70B = Shape("llama", 80, 8192, 64, 8, 28672, 128256, tied=False)  # Llama 3.1 70B
QWEN_1_5B = Shape("qwen2", 28, 1536, 12, 2, 8960, 151936, tied=True, qkv_bias=True)
QWEN_7B = Shape("qwen2", 28, 3584, 28, 4, 18944, 152064, tied=False, qkv_bias=True)
QWEN_32B = Shape("qwen2", 64, 5120, 40, 8, 27648, 152064, tied=False, qkv_bias=True)
# The names users know them by, and their published Q4_K_M file sizes (to show the headers are
# realistic).
LABELS = {LLAMA_1B: "llama3.2:1b", LLAMA_8B: "llama3.1:8b", LLAMA_70B: "llama3.1:70b",
          QWEN_1_5B: "qwen2.5:1.5b", QWEN_7B: "qwen2.5:7b", QWEN_32B: "qwen2.5:32b"}
PUBLISHED = {LLAMA_1B: 0.808e9, LLAMA_8B: 4.92e9, LLAMA_70B: 42.5e9, QWEN_1_5B: 0.986e9,
             QWEN_7B: 4.68e9, QWEN_32B: 19.85e9}


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits (src/llama-quant.cpp): where Q4_K_M spends Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# -- writing a header-only GGUF (the data region left as a hole) ----------------------------------
def q4_k_m_tensors(s: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """Tensor names, shapes (rows, columns) and types as llama.cpp's Q4_K_M quantizer picks
    them: Q4_K, with Q6_K for attn_v and ffn_down in the "more bits" layers (attn_v Q5_K
    elsewhere in a 70B), Q6_K for the output (and for token_embd when it is tied), F32 norms."""
    out: list[tuple[str, tuple[int, ...], str]] = [
        ("token_embd.weight", (s.n_vocab, s.n_embd), "Q6_K" if s.tied else "Q4_K")]
    for i in range(s.n_layer):
        p, mb = f"blk.{i}.", more_bits(i, s.n_layer)
        out += [(p + "attn_norm.weight", (s.n_embd,), "F32"),
                (p + "attn_q.weight", (s.n_embd, s.n_embd), "Q4_K"),
                (p + "attn_k.weight", (s.kv_width, s.n_embd), "Q4_K"),
                (p + "attn_v.weight", (s.kv_width, s.n_embd),
                 "Q6_K" if mb else "Q5_K" if s.n_layer == 80 else "Q4_K")]
        if s.qkv_bias:
            out += [(p + "attn_q.bias", (s.n_embd,), "F32"),
                    (p + "attn_k.bias", (s.kv_width,), "F32"),
                    (p + "attn_v.bias", (s.kv_width,), "F32")]
        out += [(p + "attn_output.weight", (s.n_embd, s.n_embd), "Q4_K"),
                (p + "ffn_norm.weight", (s.n_embd,), "F32"),
                (p + "ffn_gate.weight", (s.n_ff, s.n_embd), "Q4_K"),
                (p + "ffn_up.weight", (s.n_ff, s.n_embd), "Q4_K"),
                (p + "ffn_down.weight", (s.n_embd, s.n_ff), "Q6_K" if mb else "Q4_K")]
    out.append(("output_norm.weight", (s.n_embd,), "F32"))
    if not s.tied:
        out.append(("output.weight", (s.n_vocab, s.n_embd), "Q6_K"))
    return out


def write_sparse_header(path: Path, s: Shape) -> Path:
    """The header through the gguf package's writer (as localspec/models/tiny.py writes its
    models), then ``truncate`` to the full size: the data region is a hole, so it is sparse."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType

    w = GGUFWriter(str(path), s.arch)
    w.add_name(f"{s.arch}-{s.n_layer}-layers")
    w.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    w.add_context_length(131072)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(s.n_embd // s.n_head)
    w.add_rope_freq_base(500000.0)
    # A SentencePiece-style vocabulary padded to the real size: enough for llama.cpp to load.
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    tokens += [f"t{i}" for i in range(s.n_vocab - len(tokens))]
    types += [TokenType.NORMAL] * (s.n_vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * s.n_vocab)
    w.add_token_types([int(t) for t in types])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    data = 0
    for name, shape, type_name in q4_k_m_tensors(s):
        qtype = GGMLQuantizationType[type_name]
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        n_bytes = int(np.prod(shape)) // block * block_bytes
        w.add_tensor_info(name, shape, np.dtype(np.float32), n_bytes, raw_dtype=qtype)
        data += -(-n_bytes // w.data_alignment) * w.data_alignment
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    end = w.fout[0].tell()
    w.close()
    start = -(-end // w.data_alignment) * w.data_alignment
    os.truncate(path, start + data)
    return path


Header = Callable[[Shape], Path]


@pytest.fixture(scope="session")
def header(tmp_path_factory: pytest.TempPathFactory) -> Header:
    """``header(shape)``: the shape's sparse header file, written once per session."""
    folder = tmp_path_factory.mktemp("headers")
    made: dict[Shape, Path] = {}

    def get(s: Shape) -> Path:
        if s not in made:
            made[s] = write_sparse_header(folder / f"{s.arch}-{s.n_layer}x{s.n_embd}.gguf", s)
        return made[s]

    return get


def memory(header: Header, s: Shape) -> ModelMemory:
    return ModelMemory.from_gguf(header(s), label=LABELS[s])


def fake_gpu(total_gib: int, gpus: int = 1) -> GpuBudget:
    """The first GPU as the monitor reads it through a fake NVML (no GPU here): ``total_gib``
    GiB with :data:`DESKTOP` used by other processes."""
    nv = make_fake_pynvml(gpus=gpus, pid=os.getpid())
    total = total_gib * GIB
    nv.nvmlDeviceGetMemoryInfo = (  # type: ignore[attr-defined]
        lambda h: SimpleNamespace(total=total, used=DESKTOP, free=total - DESKTOP))
    monitor = SystemMonitor(nvml=nv)
    try:
        return GpuBudget.from_sample(monitor.sample())
    finally:
        monitor.close()


# -- the hand computation: bytes from the shape alone ---------------------------------------------
def h_block(s: Shape, i: int) -> int:
    """Block i's weights: q, o (n_embd x n_embd), k, v (kv_width x n_embd), gate, up
    (n_ff x n_embd) and down; Q4_K but where Q4_K_M spends more bits; two F32 norms."""
    v = Q6K if more_bits(i, s.n_layer) else Q5K if s.n_layer == 80 else Q4K
    down = Q6K if more_bits(i, s.n_layer) else Q4K
    q4 = (2 * s.n_embd * s.n_embd + s.kv_width * s.n_embd + 2 * s.n_ff * s.n_embd) * Q4K // 256
    bias = (s.n_embd + 2 * s.kv_width) * 4 if s.qkv_bias else 0
    return (q4 + s.kv_width * s.n_embd * v // 256 + s.n_embd * s.n_ff * down // 256
            + 2 * s.n_embd * 4 + bias)


def h_output(s: Shape) -> int:
    """The output layer on the GPU: output.weight in Q6_K, or (tied) token_embd's copy, also
    Q6_K; and output_norm."""
    return s.n_vocab * s.n_embd * Q6K // 256 + s.n_embd * 4


def h_kv(s: Shape, ctx: int) -> int:
    """One layer's K and V in f16 for ``ctx`` tokens (llama.cpp pads it to 256)."""
    return -(-ctx // 256) * 256 * 2 * s.kv_width * 2


def h_compute(s: Shape, ctx: int, copy: int, attention: bool = True) -> int:
    """The compute buffer: the mask plus the largest phase (attention scores, feed-forward,
    logits) for 512 tokens, the largest CPU weight copied in, and 1 MiB of small inputs. The
    engine's context holds 33 sequences (the main one and 32 tree branches): a second mask,
    4 bytes per cache cell and sequence, and a mask-sized temporary in the attention."""
    t, n_kv = min(512, ctx), -(-ctx // 256) * 256
    attn = (n_kv * t * (s.n_head + 1) + (5 * s.n_embd + 4 * s.kv_width) * t) * 4 if attention \
        else 0
    ffn = (3 * s.n_ff + 5 * s.n_embd + 2 * s.kv_width) * t * 4
    out = (s.n_vocab + 2 * s.n_embd) * t * 4
    masks = n_kv * t * 4 + n_kv * (t + 33) * 4
    return masks + max(attn, ffn, out) + copy + MIB


def h_cpu_copy(s: Shape) -> int:
    """The largest weight of block 0, which stays on the CPU in a split: ffn_down in Q6_K
    (block 0 is a "more bits" layer), at least as big as gate and up in Q4_K."""
    return s.n_embd * s.n_ff * Q6K // 256


def h_full(s: Shape, ctx: int = CTX) -> int:
    """The whole model on the GPU (llama.cpp's n_layer + 1 layers)."""
    return (sum(h_block(s, i) for i in range(s.n_layer)) + h_output(s)
            + s.n_layer * h_kv(s, ctx) + h_compute(s, ctx, copy=0))


def h_usable(total_gib: int) -> int:
    """What placement may use: the free VRAM less 512 MiB and 5% of it."""
    free = total_gib * GIB - DESKTOP
    return free - 512 * MIB - int(0.05 * free)


def h_split(s: Shape, room: int, ctx: int = CTX) -> tuple[int, int]:
    """(llama.cpp's n_gpu_layers, bytes on the GPU) for a split of ``s`` in ``room`` bytes:
    the output layer and compute buffer first, then blocks from the last one down, as long as
    each block and its KV cache still fit."""
    used = h_output(s) + h_compute(s, ctx, copy=h_cpu_copy(s))
    blocks = 0
    for i in reversed(range(s.n_layer)):
        if used + h_block(s, i) + h_kv(s, ctx) > room:
            break
        used += h_block(s, i) + h_kv(s, ctx)
        blocks += 1
    return blocks + 1, used


# -- the tests -----------------------------------------------------------------------------------
def test_the_sparse_70b_header_is_valid_and_takes_no_disk(header: Header) -> None:
    path = header(LLAMA_70B)
    st = path.stat()
    assert st.st_blocks * 512 < 16 * MIB < st.st_size  # a hole, not 42 GB of zeros
    info = read_gguf_info(path)  # gguf_meta's layout check accepts it
    assert info.block_count == 80 and info.vocab_size == 128256
    m = ModelMemory.from_gguf(path)
    assert m.n_layer == 80
    assert [m.layer_bytes[i] for i in (0, 10, 12)] == [h_block(LLAMA_70B, i) for i in (0, 10, 12)]
    assert m.output_bytes == h_output(LLAMA_70B)
    assert m.kv_bytes(0, CTX) == h_kv(LLAMA_70B, CTX)


@pytest.mark.parametrize("shape", list(PUBLISHED), ids=lambda s: f"{s.arch}-{s.n_layer}")
def test_the_headers_are_as_big_as_the_published_files(header: Header, shape: Shape) -> None:
    assert abs(header(shape).stat().st_size / PUBLISHED[shape] - 1) < 0.05


def test_a_7b_pair_fits_fully_on_12gb(header: Header) -> None:
    target, draft = memory(header, QWEN_7B), memory(header, QWEN_1_5B)
    plan = plan_placement(target, draft, fake_gpu(12), n_ctx=CTX)
    # By hand: both whole models fit in what may be used.
    need = h_full(QWEN_7B) + h_full(QWEN_1_5B)
    assert need <= h_usable(12)
    assert plan.fits and plan.target.full and plan.draft is not None and plan.draft.full
    assert plan.settings_layers() == (29, 29)
    assert plan.used_bytes == need
    assert plan.left_bytes == 12 * GIB - DESKTOP - need
    line = plan.describe()
    assert "\n" not in line and "29/29 layers" in line and "everything on the GPU" in line


def test_a_70b_target_is_split_on_24gb_with_the_1b_draft_fully_on(header: Header) -> None:
    target, draft = memory(header, LLAMA_70B), memory(header, LLAMA_1B)
    plan = plan_placement(target, draft, fake_gpu(24), n_ctx=CTX)
    # By hand: the draft whole, then the target's output layer and compute buffer (with block
    # 0's ffn_down copied in), then its last blocks while they fit.
    layers, target_bytes = h_split(LLAMA_70B, h_usable(24) - h_full(LLAMA_1B))
    assert 1 < layers < 81
    assert plan.draft is not None and plan.draft.full and plan.draft.gpu_bytes == h_full(LLAMA_1B)
    assert plan.target.n_gpu_layers == layers and plan.target.gpu_bytes == target_bytes
    assert plan.fits
    line = plan.describe()
    assert "\n" not in line
    assert f"{layers}/81 layers" in line and f"{81 - layers} target layers stay in RAM" in line


def test_a_32b_target_on_8gb_has_its_draft_on_and_most_layers_on_the_cpu(header: Header) -> None:
    target = memory(header, QWEN_32B)
    draft = memory(header, QWEN_1_5B)
    plan = plan_placement(target, draft, fake_gpu(8), n_ctx=CTX)
    layers, target_bytes = h_split(QWEN_32B, h_usable(8) - h_full(QWEN_1_5B))
    assert 1 < layers < 65 // 2  # most target layers stay on the CPU
    assert plan.draft is not None and plan.draft.full
    assert plan.settings_layers() == (layers, 29)
    assert plan.used_bytes == h_full(QWEN_1_5B) + target_bytes <= h_usable(8)


def test_a_70b_pair_fits_fully_on_48gb(header: Header) -> None:
    target, draft = memory(header, LLAMA_70B), memory(header, LLAMA_1B)
    plan = plan_placement(target, draft, fake_gpu(48), n_ctx=CTX)
    assert h_full(LLAMA_70B) + h_full(LLAMA_1B) <= h_usable(48)
    assert plan.settings_layers() == (81, 17)
    assert plan.used_bytes == h_full(LLAMA_70B) + h_full(LLAMA_1B)


def test_a_draft_too_big_for_the_card_alone_is_one_line_with_the_numbers(header: Header) -> None:
    # An 8B draft with a 32k context on an 8 GB card: its KV cache and attention scores alone
    # are 6 GiB.
    ctx = 32768
    target, draft = memory(header, LLAMA_70B), memory(header, LLAMA_8B)
    plan = plan_placement(target, draft, fake_gpu(8), n_ctx=ctx)
    # By hand: the target's floor (no layer: the compute buffer with the output weight copied
    # in) plus the whole draft exceed what may be used.
    target_floor = h_compute(LLAMA_70B, ctx, copy=LLAMA_70B.n_vocab * 8192 * Q6K // 256,
                             attention=False)
    draft_need = h_full(LLAMA_8B, ctx)
    assert draft_need + target_floor > h_usable(8)
    assert not plan.fits
    assert plan.target.n_gpu_layers == 0 and plan.target.gpu_bytes == target_floor
    assert plan.draft is not None and not plan.draft.full
    assert plan.draft.gpu_bytes <= h_usable(8) - target_floor
    line = plan.describe()
    assert "\n" not in line
    assert "llama3.1:8b does not fit on the GPU" in line
    for number in (draft_need, 8 * GIB - DESKTOP, h_usable(8) - target_floor):
        assert human_bytes(number) in line
    assert f"KV cache for {ctx} tokens" in line and "--ctx" in line


def test_an_explicit_number_wins(header: Header) -> None:
    target, draft = memory(header, LLAMA_70B), memory(header, LLAMA_1B)
    plan = plan_placement(target, draft, fake_gpu(24), n_ctx=CTX, target_layers=20)
    assert plan.settings_layers() == (20, 17) and plan.target.requested == 20
    assert plan.fits and "explicit target 20" in plan.describe()
    # Every layer on 24 GB is honoured too, and said to be too much; the draft gets what is
    # left: nothing.
    plan = plan_placement(target, draft, fake_gpu(24), n_ctx=CTX, target_layers=-1)
    assert plan.settings_layers() == (81, 0) and not plan.fits
    assert "may fail" in plan.describe()


def test_llama_cpps_layer_rule_offloads_the_output_layer_first(header: Header) -> None:
    s = LLAMA_8B
    m = memory(header, s)
    # n_gpu_layers 1: the output layer alone; 2: it and the last block; 33: everything.
    assert place_model(m, 1, CTX).weights_bytes == h_output(s)
    assert place_model(m, 2, CTX).weights_bytes == h_output(s) + h_block(s, 31)
    assert place_model(m, 2, CTX).kv_bytes == h_kv(s, CTX)
    whole = place_model(m, 33, CTX)
    assert whole.weights_bytes == sum(h_block(s, i) for i in range(32)) + h_output(s)
    assert place_model(m, -1, CTX) == whole and place_model(m, 99, CTX) == whole
    # The token embeddings stay in RAM even then.
    assert whole.cpu_weights_bytes == s.n_vocab * s.n_embd * Q4K // 256


def test_without_a_gpu_everything_runs_on_the_cpu(header: Header) -> None:
    monitor = SystemMonitor(nvml=make_fake_pynvml(driver=False))  # a fake: no driver here
    budget = GpuBudget.from_sample(monitor.sample())
    monitor.close()
    target, draft = memory(header, LLAMA_8B), memory(header, LLAMA_1B)
    plan = plan_placement(target, draft, budget, n_ctx=CTX)
    assert plan.settings_layers() == (0, 0) and plan.used_bytes == 0 and plan.left_bytes is None
    line = plan.describe()
    assert line.startswith("no GPU (No NVIDIA driver") and "\n" not in line


def test_more_than_one_gpu_is_said(header: Header) -> None:
    target, draft = memory(header, LLAMA_8B), memory(header, LLAMA_1B)
    plan = plan_placement(target, draft, fake_gpu(12, gpus=2), n_ctx=CTX)
    assert "2 GPUs found: placement counts GPU 0 only" in plan.describe()
    one = plan_placement(target, draft, fake_gpu(12), n_ctx=CTX)
    assert "GPUs found" not in one.describe()
    assert one.settings_layers() == plan.settings_layers()


def test_a_failed_allocation_is_one_line_with_what_was_asked_and_free(header: Header) -> None:
    m = memory(header, LLAMA_70B)
    free = 24 * GIB - DESKTOP
    line = allocation_error_line(m, -1, CTX, free)
    # By hand: what fits of the 70B alone on that card.
    layers, _ = h_split(LLAMA_70B, h_usable(24))
    assert "\n" not in line and line.startswith("llama3.1:70b: not enough GPU memory")
    assert "81/81 layers" in line and f"{CTX}-token context" in line
    assert human_bytes(h_full(LLAMA_70B)) in line and human_bytes(free) in line
    assert f"--gpu-layers {layers} " in line and "--ctx" in line
    # With the draft's share taken, fewer layers fit; with nothing free, the CPU is the fix.
    fewer = allocation_error_line(m, -1, CTX, free, other_gpu_bytes=h_full(LLAMA_1B))
    assert f"--gpu-layers {h_split(LLAMA_70B, h_usable(24) - h_full(LLAMA_1B))[0]} " in fewer
    assert "--gpu-layers 0 (the CPU)" in allocation_error_line(m, -1, CTX, 256 * MIB)


def test_the_estimate_counts_the_engines_sequences() -> None:
    assert ENGINE_SEQUENCES == 1 + TREE_BRANCHES


@pytest.mark.parametrize("branches", [0, TREE_BRANCHES], ids=["one-sequence", "engine"])
@pytest.mark.parametrize(("shape", "ctx", "batch"), [
    (LLAMA_1B, 256, 512), (LLAMA_1B, 4096, 512), (LLAMA_1B, 8192, 512), (LLAMA_1B, 32768, 512),
    (LLAMA_8B, 512, 512), (LLAMA_8B, 4096, 2048), (LLAMA_8B, 16384, 512),
    (LLAMA_70B, 4096, 512), (LLAMA_70B, 32768, 512),
])
def test_estimates_match_llama_cpps_own_dry_run(header: Header, shape: Shape, ctx: int,
                                                batch: int, branches: int) -> None:
    """llama.cpp's dry run on the CPU (everything there, as on a GPU fully offloaded), as the
    engine makes its contexts (a unified cache for the tree branches) and with one sequence:
    the compute estimate is an upper bound of its compute buffer within 20%, the KV cache
    exact."""
    from localspec.engine.llama_dry_run import dry_run

    m = memory(header, shape)
    run = dry_run(header(shape), 0, ctx, n_batch=batch, branches=branches)
    estimate = compute_buffer_bytes(m, ctx, batch, attention=True, sequences=1 + branches)
    assert 1.0 <= estimate / run.compute_bytes["CPU"] < 1.2
    assert run.kv_cells == -(-ctx // 256) * 256
    assert abs(run.kv_bytes - sum(m.kv_bytes(i, ctx) for i in range(m.n_layer))) < 8 * 1024
