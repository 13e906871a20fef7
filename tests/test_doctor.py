"""localspec doctor: the real checks on this (CPU-only) machine, NVML through a fake module."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from localspec import doctor
from localspec.cli import main
from localspec.config import config_path
from localspec.engine import repack
from localspec.engine.llama_devices import Device
from tests.fake_pynvml import make_fake_pynvml
from tests.ollama_helpers import build_model, write_model

REPO = Path(__file__).resolve().parents[1]
LLAMA_VERSION = importlib.metadata.version("llama-cpp-python")


def _doctor(*args: str) -> subprocess.CompletedProcess[str]:
    """``localspec doctor`` in a child, with the isolated env the autouse fixture set up."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "localspec", "doctor", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}: {proc.stderr}"
    return proc


def _checks(proc: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    data = json.loads(proc.stdout)
    assert set(data) == {"ok", "checks"}
    return {c["name"]: c for c in data["checks"]}


def test_json_on_this_machine() -> None:
    repack.cache_file().unlink()  # the isolated home starts with the session's verdict: run it
    proc = _doctor("--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["ok"] is True
    checks = _checks(proc)
    assert list(checks) == list(doctor.CHECK_NAMES)
    for check in checks.values():
        assert check["status"] in doctor.STATUSES and check["summary"]
        if check["status"] in ("warn", "fail"):
            assert check["fix"] and "\n" not in check["fix"], check
    llama = checks["llama-cpp-python"]["details"]
    assert llama["version"] == LLAMA_VERSION
    assert llama["imports"] is True
    assert llama["backend"] == "CPU"  # these machines have no GPU and a CPU-only build
    assert llama["gpu_offload"] is False
    assert "AVX" in llama["system_info"] or "NEON" in llama["system_info"]
    rep = checks["repack"]
    assert rep["details"]["definitive"] is True and rep["details"]["cached"] is False
    assert isinstance(rep["details"]["repack_works"], bool)
    # Works: ok. Crashes (as on AMX CPUs with 0.3.36): a warning, because run works around it.
    assert rep["status"] == ("ok" if rep["details"]["repack_works"] else "warn")
    assert checks["gpu"]["status"] == "info"  # no NVIDIA driver here
    assert checks["ollama"]["details"]["daemon"] is False  # OLLAMA_HOST points at port 9
    assert checks["ollama"]["status"] == "info"
    assert checks["paths"]["details"]["cache_dir"] == str(repack.cache_file().parent)


def test_second_run_reads_the_cached_self_test() -> None:
    repack.cache_file().unlink()
    first = _checks(_doctor("--json"))["repack"]
    assert first["details"]["cached"] is False
    second = _checks(_doctor("--json"))["repack"]
    assert second["details"]["cached"] is True and "cached" in second["summary"]
    assert second["details"]["repack_works"] == first["details"]["repack_works"]


def test_text_output_is_one_line_per_check_and_nothing_on_stderr() -> None:
    proc = _doctor()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""  # no traceback, no llama.cpp chatter, no logged warnings
    lines = proc.stdout.splitlines()
    tagged = [ln for ln in lines if ln.startswith("[")]
    names = [re.match(r"^\[( ok |info|warn|FAIL)\] ([\w-]+): \S", ln) for ln in tagged]
    assert all(names), tagged
    assert [m.group(2) for m in names if m] == list(doctor.CHECK_NAMES)
    for i, line in enumerate(lines):
        if line.startswith(("[warn]", "[FAIL]")):
            assert lines[i + 1].startswith("       fix: "), lines[i:i + 2]
        else:
            assert line.startswith(("[ ok ]", "[info]", "       fix: ", "doctor: ")), line
    assert lines[-1].startswith("doctor: nothing blocks `localspec run`")


def test_nvidia_gpu_with_a_cpu_only_build_names_the_cuda_rebuild() -> None:
    fake_nvml = make_fake_pynvml(gpus=1)  # a fake: these machines have no NVIDIA GPU
    build = doctor.probe_llama()  # the real, CPU-only llama.cpp build
    check = doctor.check_gpu(build, nvml=fake_nvml)
    assert check.status == "warn"
    assert "Fake GPU 0 (75.2 GB free of 85.9 GB)" in check.summary
    assert "driver 550.54.15, CUDA 12.4" in check.summary
    assert check.fix is not None and "\n" not in check.fix
    assert '-DGGML_CUDA=on' in check.fix and "--force-reinstall" in check.fix
    pip = Path(sys.executable).with_name("pip")
    assert f"{pip} install" in check.fix or f"{sys.executable} -m pip install" in check.fix
    assert check.fix.endswith(f"llama-cpp-python=={LLAMA_VERSION}")
    assert fake_nvml.calls == {"init": 1, "shutdown": 1}  # NVML is let go again


def test_without_nvcc_the_fix_says_the_cuda_toolkit_is_needed(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvcc there
    check = doctor.check_gpu(doctor.LlamaBuild(LLAMA_VERSION, True, gpu_offload=False),
                             nvml=make_fake_pynvml(gpus=1))
    assert check.status == "warn" and check.fix is not None
    assert "CUDA toolkit" in check.fix and "nvcc is not on PATH" in check.fix
    assert check.fix.index("nvcc") < check.fix.index("-DGGML_CUDA=on")


@pytest.mark.parametrize(("driver", "gpus", "backends", "offload", "status"), [
    (False, 0, (), False, "info"),  # no driver, CPU build: nothing to say
    (True, 0, (), False, "info"),  # a driver without a GPU
    (True, 1, ("CUDA",), True, "ok"),
    (True, 1, ("CUDA",), False, "warn"),  # CUDA build that finds no device
    (False, 0, ("CUDA",), False, "warn"),  # CUDA build without a driver
    (True, 1, ("Vulkan",), True, "ok"),  # Vulkan drives NVIDIA GPUs too
])
def test_gpu_check_against_the_build(driver: bool, gpus: int, backends: tuple[str, ...],
                                     offload: bool, status: str) -> None:
    build = doctor.LlamaBuild(LLAMA_VERSION, True, gpu_backends=backends, gpu_offload=offload)
    check = doctor.check_gpu(build, nvml=make_fake_pynvml(driver=driver, gpus=gpus))
    assert check.status == status, check
    assert (check.fix is not None) == (status == "warn")


def test_a_gpu_llama_cpp_lists_without_nvml_is_used_not_called_missing() -> None:
    """A CUDA build in a container without NVML, or Metal: llama.cpp lists a GPU (given as
    data: none is here) and NVML reads nothing (a fake). Doctor says llama.cpp offloads to it,
    not "no NVIDIA driver, reinstall the CPU build", and placement counts its memory."""
    gpu = Device("NVIDIA GeForce RTX 4070", 10 * 1024**3, 12 * 1024**3)
    build = doctor.LlamaBuild(LLAMA_VERSION, True, gpu_backends=("CUDA",), gpu_offload=True,
                              devices=(gpu,))
    check = doctor.check_gpu(build, nvml=make_fake_pynvml(driver=False))
    assert check.status == "ok" and check.fix is None
    assert "offloads with CUDA to NVIDIA GeForce RTX 4070 (10.7 GB free of 12.9 GB)" \
        in check.summary
    placement = doctor.check_placement(build, nvml=make_fake_pynvml(driver=False))
    assert placement.details["free_bytes"] == 10 * 1024**3
    assert placement.summary.startswith("NVIDIA GeForce RTX 4070: 10.7 GB free")


def test_a_last_pair_that_does_not_fit_names_the_settings_it_is_placed_with(
        target_gguf: Path, draft_gguf: Path) -> None:
    """The chat app's last pair is placed with config.toml's settings (there are no flags to
    give it); a fake NVML stands in for a GPU too small for even the draft's context."""
    from localspec.config import save_settings
    from localspec.models.catalogue import add_user_pair
    from localspec.options import Settings

    add_user_pair("mine", str(target_gguf), str(draft_gguf))
    save_settings(Settings(last_pair="mine", ctx=131072))
    build = doctor.LlamaBuild(LLAMA_VERSION, True, gpu_backends=("CUDA",), gpu_offload=True,
                              devices=(Device("small GPU", 700 * 1024**2, 1024**3),))
    check = doctor.check_placement(build, nvml=make_fake_pynvml(driver=False))
    assert check.status == "warn" and check.summary.startswith("mine: small GPU: ")
    assert check.fix is not None and "config.toml's [chat]" in check.fix
    assert "smaller ctx" in check.fix and "draft_gpu_layers" in check.fix


def test_a_bad_history_limit_fails_the_config_check() -> None:
    """`run` refuses such a file; doctor must not say nothing blocks it."""
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('[history]\nmax_tokens = "x"\n', encoding="utf-8")
    check = doctor.check_config()
    assert check.status == "fail" and "max_tokens" in check.summary, check
    assert str(path) in check.summary and check.fix and "config.toml" in check.fix


def test_readme_install_command_is_the_doctors() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r'^CMAKE_ARGS="-DGGML_CUDA=on" .*?(?<!\\)$', text, re.M | re.S)
    assert block, "the README's CUDA rebuild command is gone"
    readme = " ".join(block.group(0).replace("\\\n", " ").split())
    version = readme.rsplit("==", 1)[1]
    assert version == doctor.required_llama_version()
    ours = doctor.cuda_rebuild_command(version).replace(doctor.pip_command(), ".venv/bin/pip")
    assert readme == ours


def test_malformed_config_fails_naming_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('[chat]\nk = 4\nthreads = "many"\n', encoding="utf-8")
    check = doctor.check_config()
    assert check.status == "fail"
    assert str(path) in check.summary and "line 3" in check.summary
    assert "threads" in check.summary
    assert check.fix and "config.toml" in check.fix
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert f"[FAIL] config: {path}, line 3: threads must be a whole number" in out
    assert "got 'many'" in out
    assert "blocked by config" in out.splitlines()[-1]


def test_malformed_user_pairs_fail_too() -> None:
    from localspec.models.catalogue import user_pairs_path

    path = user_pairs_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('[[pair]]\nname = "mine"\n', encoding="utf-8")
    check = doctor.check_config()
    assert check.status == "fail" and str(path) in check.summary and "target" in check.summary


def test_ollama_counts_damaged_models_and_names_the_repair(tmp_path: Path) -> None:
    store = tmp_path / "ollama-models"  # OLLAMA_MODELS, from the autouse fixture
    gguf = b"GGUF" + bytes(60)  # list_store checks sizes and the magic, never loads
    write_model(store, "whole:1b", build_model(gguf))
    broken = build_model(gguf + b"other", params={"n": 2})
    write_model(store, "broken:1b", broken)
    (store / "blobs" / broken.model_layer.digest.replace(":", "-")).unlink()
    check = doctor.check_ollama()
    assert check.status == "warn"
    assert check.summary.startswith("1 model (1 damaged) in ")
    assert check.fix and "localspec pull" in check.fix and "broken:1b" in check.fix
    [details] = check.details["stores"]
    assert (details["models"], details["damaged"], details["exists"]) == (1, 1, True)


def test_a_bad_ollama_host_is_named_with_its_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OLLAMA_HOST", "127.0.0.1:abc")
    check = doctor.check_ollama()
    assert (check.status, check.summary) == ("warn", "OLLAMA_HOST=127.0.0.1:abc: not a host[:port]")
    assert check.fix and "OLLAMA_HOST" in check.fix and "report" not in check.fix


def test_selftest_flag_ignores_and_rewrites_the_cached_verdict(
        capsys: pytest.CaptureFixture[str]) -> None:
    planted = repack.SelfTestResult(True, "planted by the test", 123.0, definitive=True)
    repack.write_cached(repack.cache_file(), repack.build_key(), planted)
    assert main(["doctor", "--json"]) == 0
    cached = _checks_from(capsys.readouterr().out)["repack"]["details"]
    assert (cached["cached"], cached["detail"]) == (True, "planted by the test")
    assert main(["doctor", "--json", "--selftest"]) == 0
    fresh = _checks_from(capsys.readouterr().out)["repack"]["details"]
    assert fresh["cached"] is False and fresh["detail"] != "planted by the test"
    rewritten = repack.read_cached(repack.cache_file(), repack.build_key())
    assert rewritten is not None and rewritten.detail == fresh["detail"]


def _checks_from(stdout: str) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in json.loads(stdout)["checks"]}


def test_inconclusive_self_test_is_a_warning_and_not_cached() -> None:
    build = doctor.LlamaBuild(LLAMA_VERSION, True)
    timed_out = repack.SelfTestResult(False, "the self-test did not finish in 180 s", 180.0,
                                      definitive=False)
    repack.cache_file().unlink()
    check = doctor.check_repack(build, fresh=True, run=lambda: timed_out)
    assert check.status == "warn" and "inconclusive" in check.summary
    assert check.fix and "--selftest" in check.fix
    assert not repack.cache_file().exists()


def _fake_python(tmp_path: Path, body: str) -> str:
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\n{body}\n", encoding="utf-8")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


@pytest.mark.parametrize(("body", "says"), [
    ("kill -ILL $$", "importing llama_cpp kills Python (SIGILL)"),
    ("echo 'OSError: libcuda.so.1: cannot open shared object file' >&2; exit 1",
     "import llama_cpp failed: OSError: libcuda.so.1"),
], ids=["sigill", "import-error"])
def test_a_broken_llama_cpp_fails_with_the_reinstall(tmp_path: Path, body: str,
                                                     says: str) -> None:
    # A stand-in interpreter (named as a fake) that dies the way a broken build does.
    build = doctor.probe_llama(python=_fake_python(tmp_path, body))
    assert not build.imports
    check = doctor.check_llama(build)
    assert check.status == "fail" and says in check.summary
    assert check.fix and "--force-reinstall" in check.fix
    assert check.fix.endswith(f"llama-cpp-python=={LLAMA_VERSION}")
    assert doctor.check_repack(build).status == "info"  # no self-test on a broken build


def test_low_space_names_the_short_folders_together() -> None:
    gb = 1_000_000_000
    assert doctor.low_space({"config": 50 * gb, "data": 50 * gb, "cache": None}) is None
    assert doctor.low_space({"config": 0, "data": 0, "cache": 5 * gb}) == \
        "no space left for config, data"
    assert doctor.low_space({"config": 300_000_000, "data": 50 * gb, "cache": 300_000_000},
                            threshold=gb) == "only 300.0 MB left for config, cache"
    assert doctor.low_space({"cache": 300_000_000}, threshold=100_000_000) is None


def _full_disk(folder: Path) -> SimpleNamespace:
    """A fake disk at 100%, shaped like shutil.disk_usage's answer: no full file system can be
    made on this machine for a test."""
    return SimpleNamespace(total=64_000_000_000, used=64_000_000_000, free=0)


def test_paths_warns_with_the_free_space_from_the_measurement() -> None:
    check = doctor.check_paths()  # this machine's real disk: its figure is reported as is
    assert check.details["cache_free_bytes"] == shutil.disk_usage(
        next(p for p in repack.cache_file().parents if p.exists())).free
    full = doctor.check_paths(usage=_full_disk)
    assert full.status == "warn" and full.summary.endswith("; no space left for config, data, "
                                                           "cache")
    assert full.fix and "free some space" in full.fix and "LOCALSPEC_HOME" in full.fix
    assert full.details["data_free_bytes"] == 0


def test_doctor_on_a_full_home_says_so(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(shutil, "disk_usage", _full_disk)  # the fake full disk, for the CLI
    assert main(["doctor"]) == 0  # a warning: `run` itself still works
    out = capsys.readouterr().out.splitlines()
    line = next(ln for ln in out if " paths: " in ln)
    assert line.startswith("[warn] paths: ") and line.endswith("no space left for config, data, "
                                                               "cache")
    assert out[out.index(line) + 1].startswith("       fix: free some space there, or set "
                                               "LOCALSPEC_HOME")
