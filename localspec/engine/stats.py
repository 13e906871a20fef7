"""Statistics of one generation."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class DrafterStats:
    """What one drafter proposed in a request and what the target accepted of it."""

    rounds: int = 0  # verification rounds that verified its tokens
    drafted: int = 0
    accepted: int = 0

    def to_json(self) -> dict[str, int]:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted}


@dataclass(slots=True)
class GenerationStats:
    """Counters and timers of one request; derived rates are properties."""

    prompt_tokens: int = 0
    # Prompt tokens whose KV came from a cache (the last request's, or a saved state's)
    # instead of being prefilled.
    prompt_cached_tokens: int = 0
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_rounds: int = 0
    # Rounds verified as a token tree in one target pass: wider than a chain, or a chain of
    # more than one drafter's tokens.
    tree_rounds: int = 0
    # Tree rounds that held more than one drafter's tokens (free drafters' grafted in): each
    # of those drafters counts the round in its own ``drafters`` entry.
    merged_rounds: int = 0
    target_passes: int = 0
    # Verification steps that drafted and stopped at a near-tie the batched logits could not
    # decide (the position then costs a one-token pass): what keeps a quantized target on a
    # CPU from long drafts however right they are.
    tie_stops: int = 0
    # Tokens the draft model produced (before auto trimmed what it would not verify), and the
    # seconds of that drafting outside llama_decode: its host cost, what a GPU exposes.
    draft_model_tokens: int = 0
    draft_host_seconds: float = 0.0
    # Per drafter (by its registered name), for the drafters that had tokens verified.
    drafters: dict[str, DrafterStats] = field(default_factory=dict)
    k_counts: Counter[int] = field(default_factory=Counter)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    sample_seconds: float = 0.0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0
    # Time inside llama_decode (target and draft): the rest of total_seconds is host overhead.
    decode_seconds: float = 0.0
    # llama_decode calls (target passes, the draft's steps and catch-ups), calibration excluded.
    decode_calls: int = 0
    calibration_seconds: float = 0.0
    # Why the request drafted as it did (auto's reasoning from the measured costs).
    policy: str = ""

    def count_round(self, drafter: str, drafted: int, accepted: int) -> None:
        """One verification round of ``drafted`` tokens from ``drafter``."""
        d = self.drafters.get(drafter)
        if d is None:
            d = self.drafters[drafter] = DrafterStats()
        d.rounds += 1
        d.drafted += drafted
        d.accepted += accepted

    @property
    def lookup_rounds(self) -> int:
        """Rounds verified from prompt lookup: what front ends show beside the drafted count."""
        d = self.drafters.get("lookup")
        return d.rounds if d is not None else 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Drafted tokens accepted per verification round that had drafts."""
        return self.accepted / self.draft_rounds if self.draft_rounds else 0.0

    @property
    def mean_tree_size(self) -> float:
        """Drafted tokens (tree nodes; a chain's length) verified per drafting round."""
        return self.drafted / self.draft_rounds if self.draft_rounds else 0.0

    @property
    def host_ms_per_draft_token(self) -> float:
        """Milliseconds outside llama_decode per token the draft model drafted (its choice
        of tokens, the tree's bookkeeping)."""
        n = self.draft_model_tokens
        return 1000.0 * self.draft_host_seconds / n if n else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        return self.completion_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def mean_k(self) -> float:
        n = sum(self.k_counts.values())
        return sum(k * c for k, c in self.k_counts.items()) / n if n else 0.0

    @property
    def host_seconds(self) -> float:
        """Time outside llama_decode (sampling, drafting logic, text), calibration excluded."""
        return self.total_seconds - self.decode_seconds - self.calibration_seconds

    @property
    def host_ms_per_step(self) -> float:
        """Milliseconds per target pass spent outside llama_decode (sampling, drafting logic,
        text assembly): what a fast GPU exposes. Calibration is not counted."""
        return 1000.0 * self.host_seconds / self.target_passes if self.target_passes else 0.0

    @property
    def host_ms_per_token(self) -> float:
        """The same host time per generated token: what each token costs beyond the models'
        own work, so what a fast GPU's throughput loses to it."""
        n = self.completion_tokens
        return 1000.0 * self.host_seconds / n if n else 0.0

    @property
    def host_ms_per_decode(self) -> float:
        """The same host time per model step (any llama_decode call, draft or target): while
        drafting, one target pass also carries the draft's K steps and their picks."""
        return 1000.0 * self.host_seconds / self.decode_calls if self.decode_calls else 0.0

    @property
    def tokens_per_second(self) -> float:
        """End to end: new tokens over the time from request to last token."""
        return self.completion_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """After the first token: prompt processing excluded."""
        t = self.total_seconds - self.ttft_seconds
        return (self.completion_tokens - 1) / t if t > 0 and self.completion_tokens > 1 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prompt_cached_tokens": self.prompt_cached_tokens,
            "completion_tokens": self.completion_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 3),
            "tokens_per_target_pass": round(self.tokens_per_target_pass, 3),
            "draft_rounds": self.draft_rounds,
            "tree_rounds": self.tree_rounds,
            "merged_rounds": self.merged_rounds,
            "mean_tree_size": round(self.mean_tree_size, 3),
            "draft_model_tokens": self.draft_model_tokens,
            "draft_host_seconds": round(self.draft_host_seconds, 4),
            "host_ms_per_draft_token": round(self.host_ms_per_draft_token, 4),
            "lookup_rounds": self.lookup_rounds,
            "drafters": {name: d.to_json() for name, d in self.drafters.items()},
            "target_passes": self.target_passes,
            "tie_stops": self.tie_stops,
            "mean_k": round(self.mean_k, 3),
            "k_counts": {str(k): v for k, v in sorted(self.k_counts.items())},
            "prefill_seconds": round(self.prefill_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "sample_seconds": round(self.sample_seconds, 4),
            "ttft_seconds": round(self.ttft_seconds, 4),
            "total_seconds": round(self.total_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "calibration_seconds": round(self.calibration_seconds, 4),
            "decode_calls": self.decode_calls,
            "host_ms_per_step": round(self.host_ms_per_step, 4),
            "host_ms_per_decode": round(self.host_ms_per_decode, 4),
            "host_ms_per_token": round(self.host_ms_per_token, 4),
            "policy": self.policy,
            "tokens_per_second": round(self.tokens_per_second, 3),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 3),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GenerationStats:
        """Back from ``to_json`` (statistics that crossed a process boundary); derived rates
        are recomputed, unknown keys ignored, missing ones zero."""
        counters = {f: data[f] for f in ("prompt_tokens", "prompt_cached_tokens",
                                         "completion_tokens", "drafted",
                                         "accepted", "draft_rounds", "target_passes",
                                         "decode_calls", "tree_rounds", "draft_model_tokens",
                                         "merged_rounds", "tie_stops")
                    if isinstance(data.get(f), int)}
        timers = {f: float(data[f]) for f in ("prefill_seconds", "draft_seconds",
                                              "verify_seconds", "sample_seconds",
                                              "ttft_seconds", "total_seconds", "decode_seconds",
                                              "calibration_seconds", "draft_host_seconds")
                  if isinstance(data.get(f), int | float)}
        k_counts: Counter[int] = Counter()
        for k, n in (data.get("k_counts") or {}).items():
            if str(k).isdigit() and isinstance(n, int):
                k_counts[int(k)] = n
        policy = data.get("policy")
        stats = cls(k_counts=k_counts, policy=policy if isinstance(policy, str) else "",
                    drafters=_drafters_from_json(data))
        for name, value in {**counters, **timers}.items():
            setattr(stats, name, value)
        return stats

    def summary(self) -> str:
        """One human line, for --verbose and the TUI's status."""
        return (
            f"{self.completion_tokens} tokens in {self.total_seconds:.2f}s "
            f"({self.tokens_per_second:.1f} tok/s, decode {self.decode_tokens_per_second:.1f}), "
            f"TTFT {self.ttft_seconds * 1000:.0f} ms"
            + (f" ({self.prompt_cached_tokens} of {self.prompt_tokens} prompt tokens cached)"
               if self.prompt_cached_tokens else "")
            + f", drafted {self.drafted}, accepted "
            f"{self.accepted} ({self.acceptance_rate:.0%})"
            + (f", {self.tie_stops} stopped at near-ties" if self.tie_stops else "")
            + ", mean accepted length "
            f"{self.mean_accepted_length:.2f}, mean K {self.mean_k:.2f}, "
            f"draft {self.draft_seconds:.2f}s / verify {self.verify_seconds:.2f}s / "
            f"sampling {self.sample_seconds:.2f}s, host {self.host_ms_per_token:.2f} ms/token "
            f"({self.host_ms_per_step:.2f} ms/target pass, {self.host_ms_per_decode:.2f} "
            "ms/model step)"
            + (f"; this machine's costs measured in {self.calibration_seconds:.2f}s (once, "
               "then cached)" if self.calibration_seconds else "")
        )


def _drafters_from_json(data: dict[str, Any]) -> dict[str, DrafterStats]:
    """Per-drafter counts from ``to_json``; from an older peer, only its lookup_rounds."""
    raw = data.get("drafters")
    if not isinstance(raw, dict):
        n = data.get("lookup_rounds")
        return {"lookup": DrafterStats(rounds=n)} if isinstance(n, int) and n > 0 else {}
    out = {}
    for name, d in raw.items():
        if isinstance(d, dict):
            out[str(name)] = DrafterStats(**{f: d[f] for f in ("rounds", "drafted", "accepted")
                                             if isinstance(d.get(f), int)})
    return out


def drafter_totals(requests: Iterable[GenerationStats]) -> dict[str, DrafterStats]:
    """Per drafter (by name, sorted), its rounds and tokens summed over ``requests``."""
    totals: dict[str, DrafterStats] = {}
    for stats in requests:
        for name, d in stats.drafters.items():
            t = totals.setdefault(name, DrafterStats())
            t.rounds += d.rounds
            t.drafted += d.drafted
            t.accepted += d.accepted
    return dict(sorted(totals.items()))
