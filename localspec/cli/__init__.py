"""The ``localspec`` command. Each subcommand lives in its own module with ``register(sub)``.

Subcommand modules import heavy libraries (llama_cpp, textual) inside their ``run`` functions, so
``localspec --help`` and argument errors stay instant. Options may come before or after a
subcommand's positional arguments (``localspec run PAIR -n 8 "prompt"``), and every usage error
is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ..errors import LocalspecError

# Order is the order shown in --help.
SUBCOMMANDS = ("run", "demo", "bench", "inspect", "pull", "list", "suggest", "pair", "serve",
               "history", "doctor", "tui")
# OSErrors that describe this machine, not a bug: a full disk, a read-only or unreadable folder,
# a file where a folder should be. Said in one line, as the system says it.
_ENVIRONMENT_ERRNOS = frozenset({
    errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EACCES, errno.EPERM, errno.EROFS,
    errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP, errno.EMFILE,
    errno.ENFILE, errno.EPIPE})
# Commands whose native crashes (llama.cpp dying by a signal) are reported by a supervising
# parent process; the chat app and the server supervise their engine process themselves.
GUARDED = ("run", "bench", "demo")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line (the usage text is one --help away) and no
    abbreviated options: argparse would read ``--k 3`` as ``--k-max 3`` and run auto without
    a word, where the user meant a fixed K (``-k``/``--draft-k``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"localspec: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> tuple[Parser, list[str], dict[str, argparse.ArgumentParser]]:
    from .. import __version__

    parser = Parser(
        prog="localspec",
        description="Speculative decoding for local LLMs: a small draft model proposes, the large "
                    "target verifies, the output is the target's. With no command, opens the chat "
                    "app.",
    )
    parser.add_argument("--version", action="version", version=f"localspec {__version__}")
    parser.add_argument("--log-level", default=_log_level_from_env(parser),
                        type=str.upper, choices=_LOG_LEVELS,
                        help="logging level for diagnostics on stderr (default WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    registered: list[str] = []
    for name in SUBCOMMANDS:
        module = importlib.import_module(f".{name}", __name__)
        module.register(sub)
        registered.append(name)
    return parser, registered, dict(sub.choices)


def _command_index(argv: Sequence[str], commands: Sequence[str]) -> int | None:
    """Where the subcommand is in ``argv`` (after the global options), if there is one."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--log-level":
            i += 2
        elif arg.startswith("-"):
            i += 1
        else:
            return i if arg in commands else None
    return None


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser, registered, subparsers = build_parser()
    at = _command_index(argv, registered)
    if at is None:
        return parser.parse_args(argv)
    args = parser.parse_args(argv[:at])
    sub = subparsers[argv[at]]
    try:
        # Options anywhere among the positionals, as users expect of every modern CLI.
        rest = sub.parse_intermixed_args(argv[at + 1:])
    except TypeError:  # a subcommand with its own subcommands (pair add|remove)
        rest = sub.parse_args(argv[at + 1:])
    for key, value in vars(rest).items():
        setattr(args, key, value)
    args.command = argv[at]
    return args


def _log_level_from_env(parser: Parser) -> str:
    """``LOCALSPEC_LOG``, the default of ``--log-level``. argparse checks no default against
    the choices, so a value it would refuse on the command line is refused here, in one line."""
    value = os.environ.get("LOCALSPEC_LOG", "").strip() or "WARNING"
    if value.upper() not in _LOG_LEVELS:
        parser.error(f"LOCALSPEC_LOG must be one of {', '.join(_LOG_LEVELS).lower()}, "
                     f"got {value!r}")
    return value.upper()


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    # llama.cpp's own chatter is routed to this logger; keep it out unless asked for. Its error
    # lines too at the default level: what they say (why a load failed) is in localspec's one
    # line, which they would otherwise precede; --log-level info shows them.
    upper = level.upper()
    logging.getLogger("localspec.llama_cpp").setLevel(
        logging.DEBUG if upper == "DEBUG" else logging.ERROR if upper == "INFO"
        else logging.CRITICAL)


def environment_error(exc: BaseException) -> str | None:
    """The one line for an OSError that is the machine's (``no space left on device``,
    ``not a directory: /home/me/.localspec/cache``), None for any other exception."""
    if not isinstance(exc, OSError) or exc.errno not in _ENVIRONMENT_ERRNOS:
        return None
    reason = exc.strerror or os.strerror(exc.errno)
    line = reason[:1].lower() + reason[1:]
    names = [str(name) for name in (exc.filename, exc.filename2) if name is not None]
    return f"{line}: {' -> '.join(names)}" if names else line


def _dispatch(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except LocalspecError as exc:
        _error(exc.message)
        return int(getattr(exc, "exit_code", 1))
    except ValueError as exc:  # parameter validation in the library
        _error(str(exc))
        return 2
    except KeyboardInterrupt:
        print("localspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Output piped into `head` and closed early: not an error worth a traceback.
        sys.stderr.close()
        return 0
    except OSError as exc:
        line = environment_error(exc)
        if line is None:
            raise  # a bug: the guard, or Python, shows it with its traceback
        _error(line)
        return 1


def _error(message: str) -> None:
    """One line, whatever a model file or llama.cpp put into the message (a newline, a
    terminal escape)."""
    from ..formatting import printable

    print(f"localspec: error: {printable(message)}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """The program (``argv`` None: the command line), or one command in this process
    (``main(["run", ...])``, for embedding): only the program runs its models under the crash
    guard, which needs a process of its own to survive llama.cpp's death."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C before a command runs: parsing imports the command modules, a fraction of a
        # second in which it lands here, not in _dispatch.
        print("localspec: interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    as_program = argv is None
    # Not list(): importing the `list` subcommand rebinds that name in this package.
    argv = [*(sys.argv[1:] if argv is None else argv)]
    args = parse(argv)
    _setup_logging(args.log_level)
    if args.command is None:
        args = parse([*argv, "tui"])
    if as_program and args.command in GUARDED:
        from .guard import run_guarded

        return run_guarded(lambda: _dispatch(args))
    return _dispatch(args)
