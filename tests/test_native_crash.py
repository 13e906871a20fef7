"""llama.cpp's native crashes: found by the repack self-test before they happen, worked around,
and, when one happens anyway, reported in one line instead of a silent death."""

from __future__ import annotations

import ctypes
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from localspec.cli.guard import crash_line, log_path, run_guarded
from localspec.engine import activity, repack

from .conftest import run_cli


def _segfault_while_verifying() -> int:
    faulthandler.disable()  # pytest's dump of the child's stack is noise here
    activity.report("verifying", "/models/target-q4_k_m.gguf")
    ctypes.string_at(0)  # a real SIGSEGV, as a kernel bug in llama.cpp would raise
    return 0  # pragma: no cover


def test_a_native_crash_is_one_line_naming_phase_model_and_signal(
        capfd: pytest.CaptureFixture[str]) -> None:
    code = run_guarded(_segfault_while_verifying)
    assert code == 128 + signal.SIGSEGV
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1] == ("localspec: error: llama.cpp crashed in native code (SIGSEGV, signal 11) "
                       f"while verifying with target-q4_k_m.gguf; details in {log_path()}; run "
                       "`localspec doctor` to check this machine and include its output in a "
                       "bug report")


def test_a_normal_exit_passes_through_and_nothing_is_printed(
        capfd: pytest.CaptureFixture[str]) -> None:
    assert run_guarded(lambda: 3) == 3
    assert capfd.readouterr().err == ""


def test_an_abort_and_an_out_of_memory_kill_are_named() -> None:
    assert "SIGABRT" in crash_line(signal.SIGABRT, activity.Activity("loading", "/m/x.gguf"))
    assert "while loading with x.gguf" in crash_line(signal.SIGABRT,
                                                     activity.Activity("loading", "/m/x.gguf"))
    assert "out of memory?" in crash_line(signal.SIGKILL, None)


# -- the repack self-test -------------------------------------------------------------------------
def _crashing_child(quant: str) -> list[str]:
    return [sys.executable, "-c", f"import ctypes; print('start {quant}', flush=True); "
            "ctypes.string_at(0)"]


def test_a_crashing_self_test_turns_repacking_off_and_is_cached(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    result = repack.run_selftest(_crashing_child("Q4_K_M"))
    assert not result.repack_works and result.definitive
    assert result.detail == "SIGSEGV while decoding with a Q4_K_M model"
    cache = tmp_path / "verdict.json"
    caplog.set_level(logging.INFO, logger="localspec.engine.repack")
    first = repack.decide_auto(cache, run=lambda: result)
    assert not first.use_extra_bufts and first.source == "self-test"
    second = repack.decide_auto(cache, run=lambda: pytest.fail("cached: must not run again"))
    assert not second.use_extra_bufts and second.source == "cached self-test"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "repacking off" in warnings[0].getMessage()  # said once


def test_a_passing_self_test_keeps_repacking(tmp_path: Path) -> None:
    ok = repack.run_selftest([sys.executable, "-c", "print('start Q4_0'); print('ok Q4_0'); "
                              "print('done')"])
    assert ok.repack_works and ok.definitive
    assert repack.decide_auto(tmp_path / "v.json", run=lambda: ok).use_extra_bufts


def test_a_stale_or_corrupt_cache_is_ignored(tmp_path: Path) -> None:
    cache = tmp_path / "v.json"
    cache.write_text("{not json")
    assert repack.read_cached(cache, repack.build_key()) is None
    cache.write_text(json.dumps({"key": "another build", "repack_works": True, "detail": "x",
                                 "seconds": 1.0, "definitive": True}))
    assert repack.read_cached(cache, repack.build_key()) is None


def test_forcing_needs_no_self_test() -> None:
    assert repack.repack_decision("on").use_extra_bufts
    assert not repack.repack_decision("off").use_extra_bufts
    assert repack.repack_decision("off", quantized=False).kind == "unquantized"


def test_the_first_run_never_waits_and_a_background_self_test_decides(
        isolated_home: Path) -> None:
    """No verdict yet for this build: repacking stays off (always safe), and a detached
    self-test writes the verdict for the next runs."""
    cache = repack.cache_file()
    cache.unlink()
    repack._started.clear()
    repack._decided.clear()
    decision = repack.repack_decision("auto")
    assert decision.source == "pending self-test" and not decision.use_extra_bufts
    deadline = time.monotonic() + 120
    while repack.read_cached(cache, repack.build_key()) is None:
        assert time.monotonic() < deadline, "the background self-test wrote no verdict"
        time.sleep(0.2)
    assert repack.repack_decision("auto").source == "cached self-test"


def test_the_verdict_matches_what_llama_cpp_does_here(repack_verdict: Path) -> None:
    """The session's real self-test, checked against a real run: where it says repacking
    crashes, forcing it on does crash (and is reported in one line); where it says repacking
    works, forcing it on runs. No hard-coded answer: this machine decides."""
    verdict = repack.read_cached(repack_verdict, repack.build_key())
    assert verdict is not None
    from localspec.models.tiny import quantized_model

    model = quantized_model(repack_verdict.parent / "models", "Q4_K_M")
    args = ["run", "--target", str(model), "--draft-mode", "none", "--raw", "-n", "8",
            "--ctx", "256", "the model"]
    off = run_cli(*args, "--repack", "off")
    assert off.returncode == 0, off.stderr
    proc = _run_unguarded_signal_ok(*args, "--repack", "on")
    if verdict.repack_works:
        assert proc.returncode == 0 and proc.stdout == off.stdout
        return
    assert proc.returncode > 128, (proc.returncode, proc.stderr)  # died, and the guard said so
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("localspec: error: llama.cpp crashed in native code (")
    assert "while processing the prompt with " + model.name in line or "while verifying" in line \
        or "while decoding" in line, line
    assert "localspec doctor" in line


def _run_unguarded_signal_ok(*args: str):  # type: ignore[no-untyped-def]
    """This one run is expected to crash inside the guarded child; the CLI itself must not."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "localspec", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ},
                          stdin=subprocess.DEVNULL)
    assert proc.returncode >= 0, f"the CLI itself died by signal {-proc.returncode}"
    return proc
