"""The ``localspec`` command. Each subcommand lives in its own module with ``register(sub)``.

Subcommand modules import heavy libraries (llama_cpp, textual) inside their ``run`` functions, so
``localspec --help`` and argument errors stay instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from ..errors import LocalspecError

# Order is the order shown in --help.
SUBCOMMANDS = ("run", "demo", "bench", "inspect", "pull", "list", "suggest", "pair", "serve",
               "doctor", "tui")


def build_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="localspec",
        description="Speculative decoding for local LLMs: a small draft model proposes, the large "
                    "target verifies, the output is exactly the target's. With no command, opens "
                    "the chat app.",
    )
    parser.add_argument("--version", action="version", version=f"localspec {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("LOCALSPEC_LOG", "WARNING"),
                        help="logging level for diagnostics on stderr (default WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    registered: list[str] = []
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name == f"{__name__}.{name}":
                continue  # a front end not built yet in this checkout
            raise
        module.register(sub)
        registered.append(name)
    return parser, registered


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    # llama.cpp's own chatter is routed to this logger; keep it out unless asked for.
    logging.getLogger("localspec.llama_cpp").setLevel(
        logging.DEBUG if level.upper() == "DEBUG" else logging.ERROR)


def main(argv: Sequence[str] | None = None) -> int:
    parser, registered = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.log_level)
    if args.command is None:
        if "tui" not in registered:
            parser.print_help()
            return 0
        args = parser.parse_args([*(argv or []), "tui"])
    try:
        return int(args.func(args) or 0)
    except LocalspecError as exc:
        print(f"localspec: error: {exc.message}", file=sys.stderr)
        return 1
    except ValueError as exc:  # parameter validation in the library
        print(f"localspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("localspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Output piped into `head` and closed early: not an error worth a traceback.
        sys.stderr.close()
        return 0

