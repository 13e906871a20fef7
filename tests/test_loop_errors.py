"""The front's loop filter: anyio's reader race at shutdown is not logged; other errors are."""

from __future__ import annotations

import asyncio
import logging

import pytest

from localspec.server.loop_errors import ignore_cancelled_future_results


def _run_callbacks(schedule) -> None:  # type: ignore[no-untyped-def]
    """Run ``schedule(loop)`` on a fresh loop with the filter installed, then a few turns."""
    loop = asyncio.new_event_loop()
    try:
        ignore_cancelled_future_results(loop)
        schedule(loop)
        loop.run_until_complete(asyncio.sleep(0.01))
    finally:
        loop.close()


def test_a_queued_result_for_a_cancelled_future_is_not_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    """What anyio's UNIX socket does when a read is cancelled as the socket turns readable."""
    def schedule(loop: asyncio.AbstractEventLoop) -> None:
        fut = loop.create_future()
        loop.call_soon(fut.set_result, None)  # the reader's callback, already queued
        fut.cancel()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        _run_callbacks(schedule)
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text


def test_a_queued_result_for_a_wait_the_stream_closed_is_not_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    """anyio's other path to the same race: closing a UNIX socket stream ends its read wait
    itself (``set_result(None)``, not a cancel) while the reader's callback is already queued.
    Seen once in the full suite and once in six SIGTERM runs under a 2-core load."""
    def schedule(loop: asyncio.AbstractEventLoop) -> None:
        fut = loop.create_future()
        loop.call_soon(fut.set_result, None)  # the reader's callback, already queued
        fut.set_result(None)  # the stream's close ends the wait

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        _run_callbacks(schedule)
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text


def test_a_second_result_for_a_finished_future_is_still_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    """Completing a future twice with a value is a bug, not the race (anyio's waits carry
    None): it stays visible."""
    def schedule(loop: asyncio.AbstractEventLoop) -> None:
        fut = loop.create_future()
        fut.set_result(1)
        loop.call_soon(fut.set_result, None)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        _run_callbacks(schedule)
    assert "InvalidStateError" in caplog.text


def test_other_callback_errors_reach_the_previous_handler() -> None:
    seen: list[dict[str, object]] = []

    def boom() -> None:
        raise ValueError("a real bug")

    loop = asyncio.new_event_loop()
    try:
        loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
        ignore_cancelled_future_results(loop)
        loop.call_soon(boom)
        fut = loop.create_future()
        loop.call_soon(fut.set_result, None)
        fut.cancel()
        loop.run_until_complete(asyncio.sleep(0.01))
    finally:
        loop.close()
    assert [type(ctx.get("exception")) for ctx in seen] == [ValueError]
