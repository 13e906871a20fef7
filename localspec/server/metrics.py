"""Cumulative counters of the server, in Prometheus' text format or as JSON.

Updated only on the event loop thread (by the request handlers), so no lock is needed.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..engine.decoder import Finished

# name -> (help text, type). Labelled counters are rendered one line per label value.
_HELP = {
    "requests_total": ("Generation requests received, by endpoint.", "counter"),
    "request_errors_total": ("Requests answered with an error, by HTTP status.", "counter"),
    "requests_finished_total": ("Generations finished, by finish reason (cancelled: the client "
                                "went away, or the server shut down).", "counter"),
    "prompt_tokens_total": ("Prompt tokens processed.", "counter"),
    "completion_tokens_total": ("Tokens generated.", "counter"),
    "draft_tokens_total": ("Tokens proposed by the drafters.", "counter"),
    "draft_tokens_accepted_total": ("Drafted tokens the target accepted.", "counter"),
    "draft_rounds_total": ("Verification rounds that had drafted tokens.", "counter"),
    "target_passes_total": ("Forward passes of the target model.", "counter"),
    "prefill_seconds_total": ("Time spent processing prompts.", "counter"),
    "generation_seconds_total": ("Time from request start to last token, summed.", "counter"),
    "queue_waiting": ("Requests waiting for the engine.", "gauge"),
    "busy": ("1 while the engine is generating.", "gauge"),
    "uptime_seconds": ("Seconds since the server started.", "gauge"),
}
_TOTALS = tuple(k for k in _HELP if k.endswith("_total") and not k.startswith("request"))


@dataclass(slots=True)
class Metrics:
    """The counters. ``observe`` adds one finished generation."""

    started: float = field(default_factory=time.monotonic)
    requests: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    finished: Counter[str] = field(default_factory=Counter)
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_TOTALS, 0))

    def request(self, endpoint: str) -> None:
        self.requests[endpoint] += 1

    def error(self, status: int) -> None:
        self.errors[str(status)] += 1

    def observe(self, done: Finished) -> None:
        s = done.stats
        self.finished[done.finish_reason] += 1
        for key, value in (("prompt_tokens_total", s.prompt_tokens),
                           ("completion_tokens_total", s.completion_tokens),
                           ("draft_tokens_total", s.drafted),
                           ("draft_tokens_accepted_total", s.accepted),
                           ("draft_rounds_total", s.draft_rounds),
                           ("target_passes_total", s.target_passes),
                           ("prefill_seconds_total", s.prefill_seconds),
                           ("generation_seconds_total", s.total_seconds)):
            self.totals[key] += value

    def mean_generation_seconds(self) -> float:
        """Average time of one finished generation (for Retry-After); 1 s before any."""
        n = sum(self.finished.values())
        return self.totals["generation_seconds_total"] / n if n else 1.0

    def to_json(self, waiting: int, busy: bool) -> dict[str, Any]:
        return {
            "requests_total": dict(self.requests),
            "request_errors_total": dict(self.errors),
            "requests_finished_total": dict(self.finished),
            **{k: round(v, 6) if isinstance(v, float) else v for k, v in self.totals.items()},
            "queue_waiting": waiting,
            "busy": int(busy),
            "uptime_seconds": round(time.monotonic() - self.started, 3),
        }

    def to_prometheus(self, waiting: int, busy: bool) -> str:
        data = self.to_json(waiting, busy)
        labels = {"requests_total": "endpoint", "request_errors_total": "status",
                  "requests_finished_total": "reason"}
        lines = []
        for name, (text, kind) in _HELP.items():
            full = f"localspec_{name}"
            lines += [f"# HELP {full} {text}", f"# TYPE {full} {kind}"]
            value = data[name]
            if isinstance(value, dict):
                for label, v in sorted(value.items()):
                    lines.append(f'{full}{{{labels[name]}="{label}"}} {v}')
            else:
                lines.append(f"{full} {value}")
        return "\n".join(lines) + "\n"
