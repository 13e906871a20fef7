"""`localspec serve` starting and stopping: a file llama.cpp refuses ends serve with one line
(no restart loop), SIGTERM ends each stream in flight with an error event and exits 0, and the
engine folder of a front killed with SIGKILL is removed at the next start, never a live one."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from localspec.engine import ModelSettings
from localspec.loading import EngineSpec
from localspec.models.tiny import build_demo_pair
from localspec.server.config import ServerConfig
from localspec.server.engine_process import EngineProcess

from .conftest import assert_no_signal

ROOT = Path(__file__).parent.parent
SERVING = re.compile(r"at (http://127\.0\.0\.1:\d+)/v1 ")


def _serve(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "localspec", "serve", "--port", "0", *args],
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _serving_url(proc: subprocess.Popen[str]) -> str:
    assert proc.stderr is not None
    for line in proc.stderr:  # ends (EOF) if serve exits
        if found := SERVING.search(line):
            return found[1]
    raise AssertionError(f"serve exited ({proc.wait()}) without serving")


def _engine_dir(engine_pid: int) -> Path:
    """The private folder of an engine process (its --socket lives there)."""
    cmdline = psutil.Process(engine_pid).cmdline()
    return Path(cmdline[cmdline.index("--socket") + 1]).parent


def _gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def slow_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The demo pair (8 layers of 256): thousands of tokens take seconds, so a stream is still
    in flight when serve is told to stop."""
    return build_demo_pair(tmp_path_factory.mktemp("demo"))


def _unloadable(source: Path, dest: Path) -> Path:
    """A copy of ``source`` that llama.cpp refuses: a required tensor renamed. Its metadata
    and tensor layout are untouched (same length), so localspec's own checks pass it."""
    data = source.read_bytes()
    assert data.count(b"output_norm.weight") == 1
    dest.write_bytes(data.replace(b"output_norm.weight", b"output_norx.weight"))
    return dest


def test_serve_gives_up_when_the_first_load_fails(target_gguf: Path, tmp_path: Path) -> None:
    """A file that can never load is not retried every 5 s forever: serve names its port (the
    address was bound first), then ends with one error line and exit status 1."""
    bad = _unloadable(target_gguf, tmp_path / "refused.gguf")
    proc = subprocess.run([sys.executable, "-m", "localspec", "serve", "--target", str(bad),
                           "--port", "0"], capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert_no_signal(proc.returncode, "serve", proc.stderr)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 2, lines  # no traceback, no retry messages
    assert re.fullmatch(r"localspec: loading .* \(listening on http://127\.0\.0\.1:[1-9]\d*\) "
                        r"\.\.\.", lines[0]), lines
    assert lines[1].startswith("localspec: error: ") and "refused.gguf" in lines[1], lines
    assert "llama.cpp" in lines[1], lines  # refused by llama.cpp, not by localspec's checks
    # With its reason (the first error llama.cpp logged, not its last "failed to load model").
    assert "tensor 'output_norm.weight' not found" in lines[1], lines


def test_run_names_why_llama_cpp_refused_a_file_in_one_line(target_gguf: Path,
                                                            tmp_path: Path) -> None:
    bad = _unloadable(target_gguf, tmp_path / "refused.gguf")
    proc = subprocess.run([sys.executable, "-m", "localspec", "run", "--target", str(bad),
                           "-n", "2", "hi"], capture_output=True, text=True, timeout=90,
                          cwd=ROOT, stdin=subprocess.DEVNULL)
    assert_no_signal(proc.returncode, "run", proc.stderr)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"localspec: error: {bad}: llama.cpp could not load it (check_tensor_dims: tensor "
        "'output_norm.weight' not found)"]


def _wait_until_queued(url: str, seconds: float = 30) -> None:
    """Until a request waits for the engine (a fixed sleep lost the race on a busy machine)."""
    deadline = time.monotonic() + seconds
    while httpx.get(url + "/health").json().get("queue_waiting", 0) < 1:
        assert time.monotonic() < deadline, "the second request never reached the queue"
        time.sleep(0.02)


def test_sigterm_ends_each_request_in_flight_and_exits_0(slow_pair: tuple[Path, Path]) -> None:
    """What systemd and docker send: the stream in flight ends with an error event and [DONE]
    (not cut off after a graceful-shutdown timeout), a request waiting behind it gets a 503,
    the engine process and its folder are gone, and serve exits 0 with no traceback."""
    target, draft = slow_pair
    proc = _serve("--target", str(target), "--draft", str(draft), "--ctx", "4096",
                  "--threads", "1")
    try:
        url = _serving_url(proc)
        engine_pid = httpx.get(url + "/health").json()["engine_pid"]
        folder = _engine_dir(engine_pid)
        waiting: dict[str, httpx.Response] = {}

        def wait_behind() -> None:  # queued behind the stream, not streamed
            waiting["answer"] = httpx.post(url + "/v1/completions", timeout=60, json={
                "prompt": "the", "max_tokens": 3000, "temperature": 1.0})

        lines: list[str] = []
        behind = threading.Thread(target=wait_behind)
        body = {"messages": [{"role": "user", "content": "a long story"}], "max_tokens": 3500,
                "temperature": 1.0, "seed": 1, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in filter(None, r.iter_lines()):
                lines.append(line)
                if len(lines) == 5:
                    behind.start()
                    _wait_until_queued(url)  # it reaches the engine's queue
                    proc.send_signal(signal.SIGTERM)
        behind.join(60)
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "shutting_down" and "shutting down" in error["message"]
        assert not any('"finish_reason":"length"' in ln for ln in lines)  # it was stopped
        answer = waiting["answer"]
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "shutting_down"
        assert proc.wait(30) == 0
        assert proc.stderr is not None
        rest = proc.stderr.read()
        assert "Traceback" not in rest and "CancelledError" not in rest, rest
        assert _gone(engine_pid) and not folder.exists()
    finally:
        proc.kill()
        proc.wait()


def test_a_client_that_leaves_frees_the_engine(slow_pair: tuple[Path, Path]) -> None:
    """Through the front: a streamed client that closes its connection, and a non-streamed
    one that times out (an SDK's timeout, before its retry), each cancel their generation
    rather than leaving the engine generating thousands of tokens for no one."""
    target, draft = slow_pair
    proc = _serve("--target", str(target), "--draft", str(draft), "--ctx", "4096",
                  "--threads", "1")
    try:
        url = _serving_url(proc)
        body = {"prompt": "the", "max_tokens": 3500, "temperature": 1.0}
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          timeout=60) as r:
            for n, _ in enumerate(filter(None, r.iter_lines())):
                if n == 5:
                    break  # the connection closes with the block
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=1.0)

        def finished() -> dict[str, int]:
            metrics = httpx.get(url + "/metrics?format=json").json()
            return metrics["requests_finished_total"]  # type: ignore[no-any-return]

        deadline = time.monotonic() + 30
        while sum(finished().values()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert finished() == {"cancelled": 2}
    finally:
        proc.kill()
        proc.wait()


def test_the_front_answers_in_openais_shape(target_gguf: Path) -> None:
    """What no route takes is an OpenAI error body, on the front as on the engine; the SDKs'
    models.retrieve finds the model by any of its names; a relayed answer has one date and one
    server header, not the engine's beside the front's."""
    import openai

    proc = _serve("--target", str(target_gguf), "--ctx", "256", "--threads", "1",
                  "--model-name", "tiny-model")
    try:
        url = _serving_url(proc)
        for method, path, status in (("GET", "/v2/anything", 404), ("PUT", "/health", 405),
                                     ("PUT", "/v1/models", 405),
                                     ("GET", "/v1/models/nothing-here", 404)):
            r = httpx.request(method, url + path)
            assert r.status_code == status, (method, path, r.text)
            assert r.json()["error"]["message"], (method, path)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        assert client.models.retrieve("tiny-model").id == "tiny-model"
        assert client.models.retrieve(target_gguf.name).id == "tiny-model"  # an alias
        r = httpx.get(url + "/v1/models")
        assert len(r.headers.get_list("date")) == 1 and len(r.headers.get_list("server")) == 1
    finally:
        proc.kill()
        proc.wait()


def _spec(target: Path) -> EngineSpec:
    return EngineSpec(target=str(target), target_settings=ModelSettings(n_ctx=256))


def test_the_folder_of_a_killed_front_is_removed_at_the_next_start(
        target_gguf: Path, draft_gguf: Path) -> None:
    """SIGKILL gives serve no chance to remove its engine's folder; the next engine started on
    this machine does, and leaves the folder of a process that still runs."""
    proc = _serve("--target", str(target_gguf), "--draft", str(draft_gguf), "--ctx", "256")
    live = subprocess.Popen(  # another front holding an engine folder (no model needed)
        [sys.executable, "-c",
         "import time; from tests.test_serve_lifecycle import _spec; from pathlib import Path; "
         "from localspec.server.engine_process import EngineProcess; "
         "from localspec.server.config import ServerConfig; "
         f"p = EngineProcess(_spec(Path({str(target_gguf)!r})), ServerConfig(model_id='x')); "
         "print(p.socket_path, flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        url = _serving_url(proc)
        engine_pid = httpx.get(url + "/health").json()["engine_pid"]
        killed = _engine_dir(engine_pid)
        assert live.stdout is not None
        kept = Path(live.stdout.readline().strip()).parent
        assert kept.is_dir()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _gone(engine_pid)  # the engine follows its parent
        assert killed.is_dir()  # nobody removed it
        engine = EngineProcess(_spec(target_gguf), ServerConfig(model_id="x"))
        try:
            assert not killed.exists()
            assert kept.is_dir() and live.poll() is None
        finally:
            engine.close()
    finally:
        for p in (proc, live):
            p.kill()
            p.wait()
