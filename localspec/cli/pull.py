"""``localspec pull NAME|PAIR``: bring models into the Ollama store (daemon or registry)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("pull", help="pull a model or both models of a pair into the Ollama store",
                       description="Pull through the Ollama daemon when one answers (OLLAMA_HOST), "
                                   "otherwise straight from the registry into the same store, "
                                   "verified and resumable. A model already present is not "
                                   "downloaded again if every blob its manifest names has the "
                                   "declared size; blobs that are missing or the wrong size are "
                                   "fetched again. Sizes only: a blob damaged without changing "
                                   "size is found by --verify alone.")
    p.add_argument("name", metavar="NAME|PAIR",
                   help="an Ollama model name (qwen2.5-coder:1.5b) or a pair from `localspec list`")
    p.add_argument("--registry", metavar="URL",
                   help="pull from this registry (a mirror) instead of the name's host; "
                        "always the direct path")
    p.add_argument("--insecure", action="store_true", help="allow a registry on plain http")
    p.add_argument("--verify", action="store_true",
                   help="re-hash every blob of a model already present (sha256; reads every "
                        "byte, minutes for a large model) and fetch again the ones that do not "
                        "match; without it only sizes are checked")
    p.set_defaults(func=run)


def models_to_pull(name: str) -> tuple[list[str], bool]:
    """A pair's Ollama models, or the name itself; local files are left out (nothing to pull).
    With them, whether the name is a pair's, for saying so when nothing is left.

    A name written as a path must be a file: a missing one is "no such file", not an attempt
    to pull it from a registry."""
    from ..models.catalogue import can_name_pair, load_pairs
    from ..models.names import is_path_ref, looks_like_path, resolve_model

    pair = load_pairs().get(name) if can_name_pair(name) else None
    if pair is not None:
        return [ref for ref in (pair.target, pair.draft) if not is_path_ref(ref)], True
    if looks_like_path(name):
        resolve_model(name)
        return [], False
    return [name], False


def run(args: argparse.Namespace) -> int:
    from ..models.pull import pull

    names, is_pair = models_to_pull(args.name)
    if not names:
        # Said, not silent: an exit 0 with no output reads as "pulled" (or as a hang).
        what = "both models are local files" if is_pair else "a local file"
        print(f"{args.name}: {what}; nothing to pull", file=sys.stderr)
        return 0
    for name in names:
        with _ProgressBars() as bars:
            model = pull(name, registry=args.registry, insecure=args.insecure,
                         progress=bars.update, verify=args.verify)
        print(f"{model.name}\t{model.gguf_path}")
    return 0


class _ProgressBars:
    """One rich progress bar per layer (size, speed, ETA) on stderr; status lines in between."""

    def __init__(self) -> None:
        # Imported here: rich is only needed when something is actually pulled.
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), TimeRemainingColumn(),
            console=Console(file=sys.stderr), transient=False,
        )
        self._tasks: dict[str, Any] = {}
        self._last_status = ""

    def __enter__(self) -> _ProgressBars:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, event: Any) -> None:
        if not event.digest or not event.total:
            if event.status and event.status != self._last_status:
                # One line each (a damaged blob, a wait for another pull): never wrapped, and
                # never read as rich markup.
                self._progress.console.print(event.status, markup=False, highlight=False,
                                             soft_wrap=True)
                self._last_status = event.status
            return
        task = self._tasks.get(event.digest)
        if task is None:
            label = f"pulling {event.digest.removeprefix('sha256:')[:12]}"
            task = self._progress.add_task(label, total=event.total)
            self._tasks[event.digest] = task
        self._progress.update(task, completed=event.completed, total=event.total)
