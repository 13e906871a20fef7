"""``localspec pair add|remove``: manage your own pairs (merged over the shipped catalogue)."""

from __future__ import annotations

import argparse

from ..options import DRAFT_MODES


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("pair", help="add or remove your own target/draft pairs",
                       description="Your pairs are saved in <config dir>/localspec/models.toml "
                                   "and override shipped pairs of the same name.")
    actions = p.add_subparsers(dest="pair_action", metavar="ACTION", required=True)
    add = actions.add_parser("add", help="check a pair on its files, then save it")
    add.add_argument("name", metavar="NAME")
    add.add_argument("--target", required=True, metavar="MODEL", help="Ollama name or .gguf path")
    add.add_argument("--draft", required=True, metavar="MODEL", help="Ollama name or .gguf path")
    add.add_argument("--draft-mode", choices=DRAFT_MODES, default="model")
    add.add_argument("--why", default="", help="a note shown in `localspec list`")
    add.set_defaults(func=run_add)
    remove = actions.add_parser("remove", help="delete one of your pairs")
    remove.add_argument("name", metavar="NAME")
    remove.set_defaults(func=run_remove)


def run_add(args: argparse.Namespace) -> int:
    from ..models.catalogue import add_user_pair, user_pairs_path

    pair = add_user_pair(args.name, args.target, args.draft, args.draft_mode, why=args.why)
    print(f"saved pair {pair.name} ({pair.target} + {pair.draft}) to {user_pairs_path()}")
    return 0


def run_remove(args: argparse.Namespace) -> int:
    from ..models.catalogue import remove_user_pair

    pair = remove_user_pair(args.name)
    print(f"removed pair {pair.name}")
    return 0
