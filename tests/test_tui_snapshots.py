"""Snapshots of the main screens with fixed gauge numbers (FakeMonitor) and a fake library."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from localspec.chat_store import ChatStore
from localspec.config import Settings
from localspec.tui.app import LocalspecApp
from tests.tui_fakes import FIXED_CPU_SAMPLE, FIXED_GPU_SAMPLE, FakeLibrary, FakeMonitor

SIZE = (120, 34)


def _app(tmp_path: Path, sample: Any = FIXED_GPU_SAMPLE) -> LocalspecApp:
    # Fixed model paths: the library is fake, nothing is loaded, so snapshots do not vary.
    lib = FakeLibrary(Path("/models/tiny-target.gguf"), Path("/models/tiny-draft.gguf"))
    return LocalspecApp(lambda spec: None, FakeMonitor(sample), ChatStore(tmp_path / "c.db"),
                        lib, Settings(), spec=None, sample_interval=0.05)


async def _settle(pilot: Any) -> None:
    await pilot.pause(0.3)
    await pilot.wait_for_scheduled_animations()


@pytest.mark.parametrize("sample", [FIXED_GPU_SAMPLE, FIXED_CPU_SAMPLE], ids=["gpu", "no-driver"])
def test_main_screen(snap_compare: Any, tmp_path: Path, sample: Any) -> None:
    assert snap_compare(_app(tmp_path, sample), terminal_size=SIZE, run_before=_settle)


@pytest.mark.parametrize("key", ["f1", "f2", "f3", "f4"],
                         ids=["help", "pairs", "models", "settings"])
def test_screens(snap_compare: Any, tmp_path: Path, key: str) -> None:
    async def open_screen(pilot: Any) -> None:
        await _settle(pilot)
        await pilot.press(key)
        await _settle(pilot)

    assert snap_compare(_app(tmp_path), terminal_size=SIZE, run_before=open_screen)
