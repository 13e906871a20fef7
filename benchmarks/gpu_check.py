"""The Python half of benchmarks/gpu_check.sh (its header says what is measured and how to run
it): one JSON with each measurement, written atomically after every step, ``"complete": true``
only once every step has run or been skipped. A step that fails records its one-line error and
the next runs; a step the time budget cannot hold is skipped and named.

    python benchmarks/gpu_check.py --out OUT.json --work DIR [--budget S] [--cpu-dry-run]

``--cpu-dry-run`` runs every step on the CPU with tiny models (and no NVML): the code paths,
not the figures, for a machine without a GPU.

Random weights give random text, so acceptance is bounded two ways instead of measured: the
target as its own draft must accept (nearly) everything, a draft of other random weights
(nearly) nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from localspec.engine import (  # noqa: E402
    DraftSettings,
    GenerationRequest,
    LlamaRunner,
    ModelSettings,
    SpeculativeEngine,
)
from localspec.engine.llama_devices import offload_devices  # noqa: E402
from localspec.engine.llama_dry_run import Buffers, dry_run, llama_log_lines, parse_buffers  # noqa: E402
from localspec.engine.placement import (  # noqa: E402
    ENGINE_SEQUENCES,
    GpuBudget,
    ModelMemory,
    ModelPlacement,
    margin_bytes,
    place_model,
    plan_placement,
)
from localspec.engine.repack import cache_file, decide_auto  # noqa: E402
from localspec.files import atomic_write  # noqa: E402
from localspec.models.tiny import TinyModelSpec, quantize, write_tiny_model  # noqa: E402
from localspec.monitor import SystemMonitor  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
CTX = 4096
PROMPT = ("w1 w2 w3 w5 w8 w13 w21 w34 w55 w89 the model and the draft " * 6).strip()
# The engine's verification pass sizes, and the batch sizes around the CUDA backend's switch
# to running CPU-resident layers on the GPU (GGML_OP_OFFLOAD_MIN_BATCH, 32 by default).
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 31, 32, 33, 48, 64, 96, 128, 192, 256)
CPU_SIZES = (1, 2, 4, 8, 16, 32, 64)


# -- the models ------------------------------------------------------------------------------
def words(n_vocab: int) -> tuple[str, ...]:
    """tiny.py's vocabulary has 286 tokens besides its words: this many words make n_vocab."""
    return tuple(f"w{i}" for i in range(n_vocab - 286))


def specs(cpu: bool) -> dict[str, TinyModelSpec]:
    """Llama 3.2 1B and Llama 3.1 8B shapes (128k vocabulary), random weights; tiny ones on
    the CPU. ``draft`` is a different random model with the 1B's vocabulary. All have peaked
    output distributions (``output_scale``): flat random logits would make near-ties, where
    batched and one-token passes of quantized weights may rank the best two differently."""
    return {name: replace(spec, output_scale=8.0) for name, spec in _specs(cpu).items()}


def _specs(cpu: bool) -> dict[str, TinyModelSpec]:
    if cpu:
        vocab = words(2048)
        return {
            "1b": TinyModelSpec(seed=1, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_layer=4,
                                words=vocab, name="check-1b"),
            "8b": TinyModelSpec(seed=3, n_embd=512, n_head=8, n_head_kv=2, n_ff=1024,
                                n_layer=4, words=vocab, name="check-8b"),
            "draft": TinyModelSpec(seed=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                                   n_layer=2, words=vocab, name="check-random-draft"),
        }
    vocab = words(128256)
    return {
        "1b": TinyModelSpec(seed=1, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192, n_layer=16,
                            context_length=8192, words=vocab, name="check-1b"),
        "8b": TinyModelSpec(seed=3, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336,
                            n_layer=32, context_length=8192, words=vocab, name="check-8b"),
        "draft": TinyModelSpec(seed=2, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192,
                               n_layer=4, context_length=8192, words=vocab,
                               name="check-random-draft"),
    }


def n_params(s: TinyModelSpec) -> int:
    n_vocab = len(s.words) + 286
    kv = s.n_embd // s.n_head * s.n_head_kv
    block = 2 * s.n_embd * s.n_embd + 2 * kv * s.n_embd + 3 * s.n_ff * s.n_embd
    return 2 * n_vocab * s.n_embd + s.n_layer * block


def make_model(folder: Path, spec: TinyModelSpec) -> dict[str, Any]:
    """The tests' writer (F32), then llama.cpp's quantizer to Q4_K_M; the F32 file removed."""
    f32 = folder / f"{spec.name}-f32.gguf"
    out = folder / f"{spec.name}-q4_k_m.gguf"
    t0 = time.perf_counter()
    write_tiny_model(f32, spec)
    t1 = time.perf_counter()
    quantize(f32, out, "Q4_K_M")
    t2 = time.perf_counter()
    f32.unlink()
    return {"path": str(out), "params": n_params(spec), "n_layer": spec.n_layer,
            "bytes": out.stat().st_size, "write_s": round(t1 - t0, 1),
            "quantize_s": round(t2 - t1, 1)}


# -- helpers ---------------------------------------------------------------------------------
def settings(layers: int, cpu: bool, n_ctx: int = CTX, repack: str = "off") -> ModelSettings:
    # repack off unless asked: the CPU's repacked weight layouts are a separate question (the
    # self-test the engine runs for them costs time), and the CUDA backend copies plain layouts.
    return ModelSettings(n_gpu_layers=layers, n_ctx=n_ctx, repack=repack,  # type: ignore[arg-type]
                         n_threads=2 if cpu else None)


def load(path: str, layers: int, cpu: bool, *, n_ctx: int = CTX,
         repack: str = "off") -> tuple[LlamaRunner, Buffers]:
    with llama_log_lines() as lines:
        runner = LlamaRunner(path, settings(layers, cpu, n_ctx, repack))
    return runner, parse_buffers(lines)


def parts(p: ModelPlacement | None) -> dict[str, int] | None:
    if p is None:
        return None
    return {"n_gpu_layers": p.n_gpu_layers, "weights": p.weights_bytes, "kv": p.kv_bytes,
            "compute": p.compute_bytes, "total": p.gpu_bytes}


def gpu_device(b: Buffers) -> str:
    """The GPU's buffer name in llama.cpp's log ("CUDA0"); "CPU" on a build without one."""
    names = [n for n in (*b.model_bytes, *b.compute_bytes) if n.startswith("CUDA")]
    return next((n for n in names if "_" not in n), "CPU")


def request(engine: SpeculativeEngine, max_tokens: int, mode: str = "model",
            k: int | None = 4) -> GenerationRequest:
    return GenerationRequest(prompt_tokens=engine.tokenize(PROMPT, chat=False),
                             max_tokens=max_tokens,
                             draft=DraftSettings(mode=mode, k=k))  # type: ignore[arg-type]


def smi(*query: str) -> list[list[str]] | None:
    try:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


# -- the run ---------------------------------------------------------------------------------
class Check:
    """The JSON being built, saved after every step."""

    def __init__(self, out: Path, work: Path, budget: float, cpu: bool) -> None:
        self.out, self.work, self.cpu = out, work, cpu
        self.deadline = time.monotonic() + budget
        self.monitor = SystemMonitor()
        self.models: dict[str, dict[str, Any]] = {}
        self.data: dict[str, Any] = {
            "schema": 1, "complete": False, "mode": "cpu-dry-run" if cpu else "gpu",
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "budget_s": round(budget), "steps": {}, "skipped": {}, "errors": {},
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                        "GGML_OP_OFFLOAD_MIN_BATCH":
                            os.environ.get("GGML_OP_OFFLOAD_MIN_BATCH", "32 (default)")},
        }

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        atomic_write(self.out, json.dumps(self.data, indent=1, sort_keys=False) + "\n")

    def step(self, name: str, need_s: float, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` into ``data[name]`` if the budget holds ``need_s`` more seconds."""
        if self.left() < need_s:
            self.data["skipped"][name] = (f"{self.left():.0f}s left, the step needs about "
                                          f"{need_s:.0f}s")
            self.save()
            return None
        t0 = time.perf_counter()
        print(f"gpu_check: {name} ({self.left():.0f}s left)", file=sys.stderr, flush=True)
        try:
            result = fn()
            self.data[name] = result
        except Exception as exc:
            result = None
            self.data["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        self.data["steps"][name] = round(time.perf_counter() - t0, 1)
        self.save()
        return result

    # -- the steps ----------------------------------------------------------------------------
    def gpu_reading(self, when: str) -> dict[str, Any]:
        """NVML through the monitor beside nvidia-smi, at the same moment (MiB)."""
        s = self.monitor.sample()
        row: dict[str, Any] = {"when": when, "note": s.gpu_note}
        if s.gpus:
            g = s.gpus[0]
            row.update(name=g.name, nvml_used_mib=_mib(g.memory_used),
                       nvml_total_mib=_mib(g.memory_total),
                       nvml_process_mib=_mib(g.process_memory), n_gpus=len(s.gpus))
        q = smi("--query-gpu=memory.used,memory.total,memory.free,driver_version", "-i", "0")
        if q:
            used, total, free, driver = q[0][:4]
            row.update(smi_used_mib=_num(used), smi_total_mib=_num(total),
                       smi_free_mib=_num(free), driver=driver)
        devices = offload_devices()  # what placement reads first: llama.cpp's own GPU list
        if devices:
            row.update(llama_device=devices[0].description, llama_devices=len(devices),
                       llama_free_mib=_mib(devices[0].free_bytes),
                       llama_total_mib=_mib(devices[0].total_bytes))
        apps = smi("--query-compute-apps=pid,used_memory") or []
        mine = [_num(a[1]) for a in apps if len(a) > 1 and a[0] == str(os.getpid())]
        row["smi_process_mib"] = mine[0] if mine else None
        if row.get("nvml_used_mib") is not None and row.get("smi_used_mib") is not None:
            row["used_diff_mib"] = round(row["nvml_used_mib"] - row["smi_used_mib"], 1)
        return row

    def nvml_used(self) -> int | None:
        s = self.monitor.sample()
        return s.gpus[0].memory_used if s.gpus else None

    def dry_runs(self) -> list[dict[str, Any]]:
        """llama.cpp's no_alloc dry runs of 1B and 70B shapes (sparse headers, the test suite's
        writer) at several layer counts, against placement's estimate and its layer rule."""
        from tests.test_placement import LLAMA_1B, LLAMA_70B, write_sparse_header

        rows = []
        for label, shape in (("llama-1b-shape", LLAMA_1B), ("llama-70b-shape", LLAMA_70B)):
            path = write_sparse_header(self.work / f"{label}.gguf", shape)
            m = ModelMemory.from_gguf(path, label)
            slots = m.n_layer + 1
            for k in sorted({0, 1, slots // 2, slots - 1, slots}):
                b = dry_run(path, k, CTX, branches=ENGINE_SEQUENCES - 1)  # as the engine
                est = place_model(m, k, CTX)
                dev = gpu_device(b)
                gpu_slots = sorted(i for i, d in b.layer_devices.items() if d.startswith("CUDA"))
                expected = list(range(slots - k, slots)) if not self.cpu else []
                rows.append({
                    "model": label, "n_gpu_layers": k, "llama_cpp_offloaded": b.offloaded,
                    "llama_cpp_compute": b.compute_bytes, "estimate_compute": est.compute_bytes,
                    "compute_ratio": _ratio(est.compute_bytes, b.compute_bytes.get(dev)),
                    "llama_cpp_kv": b.kv_bytes,
                    "estimate_kv_all_layers": sum(m.kv_bytes(i, CTX) for i in range(m.n_layer)),
                    "gpu_slots_match_rule": gpu_slots == expected,
                    "gpu_slots": _ranges(gpu_slots)})
        return rows

    def make_models(self, names: tuple[str, ...]) -> dict[str, Any]:
        folder = self.work / "models"
        folder.mkdir(parents=True, exist_ok=True)
        made = {}
        for name in names:
            made[name] = make_model(folder, specs(self.cpu)[name])
            self.models[name] = made[name]
        return made

    def make_big(self) -> dict[str, Any] | None:
        """The ~8B, as deep as the budget allows: its time is estimated from the 1B's."""
        one = self.models.get("1b")
        spec = specs(self.cpu)["8b"]
        if one is None:
            return None
        per_param = (one["write_s"] + one["quantize_s"]) / one["params"]
        keep = self.left() - 150  # for its measurements after
        for n_layer in (spec.n_layer, spec.n_layer // 2, spec.n_layer // 4):
            s = replace(spec, n_layer=n_layer)
            if n_params(s) * per_param * 1.3 < keep:
                made = make_model(self.work / "models", s)
                made["shallower_than_8b"] = n_layer < spec.n_layer
                self.models["8b"] = made
                return made
        raise TimeoutError(f"even a quarter of the 8B would not fit in {keep:.0f}s")

    def cost_curve(self, name: str) -> dict[str, Any]:
        """One pass of n tokens (all logits out, as verification asks), best of 3, fully
        offloaded and with half the layers on the CPU; that again with the engine's default
        repack decision (``auto``: the CPU's repacked weight layouts where this machine's
        self-test allows them; the CUDA backend may not copy those for a batch)."""
        info = self.models[name]
        sizes = CPU_SIZES if self.cpu else SIZES
        half = info["n_layer"] // 2 + 1  # the output layer and the last half of the blocks
        out: dict[str, Any] = {"n_layer": info["n_layer"]}
        for label, layers, repack in (("full", -1, "off"), ("half", half, "off"),
                                      ("half_repack_auto", half, "auto")):
            if self.left() < (60 if repack == "auto" else 25):
                out[label] = "skipped: budget"
                continue
            if repack == "auto":
                # The engine's verdict for this CPU, measured now rather than by the background
                # self-test a first load starts (which would compete with the timing).
                t0 = time.perf_counter()
                decide_auto(cache_file())
                out["repack_selftest_s"] = round(time.perf_counter() - t0, 1)
            runner, b = load(info["path"], layers, self.cpu, n_ctx=2048, repack=repack)
            try:
                runner.sync(list(range(300, 364)))
                runner.time_decode(1, 2)  # warm-up: kernels, CUDA graphs
                ms = {n: round(1000 * runner.time_decode(n, 3), 3) for n in sizes}
            finally:
                runner.close()
            out[label] = {"n_gpu_layers": layers, "repack": runner.repack.describe(), "ms": ms,
                          "relative_to_1": {n: round(v / ms[1], 2) for n, v in ms.items()},
                          "gpu_buffers": b.on(gpu_device(b))}
        return out

    def engine(self) -> dict[str, Any]:
        """Host ms per step at GPU step rates (the 1B fully offloaded, plain and drafting) and
        acceptance's two bounds: the target as its own draft, a different random draft."""
        target, _ = load(self.models["1b"]["path"], -1, self.cpu)
        own_draft, _ = load(self.models["1b"]["path"], -1, self.cpu)
        other, _ = load(self.models["draft"]["path"], -1, self.cpu)
        n = 48 if self.cpu else 192
        try:
            eng = SpeculativeEngine(target, own_draft, cache_calibration=False)
            plain = eng.generate(request(eng, n, mode="none", k=None)).stats
            self_draft = eng.generate(request(eng, n)).stats
            eng2 = SpeculativeEngine(target, other, cache_calibration=False)
            random_draft = eng2.generate(request(eng2, n)).stats
        finally:
            for r in (target, own_draft, other):
                r.close()
        rates = {"self_draft": round(self_draft.acceptance_rate, 4),
                 "random_draft": round(random_draft.acceptance_rate, 4)}
        return {
            "plain": plain.to_json(), "self_draft": self_draft.to_json(),
            "random_draft": random_draft.to_json(),
            "host_ms_per_step": {"plain": round(plain.host_ms_per_step, 3),
                                 "self_draft": round(self_draft.host_ms_per_step, 3),
                                 "random_draft": round(random_draft.host_ms_per_step, 3)},
            # Near-ties still let the two passes of a quantized model part now and then (the
            # engine's drift): the own-draft bound is "nearly all", not "all".
            "acceptance_bounds": {**rates, "ok": rates["self_draft"] >= 0.9
                                  and rates["random_draft"] <= 0.05},
        }

    def placement(self, target: str, draft: str, simulated_free: str | None) -> dict[str, Any]:
        """plan_placement's decision, then the models loaded with it: what llama.cpp allocated
        on the GPU and what NVML saw used, against the prediction. ``simulated_free``: plan
        for a card with only as much free as would put about half the target on the GPU."""
        tm = ModelMemory.from_gguf(self.models[target]["path"], f"check-{target}")
        dm = ModelMemory.from_gguf(self.models[draft]["path"], f"check-{draft}")
        if simulated_free is None:
            budget = (GpuBudget.from_devices(offload_devices())
                      or GpuBudget.from_sample(self.monitor.sample()))
        else:
            need = (place_model(dm, -1, CTX).gpu_bytes
                    + place_model(tm, tm.n_layer // 2 + 1, CTX).gpu_bytes + margin_bytes(0))
            free = int(need / 0.95) + 1
            budget = GpuBudget(free, 1, f"simulated card with {free / GIB:.1f} GiB free")
        plan = plan_placement(tm, dm, budget, n_ctx=CTX)
        t_layers, d_layers = plan.settings_layers()
        before = self.nvml_used()
        d_runner, d_buf = load(self.models[draft]["path"], d_layers or 0, self.cpu)
        after_draft = self.nvml_used()
        t_runner, t_buf = load(self.models[target]["path"], t_layers, self.cpu)
        after_target = self.nvml_used()
        try:
            eng = SpeculativeEngine(t_runner, d_runner, cache_calibration=False)
            eng.generate(request(eng, 32))  # the prompt's batch and drafting: the pool grows
            after_generation = self.nvml_used()
        finally:
            t_runner.close()
            d_runner.close()
        used = None if before is None or after_generation is None else after_generation - before
        return {
            "budget_free": budget.free_bytes, "describe": plan.describe(), "fits": plan.fits,
            "predicted": {"draft": parts(plan.draft), "target": parts(plan.target),
                          "total": plan.used_bytes, "margin": plan.margin_bytes},
            "llama_cpp_gpu": {"draft": d_buf.on(gpu_device(d_buf)),
                              "target": t_buf.on(gpu_device(t_buf)),
                              "offloaded": {"draft": d_buf.offloaded, "target": t_buf.offloaded}},
            "nvml_used_delta": {
                "draft_loaded": _delta(before, after_draft),
                "target_loaded": _delta(before, after_target),
                "after_generation": used},
            # What the margin had to cover beyond the prediction (the CUDA pool, padding);
            # the CUDA context, created before, is in the summary's margin_needed.
            "unpredicted_bytes": None if used is None else used - plan.used_bytes,
            "within_free": (None if used is None or budget.free_bytes is None
                            else used <= budget.free_bytes),
        }

    def summary(self) -> dict[str, Any]:
        """The figures to read first, from the steps above (None where a step did not run)."""
        d = self.data
        out: dict[str, Any] = {"build_s": d.get("build_s"), "errors": len(d["errors"]),
                               "skipped": sorted(d["skipped"])}
        idle, ctx = d.get("idle_reading") or {}, d.get("context_reading") or {}
        context = _delta_mib(idle.get("nvml_used_mib"), ctx.get("nvml_used_mib"))
        out["cuda_context_mib"] = context
        out["nvml_minus_smi_used_mib"] = [r.get("used_diff_mib") for r in
                                          (idle, ctx, d.get("loaded_reading") or {})]
        runs = d.get("dry_runs") or []
        ratios = [r["compute_ratio"] for r in runs if r.get("compute_ratio")]
        out["dry_run_compute_ratio_range"] = [min(ratios), max(ratios)] if ratios else None
        out["dry_run_layer_rule_holds"] = all(r["gpu_slots_match_rule"] for r in runs) or None
        for name in ("cost_1b", "cost_8b"):
            curve = d.get(name) or {}
            out[name] = {label: {n: c["relative_to_1"].get(n) for n in (1, 8, 32, 64, 256)}
                         for label, c in curve.items() if isinstance(c, dict)}
        eng = d.get("engine") or {}
        out["host_ms_per_step"] = eng.get("host_ms_per_step")
        out["acceptance_bounds"] = eng.get("acceptance_bounds")
        for name in ("placement_1b_pair", "placement_8b_pair", "placement_8b_pair_simulated_card"):
            p = d.get(name)
            if p:
                extra = p.get("unpredicted_bytes")
                needed = None if extra is None or context is None else extra / MIB + context
                out[name] = {"layers": [p["predicted"]["target"]["n_gpu_layers"],
                                        p["predicted"]["draft"]["n_gpu_layers"]],
                             "unpredicted_mib": _mib(extra), "margin_needed_mib": needed,
                             "margin_planned_mib": _mib(p["predicted"]["margin"]),
                             "within_free": p.get("within_free")}
        return out


def _mib(n: int | None) -> float | None:
    return None if n is None else round(n / MIB, 1)


def _num(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def _ratio(a: int, b: int | None) -> float | None:
    return round(a / b, 4) if b else None


def _delta(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else b - a


def _delta_mib(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 1)


def _ranges(xs: list[int]) -> str:
    if not xs:
        return ""
    return f"{xs[0]}-{xs[-1]}" if xs == list(range(xs[0], xs[-1] + 1)) else str(xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=470.0, help="seconds for this half")
    ap.add_argument("--build-seconds", type=float, default=None)
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    # Calibration and caches the engine keeps go to the work folder, not the user's.
    os.environ["LOCALSPEC_HOME"] = str(args.work / "home")
    c = Check(args.out.resolve(), args.work, args.budget, args.cpu_dry_run)
    c.data["build_s"] = args.build_seconds
    c.step("idle_reading", 0, lambda: c.gpu_reading("idle, before llama.cpp"))
    c.step("dry_runs", 20, c.dry_runs)
    c.step("context_reading", 0, lambda: c.gpu_reading("after llama.cpp's first dry runs"))
    c.step("models", 60, lambda: c.make_models(("1b", "draft")))
    c.step("cost_1b", 30, lambda: c.cost_curve("1b"))
    c.step("engine", 30, c.engine)
    c.step("placement_1b_pair", 20, lambda: c.placement("1b", "draft", None))
    c.step("model_8b", 200, c.make_big)
    if "8b" in c.models:
        c.step("cost_8b", 40, lambda: c.cost_curve("8b"))
        c.step("placement_8b_pair", 30, lambda: c.placement("8b", "1b", None))
        c.step("placement_8b_pair_simulated_card", 30,
               lambda: c.placement("8b", "1b", "about half the target"))
    c.step("loaded_reading", 0, lambda: c.gpu_reading("at the end"))
    c.data["models"] = c.models
    c.data["summary"] = c.summary()
    c.data["complete"] = True
    c.data["total_s"] = round(args.budget - c.left())
    c.save()
    c.monitor.close()
    print(f"gpu_check: wrote {args.out}", file=sys.stderr)
    return 1 if c.data["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
