"""A native crash is reported, not silent.

llama.cpp is native code: a kernel bug kills the process with a signal (SIGSEGV, SIGILL) and a
failed ``GGML_ASSERT`` with SIGABRT, and nothing in Python runs afterwards. So ``run``, ``bench``
and ``demo`` do their work in a forked child, and the parent, which loaded nothing, waits for it.
When the child dies by a signal, the parent reads what the engine was doing from the shared
activity board (``engine/activity.py``) and prints one line: the signal, the phase (loading,
prefill, drafting, verifying), the model, and where to look next.

Forking costs about a millisecond (the parent has imported only the CLI). Where ``fork`` does
not exist (Windows), the command runs in-process and a crash is the operating system's to report.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from types import FrameType

from ..engine import activity


def crash_line(signum: int, what: activity.Activity | None) -> str:
    """The one line a user sees when the child died by ``signum``."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    doing = f" while {what.describe()}" if what is not None else ""
    if signum == signal.SIGKILL:
        cause = "was killed (SIGKILL: out of memory?)"
    else:
        cause = f"crashed in native code ({name}, signal {signum})"
    return (f"localspec: error: llama.cpp {cause}{doing}; run `localspec doctor` to check this "
            "machine and include its output in a bug report")


def run_guarded(work: Callable[[], int]) -> int:
    """Run ``work`` in a forked child and return its exit status (128 + signal if it died)."""
    if not hasattr(os, "fork"):
        return work()
    board = activity.Board.anonymous()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: does the work, reports into the board
        activity.install(board)
        code = 1
        try:
            code = work()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):  # a closed pipe or a closed stream
                    pass
            os._exit(code)
    return _wait(pid, board)


def _wait(pid: int, board: activity.Board) -> int:
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
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            return 128 + signum  # asked to stop: not a crash
        print(crash_line(signum, board.read()), file=sys.stderr, flush=True)
        return 128 + signum
    return os.waitstatus_to_exitcode(status)
