"""Cancelling a task that talks to NATS: once is not always enough, and a stop must end.

nats-py awaits every request and flush through ``asyncio.wait_for``, which on Python 3.11
returns the reply, dropping the cancellation, when both land in the same turn of the loop.
A task in a loop then goes on as if never cancelled, and whoever awaited its end waited for
ever (``seqstate run`` stopped during a Dynamo resync never exited)."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from projector.aio.tasks import cancel_all


class Requester:
    """A loop of requests, each a reply future awaited through ``wait_for``."""

    def __init__(self) -> None:
        self.replies: list[asyncio.Future[bytes]] = []
        self.asked = asyncio.Event()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            reply: asyncio.Future[bytes] = loop.create_future()
            self.replies.append(reply)
            self.asked.set()
            await asyncio.wait_for(reply, 60)
            self.asked.clear()


async def test_a_cancellation_that_meets_a_reply_is_repeated_until_the_task_ends() -> None:
    requester = Requester()
    task = asyncio.create_task(requester.run())
    await requester.asked.wait()
    requester.replies[-1].set_result(b"+ACK")  # the reply and the cancellation, one turn
    late = await cancel_all([task], 5.0, again_after_s=0.05)
    assert late == set() and task.cancelled()
    if sys.version_info < (3, 12):  # the first was dropped: the loop asked again
        assert len(requester.replies) == 2


async def test_on_python_3_11_a_single_cancellation_is_dropped() -> None:
    """Why :func:`cancel_all` repeats itself: the race, shown with one ``cancel``."""
    if sys.version_info >= (3, 12):
        pytest.skip("wait_for keeps the cancellation from Python 3.12 on")
    requester = Requester()
    task = asyncio.create_task(requester.run())
    await requester.asked.wait()
    requester.replies[-1].set_result(b"+ACK")
    task.cancel()
    requester.asked.clear()
    await requester.asked.wait()  # it asked again: the cancellation is gone
    assert not task.done() and len(requester.replies) == 2
    assert await cancel_all([task], 5.0) == set()


async def test_a_task_that_never_ends_is_given_up_after_the_timeout_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()
    cancels = 0

    async def stubborn() -> None:
        nonlocal cancels
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                cancels += 1

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="seqstate"):
        late = await cancel_all([task], 0.3, again_after_s=0.1)
    assert late == {task} and not task.done()
    assert cancels >= 2  # cancelled again, not once and forgotten
    assert "stubborn did not end within 0.3s of being cancelled" in caplog.text
    release.set()
    await task


async def test_what_ended_with_an_error_is_retrieved_not_raised() -> None:
    async def failing() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            raise RuntimeError("its own clean-up failed")

    task = asyncio.create_task(failing())
    await asyncio.sleep(0)
    assert await cancel_all([task]) == set()
    assert isinstance(task.exception(), RuntimeError)
