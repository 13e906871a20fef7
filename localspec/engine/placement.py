"""Where each model's layers go: GPU placement for ``--gpu-layers auto``.

Pure arithmetic over GGUF headers and the free VRAM the monitor reads: nothing here loads
llama.cpp, so the decision is made (and tested) before any model is loaded. It mirrors llama.cpp
as vendored in llama-cpp-python 0.3.36:

* ``n_gpu_layers = k`` counts ``n_layer + 1`` slots, the last being the output layer
  (``output.weight``, ``output_norm``; a copy of ``token_embd`` when the embeddings are tied).
  A slot is on the GPU when it is at or past ``n_layer + 1 - k`` (``i_gpu_start`` in
  ``llama_model_base::load_tensors``), so ``k = 1`` offloads the output layer alone, ``k``
  offloads it and the *last* ``k - 1`` blocks, and ``k = n_layer + 1`` offloads everything.
* The token embeddings always stay on the CPU ("little benefit to offloading the input layer").
* Each layer's KV cache lives on that layer's device (``llama_kv_cache``, ``offload_kqv``):
  K and V in f16, for the context padded to a multiple of 256.
* Each context reserves a compute buffer on the GPU for its worst-case graph, one micro-batch
  of ``min(n_batch, n_ctx)`` tokens; see :func:`compute_buffer_bytes`. It exists even with no
  layer offloaded: with a GPU present, a batch of 32 tokens or more (``GGML_OP_OFFLOAD_MIN_BATCH``)
  runs the matrix products of CPU-resident weights on the GPU, copying one weight at a time into
  that buffer (``ggml_backend_sched`` starts a new split per such weight so the copies reuse the
  same memory).

Multi-GPU placement is not done: the plan counts the first GPU and says so when there are more.
Architectures whose caches differ from plain attention (sliding windows, MLA, recurrent state)
are counted as plain attention, which over-counts their cache.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..formatting import human_bytes
from ..monitor import MachineSample
from .llama_devices import Device

MIB = 1 << 20
# VRAM that the estimate does not see: the CUDA context and cuBLAS handles (a few hundred MB per
# process, once for both models), then a share of the free memory for the CUDA backend's memory
# pool (its temporaries grow with the model) and the allocators' padding and fragmentation.
MARGIN_FIXED_BYTES = 512 * MIB
MARGIN_FRACTION = 0.05
# llama.cpp pads the context (and so the KV cache and the attention mask) to this many tokens.
CTX_PAD = 256
KV_BYTES_PER_VALUE = 2  # f16 K and V, llama.cpp's default cache type
_F32 = 4
# The sequences of the engine's contexts: the main one and decoder.TREE_BRANCHES tree branches
# (tests/test_placement.py keeps the two equal; the engine is not imported here).
ENGINE_SEQUENCES = 33
_SMALL_INPUTS = MIB  # the graph's other inputs (positions, output ids): well under a MiB
_BLOCK = re.compile(r"blk\.(\d+)\.")
# Tensors of llama.cpp's input layer (LLM_TENSOR_LAYER_INPUT): always on the CPU.
_INPUT_PREFIXES = ("token_embd.", "token_embd_norm.", "token_types.", "pos_embd.")


def margin_bytes(free_bytes: int) -> int:
    """The VRAM placement leaves unplanned: :data:`MARGIN_FIXED_BYTES` plus
    :data:`MARGIN_FRACTION` of what is free."""
    return MARGIN_FIXED_BYTES + int(MARGIN_FRACTION * free_bytes)


# -- a model's memory shape -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelMemory:
    """What one model needs in memory, from its GGUF header (no weights read).

    ``layer_bytes[i]`` are the weights of block ``i`` (``blk.i.*``); ``output_bytes`` the output
    layer's (everything that is neither a block nor the input layer, plus ``token_embd`` again
    when there is no ``output.weight``); ``input_bytes`` the token embeddings, which stay in RAM.
    ``kv_values_per_token[i]`` is layer ``i``'s K plus V width (``n_head_kv * head size``, each).
    """

    label: str
    n_embd: int
    n_head: int
    n_ff: int
    n_vocab: int
    layer_bytes: tuple[int, ...]
    kv_values_per_token: tuple[int, ...]
    output_bytes: int
    input_bytes: int
    # Each block's and the output layer's largest weight: what a batched pass copies to the GPU
    # when that layer stays on the CPU.
    layer_largest: tuple[int, ...]
    output_largest: int

    @property
    def n_layer(self) -> int:
        return len(self.layer_bytes)

    @property
    def weights_bytes(self) -> int:
        """Everything llama.cpp loads (the tied output copy counted once more)."""
        return sum(self.layer_bytes) + self.output_bytes + self.input_bytes

    @property
    def max_kv_values_per_token(self) -> int:
        return max(self.kv_values_per_token, default=0)

    def kv_bytes(self, layer: int, n_ctx: int) -> int:
        """Layer ``layer``'s KV cache (f16) for a context of ``n_ctx`` tokens."""
        return self.kv_values_per_token[layer] * _pad(n_ctx) * KV_BYTES_PER_VALUE

    @classmethod
    def from_gguf(cls, path: str | Path, label: str | None = None) -> ModelMemory:
        """Read a GGUF header (validated as every command validates it; GGUFError if not).
        ``label`` names the model in messages (an Ollama name rather than its blob's file)."""
        from ..gguf_meta import read_tensor_sizes

        info, meta, tensors = read_tensor_sizes(path)
        return cls.from_header(label or Path(path).name, info.architecture, info.vocab_size,
                               meta, tensors)

    @classmethod
    def from_header(cls, label: str, arch: str, n_vocab: int, meta: dict[str, Any],
                    tensors: tuple[tuple[str, int], ...]) -> ModelMemory:
        """The memory shape from a header's metadata and its (name, bytes) tensor list."""
        n_layer = _scalar(meta, f"{arch}.block_count") or 0
        n_embd = _scalar(meta, f"{arch}.embedding_length") or 0
        heads = _per_layer(meta, f"{arch}.attention.head_count", n_layer, [0] * n_layer)
        heads_kv = _per_layer(meta, f"{arch}.attention.head_count_kv", n_layer, heads)
        n_head = max(heads, default=0)
        # llama.cpp's head sizes: the key/value lengths when given, else n_embd / n_head.
        head = n_embd // n_head if n_head else 0
        head_k = _scalar(meta, f"{arch}.attention.key_length") or head
        head_v = _scalar(meta, f"{arch}.attention.value_length") or head
        n_ff = max(_per_layer(meta, f"{arch}.feed_forward_length", n_layer, [4 * n_embd]),
                   default=4 * n_embd)
        layers, largest = [0] * n_layer, [0] * n_layer
        output = inputs = output_largest = 0
        names = {name for name, _ in tensors}
        for name, size in tensors:
            block = _BLOCK.match(name)
            if block and int(block.group(1)) < n_layer:
                i = int(block.group(1))
                layers[i] += size
                largest[i] = max(largest[i], size)
            elif name.startswith(_INPUT_PREFIXES):
                inputs += size
                if name == "token_embd.weight" and "output.weight" not in names:
                    output += size  # tied embeddings: llama.cpp loads a copy as the output
                    output_largest = max(output_largest, size)
            else:
                output += size
                output_largest = max(output_largest, size)
        kv = tuple(kv_heads * (head_k + head_v) for kv_heads in heads_kv[:n_layer])
        return cls(label=label, n_embd=n_embd, n_head=n_head, n_ff=n_ff, n_vocab=n_vocab,
                   layer_bytes=tuple(layers), kv_values_per_token=kv, output_bytes=output,
                   input_bytes=inputs, layer_largest=tuple(largest),
                   output_largest=output_largest)


def _pad(n_ctx: int) -> int:
    return -(-n_ctx // CTX_PAD) * CTX_PAD


def _scalar(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(key)
    if isinstance(value, list):
        return max((v for v in value if isinstance(v, int)), default=None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _per_layer(meta: dict[str, Any], key: str, n_layer: int, default: list[int]) -> list[int]:
    value = meta.get(key)
    if isinstance(value, list) and len(value) >= n_layer:
        return [int(v) for v in value[:n_layer]]
    scalar = _scalar(meta, key)
    return [scalar] * n_layer if scalar is not None else list(default)


def compute_buffer_bytes(m: ModelMemory, n_ctx: int, n_batch: int, *, attention: bool,
                         weight_copy: int = 0, flash_attn: bool = False,
                         sequences: int = ENGINE_SEQUENCES) -> int:
    """The GPU compute buffer of one context: llama.cpp's worst-case graph for one micro-batch
    of ``t = min(n_batch, n_ctx)`` tokens against the whole (padded) cache of ``n_kv`` tokens.

    Its allocator reuses memory between nodes, so the buffer is the peak of one phase, plus the
    attention mask (a graph input, n_kv x t floats, live throughout):

    * attention, where a block is on the GPU: the scores, n_kv x t x n_head floats (not
      materialised with flash attention), beside Q, K, V, their output and the residual stream,
      ``5 n_embd + 2 (K + V width)`` floats per token;
    * the feed-forward part: gate, up and their product, ``3 n_ff`` floats per token, beside
      ``5 n_embd + (K + V width)`` of the residual stream and the attention's leftovers;
    * the output: the logits, ``n_vocab`` floats per token (llama.cpp reserves an output for
      every token of the micro-batch), beside ``2 n_embd``.

    The per-token constants are upper bounds of what llama.cpp reported for its CPU buffers in
    dry runs (``no_alloc``) of llama-shaped models from 1B to 8B, with and without grouped-query
    attention, at 256 to 8192 tokens and batches of 256 to 2048: 1% to 3% over at real shapes,
    up to 17% over for small contexts without grouped-query attention. The test suite checks
    them against real llama.cpp again. ``weight_copy`` is the largest weight
    left on the CPU, which a batched pass copies into this buffer.

    A context for several ``sequences`` (the engine's: one unified cache for the main sequence
    and every tree branch) holds a second mask, plus about 4 bytes per cache cell and sequence,
    and its attention one more mask-sized temporary. Measured in dry runs at 4096 to 32768
    tokens (batches of 512 and 2048) against one sequence: 1B and 8B shapes grew by one mask
    and 1–4 MiB, a 70B shape, whose peak is the attention, by two masks and 3–4 MiB.
    """
    n_kv = _pad(n_ctx)
    t = min(n_batch, n_ctx)
    several = sequences > 1
    mask = n_kv * t * _F32 + (n_kv * (t + sequences) * _F32 if several else 0)
    scores = (0 if flash_attn else n_kv * t * m.n_head * _F32) + (n_kv * t * _F32 if several
                                                                    else 0)
    attn = scores + (5 * m.n_embd + 2 * m.max_kv_values_per_token) * t * _F32 if attention else 0
    ffn = (3 * m.n_ff + 5 * m.n_embd + m.max_kv_values_per_token) * t * _F32
    out = (m.n_vocab + 2 * m.n_embd) * t * _F32
    return mask + max(attn, ffn, out) + weight_copy + _SMALL_INPUTS


# -- one model's share of the GPU ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelPlacement:
    """One model's ``n_gpu_layers`` (llama.cpp's value, 0 to ``n_layer + 1``) and what it puts on
    the GPU. ``requested`` is the user's explicit number, None for auto."""

    label: str
    n_gpu_layers: int
    n_layer: int
    n_ctx: int
    weights_bytes: int  # on the GPU
    kv_bytes: int  # on the GPU
    compute_bytes: int  # on the GPU
    cpu_weights_bytes: int  # left in RAM, token embeddings included
    requested: int | None = None

    @property
    def gpu_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes

    @property
    def slots(self) -> int:
        """llama.cpp's layer count in "offloaded k/n layers": the blocks and the output layer."""
        return self.n_layer + 1

    @property
    def full(self) -> bool:
        return self.n_gpu_layers >= self.slots

    def layers_text(self) -> str:
        return f"{self.n_gpu_layers}/{self.slots} layers"

    def needs_text(self) -> str:
        """What it needs on the GPU, by part."""
        return (f"{human_bytes(self.gpu_bytes)} ({human_bytes(self.weights_bytes)} weights, "
                f"{human_bytes(self.kv_bytes)} KV cache for {self.n_ctx} tokens, "
                f"{human_bytes(self.compute_bytes)} compute)")


def place_model(m: ModelMemory, n_gpu_layers: int, n_ctx: int, *, n_batch: int = 512,
                flash_attn: bool = False, gpu: bool = True,
                requested: int | None = None) -> ModelPlacement:
    """What loading ``m`` with ``n_gpu_layers`` (negative: all) puts on the GPU, by llama.cpp's
    rule. ``gpu=False``: no GPU, so nothing is offloaded whatever is asked."""
    slots = m.n_layer + 1
    k = slots if n_gpu_layers < 0 else min(n_gpu_layers, slots)
    if not gpu:
        return ModelPlacement(m.label, k, m.n_layer, n_ctx, 0, 0, 0, m.weights_bytes,
                              requested)
    first = max(0, m.n_layer + 1 - k)  # the last k - 1 blocks are on the GPU
    blocks = range(first, m.n_layer)
    weights = sum(m.layer_bytes[i] for i in blocks) + (m.output_bytes if k >= 1 else 0)
    kv = sum(m.kv_bytes(i, n_ctx) for i in blocks)
    on_cpu = max(m.layer_largest[:first], default=0)
    copy = max(on_cpu, m.output_largest) if k == 0 else on_cpu
    compute = compute_buffer_bytes(m, n_ctx, n_batch, attention=len(blocks) > 0,
                                   weight_copy=copy, flash_attn=flash_attn)
    return ModelPlacement(m.label, k, m.n_layer, n_ctx, weights, kv, compute,
                          m.weights_bytes - weights, requested)


def _most_layers(m: ModelMemory, budget: int, n_ctx: int, n_batch: int,
                 flash_attn: bool) -> ModelPlacement:
    """The most layers of ``m`` that fit in ``budget`` bytes (0 layers when none fit). The need
    is not monotonic at the top (all layers on the GPU drops the weight copy), so count down."""
    for k in range(m.n_layer + 1, -1, -1):
        p = place_model(m, k, n_ctx, n_batch=n_batch, flash_attn=flash_attn)
        if p.gpu_bytes <= budget or k == 0:
            return p
    raise AssertionError("unreachable")


# -- the machine's side ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GpuBudget:
    """The first GPU's free memory (as llama.cpp, else NVML, reports it), and how many GPUs
    there are. ``free_bytes`` is None when there is no usable GPU; ``note`` then says why."""

    free_bytes: int | None
    n_gpus: int = 1
    name: str | None = None
    note: str | None = None

    @classmethod
    def from_sample(cls, sample: MachineSample) -> GpuBudget:
        """From one monitor reading (``SystemMonitor.sample()``)."""
        if not sample.gpus or sample.gpus[0].memory_free is None:
            return cls(None, len(sample.gpus), None, sample.gpu_note or "no GPU memory reading")
        gpu = sample.gpus[0]
        return cls(gpu.memory_free, len(sample.gpus), gpu.name)

    @classmethod
    def from_devices(cls, devices: Sequence[Device]) -> GpuBudget | None:
        """From llama.cpp's own device list (``llama_devices.offload_devices``); None where it
        has no GPU with a memory figure, for NVML to answer instead."""
        if not devices or devices[0].total_bytes <= 0:
            return None
        first = devices[0]
        return cls(min(first.free_bytes, first.total_bytes), len(devices),
                   first.description or None)

    @classmethod
    def none(cls, note: str) -> GpuBudget:
        """No GPU to use (no driver, or a llama.cpp built without GPU support)."""
        return cls(None, 0, None, note)


# -- the plan ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Placement:
    """Both models' placement. ``fits``: the plan stays within the free VRAM less the margin
    (False when even the draft alone does not fit, or explicit numbers ask for too much)."""

    target: ModelPlacement
    draft: ModelPlacement | None
    budget: GpuBudget
    margin_bytes: int
    fits: bool
    reason: str

    @property
    def used_bytes(self) -> int:
        return self.target.gpu_bytes + (self.draft.gpu_bytes if self.draft else 0)

    @property
    def left_bytes(self) -> int | None:
        """Free VRAM left after both models (negative: over); None without a GPU."""
        free = self.budget.free_bytes
        return None if free is None else free - self.used_bytes

    def settings_layers(self) -> tuple[int, int | None]:
        """(target, draft) ``n_gpu_layers`` to load with."""
        return self.target.n_gpu_layers, self.draft.n_gpu_layers if self.draft else None

    def describe(self) -> str:
        """One line for the CLI, the chat app and ``doctor``."""
        if self.budget.free_bytes is None:
            return f"no GPU ({self.budget.note}): {self.reason}"
        parts = []
        for role, p in (("draft", self.draft), ("target", self.target)):
            if p is not None:
                parts.append(f"{role} {p.label} {p.layers_text()} ({human_bytes(p.gpu_bytes)})")
        gpu = self.budget.name or "GPU 0"
        line = (f"{gpu}: {', '.join(parts)}; {human_bytes(self.left_bytes)} of "
                f"{human_bytes(self.budget.free_bytes)} free left; {self.reason}")
        if self.budget.n_gpus > 1:
            line += (f"; {self.budget.n_gpus} GPUs found: placement counts GPU 0 only "
                     "(multi-GPU placement is not done yet)")
        return line


def plan_placement(target: ModelMemory, draft: ModelMemory | None, budget: GpuBudget, *,
                   n_ctx: int, n_batch: int = 512, flash_attn: bool = False,
                   target_layers: int | None = None,
                   draft_layers: int | None = None) -> Placement:
    """Place both models. ``None`` layers mean auto; an explicit number (negative: all) wins.

    Auto puts the draft fully on the GPU first (it runs many small passes, each of which would
    otherwise stream its CPU-resident weights), then as many target layers as fit in the free
    VRAM less :func:`margin_bytes`. When not even the draft fits, the draft gets the layers that
    fit, the target none, and the reason says so with the numbers. An explicit target count
    leaves an auto draft what it does not take."""
    if budget.free_bytes is None:
        return _on_the_cpu(target, draft, budget, n_ctx, target_layers, draft_layers)
    margin = margin_bytes(budget.free_bytes)
    usable = budget.free_bytes - margin

    def place(m: ModelMemory, layers: int, requested: int | None = None) -> ModelPlacement:
        return place_model(m, layers, n_ctx, n_batch=n_batch, flash_attn=flash_attn,
                           requested=requested)

    def most(m: ModelMemory, room: int) -> ModelPlacement:
        return _most_layers(m, room, n_ctx, n_batch, flash_attn)

    # The target's context reserves a compute buffer on the GPU even with no layer there.
    t_fixed = place(target, target_layers, target_layers) if target_layers is not None else None
    target_floor = (t_fixed or place(target, 0)).gpu_bytes
    d: ModelPlacement | None = None
    if draft is not None and draft_layers is not None:
        d = place(draft, draft_layers, draft_layers)
    elif draft is not None:
        d = place(draft, -1)
        if d.gpu_bytes + target_floor > usable:
            if t_fixed is None:
                t = place(target, 0)
                partial = most(draft, usable - t.gpu_bytes)
                return Placement(t, partial, budget, margin, False,
                                 _draft_reason(d, partial, t, budget, margin, usable))
            # An explicit target count wins: the draft gets what it leaves.
            d = most(draft, usable - target_floor)
    left = usable - (d.gpu_bytes if d else 0)
    t = t_fixed or most(target, left)
    fits = t.gpu_bytes <= left
    return Placement(t, d, budget, margin, fits, _reason(t, d, fits, margin, usable))


def _on_the_cpu(target: ModelMemory, draft: ModelMemory | None, budget: GpuBudget, n_ctx: int,
                target_layers: int | None, draft_layers: int | None) -> Placement:
    # Without a GPU, llama.cpp offloads nothing; an explicit number is passed on as given.
    def place(m: ModelMemory, layers: int | None) -> ModelPlacement:
        return place_model(m, 0 if layers is None else layers, n_ctx, gpu=False,
                           requested=layers)

    d = place(draft, draft_layers) if draft is not None else None
    return Placement(place(target, target_layers), d, budget, 0, True,
                     "every model runs on the CPU")


def _draft_reason(full: ModelPlacement, partial: ModelPlacement, t: ModelPlacement,
                  budget: GpuBudget, margin: int, usable: int) -> str:
    return (f"the draft {full.label} does not fit on the GPU by itself: it needs "
            f"{full.needs_text()} and {human_bytes(max(0, usable - t.gpu_bytes))} may be used "
            f"({human_bytes(budget.free_bytes)} free less a {human_bytes(margin)} margin and "
            f"the target's {human_bytes(t.gpu_bytes)}); so {partial.layers_text()} of the draft "
            f"and {t.layers_text()} of the target are on the GPU; a smaller --ctx, a smaller "
            "draft or --draft-gpu-layers would help")


def _reason(t: ModelPlacement, d: ModelPlacement | None, fits: bool, margin: int,
            usable: int) -> str:
    explicit = [f"{role} {p.requested}" for role, p in (("draft", d), ("target", t))
                if p is not None and p.requested is not None]
    if not fits:
        asked = (f"the layers asked for ({', '.join(explicit)})" if explicit
                 else "even no target layer (its compute buffer)")
        return (f"{asked} need {human_bytes((d.gpu_bytes if d else 0) + t.gpu_bytes)} but "
                f"{human_bytes(usable)} may be used (a {human_bytes(margin)} margin kept): "
                "the load may fail; use auto, fewer layers or a smaller --ctx")
    how = "explicit " + ", ".join(explicit) if explicit else "auto"
    if t.full:
        return f"everything on the GPU ({how}, {human_bytes(margin)} margin kept)"
    return (f"{t.n_layer + 1 - t.n_gpu_layers} target layers stay in RAM "
            f"({human_bytes(t.cpu_weights_bytes)} of weights, token embeddings included; "
            f"{how}, {human_bytes(margin)} margin kept)")


def allocation_error_line(m: ModelMemory, n_gpu_layers: int, n_ctx: int,
                          free_bytes: int | None, *, n_batch: int = 512,
                          flash_attn: bool = False, other_gpu_bytes: int = 0,
                          flag: str = "--gpu-layers") -> str:
    """The one line for a load that failed to allocate: the model, what was asked, what was
    free (read after the failure) and the fix, with the layer count that would fit
    alongside ``other_gpu_bytes`` (the other model's share) when there is one."""
    asked = place_model(m, n_gpu_layers, n_ctx, n_batch=n_batch, flash_attn=flash_attn)
    line = (f"{m.label}: not enough GPU memory: {asked.layers_text()} on the GPU with a "
            f"{n_ctx}-token context need about {human_bytes(asked.gpu_bytes)}")
    if free_bytes is None:
        return line + f"; use fewer layers ({flag} 0 runs it on the CPU) or a smaller --ctx"
    usable = free_bytes - margin_bytes(free_bytes) - other_gpu_bytes
    fit = _most_layers(m, usable, n_ctx, n_batch, flash_attn)
    line += f", {human_bytes(free_bytes)} was free"
    if fit.n_gpu_layers > 0 and fit.gpu_bytes <= usable:
        return line + f"; use {flag} {fit.n_gpu_layers} (what auto picks) or a smaller --ctx"
    return line + f"; use {flag} 0 (the CPU) or a smaller --ctx"
