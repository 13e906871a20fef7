"""``localspec history``: the history drafter's indexes, their size, and emptying them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

SCOPE_CHOICES = ("chat", "serve", "all")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("history", help="the history drafter's indexes: size, or clear them",
                       description="The indexes the history drafter drafts from (earlier "
                                   "requests and the chat app's saved conversations), one per "
                                   "vocabulary and scope: chat (the chat app and run) and serve. "
                                   "They live under the cache folder, owner-only.")
    p.add_argument("action", nargs="?", choices=("show", "clear"), default="show",
                   help="show (the default): documents, tokens and bytes per index; clear: "
                        "empty them (a running chat app or serve forgets its copy too)")
    p.add_argument("--scope", choices=SCOPE_CHOICES, default="all",
                   help="only this scope's indexes (default all)")
    p.add_argument("--json", action="store_true", help="one JSON object for scripts")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Deferred: the index module loads numpy and the engine package.
    from .. import history

    scopes = history.SCOPES if args.scope == "all" else (args.scope,)
    if args.action == "clear":
        try:
            cleared = history.clear(scopes)
        except OSError as exc:
            from ..errors import LocalspecError

            raise LocalspecError(f"cannot clear the history in {history.history_dir()}: "
                                 f"{exc.strerror or exc}") from None
        if args.json:
            _dump({"cleared": [f.to_json() for f in cleared]})
        else:
            tokens = sum(f.tokens or 0 for f in cleared)
            print(f"cleared {len(cleared)} index{'es' if len(cleared) != 1 else ''} "
                  f"({tokens:,} tokens) under {history.history_dir()}")
        return 0
    files = list(history.index_files(scopes))
    if args.json:
        _dump({"folder": str(history.history_dir()), "indexes": [f.to_json() for f in files]})
        return 0
    if not files:
        print(f"no history yet (it is kept under {history.history_dir()})")
        return 0
    _table(files)
    return 0


def _table(files: list[Any]) -> None:
    from ..formatting import human_bytes

    rows = [("SCOPE", "VOCABULARY", "DOCUMENTS", "TOKENS", "FILE", "MEMORY", "MODEL")]
    for f in files:
        if f.documents is None:
            rows.append((f.scope, f.vocabulary, "-", "-", human_bytes(f.file_bytes), "-",
                         "(unreadable: rebuilt at its next use)"))
            continue
        rows.append((f.scope, f.vocabulary, f"{f.documents:,}", f"{f.tokens:,}",
                     human_bytes(f.file_bytes), human_bytes(f.memory_bytes), f.note))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def _dump(data: dict[str, Any]) -> None:
    json.dump(data, sys.stdout, indent=1)
    sys.stdout.write("\n")
