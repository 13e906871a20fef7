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

The two processes are one command: a signal that asks the parent to stop (Ctrl-C, SIGTERM,
SIGHUP) is passed on to the child, and the child dies with its parent, even a parent killed by
SIGKILL, rather than compute for nobody. A signal the command was started ignoring (SIGINT
for a job a shell without job control put in the background, SIGHUP under ``nohup``) stays
ignored in both: that is what whoever started it asked for.

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
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TextIO

from .. import paths
from ..engine import activity
from ..formatting import printable
from ..signals import signal_name

LOG_NAME = "cli.log"
_LOG_MAX_BYTES = 1 << 20  # a log past this is started afresh: it holds recent runs only
# engine/llama_backend.py's ``abort_log``, by name: importing it here would load numpy.
_ABORT_LOGGER = "localspec.llama_cpp.abort"
_LAST_WORDS_SIZE = 1024
# The signals the parent passes on to the child. Blocked across the fork, so none arrives before
# each process has its own handlers.
_PASSED_ON = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PARENT_POLL_SECONDS = 0.5  # where the kernel cannot signal the parent's death: how often to look
# A SIGINT this soon after the one that stopped the child is that one's twin (see _StopOnce).
_TWIN_SECONDS = 1.0


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
    said = f" ({printable(reason)})" if reason else ""
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
    to the log. An OSError that is the machine's (a full disk, a file where a folder should be)
    is no bug: it is said as the system says it, and nothing asks for a report."""
    from . import environment_error

    said = environment_error(exc)
    if said is not None:
        print(f"localspec: error: {printable(said)}", file=sys.stderr)
        return 1
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
    detail = f": {printable(text[0])}" if text else ""
    print(f"localspec: error: unexpected {type(exc).__name__}{detail} ({where}; please report "
          "it)", file=sys.stderr)
    return 1


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return int(exc.code or 0)
    print(f"localspec: error: {exc.code}", file=sys.stderr)
    return 1


def _child(work: Callable[[], int], last_words: _LastWords,
           mask: set[int | signal.Signals]) -> int:
    log = None
    try:
        # Unblocked here, where a Ctrl-C that came meanwhile is said like any other.
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        log = _open_log()
        _route_logs(log, last_words)
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
    parent = os.getpid()
    # The kernel's parent-death signal follows the thread that forked: only the main thread
    # lives as long as the parent.
    on_main = threading.current_thread() is threading.main_thread()
    ignored = _ignored(_PASSED_ON)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _PASSED_ON)
    try:
        pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    if pid == 0:  # the child: does the work, reports into the board
        code = 1
        try:
            if signal.SIGINT not in ignored:
                signal.signal(signal.SIGINT, _StopOnce())
            _die_with_parent(parent, on_main)
            activity.install(board)
            code = _child(work, last_words, mask)
        finally:
            # Stopping now: a Ctrl-C here would escape os._exit and run the parent's code on.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            os._exit(_flush_output(code))
    return _wait(pid, board, last_words, mask, _PASSED_ON - ignored)


def _ignored(signals: frozenset[signal.Signals]) -> frozenset[signal.Signals]:
    """Those of ``signals`` this process was started ignoring."""
    return frozenset(sig for sig in signals if signal.getsignal(sig) is signal.SIG_IGN)


class _StopOnce:
    """The child's SIGINT handler: KeyboardInterrupt, once per Ctrl-C. A Ctrl-C at the terminal
    reaches the child twice, from the terminal and passed on by the parent (which cannot tell
    it from a ``kill -INT`` of the parent alone); the twin, a moment later, must not cut short
    the stopping the first began. A Ctrl-C pressed again later interrupts again, as usual."""

    def __init__(self) -> None:
        self._last: float | None = None

    def __call__(self, _signum: int, _frame: FrameType | None) -> None:
        now = time.monotonic()
        if self._last is not None and now - self._last < _TWIN_SECONDS:
            return
        self._last = now
        raise KeyboardInterrupt


def _flush_output(code: int) -> int:
    """In the child, before os._exit (which drops unflushed output): flush stdout and stderr.
    Output that cannot be written (a full disk) fails a run that succeeded; a reader that
    closed the pipe early (``| head``) does not."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:
            pass
        except ValueError:  # a closed stream
            pass
        except OSError as exc:
            if stream is sys.stdout and code == 0:
                from . import environment_error

                print(f"localspec: error: cannot write the output: "
                      f"{environment_error(exc) or exc}", file=sys.stderr, flush=True)
                code = 1
    return code


def _die_with_parent(parent: int, on_main: bool) -> None:
    """In the child: end when the parent does, even one killed by SIGKILL (nothing else
    would stop the child: it would compute on for nobody, holding the model's memory)."""
    if not (on_main and _parent_death_signal(signal.SIGKILL)):
        _watch_parent(parent)
    if os.getppid() != parent:  # gone before the kernel was asked to tell
        os._exit(1)


def _parent_death_signal(signum: int) -> bool:
    """Linux: have the kernel send this process ``signum`` when its parent exits. False
    where that cannot be had."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # deferred: the child alone needs it

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # prctl is variadic: its arguments are unsigned longs, passed as such.
        return int(libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signum), ctypes.c_ulong(0),
                              ctypes.c_ulong(0), ctypes.c_ulong(0))) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int) -> None:
    """Elsewhere: a thread that ends the process once its parent is gone (it is adopted)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="localspec-parent-watch", daemon=True).start()


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


def _wait(pid: int, board: activity.Board, last_words: _LastWords,
          mask: set[int | signal.Signals], passed_on: frozenset[signal.Signals]) -> int:
    # The child stops its work and says so; the parent only waits. What asks the parent to
    # stop is passed on: Ctrl-C too, which reaches the child twice when the terminal sent it to
    # both (the child takes the first), and once when a `kill -INT` named the parent alone.
    def forward(signum: int, _frame: FrameType | None) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    saved = {sig: signal.signal(sig, forward) for sig in passed_on}
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
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
            print(f"localspec: error: {printable(problem)}; it changed while llama.cpp was "
                  "reading it", file=sys.stderr, flush=True)
            return 1
    log = log_path()
    print(crash_line(signum, what, last_words.read(), log if log.exists() else None),
          file=sys.stderr, flush=True)
    return 128 + signum
