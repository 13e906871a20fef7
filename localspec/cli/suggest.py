"""``localspec suggest TARGET``: which local models can draft for TARGET, smallest first."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("suggest", help="local models that can draft for a target",
                       description="Checks every model in the Ollama store against TARGET's "
                                   "vocabulary and lists the compatible, smaller ones, the "
                                   "smallest first.")
    p.add_argument("target", metavar="TARGET", help="an Ollama name or a .gguf path")
    p.add_argument("--json", action="store_true", help="a JSON list for scripts")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..models.catalogue import suggest_drafts
    from ..models.names import display_name
    from .formatting import human_bytes, human_count, table

    found = suggest_drafts(args.target)
    if args.json:
        print(json.dumps([{"name": s.name, "path": str(s.gguf_path), "size": s.size,
                           "parameters": s.parameter_count, "quantization": s.quantization,
                           "size_ratio": round(s.size_ratio, 2)} for s in found], indent=2))
        return 0
    if not found:
        print(f"no local model can draft for {display_name(args.target)} "
              "(pull a smaller sibling of the same family)")
        return 0
    rows = [[s.name, human_bytes(s.size), human_count(s.parameter_count), s.quantization or "-",
             f"{s.size_ratio:.1f}x"] for s in found]
    print(table(rows, ["DRAFT", "SIZE", "PARAMS", "QUANT", "SMALLER"]))
    print(f"\nsave one: localspec pair add NAME --target {args.target} --draft {found[0].name}")
    return 0
