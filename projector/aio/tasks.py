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
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

log = logging.getLogger("seqstate")
T = TypeVar("T")

CLEANUP_S = 2.0


# A cancelled task still running this long after is taken to have dropped the cancellation
# (below), not to be cleaning up: few clean-ups take a second, a cut one leaves a consumer or
# a subscription for the server to expire.
RECANCEL_S = 2.0


async def cancel(task: asyncio.Task[Any] | None, timeout: float = CLEANUP_S) -> None:
    """Cancel ``task`` and wait for it at most ``timeout`` seconds (:func:`cancel_all`)."""
    if task is not None:
        await cancel_all([task], timeout)


async def cancel_all(
    tasks: Iterable[asyncio.Future[Any]],
    timeout: float | None = CLEANUP_S,
    *,
    again_after_s: float = RECANCEL_S,
) -> set[asyncio.Future[Any]]:
    """Cancel each of ``tasks`` and wait for them, at most ``timeout`` seconds (None: until
    they end); each still running ``again_after_s`` later is cancelled again, and so on.

    Once is not enough: Python 3.11's ``wait_for``, which nats-py awaits in every request
    and flush, drops a cancellation that lands as the reply arrives, and the task then goes
    on as if it had never been cancelled (a loop to its next wait, for ever). A task whose
    clean-up takes longer than ``again_after_s`` has it cut short, so a caller whose tasks
    clean up at length (the demo freeing what it has in flight) allows them more. Returns
    the tasks that had not ended, each logged; their failures are retrieved, not raised.
    """
    loop = asyncio.get_running_loop()
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    deadline = None if timeout is None else loop.time() + timeout
    while pending:
        for task in pending:
            task.cancel()
        wait = again_after_s if deadline is None else min(again_after_s, deadline - loop.time())
        if wait <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=wait)
    for task in tasks:
        if task.done():
            _retrieve(task)
        elif task in pending:
            log.warning("%s did not end within %gs of being cancelled", _name(task), timeout or 0)
    return pending


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _name(task: asyncio.Future[Any]) -> str:
    return task.get_name() if isinstance(task, asyncio.Task) else repr(task)


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
