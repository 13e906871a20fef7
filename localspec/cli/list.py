"""``localspec list``: catalogue pairs and local models, with presence, sizes and compatibility."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("list", help="list pairs and local models",
                       description="Pairs (shipped and your own) with whether their models are "
                                   "present and compatible, then the models in the Ollama store. "
                                   "A model with a blob missing or of the wrong size is shown "
                                   "DAMAGED (sizes only: `localspec pull NAME --verify` "
                                   "re-hashes).")
    p.add_argument("--json", action="store_true", help="one JSON object for scripts")
    p.set_defaults(func=run)


def _local_models() -> list[dict[str, Any]]:
    from ..errors import GGUFError
    from ..gguf_meta import read_gguf_info
    from ..models.ollama_store import list_store

    models = []
    for item in list_store():
        if item.model is None:
            models.append({"name": item.name, "path": None, "size": None, "quantization": None,
                           "architecture": None, "parameters": None, "damaged": True,
                           "problem": item.problem})
            continue
        model = item.model
        entry: dict[str, Any] = {"name": model.name, "path": str(model.gguf_path),
                                 "size": model.size, "quantization": None,
                                 "architecture": None, "parameters": None, "damaged": False,
                                 "problem": None}
        try:
            info = read_gguf_info(model.gguf_path)
        except GGUFError as exc:
            entry["problem"] = str(exc)
        else:
            entry.update(quantization=info.file_type, architecture=info.architecture,
                         parameters=info.parameter_count)
        models.append(entry)
    return models


def _absence(pair: dict[str, Any], which: str) -> str:
    if pair[f"{which}_damaged"]:
        return " (DAMAGED)"
    return "" if pair[f"{which}_present"] else " (absent)"


def _compat(value: bool | None) -> str:
    return {True: "yes", False: "NO", None: "-"}[value]


def run(args: argparse.Namespace) -> int:
    from ..formatting import printable
    from ..models.catalogue import load_pairs, pair_status, shipped_pairs
    from .formatting import table

    # A broken pair file of the user's hides their pairs, not the rest: the shipped pairs and
    # the models are listed, and the file's error is said last, with a failing exit.
    try:
        loaded = load_pairs()
        problem = None
    except ConfigError as exc:
        loaded, problem = shipped_pairs(), exc.message
    pairs = [pair_status(p).to_json() for p in loaded.values()]
    models = _local_models()
    if args.json:
        print(json.dumps({"pairs": pairs, "models": models,
                          **({"pairs_error": problem} if problem else {})}, indent=2))
        return _said(problem)
    rows = [[p["name"], p["target"] + _absence(p, "target"), p["draft"] + _absence(p, "draft"),
             p["draft_mode"], _compat(p["compatible"]), p["source"]] for p in pairs]
    print(table(rows, ["PAIR", "TARGET", "DRAFT", "MODE", "COMPATIBLE", "SOURCE"]))
    for p in pairs:  # a NO says why, as --json does
        if p["compatible"] is False and p["problems"]:
            print(printable(f"{p['name']}: not compatible: {'; '.join(p['problems'])}"))
    print()
    if not models:
        print("no local models (localspec pull NAME|PAIR)")
    else:
        print(table([_model_row(m) for m in models], ["MODEL", "SIZE", "QUANT", "PARAMS",
                                                      "ARCH"]))
    return _said(problem)


def _said(problem: str | None) -> int:
    """The pair file's error, if any, on stderr after the listing: 1; else 0."""
    if problem is None:
        return 0
    from ..formatting import printable

    print(printable(f"localspec: your pairs are not listed: {problem}"), file=sys.stderr)
    return 1


def _model_row(m: dict[str, Any]) -> list[str]:
    from .formatting import human_bytes, human_count

    if m["damaged"]:
        return [m["name"], "-", "-", "-",
                f"DAMAGED ({m['problem']}): run localspec pull {m['name']}"]
    return [m["name"], human_bytes(m["size"]), m["quantization"] or "-",
            human_count(m["parameters"]), m["architecture"] or (m["problem"] or "-")]
