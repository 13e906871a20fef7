"""Fakes for the TUI's collaborators that cannot run here (NVML, the registry) or would make
snapshots vary (live machine numbers). The engine stays real (tiny GGUF models)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from localspec.loading import EngineSpec
from localspec.models.library import LocalModel, MemoryEstimate, PairStatus
from localspec.monitor import GpuSample, MachineSample

GiB = 1024 ** 3

FIXED_GPU_SAMPLE = MachineSample(
    gpus=(GpuSample(0, "NVIDIA H200", 21 * GiB, 141 * GiB, 37, 18 * GiB),),
    ram_used=12 * GiB, ram_total=128 * GiB, ram_available=116 * GiB, cpu_percent=12.0,
    process_rss=2 * GiB)

FIXED_CPU_SAMPLE = MachineSample(
    gpu_note="No NVIDIA driver (NVML Shared Library Not Found)",
    ram_used=12 * GiB, ram_total=64 * GiB, ram_available=52 * GiB, cpu_percent=25.0,
    process_rss=1 * GiB)


class FakeMonitor:
    """Always the same sample: fixed gauge numbers for snapshots."""

    def __init__(self, sample: MachineSample = FIXED_GPU_SAMPLE) -> None:
        self._sample = sample
        self.closed = False

    def sample(self) -> MachineSample:
        return self._sample

    def watch(self, pid: int | None) -> None:
        self.watched = pid

    def close(self) -> None:
        self.closed = True


@dataclass
class FakePullProgress:
    digest: str
    completed: int
    total: int
    status: str


class FakeLibrary:
    """Pairs over the tiny models; a pull that reports two layers and honours cancel."""

    DAMAGE = ("broken:7b: damaged, blob sha256-0123456789ab… has 520,812,345 bytes, the "
              "manifest says 491,400,000; run `localspec pull broken:7b` to repair it")

    def __init__(self, target: Path, draft: Path, pull_steps: int = 4,
                 pull_delay: float = 0.01, damaged: bool = False) -> None:
        self.target, self.draft = target, draft
        self.pull_steps, self.pull_delay = pull_steps, pull_delay
        self.damaged = damaged  # also offer a pair and a model whose blob has the wrong size
        self.models = [LocalModel("tiny-target:latest", target, 1_000_000),
                       LocalModel("tiny-draft:latest", draft, 300_000)]
        if damaged:
            self.models.append(LocalModel("broken:7b", Path("/store/manifests/broken/7b"), 0,
                                          self.DAMAGE))
        self.pull_started = threading.Event()
        self.deleted: list[str] = []

    def pairs(self) -> list[PairStatus]:
        return [
            PairStatus("tiny", str(self.target), str(self.draft), "model",
                       "the tiny test pair", "shipped"),
            PairStatus("tiny-lookup", str(self.target), None, "lookup", "prompt lookup only",
                       "user"),
            PairStatus("absent", "qwen3:32b", "qwen3:0.6b", "model", "not pulled", "shipped"),
        ] + ([PairStatus("broken", "broken:7b", str(self.draft), "model", "a damaged target",
                         "user")] if self.damaged else [])

    def check_pair(self, pair: PairStatus) -> PairStatus:
        if pair.name == "absent":
            return replace(pair, present=False, problem="not in the Ollama store: qwen3:32b")
        if pair.name == "broken":
            return replace(pair, present=False, damaged=True, problem=self.DAMAGE)
        return replace(pair, present=True, size=1_300_000, compatible=True)

    def local_models(self) -> list[LocalModel]:
        return list(self.models)

    def pull(self, name: str, progress: Callable[[Any], None],
             cancel: threading.Event) -> LocalModel:
        self.pull_started.set()
        for layer in ("sha256:aaaaaaaaaaaaaaaa", "sha256:bbbbbbbbbbbbbbbb"):
            for step in range(self.pull_steps + 1):
                if cancel.is_set():
                    from localspec.errors import PullError

                    raise PullError("cancelled")
                progress(FakePullProgress(layer, step * 100, self.pull_steps * 100,
                                          "downloading"))
                time.sleep(self.pull_delay)
        model = LocalModel(name, self.target, 1_000_000)
        self.models.append(model)
        return model

    delete_error: Exception | None = None  # set: delete fails with it

    def delete(self, name: str) -> None:
        if self.delete_error is not None:
            raise self.delete_error
        self.deleted.append(name)
        self.models = [m for m in self.models if m.name != name]

    def inspect(self, ref: str) -> dict[str, Any]:
        return {"architecture": "llama", "name": ref, "vocab_size": 96}

    def suggest_drafts(self, target: str) -> list[str]:
        return ["tiny-draft:latest — 3.3× smaller, F32"]

    def estimate(self, spec: EngineSpec, free: int | None, where: str) -> MemoryEstimate:
        return MemoryEstimate(weights=3 * GiB, kv_cache=1 * GiB, free=free, where=where)
