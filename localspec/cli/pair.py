"""``localspec pair add|remove``: manage your own pairs (merged over the shipped catalogue)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TypeVar

from ..errors import LocalspecError
from ..options import DRAFT_MODES

T = TypeVar("T")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("pair", help="add or remove your own target/draft pairs",
                       description="Your pairs are saved in <config dir>/localspec/models.toml "
                                   "and override shipped pairs of the same name.")
    actions = p.add_subparsers(dest="pair_action", metavar="ACTION", required=True)
    add = actions.add_parser("add", help="check a pair on its files, then save it")
    add.add_argument("name", metavar="NAME")
    add.add_argument("--target", required=True, metavar="MODEL",
                     help="Ollama name or .gguf path (a path is saved absolute)")
    add.add_argument("--draft", required=True, metavar="MODEL",
                     help="Ollama name or .gguf path (a path is saved absolute)")
    add.add_argument("--draft-mode", choices=DRAFT_MODES, default="model")
    add.add_argument("--why", default="", help="a note shown in `localspec list`")
    add.add_argument("--replace", action="store_true",
                     help="replace your pair of the same name (its note too)")
    add.set_defaults(func=run_add)
    remove = actions.add_parser("remove", help="delete one of your pairs")
    remove.add_argument("name", metavar="NAME")
    remove.set_defaults(func=run_remove)


def stored_ref(ref: str) -> str:
    """A model reference as a pair keeps it: a path made absolute (a relative one means
    something else from every other folder), an Ollama name as typed."""
    from ..models.names import is_path_ref

    return os.path.abspath(os.path.expanduser(ref)) if is_path_ref(ref) else ref


def _saving(action: Callable[[], T]) -> T:
    """Run ``action``, which writes the user's pair file; a failed write (a read-only or full
    folder) is one line naming the file, not a traceback. Reading problems are ConfigErrors
    already, so an OSError here is the write."""
    from ..models.catalogue import user_pairs_path

    try:
        return action()
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise LocalspecError(f"cannot save your pairs to {user_pairs_path()}: {reason}",
                             title="Cannot save your pairs") from None


def run_add(args: argparse.Namespace) -> int:
    from ..models.catalogue import add_user_pair, user_pairs_path

    target, draft = stored_ref(args.target), stored_ref(args.draft)
    pair = _saving(lambda: add_user_pair(args.name, target, draft, args.draft_mode,
                                         why=args.why, replace=args.replace))
    print(f"saved pair {pair.name} ({pair.target} + {pair.draft}) to {user_pairs_path()}")
    return 0


def run_remove(args: argparse.Namespace) -> int:
    from ..models.catalogue import remove_user_pair

    pair = _saving(lambda: remove_user_pair(args.name))
    print(f"removed pair {pair.name}")
    return 0
