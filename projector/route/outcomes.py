"""What the writer made of each event, learned from the deltas stream.

A caller that must answer with the real outcome of its event (the slot-tracker drop-in: 201
for an add booked, 409 for a duplicate, 404 for an unknown rank) cannot guess it before the
writer has folded the event: only the fold knows what else happened first. Every delta the
writer stores names its event's sequence and outcome (and, for a duplicate add, the rank that
holds the id), so one ordered consumer of the namespace's deltas, started before the caller
publishes, hands each waiting call its outcome: one subscription per process and namespace,
whatever the number of calls, and no request/reply round trip to the writer.

An event that has no delta was refused by the writer (dead-lettered): :meth:`Outcomes.of`
says so with ``outcome=None`` as soon as its dead letter is stored (a second ordered consumer,
of the namespace's dead letters, which only costs when there are some), or once a later
event's delta arrives.

Outcomes are per event: a record batch's events share its sequence and are told apart by
their index in it (its deltas' ``index``, its dead letters' ``Seqstate-Source-Index``). An
event of a batch with no delta of its own was refused once the batch's last delta part (or a
later delta) is read, or at once by its own dead letter.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from typing import TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from projector.aio.progress import Progress
from projector.nats.consumer import OrderedConsumer
from projector.nats.resources import dead_letter_stream
from projector.nats.stream import last_seq_of
from projector.settings.config import Config
from projector.wire.headers import SOURCE_INDEX, SOURCE_SEQ, SOURCE_STREAM
from seqstate import decode_deltas
from seqstate.batches import MAX_EVENTS as MAX_BATCH_EVENTS
from seqstate.batches import BatchDecodeError, decode_batch
from seqstate.errors import SeqstateError

REMEMBER = 65_536  # outcomes kept for calls that ask after their delta went by
REMEMBER_REFUSED = 1_024  # refused events kept for calls that ask after their dead letter
K = TypeVar("K")
V = TypeVar("V")


class OutcomeForgotten(SeqstateError, LookupError):
    """Asked for an event older than the outcomes still remembered."""


class OutcomesStopped(SeqstateError, RuntimeError):
    """The deltas could not be followed (the consumer failed)."""


class EventOutcome(msgspec.Struct, frozen=True):
    """``outcome`` None: the writer stored no delta for the event (it was dead-lettered)."""

    seq: int
    outcome: str | None
    owner: tuple[int, int] | None = None  # a duplicate add's: the rank that holds the id
    # Under the slot-tracker rules: a registration's block size, or 0 (TRACKER_ENDED) for the
    # removal of the last worker.
    block_size: int | None = None


class Outcomes:
    """``outcomes = await Outcomes(nc, config).start()``, then ``await outcomes.of(seq)``."""

    def __init__(self, nc: Client, config: Config, *, remember: int = REMEMBER) -> None:
        self.config = config
        self.remember = remember
        self._js = nc.jetstream()
        self._seen = Progress()  # the highest event sequence a delta has named (or settled)
        # The highest event sequence a delta has named (the newest stored when this started,
        # then each one followed): a position every view of the namespace reaches.
        self.named = 0
        # (seq, index in its record batch: 0 alone) -> outcome, in sequence order, oldest first.
        # Ordered, not a dict: a dict's first key, once the oldest are deleted, is found past
        # every slot deleted before it (a scan of up to ``remember`` per message).
        self._recent: OrderedDict[tuple[int, int], EventOutcome] = OrderedDict()
        self._oldest = 0  # the lowest sequence still answerable (older ones are forgotten)
        self._consumer: OrderedConsumer | None = None
        self._refused: dict[int, None] = {}  # events the writer dead-lettered, oldest first
        self._refused_in: dict[tuple[int, int], None] = {}  # events of batches, the same
        self._refused_of: dict[int, int] = {}  # a batch's sequence -> its events refused
        self._sizes: dict[int, int] = {}  # a batch's sequence -> its events, once read
        self._dead: OrderedConsumer | None = None

    async def start(self) -> Outcomes:
        """Follow the deltas from the newest one stored: what is published after this returns
        is always answered."""
        self._consumer = OrderedConsumer(
            self._js,
            self.config.deltas_stream,
            self.config.deltas_subject,
            self,
            on_failure=lambda exc: self._seen.advance(2**63),
        )
        newest = await last_seq_of(self._js, self.config.deltas_stream, self.config.deltas_subject)
        if newest:
            msg = await self._js.get_msg(self.config.deltas_stream, seq=newest)
            deltas = decode_deltas(msg.data or b"")
            self.named = max((d.seq or 0 for d in deltas), default=0)
            self._oldest = self.named + 1
        await self._consumer.start(after=newest)
        dead, subject = dead_letter_stream(self.config), self.config.dead_letter_subject
        # A failure here only loses the early answer: a later delta still settles the call.
        self._dead = OrderedConsumer(
            self._js, dead, subject, _Refusals(self), on_failure=lambda exc: None
        )
        newest_dead = await last_seq_of(self._js, dead, subject)
        if newest_dead:  # a refused event with no delta after it is folded too
            with contextlib.suppress(NotFoundError):
                self.refused_by((await self._js.get_msg(dead, seq=newest_dead)).headers)
        await self._dead.start(after=newest_dead)
        return self

    def refused(self, seq: int) -> None:
        """The writer dead-lettered event ``seq``: answer its caller now."""
        self._refused[seq] = None
        _trim(self._refused)
        self._seen.release(seq)

    def refused_in(self, seq: int, index: int) -> None:
        """The writer dead-lettered event ``index`` of record batch ``seq``: answer its
        caller now (its neighbours may have applied: the batch is no more settled)."""
        if (seq, index) in self._refused_in:
            return
        self._refused_in[(seq, index)] = None
        self._refused_of[seq] = self._refused_of.get(seq, 0) + 1
        _trim(self._refused_in)
        _trim(self._refused_of)
        _trim(self._sizes)
        self._seen.release(seq)

    def refused_by(self, dead_letter_headers: dict[str, str] | None) -> None:
        """A dead letter: if it is one of this namespace's events, that event was refused."""
        headers = dead_letter_headers or {}
        if headers.get(SOURCE_STREAM) == self.config.events_stream:
            with contextlib.suppress(KeyError, ValueError):
                seq = int(headers[SOURCE_SEQ])
                if SOURCE_INDEX in headers:  # one event of a record batch
                    self.refused_in(seq, int(headers[SOURCE_INDEX]))
                else:
                    self.refused(seq)

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
        if self._dead is not None:
            await self._dead.stop()

    async def handle(self, msg: Msg) -> None:
        """One deltas message: each event's outcome (its first part carries it); a stored
        message is settled once its last part is read."""
        recent = self._recent
        last = 0
        for delta in decode_deltas(msg.data):
            seq = delta.seq
            if seq is None:
                continue
            key = (seq, delta.index)
            if key not in recent:
                recent[key] = EventOutcome(seq, delta.outcome, delta.owner, delta.block_size)
            last = seq - 1 if delta.more else seq
        while len(recent) > self.remember:
            oldest, _ = recent.popitem(last=False)
            self._oldest = oldest[0] + 1
        if last:
            self.named = max(self.named, last)
            self._seen.advance(last)

    async def folded(self, seq: int, timeout: float | None = None) -> None:
        """Until the writer has folded event ``seq`` (and so every event before it): a delta
        named it or a later one, or it was refused (a record batch: every event of it, which
        its size, read once from the events stream, tells); ``TimeoutError`` after
        ``timeout``."""
        deadline = _deadline(timeout)
        while seq > self.named and seq not in self._refused:
            refused = self._refused_of.get(seq, 0)
            if refused:
                if refused >= await self._size_of(seq):
                    return
                if self._refused_of.get(seq, 0) != refused:
                    continue  # another of its dead letters came meanwhile
            await self._seen.wait(seq, _left(deadline))
            self._raise_stopped()

    async def _size_of(self, seq: int) -> int:
        """The events of record batch ``seq`` (more than any count when it cannot be read)."""
        size = self._sizes.get(seq)
        if size is None:
            try:
                msg = await self._js.get_msg(self.config.events_stream, seq)
                size = len(decode_batch(msg.data or b""))
            except (nats.errors.Error, BatchDecodeError, TimeoutError):
                return MAX_BATCH_EVENTS + 1  # a later delta settles it
            self._sizes[seq] = size
        return size

    def _raise_stopped(self) -> None:
        if self._consumer is not None and self._consumer.failure is not None:
            raise OutcomesStopped(f"the deltas stopped: {self._consumer.failure!r}")

    async def of(self, seq: int, timeout: float | None = None, *, index: int = 0) -> EventOutcome:
        """The outcome of event ``seq`` (``index``: event ``index`` of record batch ``seq``),
        once the writer has stored its delta (all of its message's, or a later one);
        ``TimeoutError`` after ``timeout`` seconds."""
        key, deadline = (seq, index), _deadline(timeout)
        while seq not in self._refused and key not in self._refused_in:
            await self._seen.wait(seq, _left(deadline))
            self._raise_stopped()
            if self._seen.value >= seq:  # else woken for another event of its batch
                found = self._recent.get(key)
                if found is not None:
                    return found
                if seq < self._oldest:
                    raise OutcomeForgotten(
                        f"event {seq} is older than the outcomes still remembered"
                    )
                break
        return EventOutcome(seq, None)


def _trim(kept: dict[K, V]) -> None:
    """The newest ``REMEMBER_REFUSED`` of ``kept`` (oldest first)."""
    while len(kept) > REMEMBER_REFUSED:
        del kept[next(iter(kept))]


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else asyncio.get_running_loop().time() + timeout


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())


class _Refusals:
    """The dead letters of one namespace: those of its events stream name a refused event."""

    def __init__(self, outcomes: Outcomes) -> None:
        self._outcomes = outcomes

    async def handle(self, msg: Msg) -> None:
        self._outcomes.refused_by(msg.headers)
