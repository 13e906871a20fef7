"""``localspec inspect``: GGUF metadata without loading weights; optionally a pair check."""

from __future__ import annotations

import argparse
import json

from ..formatting import human_bytes, human_count, printable
from ..gguf_meta import GGUFInfo, pair_report, read_gguf_info
from ..models.names import resolve_model


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("inspect", help="show a model's GGUF metadata (no weights loaded)")
    p.add_argument("model", help=".gguf path or Ollama name")
    p.add_argument("--draft", metavar="MODEL",
                   help="also check whether MODEL can draft for this one (vocabulary rule)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def _lines(info: GGUFInfo) -> list[str]:
    rows = [
        ("file", str(info.path)),
        ("size", human_bytes(info.file_size)),
        ("name", info.name or "-"),
        ("architecture", info.architecture),
        ("parameters", human_count(info.parameter_count)),
        ("quantization", info.file_type or "-"),
        ("context length", str(info.context_length or "-")),
        ("layers", str(info.block_count or "-")),
        ("tokenizer", f"{info.tokenizer_model} (pre: {info.tokenizer_pre or '-'})"),
        ("vocabulary", str(info.vocab_size)),
        ("BOS", f"{info.bos_token_id} (added: {info.add_bos_token})"),
        ("EOS", f"{info.eos_token_id} (added: {info.add_eos_token})"),
        ("chat template", "yes" if info.has_chat_template else "no"),
    ]
    return [f"{k:<15} {printable(v)}" for k, v in rows]  # names and strings from the file


def run(args: argparse.Namespace) -> int:
    path = resolve_model(args.model)
    info = read_gguf_info(path)
    report = pair_report(path, resolve_model(args.draft)) if args.draft else None
    if args.json:
        out = info.to_json()
        if report is not None:
            out["pair"] = {"draft": args.draft, "compatible": report.compatible,
                           "problems": list(report.problems)}
        print(json.dumps(out, indent=2))
    else:
        print("\n".join(_lines(info)))
        if report is not None:
            verdict = "compatible" if report.compatible else "NOT compatible: " + "; ".join(
                report.problems)
            print(f"{'pair':<15} draft {args.draft}: {printable(verdict)}")
    return 0 if report is None or report.compatible else 1
