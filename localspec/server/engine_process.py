"""The engine in a process of its own, supervised: what the chat app and ``serve`` talk to.

llama.cpp is native code that can still die (a kernel bug, a GGML_ASSERT, a GPU out of memory).
So, like Ollama's runners, the model is loaded by a child process that serves localspec's own
OpenAI-compatible API on a private unix socket with a random key; the chat app and ``serve`` are
its clients. When the child dies, the parent knows how (the signal, and what the engine was doing
from the shared activity board) and starts a new one; nothing else goes down with it.

The child also watches its parent: if the chat app or ``serve`` is killed, the child exits
instead of holding the model (and its VRAM) forever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ..chat_engine import EngineNotReadyError
from ..engine.activity import Activity, Board
from ..engine.llama_backend import ModelSettings
from ..errors import EngineStoppedError, LocalspecError
from ..loading import EngineSpec
from ..signals import signal_name
from .config import ServerConfig
from .engine_dirs import SOCKET_NAME, make_engine_dir

log = logging.getLogger(__name__)

KEY_ENV = "LOCALSPEC_ENGINE_KEY"

# How long a broken connection waits for the engine's exit to become visible before it is
# reported as a plain failure: the wait ends as soon as the exit is seen, and a loaded machine
# (CI, 2 cores) has been seen to take over 2 s to reap a crashed engine.
END_GRACE_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class ProcessEnd:
    """How an engine process ended."""

    returncode: int
    activity: Activity | None
    last_error: str = ""

    def describe(self) -> str:
        """``signal 11 (SIGSEGV) while verifying with target.gguf`` or ``exit code 1: ...``."""
        if self.returncode < 0:
            what = f"signal {-self.returncode} ({signal_name(-self.returncode, 'unknown')})"
        else:
            what = f"exit code {self.returncode}"
        doing = f" while {self.activity.describe()}" if self.activity else ""
        error = f": {self.last_error}" if self.last_error and self.returncode >= 0 else ""
        return f"{what}{doing}{error}"


def _spec_to_json(spec: EngineSpec) -> dict[str, Any]:
    data = dataclasses.asdict(spec)
    return data


def spec_from_json(data: dict[str, Any]) -> EngineSpec:
    ts = ModelSettings(**data["target_settings"])
    ds = ModelSettings(**data["draft_settings"]) if data.get("draft_settings") else None
    return EngineSpec(target=data["target"], draft=data.get("draft"), target_settings=ts,
                      draft_settings=ds, pair_name=data.get("pair_name"),
                      draft_mode=data.get("draft_mode", "model"), history=data.get("history"))


class EngineProcess:
    """One engine child process. ``start()`` returns once it answers (the models are loaded).
    It serves as ``options`` says, the same ServerConfig a server in this process would take,
    except for the API key: the process has a random one of its own (``key``)."""

    def __init__(self, spec: EngineSpec, options: ServerConfig,
                 log_file: Path | None = None) -> None:
        self.spec = spec
        # The key goes to the child in its environment, never on its command line.
        self.options = dataclasses.replace(options, api_key=None)
        self.key = secrets.token_urlsafe(24)
        # A short private folder: unix socket paths are limited to ~100 bytes. Making it also
        # removes the folders of engines whose owner was killed before it could (SIGKILL).
        self._dir = make_engine_dir()
        self.socket_path = str(self._dir / SOCKET_NAME)
        self._board_path = self._dir / "activity"
        self._board = Board.file(self._board_path)
        self._log_file = log_file
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr_path = self._dir / "stderr"

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout: float = 600.0) -> None:
        """Spawn the child and wait until it serves; EngineStoppedError if it dies first."""
        self._board.clear()
        spec = json.dumps({"spec": _spec_to_json(self.spec),
                           "options": self.options.to_json()})
        env = {**os.environ, KEY_ENV: self.key}
        err = self._stderr_path.open("wb")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "localspec.server.engine_child", "--socket",
                 self.socket_path, "--activity", str(self._board_path), "--config", spec,
                 "--parent", str(os.getpid()),
                 *(["--log-file", str(self._log_file)] if self._log_file else [])],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env)
        finally:
            err.close()
        try:
            self._wait_ready(timeout)
        except BaseException:  # a Ctrl-C too: a child left loading would hold the model
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(transport=httpx.HTTPTransport(uds=self.socket_path),
                          timeout=2.0) as client:
            while True:
                end = self.end()
                if end is not None:
                    raise EngineStoppedError(f"the engine process stopped while starting: "
                                             f"{end.describe()}")
                with contextlib.suppress(httpx.HTTPError):
                    health = client.get("http://engine/health")
                    status = health.json().get("status")
                    if health.status_code == 200 and status == "ok":
                        return
                    if status == "error":
                        self.stop()
                        failed = health.json()
                        raise LocalspecError(str(failed.get("error") or "load failed"),
                                             title=failed.get("title"))
                if time.monotonic() > deadline:
                    self.stop()
                    raise EngineStoppedError("the engine process did not start in time")
                time.sleep(0.05)

    def end(self) -> ProcessEnd | None:
        """How the child ended, or None while it runs."""
        if self._proc is None:
            return None
        code = self._proc.poll()
        if code is None:
            return None
        return ProcessEnd(code, self._board.read(), self._last_error())

    def _last_error(self) -> str:
        try:
            lines = self._stderr_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        errors = [ln.removeprefix("localspec: error: ") for ln in lines
                  if ln.startswith("localspec: error: ")]
        return errors[-1] if errors else ""

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def activity(self) -> Activity | None:
        """What the engine is doing right now (None: idle)."""
        return self._board.read()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the child (SIGTERM, then SIGKILL) and free its folder."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = proc  # keep the exit status readable by end()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


def watch_parent(parent: int, interval: float = 0.5) -> None:
    """In the child: exit when the parent process ``parent`` is gone (reparented), so a killed
    chat app or server never leaves a model loaded. Not the kernel's parent-death signal: that
    follows the thread that started the child, and the chat app starts engines from worker
    threads that end long before it does."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(0)

    threading.Thread(target=watch, name="localspec-parent-watch", daemon=True).start()


class ProcessChatEngine:
    """The chat app's engine: a private engine process behind the ChatEngine contract.

    A failure while streaming becomes EngineStoppedError naming how the process ended ("signal
    11 (SIGSEGV) while verifying with target.gguf"); ``restart()`` starts a fresh process on the
    same pair (the conversation lives in the app, not here)."""

    def __init__(self, spec: EngineSpec, options: ServerConfig,
                 log_file: Path | None = None) -> None:
        from ..remote import RemoteEngine

        self._process = EngineProcess(spec, options, log_file)
        try:
            self._process.start()
            self._remote = RemoteEngine("http://engine", api_key=self._process.key,
                                        uds=self._process.socket_path,
                                        where="the engine process")
        except BaseException:  # nothing returned to close: the folder goes now
            self._process.close()
            raise

    @property
    def info(self) -> Any:
        from dataclasses import replace

        return replace(self._remote.info, where="engine process")

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def end(self) -> ProcessEnd | None:
        return self._process.end()

    def activity(self) -> Activity | None:
        return self._process.activity()

    @property
    def model_pid(self) -> int | None:
        return self._process.pid

    def stopped(self) -> str | None:
        end = self._process.end()
        return f"engine stopped: {end.describe()}" if end is not None else None

    def _guarded(self, events: Any) -> Any:
        try:
            yield from events
        except EngineNotReadyError:
            raise  # not taken, nothing generated: the front end sends it again once back
        except LocalspecError as exc:
            end = self._wait_end()
            if end is not None:
                raise EngineStoppedError(f"engine stopped: {end.describe()}") from exc
            raise

    def _wait_end(self, grace: float = END_GRACE_SECONDS) -> ProcessEnd | None:
        """The process's end, if it died (a broken stream can arrive just before the exit)."""
        deadline = time.monotonic() + grace
        while (end := self._process.end()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return end

    def stream_chat(self, messages: Any, options: Any, cancel: Any = None) -> Any:
        return self._guarded(self._remote.stream_chat(messages, options, cancel))

    def stream_completion(self, prompt: str, options: Any, cancel: Any = None) -> Any:
        return self._guarded(self._remote.stream_completion(prompt, options, cancel))

    def restart(self) -> None:
        self._process.stop()
        self._process.start()

    def close(self) -> None:
        self._remote.close()
        self._process.close()
