"""Regenerate assets/localspec-tui.svg: the chat app on the demo pair after one streamed answer.

    .venv/bin/python assets/make_screenshot.py
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from localspec.chat_engine import LocalChatEngine
from localspec.chat_store import ChatStore
from localspec.config import save_settings
from localspec.engine import ModelSettings
from localspec.loading import EngineSpec, load_engine
from localspec.models.library import DefaultLibrary
from localspec.models.tiny import build_demo_pair
from localspec.monitor import SystemMonitor
from localspec.options import Settings
from localspec.tui.app import LocalspecApp

OUT = Path(__file__).parent / "localspec-tui.svg"


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = build_demo_pair(Path(tmp))
        one = ModelSettings(n_ctx=2048, n_threads=1)
        spec = EngineSpec(target=str(target), draft=str(draft), pair_name="demo",
                          target_settings=one, draft_settings=one)
        store = ChatStore(Path(tmp) / "chats.sqlite3")
        app = LocalspecApp(lambda spec: LocalChatEngine(load_engine(spec), spec.display_name),
                           SystemMonitor(), store, DefaultLibrary(),
                           Settings(max_tokens=120, threads=1), save_settings=save_settings,
                           spec=spec, export_dir=Path(tmp))
        async with app.run_test(size=(130, 38)) as pilot:
            while app.engine is None:
                await pilot.pause(0.05)
            prompt = app.chat.query_one("#prompt")
            prompt.value = "Write a function that checks whether a number is prime."  # type: ignore[attr-defined]
            prompt.focus()
            await pilot.press("enter")
            await pilot.pause(0.2)
            while app.chat.generating:
                await pilot.pause(0.05)
            await pilot.pause(1.0)  # a fresh gauge sample
            app.save_screenshot(filename=OUT.name, path=str(OUT.parent))
        store.close()


if __name__ == "__main__":
    asyncio.run(main())
