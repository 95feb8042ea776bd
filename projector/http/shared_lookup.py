"""One lookup answers every read that waits for it: a non-holder's read position, shared.

Why: a serve-http that does not hold a tracker's lease answers a read from its view once the
view reflects every call answered anywhere before the read began, so it must ask the server
for the namespace's newest stored event (a NATS round trip) and wait for its outcome. Asked
once per read, that round trip is what a read costs. Reads that come while one lookup is out
cannot use its answer (it may have been sent before they began, and miss a call answered in
between), but they can all share the next one, sent once the one out is back: each read
still waits for a lookup begun after it began (read-your-writes holds as before), and a burst
of N concurrent reads costs two lookups, not N.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable


def _retrieved(done: asyncio.Future[None]) -> None:
    """A lookup's failure is each waiter's; with none left, it is not an unretrieved one."""
    if not done.cancelled():
        done.exception()


class SharedLookup:
    """``await shared.wait()``: once a run of ``look()`` begun after the call has ended (its
    failure raised to every read that waited for it). ``shared.close()`` stops it."""

    def __init__(self, look: Callable[[], Awaitable[None]]) -> None:
        self._look = look
        self._next: asyncio.Future[None] | None = None  # the run the reads begun since wait for
        self._running: asyncio.Task[None] | None = None
        self.runs = 0  # lookups begun (metrics, tests)

    async def wait(self) -> None:
        done = self._next
        if done is None:
            done = self._next = asyncio.get_running_loop().create_future()
            done.add_done_callback(_retrieved)
            if self._running is None:
                self._start()
        await asyncio.shield(done)  # a read given up on leaves the others theirs

    def _start(self) -> None:
        done, self._next = self._next, None
        assert done is not None
        self.runs += 1
        self._running = asyncio.ensure_future(self._run(done))

    async def _run(self, done: asyncio.Future[None]) -> None:
        try:
            await self._look()
        except asyncio.CancelledError:
            done.cancel()
            raise
        except Exception as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)
        finally:
            self._running = None
        if self._next is not None:
            self._start()

    async def close(self) -> None:
        running, self._running = self._running, None
        if running is not None:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await running
        if self._next is not None:
            self._next.cancel()
            self._next = None
