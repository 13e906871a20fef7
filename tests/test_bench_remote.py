"""`localspec bench --url`: the same measurement against OpenAI-compatible servers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from localspec.cli import main
from localspec.engine import DraftSettings, ModelSettings, SpeculativeEngine
from localspec.server import ServerConfig
from localspec.server.app import create_app
from localspec.server.running import BackgroundServer


@pytest.fixture(scope="module")
def servers(target_gguf: Path, draft_gguf: Path) -> Iterator[tuple[str, str]]:
    spec_engine = SpeculativeEngine.load(target_gguf, draft_gguf, ModelSettings(n_ctx=1024))
    plain_engine = SpeculativeEngine.load(target_gguf, None, ModelSettings(n_ctx=1024))
    spec = BackgroundServer(create_app(spec_engine, ServerConfig(
        model_id="pair", draft=DraftSettings(k=3)))).start()
    plain = BackgroundServer(create_app(plain_engine, ServerConfig(
        model_id="pair", draft=DraftSettings(mode="none")))).start()
    yield spec.url, plain.url
    spec.stop()
    plain.stop()
    spec_engine.close()
    plain_engine.close()


def test_bench_against_a_server_and_its_baseline(servers: tuple[str, str],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    spec_url, plain_url = servers
    assert main(["bench", "--url", spec_url, "--baseline-url", plain_url, "--prompt",
                 "the model and the draft", "--prompt", "print the list", "-n", "30",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["remote"] is True and result["baseline"] is True
    assert result["all_identical"] is True  # greedy: the server's spec output == plain output
    assert result["speedup"] > 0
    for p in result["prompts"]:
        assert p["tokens"] == 30 and p["identical"] is True
        assert p["acceptance_rate"] > 0  # the server reported its draft statistics


def test_bench_against_a_server_alone_has_no_ratio(servers: tuple[str, str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--url", servers[0], "--prompt", "the model", "-n", "10"]) == 0
    out = capsys.readouterr().out
    assert "no --baseline-url, so no speedup" in out


def test_bench_unreachable_server_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--url", "http://127.0.0.1:9", "--prompt", "x", "-n", "5"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach" in err[0]
