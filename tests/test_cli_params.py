"""Every parameter is validated once, the same way in the CLI, config.toml and the server; bad
input is one line and exit status 2, never a traceback or llama.cpp's own error output."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from localspec.engine import ModelSettings, SpeculativeEngine

from .conftest import run_cli


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize("args, words", [
    (["-n", "-5"], ["--max-tokens", "whole number >= 1", "got -5"]),
    (["-n", "0"], ["--max-tokens", ">= 1", "got 0"]),
    (["--ctx", "0"], ["--ctx", ">= 64", "got 0"]),
    (["--ctx", "-1"], ["--ctx", ">= 64", "got -1"]),
    (["--k-max", "-3"], ["--k-max", ">= 1 and <= 32", "got -3"]),
    (["--threads", "0"], ["--threads", ">= 1", "got 0"]),
    (["--threads", "-4"], ["--threads", ">= 1", "got -4"]),
    (["--temperature", "nan"], ["--temperature", "finite number >= 0 and <= 2", "got nan"]),
    (["--temperature", "inf"], ["--temperature", "finite number", "got inf"]),
    (["--top-p", "0"], ["--top-p", "> 0 and <= 1", "got 0"]),
    (["-k", "lots"], ["--draft-k", "auto or a whole number", "got lots"]),
    (["--repack", "maybe"], ["--repack", "invalid choice", "maybe"]),
])
def test_bad_values_name_the_parameter_value_and_range(args: list[str], words: list[str],
                                                       target_gguf: Path) -> None:
    proc = run_cli("run", "--target", str(target_gguf), "hello", *args)
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc.stderr)
    assert line.startswith("localspec: error: argument ")
    for word in words:
        assert word in line, line
    assert "llama" not in line.lower()  # nothing reached llama.cpp


@pytest.mark.parametrize("args", [["run", "-n", "4", "hello"],
                                  ["bench", "-n", "4", "--prompt", "hello"]],
                         ids=["run", "bench"])
def test_an_abbreviated_option_is_refused_not_guessed(args: list[str],
                                                      target_gguf: Path) -> None:
    """`--k 3` is not `--k-max 3` (argparse's prefix matching would run auto and say nothing
    where the user asked for a fixed K)."""
    proc = run_cli(*args, "--target", str(target_gguf), "--k", "3")
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc.stderr)
    assert "unrecognized arguments: --k" in line, line


def test_bench_refuses_an_empty_prompt(target_gguf: Path) -> None:
    proc = run_cli("bench", "--target", str(target_gguf), "--prompt", "")
    assert proc.returncode == 2
    assert "--prompt must not be empty" in _one_line(proc.stderr)


def test_bench_reports_a_bad_file_before_measuring_this_machine(tmp_path: Path,
                                                               target_gguf: Path) -> None:
    """Without a cached repack verdict, `bench` runs the self-test before timing anything:
    a file that cannot load is one line at once, not after the self-test's seconds."""
    from localspec.engine import repack

    repack.cache_file().unlink()
    bad = tmp_path / "draft.gguf"
    bad.write_bytes(b"not a model")
    proc = run_cli("bench", "--target", str(target_gguf), "--draft", str(bad),
                   "--prompt", "hi", "-n", "2")
    assert proc.returncode == 1, proc.stderr
    assert "not a GGUF file" in _one_line(proc.stderr)
    assert not repack.cache_file().exists()  # no self-test ran


def test_options_after_the_pair_name(target_gguf: Path, draft_gguf: Path) -> None:
    """`run PAIR -n 8 "prompt"`: options among the positionals, as in every CLI users know."""
    add = run_cli("pair", "add", "tiny", "--target", str(target_gguf), "--draft", str(draft_gguf))
    assert add.returncode == 0, add.stderr
    proc = run_cli("run", "tiny", "-n", "8", "the model", "--ctx", "256", "--json", "--raw")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["stats"]["completion_tokens"] == 8
    with SpeculativeEngine.load(target_gguf, None, ModelSettings(n_ctx=256)) as engine:
        raw = engine.tokenize("the model", chat=False)  # --raw, given last, was honoured
    assert out["stats"]["prompt_tokens"] == len(raw)


def test_non_utf8_stdin_is_one_line(target_gguf: Path) -> None:
    proc = run_cli("run", "--target", str(target_gguf), stdin=b"hello \xff\xfe world")
    assert proc.returncode == 1
    line = _one_line(proc.stderr.decode())
    assert "the prompt on stdin is not UTF-8 text (byte 0xff at offset 6)" in line


def test_a_non_utf8_argument_is_one_line_naming_it(target_gguf: Path) -> None:
    proc = run_cli("run", "--target", str(target_gguf), os.fsdecode(b"caf\xe9"))
    assert proc.returncode == 1
    line = _one_line(proc.stderr)
    assert "the prompt given as arguments is not UTF-8 text (byte 0xe9 at offset 3)" in line


def test_a_non_utf8_system_message_is_one_line_naming_it(target_gguf: Path) -> None:
    proc = run_cli("run", "--target", str(target_gguf), "--system", os.fsdecode(b"b\xe9"),
                   "hello")
    assert proc.returncode == 1
    line = _one_line(proc.stderr)
    assert "--system is not UTF-8 text (byte 0xe9 at offset 1)" in line


def test_config_values_are_checked_for_run(target_gguf: Path, isolated_home: Path) -> None:
    config = isolated_home / "config" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text("[chat]\ntemperature = inf\n")
    proc = run_cli("run", "--target", str(target_gguf), "hello")
    assert proc.returncode == 2
    line = _one_line(proc.stderr)
    assert f"{config}, line 2: temperature must be a finite number >= 0 and <= 2, got inf" in line
    config.write_text('[chat]\nthreads = "many"\n')
    line = _one_line(run_cli("run", "--target", str(target_gguf), "hello").stderr)
    assert f"{config}, line 2: threads must be a whole number" in line


def test_config_defaults_apply_and_flags_win(target_gguf: Path, isolated_home: Path) -> None:
    config = isolated_home / "config" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text("[chat]\nmax_tokens = 7\nctx = 256\n")
    base = ["run", "--target", str(target_gguf), "--raw", "--json", "the model"]
    assert json.loads(run_cli(*base).stdout)["stats"]["completion_tokens"] == 7
    assert json.loads(run_cli(*base, "-n", "3").stdout)["stats"]["completion_tokens"] == 3


def test_a_wrong_tensor_count_is_refused_by_every_command(tmp_path: Path, target_gguf: Path,
                                                          draft_gguf: Path) -> None:
    """A GGUF whose tensor count was lowered by one: run, inspect, pair add and list all refuse
    it with the same one line (it used to pass inspect and pair add)."""
    data = bytearray(target_gguf.read_bytes())
    count = int.from_bytes(data[8:16], "little")
    data[8:16] = (count - 1).to_bytes(8, "little")
    bad = tmp_path / "one-tensor-short.gguf"
    bad.write_bytes(bytes(data))
    for args in (["run", "--target", str(bad), "hi"], ["inspect", str(bad)],
                 ["inspect", str(target_gguf), "--draft", str(bad)],
                 ["pair", "add", "broken", "--target", str(bad), "--draft", str(draft_gguf)]):
        proc = run_cli(*args)
        assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
        line = _one_line(proc.stderr)
        assert "damaged" in line and "after the last tensor" in line and str(bad) in line, line
    listed = json.loads(run_cli("list", "--json").stdout)
    assert all(p["name"] != "broken" for p in listed["pairs"])


def test_a_draft_without_a_target_is_refused_not_dropped(tmp_path: Path, target_gguf: Path,
                                                         draft_gguf: Path) -> None:
    """`run --draft D MODEL` ran MODEL with prompt lookup and exit 0: the draft was never
    loaded, nor even checked (a text file passed); with a pair the pair's own draft won."""
    add = run_cli("pair", "add", "tiny", "--target", str(target_gguf), "--draft", str(draft_gguf))
    assert add.returncode == 0, add.stderr
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    both = "give either a pair name (or one model) or --target/--draft, not both"
    cases = [
        (["run", "--draft", str(draft_gguf), str(target_gguf), "-n", "3", "-v", "hi there"],
         both),
        (["run", "tiny", "--draft", str(notes), "-n", "3", "hi there"], both),
        (["bench", "tiny", "--draft", str(draft_gguf), "-n", "3", "--prompt", "hi"], both),
        (["serve", "--draft", str(draft_gguf), "--port", "0"], "--draft needs --target"),
    ]
    for args, words in cases:
        proc = run_cli(*args, stdin="", timeout=60)
        assert proc.returncode == 1, (args, proc.stderr)
        assert proc.stdout == "", (args, proc.stdout)
        line = _one_line(proc.stderr)
        assert words in line and "--draft needs --target" in line, (args, line)


def test_a_name_too_long_for_a_file_is_no_such_pair_or_file(tmp_path: Path) -> None:
    """A prompt typed where the pair goes (or any name over 255 bytes) made stat() fail with
    ENAMETOOLONG: an "unexpected OSError" line, or a traceback from suggest and inspect."""
    prompt = "Explain in detail how speculative decoding works " * 6
    too_long = str(tmp_path / ("a" * 300 + ".gguf"))
    cases = [(["run", prompt], "no pair named"),
             (["suggest", prompt], "is not an Ollama model name"),
             (["inspect", too_long], f"{too_long}: no such file"),
             (["run", "--target", too_long, "hi"], f"{too_long}: no such file")]
    for args, words in cases:
        proc = run_cli(*args, stdin="")
        assert proc.returncode == 1, (args[0], proc.stderr)
        line = _one_line(proc.stderr)
        assert words in line and "Errno" not in line, (args[0], line)


@pytest.mark.parametrize("value", ["trace", "verbose"])
def test_an_unknown_localspec_log_is_one_line(value: str) -> None:
    proc = run_cli("list", env={**os.environ, "LOCALSPEC_LOG": value})
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "LOCALSPEC_LOG" in proc.stderr
    assert value in proc.stderr


def test_localspec_log_sets_the_default_level(target_gguf: Path) -> None:
    args = ("run", "--target", str(target_gguf), "--draft-mode", "none", "--repack", "off",
            "-n", "2", "--raw", "hi")
    quiet = run_cli(*args, env={**os.environ, "LOCALSPEC_LOG": ""})
    loud = run_cli(*args, env={**os.environ, "LOCALSPEC_LOG": "Debug"})
    assert quiet.returncode == loud.returncode == 0, loud.stderr
    assert "DEBUG " not in quiet.stderr and "DEBUG " in loud.stderr
