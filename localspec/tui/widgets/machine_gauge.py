"""GPU (NVML) or system (psutil) memory and load, redrawn from each MachineSample."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ...monitor import MachineSample
from ._format import bar, human_bytes, percent


class MachineGauge(Widget):
    """Per GPU: VRAM bar, utilisation, this process's VRAM. Without NVML: RAM, CPU, process RSS.
    Then the loaded pair's placement (which layers are on the GPU, or "no GPU")."""

    # layout=True: the first render ("sampling…") is one line; a sample needs several.
    sample: reactive[MachineSample | None] = reactive(None, layout=True)
    # The loaded pair's placement line (localspec.placing), shown beside the gauges.
    placement: reactive[str | None] = reactive(None, layout=True)

    def render(self) -> RenderableType:
        s = self.sample
        if s is None:
            return Text("sampling…", style="dim")
        lines: list[RenderableType] = []
        for gpu in s.gpus:
            frac = (gpu.memory_used / gpu.memory_total
                    if gpu.memory_used is not None and gpu.memory_total else None)
            lines.append(Text(f"GPU {gpu.index} {gpu.name or ''}".rstrip(), style="bold"))
            lines.append(Text.assemble("VRAM ", bar(frac), " ",
                                       f"{human_bytes(gpu.memory_used)} / "
                                       f"{human_bytes(gpu.memory_total)}"))
            lines.append(Text(f"util {percent(gpu.utilization)}  "
                              f"this process {human_bytes(gpu.process_memory)}"))
        if not s.gpus:
            if s.gpu_note:
                lines.append(Text(s.gpu_note, style="italic dim"))
            frac = (s.ram_used / s.ram_total if s.ram_used is not None and s.ram_total else None)
            lines.append(Text.assemble("RAM  ", bar(frac), " ",
                                       f"{human_bytes(s.ram_used)} / {human_bytes(s.ram_total)}"))
            cpu = s.cpu_percent / 100 if s.cpu_percent is not None else None
            lines.append(Text.assemble("CPU  ", bar(cpu), f" {percent(s.cpu_percent)}"))
            lines.append(Text(f"this process {human_bytes(s.process_rss)}"))
        if self.placement:
            lines.append(Text(f"placement: {self.placement}", style="dim"))
        return Group(*lines)
