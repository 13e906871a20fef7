"""config.toml: TOML round trip, every bad value named with its file and line, engine mappings."""

from __future__ import annotations

from pathlib import Path

import pytest

from localspec.config import load_settings, save_settings
from localspec.errors import ConfigError
from localspec.options import Settings, model_settings
from localspec.params import PARAMS, InvalidOptionError
from localspec.requests import draft_from_settings, fit_draft


def test_defaults_when_missing_and_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    assert load_settings(path) == Settings()
    s = Settings(draft_mode="lookup", k=6, temperature=0.7, threads=4, last_pair="tiny",
                 exact=True, repack="off")
    save_settings(s, path)
    assert load_settings(path) == s
    auto = Settings(k=None)
    save_settings(auto, path)
    assert 'k = "auto"' in path.read_text() and load_settings(path) == auto


def test_saving_keeps_the_users_other_tables_and_comments(tmp_path: Path) -> None:
    """The settings screen (and the chat app recording the last pair) rewrites only [chat]:
    [history] limits and the user's notes must survive it."""
    from localspec import history

    path = tmp_path / "config.toml"
    path.write_text('# my settings\n[chat]\ntemperature = 0.2  # for code\n'
                    'gpu_layers_draft = 0\nseed = 7\n\n'
                    '[history]\nserve_scope = "chat"\nmax_bytes = 4194304\n')
    before = history.load_config(path)
    save_settings(Settings(temperature=0.5, draft_gpu_layers=0, last_pair="tiny"), path)
    text = path.read_text()
    assert "# my settings" in text and "# for code" in text
    assert history.load_config(path) == before
    assert before.serve_scope == "chat" and before.max_bytes == 4194304
    saved = load_settings(path)
    assert (saved.temperature, saved.draft_gpu_layers, saved.last_pair) == (0.5, 0, "tiny")
    # A key unset since (seed), or written under an older name, goes.
    assert saved.seed is None and "seed" not in text and "gpu_layers_draft" not in text


def test_saving_keeps_the_files_line_endings(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(b"# mine\r\n[chat]\r\ntemperature = 0.2\r\n\r\n[history]\r\n"
                     b"max_bytes = 4194304\r\n")
    save_settings(Settings(temperature=0.5, k=3), path)
    data = path.read_bytes()
    assert data.count(b"\n") == data.count(b"\r\n") > 5  # the keys added too
    assert data.startswith(b"# mine\r\n") and load_settings(path).k == 3


def test_saving_over_a_file_with_an_error_leaves_it_alone(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[chat]\ntemperature = \n[history]\nmax_bytes = 1\n")
    with pytest.raises(ConfigError, match=rf"cannot save settings: {path} has an error"):
        save_settings(Settings(k=3), path)
    assert path.read_text() == "[chat]\ntemperature = \n[history]\nmax_bytes = 1\n"


def test_default_path_is_under_config_dir(isolated_home: Path) -> None:
    where = save_settings(Settings(k=3))
    assert where == isolated_home / "config" / "config.toml"
    assert load_settings().k == 3


def test_malformed_toml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[chat]\nk = 3\ntemperature = = 1\n")
    with pytest.raises(ConfigError, match=r"config.toml.*line 3"):
        load_settings(path)


@pytest.mark.parametrize("body, message", [
    ("temperature = inf", r"temperature must be a finite number >= 0 and <= 2, got inf"),
    ("temperature = nan", r"temperature must be a finite number .*got nan"),
    ("max_tokens = 1e20", r"max_tokens must be a whole number >= 1 and <= 1048576, got 1e\+20"),
    ("last_pair = {a = 1}", r"last_pair must be text, got \{.a.: 1\}"),
    ('threads = "many"', r"threads must be a whole number >= 1 and <= 1024 .*got 'many'"),
    ("threads = 1.5", r"threads must be a whole number"),
    ("k = 99", r"k must be auto or a whole number >= 0 and <= 32, got 99"),
    ("k = 'four'", r"k must be auto or a whole number"),
    ("top_k = -1", r"top_k must be a whole number >= 0"),
    ("ctx = 0", r"ctx must be a whole number >= 64"),
    ("tempo = 1", r"unknown setting 'tempo'"),
    ("draft_mode = 'fast'", r"draft_mode must be one of model, lookup, history, none, got 'fast'"),
])
def test_bad_values_name_file_line_parameter_and_range(tmp_path: Path, body: str,
                                                       message: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f"# my settings\n[chat]\nmin_p = 0.1\n{body}\n")
    with pytest.raises(ConfigError, match=message) as err:
        load_settings(path)
    assert f"{path}, line 4: " in err.value.message
    assert "\n" not in err.value.message
    assert isinstance(err.value, InvalidOptionError) and err.value.exit_code == 2


def test_a_binary_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(b"\x00\xff\xfe binary \x89PNG")
    with pytest.raises(ConfigError, match=rf"{path}: not a text file"):
        load_settings(path)


def test_settings_of_older_versions_are_read(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[chat]\ndraft_mode = "fixed"\nk = 5\ngpu_layers_draft = 0\n')
    s = load_settings(path)
    assert (s.draft_mode, s.k, s.draft_gpu_layers) == ("model", 5, 0)
    path.write_text('[chat]\ndraft_mode = "auto"\nk = 4\n')
    assert (load_settings(path).draft_mode, load_settings(path).k) == ("model", None)
    path.write_text('[chat]\ndraft_mode = "off"\n')
    assert load_settings(path).draft_mode == "none"


def test_text_values_read_as_the_command_line_reads_them(tmp_path: Path) -> None:
    """`--threads ""` is automatic on the command line, and the error says "or empty for
    automatic": config.toml reads the same text the same way."""
    path = tmp_path / "config.toml"
    path.write_text('[chat]\nthreads = ""\nseed = " 7 "\ngpu_layers = "auto"\nexact = "yes"\n')
    s = load_settings(path)
    assert (s.threads, s.seed, s.gpu_layers, s.exact) == (None, 7, None, True)
    assert s == Settings(threads=PARAMS["threads"].parse(""), seed=PARAMS["seed"].parse(" 7 "),
                         gpu_layers=PARAMS["gpu_layers"].parse("auto"),
                         exact=PARAMS["exact"].parse("yes"))


@pytest.mark.parametrize("order", [("gpu_layers_target", "gpu_layers"),
                                   ("gpu_layers", "gpu_layers_target")])
def test_an_old_name_beside_its_new_one_is_refused(tmp_path: Path,
                                                   order: tuple[str, str]) -> None:
    """Which of the two was meant cannot be told; taking the later one dropped the other."""
    path = tmp_path / "config.toml"
    path.write_text(f"[chat]\n{order[0]} = 5\n{order[1]} = 3\n")
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    line = 2 if order[0] == "gpu_layers_target" else 3
    assert err.value.message == (f"{path}, line {line}: gpu_layers_target is the old name of "
                                 "gpu_layers, which is set too; keep one of them")


def test_a_byte_order_mark_is_no_setting(tmp_path: Path) -> None:
    """Windows editors start UTF-8 files with one; TOML then fails at line 1, column 1, and
    the [history] limits were silently the defaults."""
    from localspec import history

    path = tmp_path / "config.toml"
    path.write_bytes("\ufeff[chat]\nseed = 7\n\n[history]\nmax_bytes = 4194304\n"
                     .encode("utf-8"))
    assert load_settings(path).seed == 7
    assert history.load_config(path).max_bytes == 4194304
    save_settings(Settings(seed=8), path)
    assert load_settings(path).seed == 8 and history.load_config(path).max_bytes == 4194304


def draft_settings(s: Settings, has_draft_model: bool):  # type: ignore[no-untyped-def]
    """What a request built from these settings drafts with (the one rule, in requests.py)."""
    return fit_draft(draft_from_settings(s), has_draft_model)


def test_engine_mappings() -> None:
    assert draft_settings(Settings(), True).mode == "model"
    assert draft_settings(Settings(), False).mode == "lookup"
    fixed = draft_settings(Settings(k=5, exact=True), True)
    assert (fixed.mode, fixed.k, fixed.exact) == ("model", 5, True)
    assert draft_settings(Settings(draft_mode="none"), True).mode == "none"
    t, d = model_settings(Settings(ctx=2048, draft_gpu_layers=0, repack="off"))
    # The target's GPU layers default to auto (None), resolved when the files are known.
    assert (t.n_ctx, t.n_gpu_layers, d.n_gpu_layers, t.repack) == (2048, None, 0, "off")


def test_gpu_layers_auto_round_trips_through_config(tmp_path: Path) -> None:
    from localspec.config import load_settings, save_settings

    path = save_settings(Settings(draft_gpu_layers=7), tmp_path / "c.toml")
    assert 'gpu_layers = "auto"' in path.read_text()
    back = load_settings(path)
    assert (back.gpu_layers, back.draft_gpu_layers) == (None, 7)


def test_every_setting_is_a_parameter_with_a_meaning() -> None:
    for name in Settings.__dataclass_fields__:
        assert PARAMS[name].meaning
        assert PARAMS[name].check(PARAMS[name].default) == PARAMS[name].default


@pytest.mark.parametrize("text, line, message", [
    ('temperature = "hot"\n[chat]\nk = 3\n', 1,
     r"unknown top-level key 'temperature' \(known: \[chat\], \[history\]\); "
     r"put it under \[chat\]"),
    ("[chat]\nk = 3\n\n[caht]\nmax_tokens = -5\n", 4,
     r"unknown table \[caht\] \(known: \[chat\], \[history\]\); did you mean \[chat\]\?"),
    ('[history]\nmax_bytes = 4194304\n[server]\nport = 8081\n', 3,
     r"unknown table \[server\] \(known: \[chat\], \[history\]\)$"),
    ("[chat]\nk = 3\n[[histroy]]\nmax_tokens = 2048\n", 3,
     r"unknown table \[\[histroy\]\] .*did you mean \[history\]\?"),
])
def test_unknown_top_level_keys_and_tables_are_refused(tmp_path: Path, text: str, line: int,
                                                       message: str) -> None:
    """A typo'd table or a setting outside any table would silently not apply."""
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        load_settings(path)
    assert err.value.message.startswith(f"{path}, line {line}: ")
    assert "\n" not in err.value.message


def test_run_with_an_unknown_table_fails_with_one_line(
        target_gguf: Path, isolated_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from localspec.cli import main

    path = isolated_home / "config" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[caht]\nmax_tokens = -5\n")
    assert main(["run", "--target", str(target_gguf), "hello", "-n", "2"]) != 0
    err = capsys.readouterr().err.strip()
    assert f"{path}, line 1: unknown table [caht]" in err and "\n" not in err
