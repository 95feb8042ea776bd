"""A processor run over a stream: a feed, a runner, and dead-lettering around the processor.

The writer, the projector and the router's outcomes each run a processor this way; the parts
are in modules of their own, each with its why: :mod:`projector.nats.feed` (what reads the
stream, bounded and ordered), :mod:`projector.nats.runner` (what drives the processor) and
:mod:`projector.nats.dead_lettering` (what a processor refuses, stored once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from nats.js import JetStreamContext

from projector.aio.progress import Progress
from projector.aio.tasks import cancel
from projector.nats import client_internals
from projector.nats.dead_lettering import DeadLettering
from projector.nats.feed import DEFAULT_WINDOW, StreamFeed
from projector.nats.runner import Runner
from projector.nats.stream import DeadLetterSink, Processor, last_seq_of


class OrderedConsumer:
    """Runs a processor over ``subjects`` of ``stream``, in stream order, from a position, with
    at most ``window`` messages received and not yet handled (:class:`StreamFeed`).

    ``position`` (a :class:`~projector.aio.progress.Progress`, the caller's or a new one)
    advances to each message's stream sequence once the processor has handled it; a caller
    needs to know when the processor has seen what the stream held when it started:
    ``caught_up`` is set once it has passed the subjects' last sequence as looked up at
    :meth:`start` (at once if there was nothing to pass). A processor's exception is kept in
    ``failure`` and reported once to ``on_failure``, and no further message is handed over
    (:class:`Runner`).

    A message the processor refuses is written to ``dead_letters`` once, the processor is told
    (``dead_lettered``), and the position moves past it (:class:`DeadLettering`). A consumer
    without ``dead_letters`` cannot refuse: a refusal stops it, as an exception would.
    """

    def __init__(
        self,
        js: JetStreamContext,
        stream: str,
        subjects: str,
        processor: Processor,
        *,
        on_failure: Callable[[BaseException], None],
        position: Progress | None = None,
        dead_letters: DeadLetterSink | None = None,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        self.stream = stream
        self.subjects = subjects
        self.window = window
        self.position = position if position is not None else Progress()
        self.feed = StreamFeed(js, stream, subjects, self.position, window=window)
        handler = (
            processor if dead_letters is None else DeadLettering(processor, dead_letters, stream)
        )
        self.runner = Runner(self.feed, handler, position=self.position, on_failure=on_failure)
        self.caught_up = self.runner.caught_up
        self.dead_letters = dead_letters
        self._js = js
        self._task: asyncio.Task[None] | None = None

    async def start(self, after: int = 0) -> None:
        """Subscribe from the message after stream sequence ``after`` (0: from the first)."""
        client_internals.install()  # a feed on a client of the caller's making takes any subject
        self.position.advance(after)
        self.runner.aim(await last_seq_of(self._js, self.stream, self.subjects))
        await self.feed.open()
        self._task = asyncio.create_task(self.runner.run(), name=f"seqstate-consume-{self.stream}")

    @property
    def target(self) -> int:
        """The subjects' last sequence when :meth:`start` looked it up: ``caught_up`` is set
        once the processor has passed it (0 before the start)."""
        return self.runner.target

    @property
    def failure(self) -> BaseException | None:
        return self.runner.failure

    @property
    def held(self) -> int:
        """Messages received and not yet handled (at most ``window``)."""
        return self.feed.held

    @property
    def peak_held(self) -> int:
        """The most messages ever received and not yet handled at once."""
        return self.feed.peak_held

    @property
    def restarts(self) -> int:
        """Consumers started again on the server (a gap, a silent server)."""
        return self.feed.restarts

    def halt(self) -> None:
        """Hand no further message over; synchronous, so any callback can call it."""
        self.runner.halt()

    async def stop(self) -> None:
        """Halt, then end the subscription and the consumer (within bounds: the server may be
        away). A message being handled is left to finish only if this is called from within
        it."""
        self.runner.halt()
        current = asyncio.current_task()
        task, self._task = self._task, None
        if task is not None and task is not current:
            await cancel(task)
        if self.dead_letters is not None:
            self.dead_letters.say_held()
        await self.feed.close(current)
