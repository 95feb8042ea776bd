"""What drives a processor over a feed: one message after another, in a task of its own.

A processor (:class:`~projector.nats.stream.Processor`) knows nothing of subscriptions, start
positions or the client's quirks; the :class:`~projector.nats.feed.StreamFeed` knows nothing
of what is done with a message. The runner sits between them, as eventsourcing's runners run
an ``EventProcessor``, and does what neither would:

- a processor's exception is kept in ``failure``, reported once to ``on_failure``, and no
  further message is handed over;
- a refusal that reaches it (a processor run without dead-lettering,
  :class:`~projector.nats.dead_lettering.DeadLettering`) stops it as an exception would:
  nothing is passed over unrecorded;
- every ``YIELD_EVERY`` messages the loop gets a turn, so a backlog does not starve the loop's
  other tasks (a processor's background work);
- ``position`` advances to each message's stream sequence once the processor has handled it,
  and ``caught_up`` is set once it has passed ``target`` (what the stream held at the start).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from nats.aio.msg import Msg

from projector.aio.progress import Progress
from projector.nats.feed import StreamFeed
from projector.nats.stream import Processor, Refused

YIELD_EVERY = 64  # messages handled back to back before the runner lets other tasks run


class Runner:
    """Hands each message of ``feed`` not handled yet to ``processor``, in stream order."""

    def __init__(
        self,
        feed: StreamFeed,
        processor: Processor,
        *,
        position: Progress,
        on_failure: Callable[[BaseException], None],
    ) -> None:
        self.feed = feed
        self.position = position
        self.caught_up = asyncio.Event()
        self.failure: BaseException | None = None
        self.target = 0  # the stream's last sequence at the start: caught up once passed
        self._processor = processor
        self._on_failure = on_failure
        self._halted = False
        self._since_yield = 0  # messages handled since the runner last gave the loop a turn

    def aim(self, target: int) -> None:
        """Caught up once past ``target`` (at once if the position is there already)."""
        self.target = target
        if target <= self.position.value:
            self.caught_up.set()

    async def run(self) -> None:
        feed, position = self.feed, self.position
        take, handled, deliver = feed.take, feed.handled, self.deliver  # once, not per message
        while not self._halted:
            taken = take()
            if taken is None:
                await feed.settle()
                continue
            msg, seq = taken
            if seq > position.value:
                await deliver(msg, seq)
                if self._halted:
                    continue
            if handled(msg):
                await feed.ack()

    def halt(self) -> None:
        """Hand no further message over; synchronous, so any callback can call it."""
        self._halted = True
        self.feed.halt()

    @property
    def halted(self) -> bool:
        return self._halted

    async def deliver(self, msg: Msg, seq: int) -> None:
        """Hand ``msg`` (stream sequence ``seq``) to the processor, then move past it."""
        if self._halted:
            return
        try:
            refused = await self._processor.handle(msg)
            if refused is not None:
                raise RuntimeError(_unrecorded(self.feed.stream, seq, refused))
            # A backlog never makes a handler wait, so it would starve the loop's other tasks
            # (the delta log, a snapshot being saved, the ticker, the lease): give them a turn,
            # every YIELD_EVERY messages (a turn per message cost a loop pass per event).
            self._since_yield += 1
            if self._since_yield >= YIELD_EVERY:
                self._since_yield = 0
                await asyncio.sleep(0)
        except Exception as exc:
            self.halt()
            self.failure = exc
            self._on_failure(exc)
            return
        if not self.caught_up.is_set() and seq >= self.target:
            self.caught_up.set()
        self.position.advance(seq)


def _unrecorded(stream: str, seq: int, refused: Refused | list[Refused]) -> str:
    first = refused[0] if isinstance(refused, list) else refused
    return (
        f"message {seq} of {stream} refused ({first.kind}: {first.reason}), "
        "and this consumer has no dead letters to put it in"
    )
