"""The engine in its own process: a native crash there takes nothing else down. serve answers
the client in flight with an error naming the cause and keeps serving; the chat app's engine
reports how it ended and restarts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from localspec.chat_engine import ChatOptions
from localspec.engine import Finished, ModelSettings, SamplingParams
from localspec.errors import EngineStoppedError, LocalspecError
from localspec.loading import EngineSpec
from localspec.server.config import ServerConfig
from localspec.server.engine_process import EngineProcess, ProcessChatEngine

HELLO = [{"role": "user", "content": "hello"}]
LONG = ChatOptions(max_tokens=3000, sampling=SamplingParams(temperature=1.0, seed=1))
GENERATING = ("verifying", "decoding", "drafting")


def _spec(target: Path, draft: Path) -> EngineSpec:
    one = ModelSettings(n_ctx=4096, n_threads=1)
    return EngineSpec(target=str(target), draft=str(draft), target_settings=one,
                      draft_settings=one, pair_name="tiny")


def test_a_crash_of_the_engine_process_is_named_and_it_restarts(
        target_gguf: Path, draft_gguf: Path) -> None:
    engine = ProcessChatEngine(_spec(target_gguf, draft_gguf), ServerConfig(model_id="tiny"))
    try:
        first = list(engine.stream_chat(HELLO, ChatOptions(max_tokens=12)))[-1]
        assert isinstance(first, Finished) and first.stats.completion_tokens == 12
        pid = engine.pid
        assert pid is not None and pid != os.getpid()
        with pytest.raises(EngineStoppedError) as stopped:
            for _event in engine.stream_chat(HELLO, LONG):
                doing = engine.activity()
                if doing is not None and doing.phase in GENERATING:
                    os.kill(pid, signal.SIGSEGV)  # as a kernel bug in llama.cpp would
        message = stopped.value.message
        assert message.startswith("engine stopped: signal 11 (SIGSEGV) while "), message
        assert any(phase in message for phase in ("verifying", "decoding", "drafting"))
        assert target_gguf.name in message or draft_gguf.name in message
        engine.restart()
        again = list(engine.stream_chat(HELLO, ChatOptions(max_tokens=12)))[-1]
        assert again.text == first.text  # greedy: the same answer from the new process
        assert engine.pid != pid
    finally:
        engine.close()


def test_a_load_failure_is_one_line(tmp_path: Path, draft_gguf: Path) -> None:
    missing = tmp_path / "gone.gguf"
    process = EngineProcess(_spec(missing, draft_gguf), ServerConfig(model_id="x"))
    try:
        with pytest.raises(Exception) as err:
            process.start(timeout=60)
        assert "gone.gguf" in str(err.value) and "\n" not in str(err.value)
    finally:
        process.close()


def test_the_engine_process_exits_with_its_parent(target_gguf: Path, draft_gguf: Path,
                                                  tmp_path: Path) -> None:
    """A killed chat app or server never leaves a model loaded."""
    code = ("import sys, time; from localspec.server.engine_process import EngineProcess; "
            "from localspec.server.config import ServerConfig; "
            "from localspec.server.engine_child import main; "
            "from tests.test_engine_process import _spec; from pathlib import Path; "
            f"p = EngineProcess(_spec(Path({str(target_gguf)!r}), Path({str(draft_gguf)!r})), "
            "ServerConfig(model_id='t')); p.start(); print(p.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).parent.parent, env={**os.environ})
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child):
            assert time.monotonic() < deadline, "the engine process outlived its parent"
            time.sleep(0.1)
    finally:
        parent.kill()


def test_an_engine_process_whose_parent_died_at_once_exits(target_gguf: Path,
                                                             draft_gguf: Path) -> None:
    """The parent killed before its engine process has even started its watch (its imports
    take a while): the process must still find it gone, not take init for its parent."""
    code = ("import os; from localspec.server.engine_process import EngineProcess; "
            "from localspec.server.config import ServerConfig; "
            "from tests.test_engine_process import _spec; from pathlib import Path\n"
            "def die(self, timeout): print(self.pid, flush=True); os._exit(0)\n"
            "EngineProcess._wait_ready = die\n"
            f"EngineProcess(_spec(Path({str(target_gguf)!r}), Path({str(draft_gguf)!r})), "
            "ServerConfig(model_id='t')).start()")
    parent = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).parent.parent, env={**os.environ}, timeout=60)
    child = int(parent.stdout)
    try:
        deadline = time.monotonic() + 30
        while _alive(child):
            assert time.monotonic() < deadline, "the engine process outlived its parent"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("failure", ["corrupt file", "ctrl-c"])
def test_a_failed_start_leaves_no_folder_and_no_process(
        failure: str, tmp_path: Path, draft_gguf: Path, target_gguf: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A chat engine that never started has nothing to close: what it made goes at once."""
    temp = Path(tempfile.mkdtemp(prefix="ls-"))  # short: a socket path has ~100 bytes
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    started: list[EngineProcess] = []
    target = target_gguf
    if failure == "corrupt file":
        target = tmp_path / "corrupt.gguf"
        target.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    else:
        def ctrl_c(self: EngineProcess, timeout: float) -> None:
            started.append(self)
            raise KeyboardInterrupt  # as it arrives while the models load

        monkeypatch.setattr(EngineProcess, "_wait_ready", ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt if failure == "ctrl-c" else LocalspecError):
            ProcessChatEngine(_spec(target, draft_gguf), ServerConfig(model_id="x"))
        assert list(temp.iterdir()) == []
        for process in started:
            assert process.end() is not None, "the engine process was left running"
    finally:
        for process in started:
            process.close()
        shutil.rmtree(temp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as fh:  # a zombie is dead too
            return fh.read().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def test_serve_survives_a_crash_of_its_engine(target_gguf: Path, draft_gguf: Path) -> None:
    """kill -SEGV of serve's engine during a stream: that client gets an error naming the cause,
    /health says restarting, and a client that connects afterwards gets an answer."""
    proc = subprocess.Popen([sys.executable, "-m", "localspec", "serve", "--target",
                             str(target_gguf), "--draft", str(draft_gguf), "--ctx", "4096",
                             "--port", "0", "--threads", "1"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        url = None
        for line in proc.stderr:
            found = re.search(r"at (http://127\.0\.0\.1:\d+)/v1 ", line)
            if found:
                url = found[1]
                break
        assert url, "serve did not announce its address"
        health = httpx.get(url + "/health").json()
        assert health["status"] == "ok" and health["restarts"] == 0
        engine_pid = health["engine_pid"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        texts: list[str] = []
        with pytest.raises(openai.APIError) as broken:
            stream = client.chat.completions.create(model=model, messages=HELLO,
                                                    max_tokens=3000, temperature=1.0, seed=2,
                                                    stream=True)
            for chunk in stream:
                texts.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
                if len(texts) == 5:
                    os.kill(engine_pid, signal.SIGSEGV)
        assert "signal 11 (SIGSEGV)" in str(broken.value), str(broken.value)
        states = set()
        deadline = time.monotonic() + 60
        while True:
            h = httpx.get(url + "/health").json()
            states.add(h["status"])
            if h["status"] == "ok" and h["restarts"] == 1:
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.05)
        assert "restarting" in states and "SIGSEGV" in h["last_stop"]
        answer = client.chat.completions.create(model=model, messages=HELLO, max_tokens=10,
                                                temperature=0)
        assert answer.usage.completion_tokens == 10
        assert proc.poll() is None  # serve itself never went down
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
        assert code >= 0, f"serve was killed by signal {-code}"
        rest = proc.stderr.read()
        assert "Traceback" not in rest
        assert not _alive(engine_pid) and not _alive(h["engine_pid"])
    finally:
        proc.kill()
        proc.wait()


def test_metrics_and_errors_pass_through_the_front(target_gguf: Path, draft_gguf: Path) -> None:
    """The front relays what the engine process answers: 400s, 404s, metrics."""
    proc = subprocess.Popen([sys.executable, "-m", "localspec", "serve", "--target",
                             str(target_gguf), "--draft", str(draft_gguf), "--ctx", "512",
                             "--port", "0", "--api-key", "secret"], stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stderr is not None
        url = next(m[1] for line in proc.stderr
                   if (m := re.search(r"at (http://127\.0\.0\.1:\d+)/v1 ", line)))
        auth = {"Authorization": "Bearer secret"}
        assert httpx.get(url + "/v1/models").status_code == 401
        bad = httpx.post(url + "/v1/completions", headers=auth,
                         json={"prompt": "x", "temperature": 3})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        nested = httpx.post(url + "/v1/completions", headers=auth, content=b"[" * 100_000)
        assert nested.status_code == 400
        surrogate = httpx.post(url + "/v1/chat/completions", headers=auth,
                               content=b'{"model": "\\ud800", "messages": []}')
        assert surrogate.status_code == 400 and surrogate.json()["error"]["param"] == "model"
        # The first generation calibrates the costs: seconds on a busy machine, past httpx's
        # default timeout of 5.
        ok = httpx.post(url + "/v1/completions", headers=auth, timeout=60,
                        json={"prompt": "the", "max_tokens": 3})
        assert ok.status_code == 200 and json.loads(ok.text)["usage"]["completion_tokens"] == 3
        metrics = httpx.get(url + "/metrics?format=json", headers=auth).json()
        assert metrics["requests_total"]["completion"] >= 2
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        proc.kill()



def test_the_chat_app_attaches_to_a_serve_of_the_same_pair(target_gguf: Path,
                                                           draft_gguf: Path) -> None:
    """With `localspec serve` already serving these files, the chat app's engine (and `run
    --url`) use it instead of loading a second copy; another pair gets its own process."""
    from localspec.open_engine import open_chat_engine
    from localspec.served_engine import ServedChatEngine

    from .conftest import run_cli

    proc = subprocess.Popen([sys.executable, "-m", "localspec", "serve", "--target",
                             str(target_gguf), "--draft", str(draft_gguf), "--ctx", "512",
                             "--port", "0", "--api-key", "k3y"], stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stderr is not None
        url = next(m[1] for line in proc.stderr
                   if (m := re.search(r"at (http://127\.0\.0\.1:\d+)/v1 ", line)))
        from localspec.server import discovery

        served = discovery.find(target_gguf, draft_gguf)
        assert served is not None and served.history == "serve"  # its own index, by default
        engine = open_chat_engine(_spec(target_gguf, draft_gguf))
        try:
            assert isinstance(engine, ServedChatEngine) and engine.attached
            assert engine.info.where == f"localspec serve at {url}"
            done = list(engine.stream_chat(HELLO, ChatOptions(max_tokens=8)))[-1]
            assert isinstance(done, Finished) and done.stats.completion_tokens == 8
        finally:
            engine.close()
        other = open_chat_engine(_spec(target_gguf, target_gguf))  # not what serve serves
        try:
            assert other.info.where == "engine process"
        finally:
            other.close()
        cli = run_cli("run", "--url", url, "--api-key", "k3y", "-n", "8", "--json", "hello")
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["text"] == done.text
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        proc.kill()
