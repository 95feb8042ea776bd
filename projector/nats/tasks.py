"""Bounded clean-up: a consumer that has failed must end promptly, whatever its helpers do.

A helper task blocked in the client while it reconnects (a publish, an unsubscribe) may not
end when cancelled, and awaiting it would keep a dead consumer's process alive, which then
exits 0 on the next SIGTERM and hides the failure from its supervisor. Clean-up therefore
waits a bounded time and moves on.

Long work that never awaits (decoding a large snapshot: seconds) holds the loop, and a signal
with it: :func:`off_loop` runs it on a thread of its own, which a process stopping does not
wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

log = logging.getLogger("seqstate")
T = TypeVar("T")

CLEANUP_S = 2.0


async def cancel(task: asyncio.Task[Any] | None, timeout: float = CLEANUP_S) -> None:
    """Cancel ``task`` and wait for it at most ``timeout`` seconds."""
    if task is None or task.done():
        return
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=timeout)
    if not done:
        log.warning("%s did not end within %gs of being cancelled", task.get_name(), timeout)


async def until_set(stop: asyncio.Event, work: Awaitable[T]) -> T | None:
    """``work``'s result; or, as soon as ``stop`` is set, None, ``work`` cancelled (the caller
    tells the two apart by ``stop``). For a long step of a start-up (a snapshot read, a bucket
    read back) that a stop must not wait for, nor a cancellation alone end: Python 3.11's
    ``wait_for`` drops one that lands while the result it waits for is ready."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not task.done():
            await cancel(task)
    if task.cancelled():
        return None
    return task.result()


async def attempt(what: Awaitable[Any], timeout: float = CLEANUP_S) -> None:
    """Await ``what`` for at most ``timeout`` seconds, ignoring its failure (clean-up only)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(what, timeout)


async def off_loop(work: Callable[[], T], name: str) -> T:
    """``work()``, run on a daemon thread so that the loop (and a signal) is served meanwhile.

    Only for work with no effect but its result (a decode): called off (cancelled), it is
    abandoned, and a process that exits meanwhile does not wait for it, as it would for
    ``asyncio.to_thread``'s executor. ``name`` names the thread.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if done.done():  # called off
            return
        if ok:
            done.set_result(value)
        else:
            done.set_exception(value)

    def run() -> None:
        try:
            outcome: tuple[bool, Any] = (True, work())
        except BaseException as exc:  # handed to the awaiting task, as to_thread would
            outcome = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await done
