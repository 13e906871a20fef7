"""A native crash is reported, not silent; so is any other way the work can fail.

llama.cpp is native code: a kernel bug kills the process with a signal (SIGSEGV, SIGILL) and a
failed ``GGML_ASSERT`` with SIGABRT, and nothing in Python runs afterwards. So ``run``, ``bench``
and ``demo`` do their work in a forked child, and the parent, which loaded nothing, waits for it.
When the child dies by a signal, the parent reads what the engine was doing from the shared
activity board (``engine/activity.py``), and the failed assertion's message if there was one,
and prints one line: the signal, the phase (loading, prefill, drafting, verifying), the model,
and where to look next.

The child also keeps a log (``cli.log`` in the cache folder): warnings, llama.cpp's errors, the
Python stacks at a native crash (``faulthandler``) and the traceback of any exception the command
did not turn into a user-facing error. Such an exception is one line on stderr naming the log,
and exit status 1: the child ends with ``os._exit``, which would otherwise drop it unsaid.

Forking costs about a millisecond (the parent has imported only the CLI). Where ``fork`` does
not exist (Windows), the command runs in-process and a crash is the operating system's to report.
"""

from __future__ import annotations

import faulthandler
import logging
import mmap
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TextIO

from .. import paths
from ..engine import activity
from ..signals import signal_name

LOG_NAME = "cli.log"
_LOG_MAX_BYTES = 1 << 20  # a log past this is started afresh: it holds recent runs only
# engine/llama_backend.py's ``abort_log``, by name: importing it here would load numpy.
_ABORT_LOGGER = "localspec.llama_cpp.abort"
_LAST_WORDS_SIZE = 1024


def log_path() -> Path:
    """Where guarded commands log what went wrong."""
    return paths.cache_dir() / LOG_NAME


def crash_line(signum: int, what: activity.Activity | None, reason: str | None = None,
               log: Path | None = None) -> str:
    """The one line a user sees when the child died by ``signum``: ``reason`` is llama.cpp's
    last words (a failed assertion), ``log`` the file with the details."""
    name = signal_name(signum)
    doing = f" while {what.describe()}" if what is not None else ""
    if signum == signal.SIGKILL:
        cause = "was killed (SIGKILL: out of memory?)"
    elif signum == signal.SIGBUS:
        cause = f"crashed in native code ({name}, signal {signum}: a model file changed while " \
                "in use?)"
    else:
        cause = f"crashed in native code ({name}, signal {signum})"
    said = f" ({reason})" if reason else ""
    details = f"; details in {log}" if log is not None else ""
    return (f"localspec: error: llama.cpp {cause}{doing}{said}{details}; run `localspec doctor` "
            "to check this machine and include its output in a bug report")


class _LastWords:
    """A shared buffer for one message the child writes just before it dies (forked children
    share it, like the activity board)."""

    def __init__(self) -> None:
        self._buf = mmap.mmap(-1, _LAST_WORDS_SIZE, flags=mmap.MAP_SHARED)

    def write(self, text: str) -> None:
        data = text.encode("utf-8", "replace")[:_LAST_WORDS_SIZE - 1]
        self._buf[:len(data) + 1] = data + b"\0"

    def read(self) -> str | None:
        text = bytes(self._buf).split(b"\0", 1)[0].decode("utf-8", "replace")
        return text or None


class _Remember(logging.Handler):
    def __init__(self, last_words: _LastWords) -> None:
        super().__init__(logging.CRITICAL)
        self._last_words = last_words

    def emit(self, record: logging.LogRecord) -> None:
        self._last_words.write(record.getMessage())


def _open_log() -> TextIO | None:
    """The log, for appending (started afresh when large); None where it cannot be written."""
    path = log_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        big = path.exists() and path.stat().st_size > _LOG_MAX_BYTES
        return path.open("w" if big else "a", encoding="utf-8")
    except OSError:
        return None


def _route_logs(log: TextIO | None, last_words: _LastWords) -> None:
    """In the child: log records also into the log; a native abort's message into the log and
    the last words, not onto stderr (the parent's one line carries it)."""
    aborts = logging.getLogger(_ABORT_LOGGER)
    aborts.propagate = False
    aborts.addHandler(_Remember(last_words))
    if log is None:
        return
    handler = logging.StreamHandler(log)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s pid {os.getpid()} %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    aborts.addHandler(handler)
    faulthandler.enable(file=log, all_threads=True)  # Python's stacks at a native crash


def _unexpected(exc: BaseException, log: TextIO | None) -> int:
    """One line for an exception nothing turned into a user-facing error; the traceback goes
    to the log."""
    where = "no log: the cache folder is not writable"
    if log is not None:
        try:
            log.write(f"localspec {' '.join(sys.argv[1:])}: unexpected error\n")
            log.write("".join(traceback.format_exception(exc)))
            log.flush()
            where = f"the traceback is in {log_path()}"
        except OSError:
            pass
    text = str(exc).strip().splitlines()
    detail = f": {text[0]}" if text else ""
    print(f"localspec: error: unexpected {type(exc).__name__}{detail} ({where}; please report "
          "it)", file=sys.stderr)
    return 1


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return int(exc.code or 0)
    print(f"localspec: error: {exc.code}", file=sys.stderr)
    return 1


def _child(work: Callable[[], int], last_words: _LastWords) -> int:
    log = _open_log()
    _route_logs(log, last_words)
    try:
        return work()
    except SystemExit as exc:
        return _exit_code(exc)
    except KeyboardInterrupt:
        print("localspec: interrupted", file=sys.stderr)
        return 130
    except BaseException as exc:  # anything else: one line, never a silent exit
        return _unexpected(exc, log)


def run_guarded(work: Callable[[], int]) -> int:
    """Run ``work`` in a forked child and return its exit status (128 + signal if it died)."""
    if not hasattr(os, "fork"):
        return work()
    board = activity.Board.anonymous()
    last_words = _LastWords()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: does the work, reports into the board
        activity.install(board)
        code = 1
        try:
            code = _child(work, last_words)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):  # a closed pipe or a closed stream
                    pass
            os._exit(code)
    return _wait(pid, board, last_words)


def _changed_file(what: activity.Activity | None) -> str | None:
    """After SIGBUS (a memory-mapped file shrank under llama.cpp): the file's problem now,
    if the file llama.cpp was using no longer validates."""
    if what is None or not what.model:
        return None
    from ..errors import GGUFError
    from ..gguf_meta import read_gguf_info  # deferred: only after a crash

    try:
        read_gguf_info(what.model)
    except GGUFError as exc:
        return exc.message
    return None


def _wait(pid: int, board: activity.Board, last_words: _LastWords) -> int:
    # Ctrl-C reaches both processes (one terminal process group): the child stops its work
    # and says so; the parent only waits. Termination requests are passed on.
    def forward(signum: int, _frame: FrameType | None) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    saved = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        saved[sig] = signal.signal(sig, forward)
    try:
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    if not os.WIFSIGNALED(status):
        return os.waitstatus_to_exitcode(status)
    signum = os.WTERMSIG(status)
    if signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        return 128 + signum  # asked to stop: not a crash
    what = board.read()
    if signum == signal.SIGBUS:
        problem = _changed_file(what)
        if problem is not None:  # the file's fault, not llama.cpp's: a bad-file error
            print(f"localspec: error: {problem}; it changed while llama.cpp was reading it",
                  file=sys.stderr, flush=True)
            return 1
    log = log_path()
    print(crash_line(signum, what, last_words.read(), log if log.exists() else None),
          file=sys.stderr, flush=True)
    return 128 + signum
