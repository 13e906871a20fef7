"""Ctrl-C stops a command promptly and cleanly (one line, exit status 130, no child left
running), and a process whose parent is gone does not keep computing."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from localspec.engine.llama_backend import LlamaRunner, ModelSettings

from .conftest import run_cli


def _ctrl_c_as_on_a_terminal() -> None:
    """For a child: SIGINT's default, whatever the runner's is. A runner started in the
    background by a shell without job control ignores SIGINT, and its children inherit that:
    Python then installs no KeyboardInterrupt handler, and no Ctrl-C could be tested."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ctrl_c_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture(autouse=True)
def _ctrl_c_raises() -> Iterator[None]:
    """The same in this process, for the in-process tests."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


class _CtrlCAt(logging.Handler):
    """Sends this process SIGINT from inside llama.cpp's log callback, at its first line that
    starts with ``prefix``: Python then raises KeyboardInterrupt in the callback, as it does
    for a real Ctrl-C that arrives while llama.cpp loads a model."""

    def __init__(self, prefix: str) -> None:
        super().__init__(logging.DEBUG)
        self.prefix = prefix
        self.sent = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.sent and record.getMessage().startswith(self.prefix):
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("during", ["llama_model_loader", "llama_context"])
def test_ctrl_c_while_llama_cpp_logs_stops_the_load(target_gguf: Path, during: str) -> None:
    """ctypes cannot pass an exception through native code: without care the interrupt is
    printed as "Exception ignored" and the command runs to its end."""
    logger = logging.getLogger("localspec.llama_cpp")
    ctrl_c, level = _CtrlCAt(during), logger.level
    logger.addHandler(ctrl_c)
    logger.setLevel(logging.DEBUG)
    try:
        with pytest.raises(KeyboardInterrupt):
            LlamaRunner(target_gguf, ModelSettings(n_ctx=256, repack="off")).close()
    finally:
        logger.removeHandler(ctrl_c)
        logger.setLevel(level)
    assert ctrl_c.sent


@pytest.mark.parametrize("call", ["decode", "decode_tree"])
def test_ctrl_c_while_a_failing_decode_logs_is_the_ctrl_c(target_gguf: Path, call: str) -> None:
    """A decode that fails after a Ctrl-C landed in its log lines raises the Ctrl-C (not the
    failure), at once, and the runner works on afterwards with no interrupt left pending."""
    logger = logging.getLogger("localspec.llama_cpp")
    ctrl_c, level = _CtrlCAt("init: invalid token"), logger.level
    with LlamaRunner(target_gguf, ModelSettings(n_ctx=256, repack="off"), branches=2) as runner:
        runner.decode([1, 2, 3])
        logger.addHandler(ctrl_c)
        logger.setLevel(logging.DEBUG)
        try:
            with pytest.raises(KeyboardInterrupt):
                if call == "decode":
                    runner.decode([runner.n_vocab + 5])
                else:
                    runner.decode_tree([4, runner.n_vocab + 5], [-1, -1])
        finally:
            logger.removeHandler(ctrl_c)
            logger.setLevel(level)
        assert ctrl_c.sent
        assert runner.tokens == [1, 2, 3]
        assert runner.decode([4]).shape == (1, runner.n_vocab)  # nothing raised late


# -- the crash guard's two processes --------------------------------------------------------------
def _long_run(target: Path, draft: Path, out: Path, err: Path, ctrl_c: bool = True
              ) -> tuple[subprocess.Popen[bytes], int]:
    """``localspec run`` generating for a minute or more, once its models are loaded and text
    flows; returns the process and its guarded child's pid. In a session of its own: a signal
    for its group reaches it alone. ``ctrl_c=False`` starts it ignoring SIGINT, as a shell
    without job control starts a job it puts in the background."""
    import psutil

    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "localspec", "run", "--target", str(target), "--draft",
             str(draft), "--repack", "off", "--ctx", "32768", "-n", "30000", "--raw", "hello"],
            stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True,
            preexec_fn=_ctrl_c_as_on_a_terminal if ctrl_c else _ctrl_c_ignored)
    deadline = time.monotonic() + 60
    while not out.stat().st_size:
        assert proc.poll() is None, err.read_text()
        assert time.monotonic() < deadline, "no text within a minute"
        time.sleep(0.05)
    children = psutil.Process(proc.pid).children()
    assert len(children) == 1
    return proc, children[0].pid


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:  # a zombie is dead too
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, seconds: float = 15) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _end(proc: subprocess.Popen[bytes], child: int) -> None:
    """Whatever the test found: nothing it started keeps running."""
    for pid in (proc.pid, child):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@linux_only
@pytest.mark.parametrize("to_group", [False, True], ids=["kill-parent", "terminal-ctrl-c"])
def test_ctrl_c_stops_the_guarded_child(target_gguf: Path, draft_gguf: Path, tmp_path: Path,
                                        to_group: bool) -> None:
    """SIGINT to the parent alone (`kill -INT`) reaches the child through the parent; a
    terminal's Ctrl-C reaches both, so the child gets it twice and must stop once: one line,
    exit status 130, no traceback, no child left."""
    err = tmp_path / "err"
    proc, child = _long_run(target_gguf, draft_gguf, tmp_path / "out", err)
    try:
        if to_group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        assert err.read_text() == "localspec: interrupted\n"
        assert _wait_gone(child)
    finally:
        _end(proc, child)


@linux_only
def test_a_run_started_ignoring_ctrl_c_keeps_running(target_gguf: Path, draft_gguf: Path,
                                                     tmp_path: Path) -> None:
    """`localspec run ... &` in a script: the shell starts it ignoring SIGINT, so a Ctrl-C
    meant for the script's foreground job must not stop it, in either of its processes."""
    out, err = tmp_path / "out", tmp_path / "err"
    proc, child = _long_run(target_gguf, draft_gguf, out, err, ctrl_c=False)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        written = out.stat().st_size
        deadline = time.monotonic() + 30
        while out.stat().st_size == written:  # text still flows after the Ctrl-C
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, "no text after the Ctrl-C"
            time.sleep(0.05)
        assert proc.poll() is None and _alive(child)
        assert "interrupted" not in err.read_text()
    finally:
        _end(proc, child)


@linux_only
def test_the_guarded_child_dies_with_its_parent(target_gguf: Path, draft_gguf: Path,
                                                tmp_path: Path) -> None:
    """`kill -9` of the parent leaves no child computing for nobody."""
    proc, child = _long_run(target_gguf, draft_gguf, tmp_path / "out", tmp_path / "err")
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _wait_gone(child), "the guarded child outlived its parent"
    finally:
        _end(proc, child)


# -- before a command runs, and the machine's errors -----------------------------------------------
def test_ctrl_c_while_the_arguments_are_parsed_is_one_line() -> None:
    """Parsing imports the command modules (a fraction of a second): a Ctrl-C then is said like
    any other, not with a traceback. The SIGINT is sent as the `run` module is imported."""
    code = ("import importlib, os, signal, sys\n"
            "import localspec.cli as cli\n"
            "real = importlib.import_module\n"
            "def ctrl_c(name, package=None):\n"
            "    if name == '.run':\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "    return real(name, package)\n"
            "importlib.import_module = ctrl_c\n"
            "sys.exit(cli.main())\n")
    proc = subprocess.run([sys.executable, "-c", code, "run", "--target", "x.gguf", "hello"],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                          preexec_fn=_ctrl_c_as_on_a_terminal)
    assert (proc.returncode, proc.stderr) == (130, "localspec: interrupted\n")


def test_a_home_that_is_a_file_is_one_plain_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.write_text("not a folder")
    proc = run_cli("demo", "--no-tui", "--json", env={**os.environ, "LOCALSPEC_HOME": str(home)})
    assert proc.returncode == 1
    assert proc.stderr.startswith("localspec: error: not a directory: " + str(home))
    assert proc.stderr.count("\n") == 1 and "report" not in proc.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("guarded", [True, False], ids=["run", "list"])
def test_a_full_disk_under_the_output_is_one_plain_line(target_gguf: Path, guarded: bool) -> None:
    args = (["run", "--target", str(target_gguf), "--draft-mode", "none", "--repack", "off",
             "-n", "4", "--raw", "hello"] if guarded else ["list", "--json"])
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "localspec", *args], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
    assert (proc.returncode, proc.stderr) == (1, "localspec: error: no space left on device\n")
