"""Extra buffer types per weight kind: the rule on injected measurements (this machine has
AVX-512 but no AMX, so the AMX case can only be injected here), the self-test's protocol and
cache, and the real self-test and loads on this machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from localspec import doctor
from localspec.engine import repack
from localspec.engine.repack import KindTrial, Measurement

from .conftest import run_cli

MB = 1_000_000
F16_WEIGHTS = 3_000 * MB  # the 1.5B F16 pair's weights, roughly

# Injected measurements. AMX-like, from the F16 1.5B pair: on keeps a second copy of
# the weights, loads 5x slower and verifies slower.
AMX_F16 = KindTrial("F16", F16_WEIGHTS, off=Measurement(1.8, 2.47, 4_300 * MB),
                    on=Measurement(9.5, 3.80, 6_800 * MB))
# AVX2-like quantized: repacking costs load time and the touched source pages, and verifies
# twice as fast.
AVX2_Q4 = KindTrial("Q4_K_M", 8 * MB, off=Measurement(0.020, 0.008, 9 * MB),
                    on=Measurement(0.030, 0.004, 15 * MB))
SAME = KindTrial("F16", 26 * MB, off=Measurement(0.0100, 0.0050, 30 * MB),
                 on=Measurement(0.0103, 0.0049, 30 * MB + 300_000))


def test_amx_like_costs_turn_extra_buffer_types_off() -> None:
    verdict = repack.decide_kind(AMX_F16)
    assert not verdict.use_extra_bufts
    assert "+2.5 GB memory (0.8x the weights)" in verdict.reason
    assert "5.3x the load time" in verdict.reason and "1.5x the verification time" in verdict.reason


@pytest.mark.parametrize("cost", ["memory", "load", "verify"])
def test_any_one_cost_without_a_clear_gain_turns_them_off(cost: str) -> None:
    off = Measurement(0.010, 0.005, 30 * MB)
    on = {"memory": Measurement(0.010, 0.005, 50 * MB),
          "load": Measurement(0.030, 0.005, 30 * MB),
          "verify": Measurement(0.010, 0.007, 30 * MB)}[cost]
    verdict = repack.decide_kind(KindTrial("F16", 26 * MB, off=off, on=on))
    assert not verdict.use_extra_bufts
    assert {"memory": "memory", "load": "load time", "verify": "verification time"}[cost] \
        in verdict.reason


def test_a_clear_verification_gain_keeps_them_on_despite_their_costs() -> None:
    verdict = repack.decide_kind(AVX2_Q4)
    assert verdict.use_extra_bufts
    assert verdict.reason.startswith("on verifies 2.0x faster")
    assert "+6.0 MB memory" in verdict.reason and "1.5x the load time" in verdict.reason


def test_noise_sized_differences_keep_llama_cpp_s_default() -> None:
    verdict = repack.decide_kind(SAME)
    assert verdict.use_extra_bufts and "measure the same" in verdict.reason


def test_a_crash_turns_them_off_and_a_kind_never_reached_too() -> None:
    crashed = repack.decide_kind(KindTrial(crashed="SIGSEGV while decoding with a Q4_0 model"))
    assert not crashed.use_extra_bufts and "SIGSEGV" in crashed.reason
    unreached = repack.decide_kind(None, crash="SIGSEGV while decoding with a F16 model")
    assert not unreached.use_extra_bufts and "not measured" in unreached.reason
    # No measurement and no crash (a planted or hand-written verdict): llama.cpp's default.
    assert repack.decide_kind(None).use_extra_bufts


# -- the child's protocol -------------------------------------------------------------------------
def _child(*lines: str, crash: bool = False) -> list[str]:
    """A stand-in self-test child (a fake: the real one cannot be made to crash on this CPU)
    that prints ``lines`` and then, with ``crash``, dies of a real SIGSEGV."""
    code = "".join(f"print({line!r}, flush=True)\n" for line in lines)
    if crash:
        code += "import ctypes, faulthandler\nfaulthandler.disable()\nctypes.string_at(0)\n"
    return [sys.executable, "-c", code]


def _measure_lines(kind: str, trial: KindTrial) -> list[str]:
    out = []
    for setting in ("off", "on"):
        m = getattr(trial, setting)
        data = {"load_s": m.load_s, "verify_s": m.verify_s, "rss_bytes": m.rss_bytes,
                "weights_bytes": trial.weights_bytes, "model": trial.model}
        out.append(f"measure {kind} {setting} {json.dumps(data)}")
    return out


def test_a_crash_after_the_f16_measurements_keeps_their_verdict() -> None:
    result = repack.run_selftest(_child("start F16 off", "start F16 on",
                                        *_measure_lines("unquantized", AMX_F16),
                                        "start Q4_0", crash=True))
    assert result.definitive and not result.repack_works
    assert result.detail == "SIGSEGV while decoding with a Q4_0 model"
    assert result.trials["unquantized"] == AMX_F16
    unquantized, quantized = result.verdict("unquantized"), result.verdict("quantized")
    assert not unquantized.use_extra_bufts and "the load time" in unquantized.reason
    assert not quantized.use_extra_bufts and "crashes here (SIGSEGV" in quantized.reason


def test_a_crash_measuring_f16_with_them_on_turns_both_kinds_off() -> None:
    result = repack.run_selftest(_child("start F16 off", "start F16 on", crash=True))
    assert result.detail == ("SIGSEGV while decoding with a F16 model "
                             "(extra buffer types on)")
    assert "crashes here" in result.verdict("unquantized").reason
    assert "not measured" in result.verdict("quantized").reason
    assert not any(result.verdict(k).use_extra_bufts for k in repack.WEIGHT_KINDS)


def test_a_finished_self_test_decides_per_kind() -> None:
    result = repack.run_selftest(_child(*_measure_lines("unquantized", AMX_F16),
                                        "start Q4_0", "ok Q4_0",
                                        *_measure_lines("quantized", AVX2_Q4), "done"))
    assert result.repack_works and result.definitive
    assert result.detail == "Q4_0 batches decoded; F16 and Q4_K_M measured"
    assert not result.verdict("unquantized").use_extra_bufts
    assert result.verdict("quantized").use_extra_bufts


def _killed(signame: str, *lines: str) -> list[str]:
    """A stand-in child that prints ``lines`` and then dies of signal ``signame``, as if sent
    from outside (its default action, whatever handler Python installed)."""
    code = "".join(f"print({line!r}, flush=True)\n" for line in lines)
    code += "import os, signal\n"
    if signame != "SIGKILL":  # which has no handler to reset
        code += f"signal.signal(signal.{signame}, signal.SIG_DFL)\n"
    code += f"os.kill(os.getpid(), signal.{signame})\n"
    return [sys.executable, "-c", code]


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT", "SIGHUP", "SIGKILL"])
def test_a_self_test_killed_from_outside_is_measured_again(
        signame: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The OOM killer, a shutdown or Ctrl-C stopping the child says nothing about the kernels:
    the background self-test caches nothing, and the next run measures again."""
    child = _killed(signame, *_measure_lines("unquantized", AMX_F16), "start Q4_0")
    result = repack.run_selftest(child)
    assert not result.definitive
    assert signame in result.detail and "not a crash" in result.detail
    assert result.trials["unquantized"].crashed is None
    monkeypatch.setattr(repack, "selftest_command", lambda models: child)
    cache = tmp_path / "repack-selftest.json"
    repack._main(["--write-cache", str(cache), str(tmp_path / "models")])
    assert not cache.exists()


@pytest.mark.parametrize("signame", ["SIGSEGV", "SIGILL", "SIGBUS", "SIGFPE", "SIGABRT"])
def test_a_self_test_that_crashes_is_a_verdict(signame: str) -> None:
    result = repack.run_selftest(_killed(signame, "start Q4_0"))
    assert result.definitive and not result.repack_works
    assert result.detail == f"{signame} while decoding with a Q4_0 model"
    assert not result.verdict("quantized").use_extra_bufts


def test_a_cached_verdict_of_a_self_test_killed_from_outside_is_measured_again(
        tmp_path: Path) -> None:
    """What earlier versions cached when the child was killed from outside."""
    cache, key = tmp_path / "v.json", repack.build_key()
    for detail, kept in (("SIGTERM while decoding with a Q4_0 model", False),
                         ("SIGKILL while decoding with a F16 model (extra buffer types on)",
                          False),
                         ("SIGSEGV while decoding with a Q4_0 model", True)):
        trial = KindTrial(crashed=detail)
        repack.write_cached(cache, key, repack.SelfTestResult(False, detail, 1.0, True,
                                                              {"quantized": trial}))
        assert (repack.read_cached(cache, key) is not None) == kept, detail


# -- the cache ------------------------------------------------------------------------------------
def _amx_result() -> repack.SelfTestResult:
    return repack.SelfTestResult(True, "injected: AMX-like measurements", 1.5, True,
                                 {"unquantized": AMX_F16, "quantized": AVX2_Q4})


def test_the_cache_keeps_the_measurements_and_its_version(tmp_path: Path) -> None:
    cache, key = tmp_path / "v.json", repack.build_key()
    repack.write_cached(cache, key, _amx_result())
    assert json.loads(cache.read_text())["version"] == repack.SELFTEST_VERSION
    back = repack.read_cached(cache, key)
    assert back is not None and back.trials == _amx_result().trials
    assert not back.verdict("unquantized").use_extra_bufts


def test_an_older_cache_is_measured_again_and_a_newer_one_left_alone(tmp_path: Path) -> None:
    cache, key = tmp_path / "v.json", repack.build_key()
    old = {"key": key, "repack_works": True, "detail": "version 1 had no measurements",
           "seconds": 1.0, "definitive": True}
    cache.write_text(json.dumps(old))
    assert repack.read_cached(cache, key) is None  # so the self-test runs again
    calls: list[int] = []

    def run() -> repack.SelfTestResult:
        calls.append(1)
        return _amx_result()

    decision = repack.decide_auto(cache, run=run, quantized=False)
    assert calls and decision.source == "self-test" and not decision.use_extra_bufts
    assert repack.read_cached(cache, key) is not None  # rewritten in today's version
    newer = json.dumps({"version": repack.SELFTEST_VERSION + 1, "key": key, "format": "?"})
    cache.write_text(newer)
    repack.write_cached(cache, key, _amx_result())
    assert cache.read_text() == newer


def _plant(result: repack.SelfTestResult) -> None:
    """Put ``result`` in this test's home as this build's verdict (and forget the process's)."""
    repack.write_cached(repack.cache_file(), repack.build_key(), result)
    repack._decided.clear()


def test_auto_follows_the_planted_verdict_per_kind() -> None:
    _plant(_amx_result())
    f16 = repack.repack_decision("auto", quantized=False)
    assert (f16.use_extra_bufts, f16.source, f16.kind) == (False, "cached self-test",
                                                           "unquantized")
    assert f16.describe().startswith("llama.cpp's extra buffer types (repacked CPU kernels) off "
                                     "for F16/BF16/F32 weights (cached self-test: on costs")
    assert repack.repack_decision("auto", quantized=True).use_extra_bufts
    assert repack.repack_decision("on", quantized=False).use_extra_bufts  # forcing still wins
    repack._decided.clear()


def test_run_verbose_says_which_setting_and_why(target_gguf: Path) -> None:
    """The tiny F32 target (unquantized, like F16) under injected AMX-like figures."""
    _plant(_amx_result())
    proc = run_cli("run", "--target", str(target_gguf), "--draft-mode", "none", "--raw", "-n",
                   "2", "--ctx", "128", "--verbose", "hello")
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("target "))
    assert "extra buffer types (repacked CPU kernels) off for F16/BF16/F32 weights" in line
    assert "on costs +2.5 GB memory" in line
    repack._decided.clear()


def test_doctor_says_the_setting_per_kind_and_why() -> None:
    _plant(_amx_result())
    check = doctor.check_repack(doctor.LlamaBuild("x", True))
    assert check.status == "ok"
    assert "off for F16/BF16/F32 weights (on costs +2.5 GB memory" in check.summary
    assert "on for quantized weights (on verifies 2.0x faster" in check.summary
    assert check.details["extra_buffer_types"]["unquantized"]["on"] is False
    assert check.details["measurements"]["unquantized"]["on"]["rss_bytes"] == 6_800 * MB


# -- the real self-test on this machine -----------------------------------------------------------
def test_the_real_self_test_measured_both_kinds(repack_verdict: Path) -> None:
    """This session's self-test (no injected figures): both kinds were measured, the weights
    are resident after a verification with either setting (so memory growth is real), and the
    verdicts are the rule's on those figures. Which way they go is this machine's business."""
    result = repack.read_cached(repack_verdict, repack.build_key())
    assert result is not None and result.repack_works is not None
    for kind in repack.WEIGHT_KINDS:
        trial = result.trials.get(kind)
        if trial is None or trial.crashed:
            assert not result.verdict(kind).use_extra_bufts
            continue
        assert trial.on is not None and trial.off is not None
        for m in (trial.on, trial.off):
            assert m.load_s > 0 and m.verify_s > 0
            assert m.rss_bytes > trial.weights_bytes // 2, (kind, m)
        assert result.verdict(kind) == repack.decide_kind(trial)


def test_an_f16_model_runs_the_same_with_either_setting(tmp_path: Path) -> None:
    """Whichever way the rule goes for F16, both settings give the same text."""
    from localspec.models.tiny import quantized_model

    model = quantized_model(tmp_path, "F16")
    args = ["run", "--target", str(model), "--draft-mode", "none", "--raw", "-n", "6",
            "--ctx", "128", "the model"]
    on, off = run_cli(*args, "--repack", "on"), run_cli(*args, "--repack", "off")
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    assert on.stdout == off.stdout


def test_demo_measures_only_after_the_self_test_has_a_verdict(isolated_home: Path) -> None:
    # A fresh machine: no verdict yet. demo must not time anything while a background self-test
    # shares the cores, so it settles the verdict first (the real self-test, in its child).
    cache = repack.cache_file()
    cache.unlink()
    proc = run_cli("demo", "--no-tui", "--json")
    assert proc.returncode == 0, proc.stderr
    assert repack.read_cached(cache, repack.build_key()) is not None
    assert "measuring llama.cpp's extra buffer types" in proc.stderr
    again = run_cli("demo", "--no-tui", "--json")  # cached now: no second self-test
    assert again.returncode == 0 and "measuring llama.cpp" not in again.stderr
