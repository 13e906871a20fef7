"""Files llama.cpp would abort on are refused before it sees them, in one line, by every command;
what still goes wrong in a guarded command (an exception, a native abort, a file truncated under
llama.cpp) is one line too, never silence, a backtrace or a bus error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from localspec import gguf_meta
from localspec.cli.guard import log_path, run_guarded
from localspec.errors import GGUFError
from localspec.models.tiny import TinyModelSpec, Typed, write_tiny_model

from .conftest import run_cli

# name -> (the file's shape, what the one-line refusal names)
BAD = {
    "layers-1e6": (TinyModelSpec(metadata=(("llama.block_count", 10**6),)),
                   "llama.block_count is 1000000"),
    "layers-513": (TinyModelSpec(metadata=(("llama.block_count", 513),)),
                   "llama.block_count is 513"),
    "experts-1e5": (TinyModelSpec(metadata=(("llama.expert_count", 10**5),)),
                    "llama.expert_count is 100000"),
    "eps-nan": (TinyModelSpec(metadata=(("llama.attention.layer_norm_rms_epsilon",
                                         float("nan")),)),
                "layer_norm_rms_epsilon is nan"),
    "kv-heads-3-of-4": (TinyModelSpec(n_head=4, n_head_kv=3),
                        "head_count_kv 3 does not divide head_count 4"),
    "heads-3-of-64": (TinyModelSpec(n_head=3, n_head_kv=3),
                      "head_count 3 does not divide embedding_length 64"),
    "qwen2-rope-8-of-16": (TinyModelSpec(architecture="qwen2", metadata=(
        ("qwen2.rope.dimension_count", 8),)),
        "qwen2.rope.dimension_count is 8, not the head size 16"),
    "values-8-keys-16": (TinyModelSpec(metadata=(("llama.attention.key_length", 16),
                                                 ("llama.attention.value_length", 8))),
                         "key_length 16 and llama.attention.value_length 8 differ"),
    "heads-inf": (TinyModelSpec(metadata=(("llama.attention.head_count",
                                           (float("inf"), float("inf"))),)),
                  "head_count holds float values such as inf"),
    "wordpiece-vocab": (TinyModelSpec(metadata=(("tokenizer.ggml.model", "bert"),)),
                        "a BERT (WordPiece) vocabulary"),
    "unknown-architecture": (TinyModelSpec(architecture="foo"),
                             "architecture 'foo' is not one llama.cpp"),
}
# The ones llama.cpp 0.3.36 answers with SIGABRT (3 heads of a 64-wide model is a load error).
ABORTS = ("layers-1e6", "layers-513", "experts-1e5", "eps-nan", "kv-heads-3-of-4",
          "qwen2-rope-8-of-16", "wordpiece-vocab")


@pytest.fixture(scope="session")
def bad_files(models_dir: Path) -> dict[str, Path]:
    folder = models_dir / "bad"
    return {name: write_tiny_model(folder / f"{name}.gguf", spec)
            for name, (spec, _) in BAD.items()}


# Files llama.cpp refuses with a load error, not an abort: refused by localspec as well, so
# that inspect, list and pair add agree with run. name -> (shape, bytes replaced in the written
# file (the writer cannot write these), what the refusal names)
REFUSED: dict[str, tuple[TinyModelSpec, tuple[bytes, bytes] | None, str]] = {
    "alignment-u64": (TinyModelSpec(metadata=(("general.alignment", Typed(32, "UINT64")),)),
                      None, "general.alignment is a u64, not a u32"),
    "scores-strings": (TinyModelSpec(metadata=(("tokenizer.ggml.scores",
                                                Typed(("a", "b"), "STRING")),)),
                       None, "tokenizer.ggml.scores is an array of string, not an array of "
                       "i32 or an array of f32"),
    "types-floats": (TinyModelSpec(metadata=(("tokenizer.ggml.token_type", (1.0, 1.0)),)),
                     None, "token_type is an array of f32, not an array of i32"),
    "scores-short": (TinyModelSpec(metadata=(("tokenizer.ggml.scores", (0.0, 0.0, 0.0)),)),
                     None, "tokenizer.ggml.scores holds 3 values for"),
    "types-short": (TinyModelSpec(metadata=(("tokenizer.ggml.token_type",
                                             Typed((1, 1), "INT32")),)),
                    None, "tokenizer.ggml.token_type holds 2 values for"),
    "key-empty": (TinyModelSpec(metadata=(("", "x"),)), None, "a metadata key is empty"),
    "key-twice": (TinyModelSpec(metadata=(("general.namf", "x"),)),
                  (b"general.namf", b"general.name"), "general.name appears twice"),
    "tensor-twice": (TinyModelSpec(), (b"blk.0.attn_k.weight", b"blk.0.attn_q.weight"),
                     "tensor blk.0.attn_q.weight appears twice"),
}


@pytest.fixture(scope="session")
def refused_files(models_dir: Path) -> dict[str, Path]:
    folder = models_dir / "refused"
    files = {}
    for name, (spec, patch, _) in REFUSED.items():
        path = write_tiny_model(folder / f"{name}.gguf", spec)
        if patch is not None:
            data = path.read_bytes()
            assert data.count(patch[0]) == 1
            path.write_bytes(data.replace(*patch))
        files[name] = path
    return files


@pytest.mark.parametrize("name", list(REFUSED))
def test_files_llama_cpp_refuses_are_refused_before_it_loads_them(
        refused_files: dict[str, Path], name: str) -> None:
    path = refused_files[name]
    code = ("import sys, llama_cpp as l\n"
            "l.llama_backend_init()\n"
            "m = l.llama_model_load_from_file(sys.argv[1].encode(), "
            "l.llama_model_default_params())\n"
            "sys.exit(3 if m else 0)\n")
    native = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                            text=True, timeout=120)
    assert native.returncode == 0, "llama.cpp loads it now: the rule can go"
    with pytest.raises(GGUFError, match=REFUSED[name][2]):
        gguf_meta.read_gguf_info(path)
    proc = run_cli("inspect", str(path))
    assert proc.returncode == 1 and REFUSED[name][2] in _one_error_line(proc.stderr)


def _one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("localspec: error: "), stderr
    return lines[0]


@pytest.mark.parametrize("name", list(BAD))
def test_the_validation_names_the_impossible_value(bad_files: dict[str, Path],
                                                   name: str) -> None:
    with pytest.raises(GGUFError) as err:
        gguf_meta.read_gguf_info(bad_files[name])
    message = str(err.value)
    assert BAD[name][1] in message and str(bad_files[name]) in message
    assert "\n" not in message


def test_a_valid_file_with_these_keys_in_range_passes(tmp_path: Path) -> None:
    """The rules refuse what llama.cpp aborts on, not the keys themselves."""
    ok = write_tiny_model(tmp_path / "ok.gguf", TinyModelSpec(metadata=(
        ("llama.block_count", 2), ("llama.attention.layer_norm_rms_epsilon", 1e-6),
        ("llama.rope.scaling.type", "linear"))))
    assert gguf_meta.read_gguf_info(ok).block_count == 2
    # Whole-head RoPE where the graph asserts it; part of each head where it does not.
    qwen2 = write_tiny_model(tmp_path / "qwen2.gguf", TinyModelSpec(architecture="qwen2"))
    assert gguf_meta.read_gguf_info(qwen2).architecture == "qwen2"
    partial = write_tiny_model(tmp_path / "stablelm.gguf", TinyModelSpec(
        architecture="stablelm", metadata=(("stablelm.rope.dimension_count", 4),)))
    assert gguf_meta.read_gguf_info(partial).architecture == "stablelm"


@pytest.mark.parametrize("name", ABORTS)
def test_llama_cpp_really_aborts_on_them(bad_files: dict[str, Path], name: str) -> None:
    """Why the rules exist: loaded by llama.cpp directly (no localspec in between), each file
    kills the process with SIGABRT. If a llama.cpp upgrade returns an error instead, this
    fails and the rule can go."""
    code = ("import sys, llama_cpp as l\n"
            "l.llama_backend_init()\n"
            "mp = l.llama_model_default_params()\n"
            "m = l.llama_model_load_from_file(sys.argv[1].encode(), mp)\n"
            "assert m, 'refused with an error'\n"
            "p = l.llama_context_default_params(); p.n_ctx = 64\n"
            "c = l.llama_init_from_model(m, p)\n"
            "assert c, 'refused with an error'\n"
            "l.llama_decode(c, l.llama_batch_get_one((l.llama_token * 2)(1, 5), 2))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(bad_files[name])],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GGML_NO_BACKTRACE": "1"})
    assert proc.returncode == -signal.SIGABRT, proc.stderr[-2000:]


@pytest.mark.parametrize("name", list(BAD))
def test_inspect_run_and_pair_add_refuse_them_in_one_line(bad_files: dict[str, Path],
                                                          target_gguf: Path, name: str) -> None:
    bad = str(bad_files[name])
    runs = {
        "inspect": run_cli("inspect", bad),
        "inspect --draft": run_cli("inspect", str(target_gguf), "--draft", bad),
        "run": run_cli("run", "--target", bad, "--draft-mode", "none", "-n", "4", "hello"),
        "run with a draft": run_cli("run", "--target", str(target_gguf), "--draft", bad,
                                    "-n", "4", "hello"),
        "pair add": run_cli("pair", "add", "bad", "--target", bad, "--draft",
                            str(target_gguf)),
    }
    for what, proc in runs.items():
        assert proc.returncode == 1, (what, proc.returncode, proc.stderr)
        assert proc.stdout == "", (what, proc.stdout[:2000])  # no gdb, no llama.cpp
        assert BAD[name][1] in _one_error_line(proc.stderr), what
    listed = run_cli("list")
    assert "bad" not in listed.stdout.split()  # pair add saved nothing


def test_strings_from_a_file_cannot_break_the_line_or_drive_the_terminal(tmp_path: Path) -> None:
    """An architecture or a name with a newline could forge a second line of output
    ("localspec: ok"), an escape sequence could drive the terminal: both are shown escaped,
    in errors (ours and llama.cpp's) and in inspect's table."""
    forged = "evil\nlocalspec: ok \x1b[2J"
    bad = write_tiny_model(tmp_path / "bad.gguf", TinyModelSpec(
        architecture=forged, metadata=((f"{forged}.block_count", 600),)))
    unknown = write_tiny_model(tmp_path / "unknown.gguf", TinyModelSpec(architecture=forged))
    for path in (bad, unknown):
        proc = run_cli("run", "--target", str(path), "--draft-mode", "none", "-n", "2", "hi")
        line = _one_error_line(proc.stderr)
        assert "evil\\nlocalspec: ok \\x1b[2J" in line and "\x1b" not in line
    named = write_tiny_model(tmp_path / "named.gguf", TinyModelSpec(name=forged))
    shown = run_cli("inspect", str(named))
    assert shown.returncode == 0
    assert "name            evil\\nlocalspec: ok \\x1b[2J\n" in shown.stdout
    assert "\x1b" not in shown.stdout


# -- what still fails in a guarded command -------------------------------------------------------
BAD_TEMPLATES = {
    "unknown filter": ("{{ messages | no_such_filter }}", "TemplateAssertionError"),
    "runaway recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
                          "RecursionError"),
}


@pytest.mark.parametrize("case", list(BAD_TEMPLATES))
def test_a_chat_template_jinja_cannot_render_is_one_line_not_silence(
        tmp_path: Path, isolated_home: Path, case: str) -> None:
    template, error = BAD_TEMPLATES[case]
    model = write_tiny_model(tmp_path / "t.gguf", TinyModelSpec(metadata=(
        ("tokenizer.chat_template", template),)))
    proc = run_cli("run", "--target", str(model), "--draft-mode", "none", "-n", "4", "hello")
    assert proc.returncode == 1
    line = _one_error_line(proc.stderr)
    assert error in line and "Traceback" not in proc.stderr
    # Named as the model file's problem, with the way around it (no "please report it").
    assert "chat template in t.gguf cannot be rendered" in line and "--raw" in line
    assert "unexpected" not in line


def _raise_type_error() -> int:
    raise TypeError("a bug\nwith a second line")


def test_any_exception_in_the_guarded_child_is_one_line(capfd: pytest.CaptureFixture[str]
                                                        ) -> None:
    assert run_guarded(_raise_type_error) == 1
    err = capfd.readouterr().err
    assert _one_error_line(err).startswith("localspec: error: unexpected TypeError: a bug (")
    assert 'raise TypeError("a bug' in log_path().read_text()


def _exit_with(code: int | str | None) -> int:
    raise SystemExit(code)


def test_sys_exit_in_the_guarded_child_keeps_its_status(capfd: pytest.CaptureFixture[str]
                                                        ) -> None:
    assert run_guarded(lambda: _exit_with(3)) == 3
    assert run_guarded(lambda: _exit_with(None)) == 0
    assert capfd.readouterr().err == ""
    assert run_guarded(lambda: _exit_with("gave up")) == 1
    assert capfd.readouterr().err == "localspec: error: gave up\n"


def _llama_cpp_asserts(model: Path) -> int:
    """Hand llama.cpp a file it asserts on, past localspec's validation (as a file with a rule
    localspec does not know yet would reach it)."""
    import faulthandler

    import llama_cpp

    from localspec.engine import activity
    from localspec.engine.llama_backend import route_llama_logs_to_logging

    faulthandler.disable()  # pytest's own handler would print the stacks on stderr
    route_llama_logs_to_logging()
    activity.report("loading", model)
    llama_cpp.llama_model_load_from_file(str(model).encode(),
                                         llama_cpp.llama_model_default_params())
    return 0  # pragma: no cover


def test_a_native_abort_is_one_line_with_its_assertion_and_no_backtrace(
        bad_files: dict[str, Path], capfd: pytest.CaptureFixture[str]) -> None:
    model = bad_files["layers-513"]
    assert run_guarded(lambda: _llama_cpp_asserts(model)) == 128 + signal.SIGABRT
    out, err = capfd.readouterr()
    assert out == ""  # ggml's gdb backtrace went to stdout
    line = _one_error_line(err)
    assert "(SIGABRT, signal 6) while loading with layers-513.gguf" in line
    assert "(llama-model.cpp:" in line and "LLAMA_MAX_LAYERS) failed)" in line
    assert f"details in {log_path()}" in line
    assert "GGML_ASSERT(hparams.n_layer_all > 0" in log_path().read_text()


def _truncate_under_llama_cpp(model: Path) -> int:
    """Load a model (llama.cpp maps its weights), shrink the file, decode: the weights' pages
    are gone, as when a download replaces a model a command is using."""
    from localspec.engine import activity
    from localspec.engine.llama_backend import LlamaRunner, ModelSettings

    runner = LlamaRunner(model, ModelSettings(n_ctx=64), extra_bufts=False)
    os.truncate(model, model.stat().st_size // 2)
    with activity.doing("decoding", model):
        runner.decode([1, 5, 6])
    return 0  # pragma: no cover


def test_a_model_truncated_under_llama_cpp_is_a_bad_file_line_not_a_bus_error(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    model = write_tiny_model(tmp_path / "shrinking.gguf", TinyModelSpec())
    assert run_guarded(lambda: _truncate_under_llama_cpp(model)) == 1
    line = _one_error_line(capfd.readouterr().err)
    assert str(model) in line and "truncated" in line
    assert line.endswith("; it changed while llama.cpp was reading it")


def _cut_points(model: Path) -> dict[str, int]:
    """Where to cut ``model``, found by the gguf package's own reader (not ours)."""
    from gguf import GGUFReader

    reader = GGUFReader(model)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    return {"header": 20, "vocabulary": int(tokens.offset) + 100,
            "tensor table": int(reader.data_offset) - 40,
            "weights": int(reader.data_offset) + 1000}


@pytest.mark.parametrize("where", ["header", "vocabulary", "tensor table", "weights"])
def test_a_file_that_shrinks_while_its_metadata_is_read_is_one_line(
        tmp_path: Path, where: str) -> None:
    """What stat said, then a shorter file to read: a short read and one line, where a memory
    map faulted (SIGBUS, exit 135, nothing said)."""
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec())
    size = model.stat().st_size
    os.truncate(model, _cut_points(model)[where])
    with pytest.raises(GGUFError) as err:
        gguf_meta._read_file(model, size, want_tokens=True)
    message = str(err.value)
    assert str(model) in message and "\n" not in message
    if where == "weights":  # the header is whole: the layout check, on the size now, says it
        assert "truncated: tensor" in message
    else:
        assert "truncated or replaced meanwhile" in message


def _vocabulary_with(monkeypatch: pytest.MonkeyPatch, rename: dict[str, str]) -> None:
    """Tiny models written with some byte tokens renamed (then of the normal type: llama.cpp
    refuses a byte token that is not ``<0xXX>``), or, renamed to "", dropped."""
    from gguf import TokenType

    from localspec.models import tiny

    original = tiny.vocabulary

    def patched(spec: TinyModelSpec) -> tuple[list[str], list[float], list[int]]:
        tokens, scores, types = original(spec)
        kept = [i for i, t in enumerate(tokens) if rename.get(t, t)]
        return ([rename.get(tokens[i], tokens[i]) for i in kept], [scores[i] for i in kept],
                [TokenType.NORMAL if tokens[i] in rename else types[i] for i in kept])

    monkeypatch.setattr(tiny, "vocabulary", patched)


def test_text_a_vocabulary_without_byte_fallback_cannot_take_is_one_line(
        tmp_path: Path) -> None:
    """A SentencePiece vocabulary with no byte tokens: llama.cpp itself aborts (it throws
    std::out_of_range from a noexcept path) on the first text outside it. Such a model still
    runs on text within its vocabulary; text outside it is one line, before llama.cpp."""
    model = write_tiny_model(tmp_path / "no-bytes.gguf", TinyModelSpec(byte_tokens=False))
    code = ("import sys, llama_cpp as l\n"
            "l.llama_backend_init()\n"
            "m = l.llama_model_load_from_file(sys.argv[1].encode(),"
            " l.llama_model_default_params())\n"
            "assert m, 'refused with an error'\n"
            "text = 'Zürich'.encode()\n"
            "out = (l.llama_token * 64)()\n"
            "l.llama_tokenize(l.llama_model_get_vocab(m), text, len(text), out, 64, True, False)\n")
    direct = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "GGML_NO_BACKTRACE": "1"})
    assert direct.returncode == -signal.SIGABRT, direct.stderr[-2000:]
    base = ("run", "--target", str(model), "--draft-mode", "none", "--raw", "-n", "3")
    refused = run_cli(*base, "Zürich")
    assert refused.returncode == 1, refused.stderr
    line = _one_error_line(refused.stderr)
    assert "no-bytes.gguf cannot take the character" in line and "would abort" in line, line
    assert run_cli(*base, "the data").returncode == 0  # within its vocabulary
    # A chat template's control tokens are taken out of the text before the tokenizer sees
    # it: their characters need no token of their own.
    from localspec.engine import ModelSettings
    from localspec.engine.llama_backend import LlamaRunner
    from localspec.errors import UnencodableTextError

    runner = LlamaRunner(model, ModelSettings(n_ctx=64, n_threads=1))
    try:
        assert runner.tokenize("</s>the data<s>", add_bos=False, special=True)[0] == 2
        with pytest.raises(UnencodableTextError, match="'<'"):
            runner.tokenize("</s>the data", add_bos=False, special=False)
    finally:
        runner.close()
    # Through the server: the asker's text, so a 400 naming the character.
    import httpx

    from localspec.engine import DraftSettings, SpeculativeEngine
    from localspec.server import ServerConfig
    from localspec.server.app import create_app
    from localspec.server.running import BackgroundServer

    with SpeculativeEngine.load(model, None, ModelSettings(n_ctx=128)) as engine, \
            BackgroundServer(create_app(engine, ServerConfig(
                model_id="m", draft=DraftSettings(mode="none")))) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Zürich", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 400, r.text
        assert "cannot take the character" in r.json()["error"]["message"]


def test_which_characters_a_vocabulary_with_gaps_can_take(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's lookup, byte by byte: ``<0xXX>``, else the byte as a one-character token
    (ASCII). A character that is a token of its own never falls back."""
    from localspec.engine import ModelSettings
    from localspec.engine.llama_backend import LlamaRunner
    from localspec.errors import UnencodableTextError

    with monkeypatch.context() as patch:
        _vocabulary_with(patch, {"<0xBC>": ""})  # the second byte of "ü" (C3 BC)
        no_bc = write_tiny_model(tmp_path / "no-0xBC.gguf")
    letters = set("abcdefghijklmnopqrstuvwxyz")
    _vocabulary_with(monkeypatch, {f"<0x{b:02X}>": chr(b) for b in range(0x80)
                                   if chr(b) not in letters})
    ascii_as_itself = write_tiny_model(tmp_path / "ascii-as-itself.gguf")
    whole = write_tiny_model(tmp_path / "whole.gguf")
    settings = ModelSettings(n_ctx=64, n_threads=1)
    runner = LlamaRunner(no_bc, settings)
    try:
        assert runner.tokenize("café Zürich"[:4], add_bos=False)  # é is C3 A9: both there
        with pytest.raises(UnencodableTextError, match=r"'ü' \(U\+00FC\)"):
            runner.tokenize("Zürich", add_bos=False)
    finally:
        runner.close()
    for path in (ascii_as_itself, whole):
        runner = LlamaRunner(path, settings)
        try:
            assert runner.tokenize("Zürich, 42 ü!", add_bos=False)
        finally:
            runner.close()
