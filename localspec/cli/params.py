"""Command-line flags for parameters: each validated through ``params.PARAMS``, so a flag accepts
exactly what ``config.toml``, the chat app and the server accept."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from ..options import SETTINGS_FIELDS, Settings
from ..params import PARAMS, InvalidOptionError


def cli_type(name: str) -> Callable[[str], Any]:
    """An argparse ``type=`` that validates through the parameter's range."""
    p = PARAMS[name]

    def convert(text: str) -> Any:
        try:
            return p.parse(text, label=p.cli_flag)
        except InvalidOptionError:
            # argparse names the flag itself ("argument --port: ..."), so the rest is the rule.
            raise argparse.ArgumentTypeError(f"must be {p.allowed()}, got {text}") from None

    convert.__name__ = name  # argparse names the type in some messages
    return convert


def add_argument(group: Any, name: str, *aliases: str, help_extra: str = "") -> None:
    """Add ``--name`` for a parameter. Its default is None: "not given, use the settings"."""
    p = PARAMS[name]
    flags = [p.cli_flag, *aliases]
    kwargs: dict[str, Any] = {"dest": name, "default": None}
    if p.kind == "bool":
        group.add_argument(*flags, action="store_const", const=True,
                           help=p.meaning + help_extra, **kwargs)
        return
    if p.kind == "choice":
        kwargs["choices"] = p.choices
    else:
        kwargs["type"] = cli_type(name)
    metavar = ("K|auto" if name == "k" else "N|auto") if p.kind == "k" else None
    default = "auto" if p.kind == "k" and p.default is None else p.default
    shown = f" (default {default})" if default not in (None, "") else ""
    group.add_argument(*flags, metavar=metavar, help=p.meaning + shown + help_extra, **kwargs)


def apply_args(base: Settings, args: argparse.Namespace) -> Settings:
    """``base`` with every parameter flag the user gave (None means not given)."""
    changes = {name: getattr(args, name) for name in SETTINGS_FIELDS
               if getattr(args, name, None) is not None}
    return dataclasses.replace(base, **changes).validate()
