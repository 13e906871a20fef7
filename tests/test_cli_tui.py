"""`localspec tui` over a chat history that cannot be used: one line on stderr, never a
traceback; --reset-damaged-chats moves a damaged one aside; on a terminal the app asks first."""

from __future__ import annotations

import logging
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from localspec import paths
from localspec.chat_store import ChatStore, DamagedChatHistory
from localspec.errors import DamagedChatStoreError
from localspec.tui import RESET_HINT, open_chat_store

REPO = Path(__file__).resolve().parents[1]


def damage(db: Path) -> bytes:
    """Random bytes where the chat database is, as the tester left them."""
    db.parent.mkdir(parents=True, exist_ok=True)
    original = os.urandom(8192)
    db.write_bytes(original)
    return original


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# -- choosing the store (what open_tui does before the app starts) -----------------------------
def test_the_flag_moves_a_damaged_history_aside(caplog: pytest.LogCaptureFixture) -> None:
    db = paths.data_dir() / "chats.sqlite3"
    original = damage(db)
    wal = os.urandom(4096)
    Path(f"{db}-wal").write_bytes(wal)
    with caplog.at_level(logging.WARNING, logger="localspec.tui"):
        store = open_chat_store(reset_damaged=True, ask=False)
    assert isinstance(store, ChatStore) and store.path == db
    [aside] = [p for p in db.parent.iterdir() if re.search(r"\.damaged-[\d-]+$", p.name)]
    assert re.fullmatch(r"chats\.sqlite3\.damaged-\d{8}-\d{6}", aside.name)
    assert aside.read_bytes() == original and Path(f"{aside}-wal").read_bytes() == wal
    assert str(db) in caplog.text and str(aside) in caplog.text
    chat = store.create_chat("fresh")
    assert [c.id for c in store.list_chats()] == [chat.id]
    store.close()


def test_without_a_terminal_or_the_flag_it_is_one_line_naming_the_flag() -> None:
    db = paths.data_dir() / "chats.sqlite3"
    original = damage(db)
    with pytest.raises(DamagedChatStoreError) as caught:
        open_chat_store(reset_damaged=False, ask=False)
    assert str(caught.value) == f"{db} is damaged (file is not a database); {RESET_HINT}"
    assert "--reset-damaged-chats" in RESET_HINT
    assert db.read_bytes() == original and names(db.parent) == ["chats.sqlite3"]


def test_on_a_terminal_the_app_gets_the_question() -> None:
    db = paths.data_dir() / "chats.sqlite3"
    original = damage(db)
    history = open_chat_store(reset_damaged=False, ask=True)
    assert isinstance(history, DamagedChatHistory) and history.path == db
    assert history.store is None and db.read_bytes() == original
    healthy = open_chat_store(reset_damaged=False, ask=True, path=db.parent / "other.sqlite3")
    assert isinstance(healthy, ChatStore)
    healthy.close()


# -- the command, in a subprocess ---------------------------------------------------------------
def localspec(*args: str) -> subprocess.CompletedProcess[str]:
    # stdin is not a terminal, so the app cannot ask: the command must answer by itself.
    return subprocess.run([sys.executable, "-m", "localspec", *args], cwd=REPO,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [("tui",), ()], ids=["tui", "no-command"])
def test_a_damaged_history_is_one_stderr_line_not_a_traceback(args: tuple[str, ...]) -> None:
    db = paths.data_dir() / "chats.sqlite3"
    original = damage(db)
    proc = localspec(*args)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [
        f"localspec: error: {db} is damaged (file is not a database); {RESET_HINT}"]
    assert proc.stdout == ""
    assert db.read_bytes() == original and names(db.parent) == ["chats.sqlite3"]


@pytest.mark.parametrize("stdin", ["devnull", "closed"])
@pytest.mark.parametrize("args", [("tui",), ()], ids=["tui", "no-command"])
def test_without_a_terminal_the_app_is_one_line_not_a_hang_or_traceback(
        args: tuple[str, ...], stdin: str) -> None:
    """From a script or a service (stdin not a terminal, or closed): Textual would draw into
    the pipe for ever, or fail on the missing stdin with a traceback and exit status 0."""
    proc = subprocess.run([sys.executable, "-m", "localspec", *args], cwd=REPO,
                          stdin=subprocess.DEVNULL if stdin == "devnull" else None,
                          preexec_fn=(lambda: os.close(0)) if stdin == "closed" else None,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("localspec: error: the chat app needs a terminal"), line
    assert proc.stdout == ""


@pytest.mark.parametrize("kind", ["folder", "data-dir-is-a-file"])
def test_an_unopenable_history_is_one_stderr_line(kind: str) -> None:
    db = paths.data_dir() / "chats.sqlite3"
    if kind == "folder":
        db.mkdir(parents=True)
        expected = f"cannot open the chat history {db}: it is a folder, not a database file"
    else:
        db.parent.parent.mkdir(parents=True, exist_ok=True)
        db.parent.write_text("not a folder")
        expected = f"cannot create the folder {db.parent} for the chat history: a file is in " \
                   "the way"
    proc = localspec("tui", "--reset-damaged-chats")  # moving would not help: not offered
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [f"localspec: error: {expected}"]


# -- the command on a terminal (a pseudo-terminal) ------------------------------------------------
ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[@-Z\\-_])")


class Terminal:
    """`localspec ARGS` on a pseudo-terminal: what it draws, keys typed into it."""

    def __init__(self, *args: str) -> None:
        import fcntl
        import pty
        import struct
        import termios

        self._fd, child = pty.openpty()
        fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 36, 120, 0, 0))
        env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "36"}
        self.proc = subprocess.Popen([sys.executable, "-m", "localspec", *args], cwd=REPO,
                                     stdin=child, stdout=child, stderr=child, env=env)
        os.close(child)
        self._raw = b""

    @property
    def text(self) -> str:
        return ANSI.sub("", self._raw.decode("utf-8", "replace"))

    def _read(self, wait: float) -> bool:
        ready, _, _ = select.select([self._fd], [], [], wait)
        if not ready:
            return True
        try:
            chunk = os.read(self._fd, 65536)
        except OSError:  # EIO: the program has closed the terminal
            return False
        self._raw += chunk
        return bool(chunk)

    def wait_for(self, cond: Callable[[str], bool], timeout: float = 90) -> None:
        t0 = time.monotonic()
        while not cond(self.text):
            if time.monotonic() - t0 > timeout or not self._read(0.1):
                raise AssertionError(f"not shown (timed out or the program ended); the "
                                     f"terminal said:\n{self.text[-3000:]}")

    def type(self, keys: bytes) -> None:
        os.write(self._fd, keys)

    def finish(self, timeout: float = 60) -> int:
        """Keep reading what it draws until it exits; its exit status."""
        t0 = time.monotonic()
        while self._read(0.1) and time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None and not select.select([self._fd], [], [], 0)[0]:
                break
        return self.proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self._fd)


@pytest.fixture
def terminal() -> Iterator[Callable[..., Terminal]]:
    pytest.importorskip("pty")  # POSIX only
    started: list[Terminal] = []

    def start(*args: str) -> Terminal:
        started.append(Terminal(*args))
        return started[-1]

    yield start
    for t in started:  # a failed test must not leave the app running
        t.kill()


CTRL_Q = b"\x11"


def test_on_a_terminal_quitting_the_question_leaves_the_file(terminal: Callable[..., Terminal]
                                                             ) -> None:
    db = paths.data_dir() / "chats.sqlite3"
    original = damage(db)
    term = terminal("tui")
    term.wait_for(lambda s: "Move aside and continue" in s)
    term.type(CTRL_Q)  # quit without answering: the same as Quit
    assert term.finish() == 1
    assert "Traceback" not in term.text
    # The last thing written, after the app has given the terminal back.
    line = f"localspec: error: {db} is damaged (file is not a database); {RESET_HINT}"
    assert term.text.rstrip().endswith(line)
    assert db.read_bytes() == original and names(db.parent) == ["chats.sqlite3"]


def test_on_a_terminal_the_flag_starts_an_empty_history(terminal: Callable[..., Terminal]
                                                        ) -> None:
    db = paths.data_dir() / "chats.sqlite3"
    original = damage(db)
    term = terminal("tui", "--reset-damaged-chats")
    term.wait_for(lambda s: "no pair loaded" in s)  # the chat screen, no question
    assert "Move aside and continue" not in term.text
    term.type(CTRL_Q)
    assert term.finish() == 0
    assert "Traceback" not in term.text
    assert f"moved the damaged chat history {db}" in term.text  # left in the scrollback
    [aside] = [p for p in db.parent.iterdir() if re.search(r"\.damaged-[\d-]+$", p.name)]
    assert aside.read_bytes() == original
    store = ChatStore(db)
    assert store.list_chats() == []
    store.close()


def test_on_a_terminal_a_paste_keeps_all_its_lines(terminal: Callable[..., Terminal]) -> None:
    """A bracketed paste, as a terminal sends it, lands whole in the message box (a one-line
    input kept only its first line, silently)."""
    term = terminal("tui")
    term.wait_for(lambda s: "no pair loaded" in s)
    term.type(b"\x1b[200~first pasted line\nsecond pasted line\nthird pasted line\x1b[201~")
    term.wait_for(lambda s: "third pasted line" in s)
    assert "second pasted line" in term.text
    term.type(CTRL_Q)
    assert term.finish() == 0
    assert "Traceback" not in term.text
