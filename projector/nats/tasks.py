"""Bounded clean-up: a consumer that has failed must end promptly, whatever its helpers do.

A helper task blocked in the client while it reconnects (a publish, an unsubscribe) may not
end when cancelled, and awaiting it would keep a dead consumer's process alive, which then
exits 0 on the next SIGTERM and hides the failure from its supervisor. Clean-up therefore
waits a bounded time and moves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import Any

log = logging.getLogger("seqstate")

CLEANUP_S = 2.0


async def cancel(task: asyncio.Task[Any] | None, timeout: float = CLEANUP_S) -> None:
    """Cancel ``task`` and wait for it at most ``timeout`` seconds."""
    if task is None or task.done():
        return
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=timeout)
    if not done:
        log.warning("%s did not end within %gs of being cancelled", task.get_name(), timeout)


async def attempt(what: Awaitable[Any], timeout: float = CLEANUP_S) -> None:
    """Await ``what`` for at most ``timeout`` seconds, ignoring its failure (clean-up only)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(what, timeout)
