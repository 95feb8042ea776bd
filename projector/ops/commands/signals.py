"""SIGINT and SIGTERM stop a long-running command cleanly, even while it is still starting.

The loop's handlers come off again before it closes (:func:`projector.aio.signals.run`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from projector.aio.signals import STOPPING
from projector.aio.tasks import cancel_all

CLEAN_UP_S = 5.0  # what a stopping task has for its clean-up before it is cancelled again

_stopping: dict[asyncio.AbstractEventLoop, asyncio.Event] = {}


def catch_signals() -> asyncio.Event:
    """From now on SIGINT and SIGTERM stop a long-running command cleanly.

    Called first thing, so a signal that arrives while the command is still starting (the
    pipeline catching up) is kept and honoured by :func:`until_signal`, not fatal. One event
    per event loop: ``main`` run twice in one process gets a fresh one each time.
    """
    loop = asyncio.get_running_loop()
    stop = _stopping.get(loop)
    if stop is None:
        _stopping.clear()  # a finished run's loop is closed: nothing of it is needed
        stop = _stopping[loop] = asyncio.Event()
        for sig in STOPPING:
            loop.add_signal_handler(sig, stop.set)
    return stop


async def until_signal(*tasks: Awaitable[Any], duration: float | None = None) -> None:
    """Until SIGINT/SIGTERM, the duration, or the first of ``tasks`` ends (its error raised)."""
    stop = catch_signals()
    waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(t) for t in tasks]
    stopper = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait(
            [stopper, *waits], timeout=duration, return_when=asyncio.FIRST_COMPLETED
        )
        for fut in done:
            if fut is not stopper:
                fut.result()
    finally:
        stopper.cancel()
        # Each one finishes its own clean-up (the demo frees what it has in flight); one that
        # dropped its cancellation in a NATS request is cancelled again a while later.
        await cancel_all(waits, None, again_after_s=CLEAN_UP_S)
