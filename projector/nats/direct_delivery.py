"""A subscription's messages handed to a function as nats-py reads them: no queue, no task hop.

Why: for a subscription with a callback, nats-py puts each message on an ``asyncio.Queue``,
and a task of the subscription takes it off and awaits the callback: a put, a get and a task
switch per message, before the consumer's own work. serve-http's lease holder receives two
messages per call (its event's ack, and the event back through the writer's consumer), and
every consumer of the pipeline one per stored message; their handlers only note the message
and wake their own runner, which is all that needs the loop (measured in
``benchmarks/slot_vs_dynamo.py``, recorded in BENCHMARKS.md).

:func:`attach` puts a sink in place of the subscription's queue (which nats-py keeps
private: :mod:`projector.nats.client_internals` swaps it): nats-py's reader calls
``on_msg(msg)`` at once, in the order it reads, and the byte count nats-py keeps for its
slow-consumer check is settled there. It returns False where this nats-py has no such
queue; the caller keeps the callback then. ``on_msg`` runs inside nats-py's reader: it must
be quick, and what it raises is logged and dropped, never let into the reader (a bug there
must not take the connection down).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from projector.nats import client_internals

log = logging.getLogger("seqstate.nats")


class _Sink:
    """Stands for the subscription's queue: what nats-py puts there goes to ``on_msg``."""

    def __init__(self, sub: Subscription, on_msg: Callable[[Msg], None]) -> None:
        self._sub = sub
        self._on_msg = on_msg

    def put_nowait(self, msg: Msg) -> None:
        client_internals.settle(self._sub, len(msg.data))  # nothing stays pending here
        try:
            self._on_msg(msg)
        except Exception:
            log.exception("a message of %s could not be handed over", msg.subject)

    def qsize(self) -> int:
        return 0

    def empty(self) -> bool:
        return True

    def task_done(self) -> None:
        pass

    async def join(self) -> None:
        pass

    async def get(self) -> Any:  # nothing is ever taken from here: nats-py's task waits on
        await asyncio.get_running_loop().create_future()


def usable(sub: Subscription) -> bool:
    """Whether ``sub`` keeps the queue and byte count this replaces (nats-py 2.x)."""
    return client_internals.keeps_queue(sub)


def attach(sub: Subscription, on_msg: Callable[[Msg], None]) -> bool:
    """Hand ``sub``'s messages to ``on_msg`` as they are read, those already queued first;
    False (nothing changed) if this nats-py's subscription is not the one this knows."""
    sink = _Sink(sub, on_msg)
    queued = client_internals.swap_queue(sub, sink)
    if queued is None:
        return False
    while not queued.empty():  # read before this: not taken by nats-py's task yet
        sink.put_nowait(queued.get_nowait())
    return True
