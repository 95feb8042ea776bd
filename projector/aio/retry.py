"""Asking again with a growing pause, for a bounded time, then giving up loudly.

The loop is the same whatever is asked: what may be asked again, for how long, and how a
failure reads in the log are the caller's (:mod:`projector.nats.failures` says it for NATS
requests: a timeout, a server restarting, a cluster still placing).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger("seqstate")

T = TypeVar("T")


async def with_backoff(
    call: Callable[[], Awaitable[T]],
    *,
    again: Callable[[BaseException], bool],
    within_s: float,
    say: Callable[[BaseException, float], str | None],
    first_pause_s: float = 0.05,
    max_pause_s: float = 1.0,
) -> T:
    """``await call()``; after a failure that ``again`` accepts, pause and call again, the pause
    doubling up to ``max_pause_s``, until ``within_s`` seconds have passed: then, or at once
    for any other failure, it is raised. ``say(exc, pause)`` gives the warning logged before a
    pause (None: say nothing this time)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    pause = first_pause_s
    while True:
        try:
            return await call()
        except Exception as exc:
            if not again(exc) or loop.time() >= deadline:
                raise
            if (line := say(exc, pause)) is not None:
                log.warning("%s", line)
        await asyncio.sleep(pause)
        pause = min(pause * 2, max_pause_s)
