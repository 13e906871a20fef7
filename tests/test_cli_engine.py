"""The CLI over the engine: run, bench, demo, inspect; bad input is one line and a non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from localspec.cli import main

from .conftest import run_cli


def test_run_streams_text_and_stats(target_gguf: Path, draft_gguf: Path) -> None:
    proc = run_cli("run", "--target", str(target_gguf), "--draft", str(draft_gguf), "-n", "30",
                "--verbose", "--ctx", "512", "hello model")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "30 tokens in" in proc.stderr and "accepted" in proc.stderr
    assert "llama_" not in proc.stderr  # llama.cpp's own logging stays out


def test_run_json_matches_plain_decoding(target_gguf: Path, draft_gguf: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    base = ["run", "--target", str(target_gguf), "--ctx", "512", "-n", "25", "--json",
            "--raw", "import data from the list"]
    assert main([*base, "--draft", str(draft_gguf), "-k", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert main([*base, "--draft-mode", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert spec["text"] == plain["text"]
    assert spec["stats"]["completion_tokens"] == 25
    assert spec["stats"]["drafted"] > 0 and plain["stats"]["drafted"] == 0


def test_run_prompt_from_stdin(target_gguf: Path) -> None:
    proc = run_cli("run", "--target", str(target_gguf), "--draft-mode", "lookup", "-n", "5",
                "--ctx", "256", "--json", stdin="a prompt on stdin")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stats"]["prompt_tokens"] > 3


def test_text_piped_beside_the_words_goes_before_them(target_gguf: Path) -> None:
    """`cat notes.md | localspec run PAIR "summarise this"`: the piped text is part of the
    prompt, not dropped because words were given too."""
    from localspec.engine import ModelSettings, SpeculativeEngine

    base = ("run", "--target", str(target_gguf), "--draft-mode", "none", "-n", "1",
            "--ctx", "256", "--raw", "--json")
    both = run_cli(*base, "summarise this", stdin="the notes\n")
    alone = run_cli(*base, "summarise this")  # stdin: nothing (the tests' /dev/null)
    assert both.returncode == alone.returncode == 0, both.stderr + alone.stderr
    with SpeculativeEngine.load(target_gguf, None, ModelSettings(n_ctx=256)) as engine:
        want = len(engine.tokenize("the notes\n\nsummarise this", chat=False))
        words = len(engine.tokenize("summarise this", chat=False))
    assert json.loads(both.stdout)["stats"]["prompt_tokens"] == want
    assert json.loads(alone.stdout)["stats"]["prompt_tokens"] == words
    # Text that comes slowly (a command still working) is waited for, and the wait is said.
    proc = subprocess.Popen([sys.executable, "-m", "localspec", *base, "summarise this"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    said = proc.stderr.readline()  # nothing else comes on stderr before the text does
    assert said.startswith("localspec: waiting for the text on stdin"), said
    out, err = proc.communicate("the notes\n", timeout=120)
    assert proc.returncode == 0, err
    assert json.loads(out)["stats"]["prompt_tokens"] == want


def test_bench_json_has_speedup_and_identity(target_gguf: Path, draft_gguf: Path,
                                             tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    pf = tmp_path / "p.txt"
    pf.write_text("print the value of the list\nand return it")
    assert main(["bench", "--target", str(target_gguf), "--draft", str(draft_gguf), "--ctx",
                 "512", "-n", "40", "--prompt", "the model", "--prompt-file", str(pf),
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert isinstance(result["speedup"], float) and result["speedup"] > 0
    assert result["all_identical"] is True
    assert [p["name"] for p in result["prompts"]] == ["prompt1", str(pf)]
    for p in result["prompts"]:
        assert p["identical"] and p["tokens"] == 40
        assert p["plain_tokens_per_second"] > 0 and p["spec_tokens_per_second"] > 0
        # Every pass yields at least its own token; the drafters' counts add up.
        assert p["tokens_per_target_pass"] >= 1.0
        assert p["host_ms_per_draft_token"] >= 0.0
        drafted = sum(d["drafted"] for d in p["drafters"].values())
        assert all(d["accepted"] <= d["drafted"] for d in p["drafters"].values())
        assert (p["mean_tree_size"] > 0) == (drafted > 0)
    assert result["tree"] is True and result["history"] is False


def test_bench_history_on_drafts_only_from_earlier_prompts(
        target_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With the history on, a prompt's repeats never draft from each other: the first asking
    drafts nothing from the history, the same text asked next drafts from its answer."""
    text = "the model of the list"
    assert main(["bench", "--target", str(target_gguf), "--ctx", "512", "-n", "32",
                 "--draft-mode", "history", "--draft-k", "8", "--history", "on",
                 "--repeats", "2", "--baseline", "engine", "--prompt", text, "--prompt", text,
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["history"] is True and result["all_identical"] is True
    first, second = result["prompts"]
    assert first["drafters"].get("history", {}).get("drafted", 0) == 0, first["drafters"]
    assert second["drafters"]["history"]["accepted"] >= 32, second["drafters"]


def test_bench_sweep_reports_auto_against_each_fixed_k(
        target_gguf: Path, draft_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "--target", str(target_gguf), "--draft", str(draft_gguf), "--ctx", "512",
            "-n", "16", "--prompt", "the model", "--repeats", "2", "--sweep-k", "1,3"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    sweep = result["prompts"][0]["sweep"]
    assert set(sweep["tokens_per_second"]) == {"K=1", "K=3"}
    assert sweep["best"] in ("K=1", "K=3") and len(sweep["auto_vs_best_runs"]) == 2
    assert set(result["sweep"]["auto_vs_each_k_overall"]) == {"K=1", "K=3"}
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "auto vs the best fixed K in hindsight" in out
    assert "auto vs one fixed K for every prompt: K=1" in out


def test_bench_checks_seeded_coupled_sampling_for_identity(
        target_gguf: Path, draft_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Seeded sampling under the coupled rule is the engine's plain sampling token for token,
    so bench checks it; the rejection rule only preserves the distribution, so it does not."""
    base = ["bench", "--target", str(target_gguf), "--draft", str(draft_gguf), "--ctx", "512",
            "-n", "30", "--prompt", "the model", "--temperature", "0.9", "-k", "3",
            "--baseline", "engine", "--json"]
    assert main([*base, "--seed", "11"]) == 0
    coupled = json.loads(capsys.readouterr().out)
    assert coupled["all_identical"] is True and coupled["prompts"][0]["identical"] is True
    assert coupled["prompts"][0]["acceptance_rate"] > 0  # it drafted, and kept the text
    assert main([*base, "--seed", "11", "--accept-rule", "rejection"]) == 0
    assert json.loads(capsys.readouterr().out)["all_identical"] is None
    assert main([*base[:-1], "--seed", "11", "--accept-rule", "rejection"]) == 0
    assert "n/a (sampled" in capsys.readouterr().out


def test_bench_builtin_prompt_kinds(target_gguf: Path, draft_gguf: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--target", str(target_gguf), "--draft", str(draft_gguf), "--ctx",
                 "1024", "-n", "8", "--kind", "edit"]) == 0
    out = capsys.readouterr().out
    assert "typehints" in out and "rename" in out and "fib" not in out
    assert "identical output: yes" in out


def test_demo_builds_once_and_reports(capsys: pytest.CaptureFixture[str],
                                      isolated_home: Path) -> None:
    assert main(["demo", "--json", "-n", "60"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["identical"] is True
    # Whether auto drafts on the tiny pair is the measured costs' call, and it is close on a
    # small CPU (a one-token step is ~2 ms, host time a sizeable part of it): the fixed-K run
    # is the one sure to draft; auto must say why it did what it did.
    assert result["fixed"]["drafted"] > 0 and result["fixed"]["accepted"] > 0
    assert result["why"].startswith("auto")
    built = sorted(p.name for p in (isolated_home / "cache" / "demo-models").iterdir())
    assert built == ["demo-draft.gguf", "demo-target.gguf"]
    mtime = (isolated_home / "cache" / "demo-models" / "demo-target.gguf").stat().st_mtime
    assert main(["demo", "-n", "10"]) == 0
    assert "noise" in capsys.readouterr().out
    assert (isolated_home / "cache" / "demo-models" / "demo-target.gguf").stat().st_mtime == mtime


@pytest.mark.parametrize(("args", "said"), [
    (["--json", "--tui"], "--json prints the statistics for a program"),
    (["--tui"], "the chat app needs a terminal"),  # run_cli's stdin is not one
    (["-n", "40000"], "the demo generates at most 32640 tokens, not 40000"),
])
def test_demo_says_what_it_will_not_do_before_doing_anything(args: list[str], said: str,
                                                             isolated_home: Path) -> None:
    proc = run_cli("demo", *args)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("localspec: error: ") and said in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert not (isolated_home / "cache" / "demo-models").exists()  # nothing built, nothing run


def test_demo_generates_every_token_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    """Past its default context (2048) too: none is cut unsaid."""
    assert main(["demo", "--json", "--no-tui", "-n", "2100"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["plain"]["completion_tokens"] == 2100


def test_inspect_json_and_pair_check(target_gguf: Path, draft_gguf: Path,
                                     other_vocab_gguf: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(target_gguf), "--json", "--draft", str(draft_gguf)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["vocab_size"] == 332 and info["pair"]["compatible"] is True
    assert main(["inspect", str(target_gguf), "--draft", str(other_vocab_gguf)]) == 1
    assert "NOT compatible: token 259 differs" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["missing", "text", "truncated", "incompatible", "k", "ctx"])
def test_bad_input_is_one_line_without_traceback(case: str, tmp_path: Path, target_gguf: Path,
                                                 draft_gguf: Path,
                                                 other_vocab_gguf: Path) -> None:
    bad = tmp_path / "bad.gguf"
    args = ["run", "--target", str(target_gguf), "--draft", str(draft_gguf), "hi"]
    if case == "missing":
        args[2] = str(tmp_path / "nope.gguf")
    elif case == "text":
        bad.write_text("not a model")
        args[4] = str(bad)
    elif case == "truncated":
        bad.write_bytes(target_gguf.read_bytes()[:200_000])
        args[2] = str(bad)
    elif case == "incompatible":
        args[4] = str(other_vocab_gguf)
    elif case == "k":
        args += ["-k", "lots"]
    elif case == "ctx":
        args[5] = "the model " * 300
        args += ["--ctx", "256"]
    proc = run_cli(*args)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 or case == "k", proc.stderr  # argparse prints usage + one error
    assert "error" in lines[-1]
