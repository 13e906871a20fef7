"""``localspec doctor``: what this machine can run, and what to fix, before filing a bug."""

from __future__ import annotations

import argparse
import json
from typing import Any

TAGS = {"ok": "[ ok ]", "info": "[info]", "warn": "[warn]", "fail": "[FAIL]"}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("doctor", help="check this machine: llama.cpp build, CPU, GPU, Ollama, "
                                      "config",
                       description="Checks localspec and Python, llama-cpp-python (version, "
                                   "CPU/CUDA/Metal/... build, GPU offload), the CPU, llama.cpp's "
                                   "repack self-test, NVIDIA GPUs (NVML), the Ollama store and "
                                   "daemon, config.toml and localspec's folders. Every warning "
                                   "or failure names its fix. Exit status 1 when something "
                                   "blocks `localspec run`, else 0.")
    p.add_argument("--json", action="store_true",
                   help='one JSON object for scripts: {"ok": bool, "checks": [...]}')
    p.add_argument("--selftest", action="store_true",
                   help="run the repack self-test again (ignore and rewrite its cached verdict)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print each check's details (paths, versions, flags)")
    p.set_defaults(func=run)


def _detail_lines(details: dict[str, Any]) -> list[str]:
    lines = []
    for key, value in details.items():
        if value is None or value == "" or value == [] or value == {}:
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        lines.append(f"       {key}: {text}")
    return lines


def render(checks: list[Any], verbose: bool = False) -> str:
    """One line per check, an indented fix under warnings and failures, one summary line."""
    from ..doctor import all_ok

    lines = []
    for check in checks:
        lines.append(f"{TAGS[check.status]} {check.name}: {check.summary}")
        if check.fix:
            lines.append(f"       fix: {check.fix}")
        if verbose:
            lines += _detail_lines(check.details)
    counts = {status: sum(1 for c in checks if c.status == status) for status in TAGS}
    tally = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    if all_ok(checks):
        lines.append(f"doctor: nothing blocks `localspec run` ({tally})")
    else:
        failed = ", ".join(c.name for c in checks if c.status == "fail")
        lines.append(f"doctor: `localspec run` is blocked by {failed}: see the fix above "
                     f"({tally})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    # Deferred: the checks import the model store, NVML and the repack self-test's machinery.
    from ..doctor import all_ok, run_checks

    checks = run_checks(fresh_selftest=args.selftest)
    ok = all_ok(checks)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [c.to_json() for c in checks]}, indent=2,
                         default=str))
    else:
        print(render(checks, verbose=args.verbose))
    return 0 if ok else 1
