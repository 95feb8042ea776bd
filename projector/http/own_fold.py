"""The lease holder's calls: stored by group commit in record batches, answered from its own
writer's fold.

Why: a durable call used to wait for two JetStream round trips back to back (its event's
publish and ack, then the writer's delta read back from the deltas stream by an outcome
follower) and cost about 6.5 NATS messages of client parsing. The process that
holds a namespace's lease runs that namespace's writer, so it need not read the writer's
verdict back from the deltas: it hears it.

- Calls are stored by group commit (:meth:`OwnFold.commit`): while one group's messages wait
  for their acks, the calls that come meanwhile gather, and go out together once the group
  before them is acked (or after ``GROUP_WAIT_S``, so that an ack lost in a reconnect never
  holds calls back). A lone call goes out in the turn of the loop it came in.
- A group goes out as record batches (:mod:`seqstate.batches`): its events of one subject
  share one stored message, one ``Nats-Msg-Id`` and one ack (a batch holds only events of its
  own subject, as the fold checks), cut to the server's payload limit and the batches'
  bounds. The calls of one connection (``order``) are stored in the order they came (an
  event joins its subject's open batch only where that keeps it behind its connection's
  previous call, else starts a batch after it); calls of different connections promise no
  order among them, and a batch of one event is a plain message, byte for byte as before.
  Replies come under one wildcard subscription: no request, future or task per call.
  (Measured, a JetStream atomic batch costs the server ~2.4 ms per batch on a file stream,
  against ~17 µs per plain publish; BENCHMARKS.md: a record batch is one plain publish.)
- Each call is answered from the writer's fold of its own event: the verdict at its index
  in the verdicts of the stored message, which the writer's consumer hands over with the
  message's msg-id (:meth:`Writer.await_fold`). So the answer is by construction what every
  replay of the log decides for that event: same position, same log time (the message's,
  fixed when it is stored, before its answer), whatever else the log holds around it. An
  event refused within a batch is refused alone, as it would be alone (its neighbours
  apply), and answered as a refused single event is. Nothing needs fencing or stamping: a
  router or another replica publishing at the same moment only changes where the event
  lands, and the fold says what that means.
- The ack only says when the message was *not* stored (an error: ``503`` for each of its
  calls, nothing stored) and where it was (its sequence, and each call's index in it: a call
  whose event this writer did not fold, because the lease moved on, is answered from the
  deltas, as a replica that does not hold the lease answers). No ack and no fold within
  ``answer_within_s``: ``503``, perhaps stored. Never a guess.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections import deque
from collections.abc import Callable, Hashable
from typing import Protocol, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from projector.nats import direct_delivery, fast_publish
from projector.nats.failures import describe
from projector.nats.pub_ack import ACK_DECODER
from projector.wire.sizes import batch_limit
from projector.write.writer import Writer
from seqstate.batches import MAX_EVENTS as MAX_BATCH_EVENTS
from seqstate.batches import batch_size, encode_batch_of
from seqstate.fold import Verdict

log = logging.getLogger("seqstate.slots")

SWEEP_S = 1.0
# A group whose acks have not all come by then no longer holds the next one back.
GROUP_WAIT_S = 0.002

Folded = Callable[[int, Verdict], None]  # (stream sequence, verdict)
# (stream sequence if known stored else 0, the event's index in its message, why)
Failed = Callable[[int, int, str], None]


class _Entry:
    """One call's event, waiting for its group commit."""

    __slots__ = ("failed", "folded", "order", "payload", "subject")

    def __init__(
        self, subject: str, payload: bytes, folded: Folded, failed: Failed, order: Hashable
    ) -> None:
        self.subject = subject
        self.payload = payload
        self.folded = folded
        self.failed = failed
        self.order = order


class Queued(Protocol):
    """What :func:`by_message` reads of a call that waits for its group commit."""

    subject: str
    payload: bytes
    order: Hashable  # calls of one order (a connection) are stored in the order they came


Q = TypeVar("Q", bound=Queued)


def by_message(entries: list[Q], limit: int) -> list[list[Q]]:
    """``entries`` by stored message, in the order to send them: each joins the last batch
    of its subject unless that would store it before its connection's previous call, or take
    the batch over ``limit`` bytes or :data:`~seqstate.batches.MAX_EVENTS`; else it starts a
    batch. Calls of different connections keep no order among them; a subject's calls of one
    connection keep theirs, so do its calls across subjects."""
    batches: list[list[Q]] = []
    sizes: list[int] = []  # the events' bytes of each batch
    last: dict[str, int] = {}  # subject -> its last batch
    behind: dict[Hashable, int] = {}  # connection -> the batch of its last call
    for entry in entries:
        at = last.get(entry.subject, -1)
        grown = len(entry.payload) + (sizes[at] if at >= 0 else 0)
        if (
            at < 0
            or at < behind.get(entry.order, -1)
            or len(batches[at]) >= MAX_BATCH_EVENTS
            or batch_size(len(batches[at]) + 1, grown) > limit
        ):
            at = last[entry.subject] = len(batches)
            batches.append([])
            sizes.append(0)
            grown = len(entry.payload)
        batches[at].append(entry)
        sizes[at] = grown
        behind[entry.order] = at
    return batches


class _Message:
    """One stored message of a group commit: a call's event, or a record batch of several."""

    __slots__ = ("acked", "entries", "seq")

    def __init__(self, entries: list[_Entry]) -> None:
        self.entries = entries
        self.seq = 0  # from the ack, once it came
        self.acked = False  # its ack, its fold or its failure came: its group waits no more

    def fail(self, seq: int, why: str) -> None:
        """Each call of the message failed, told its place in it (for its event's delta)."""
        for index, entry in enumerate(self.entries):
            entry.failed(seq, index, why)


class OwnFold:
    """``own = await OwnFold(nc, writer).start()``; ``own.submit(...)`` per call, for as
    long as this process's ``writer`` folds the namespace; ``await own.close(why)``."""

    def __init__(self, nc: Client, writer: Writer, *, answer_within_s: float = 30.0) -> None:
        self.nc = nc
        self.writer = writer
        self.answer_within_s = answer_within_s
        self._prefix = f"{nc.new_inbox()}."
        self._run = f"fold-{uuid.uuid4().hex[:16]}:"
        self._ids = itertools.count(1)
        self._waiting: dict[str, _Message] = {}
        self._deadlines: deque[tuple[float, str]] = deque()
        self._group: list[_Entry] = []  # calls gathered for the next commit, in order
        self._unacked = 0  # messages of the commit in flight not acked (nor folded) yet
        self._flush_due: asyncio.Handle | None = None  # the next group's send, scheduled
        self.commits = 0  # group commits made
        self.committed = 0  # events sent by them
        self.messages = 0  # messages sent by them (a record batch is one)
        self._sub: Subscription | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()
        self.closed = False

    async def start(self) -> OwnFold:
        self._sub = await self.nc.subscribe(f"{self._prefix}*", cb=self._on_ack)
        direct_delivery.attach(self._sub, self._acked)
        self._sweeper = asyncio.create_task(self._sweep(), name="seqstate-own-fold-sweep")
        return self

    async def close(self, why: str) -> None:
        """Stop; every call not answered yet is failed (its message's sequence, if its ack
        came, lets the caller answer it from the deltas)."""
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._fail_all(why)

    def submit(
        self, subject: str, payload: bytes, folded: Folded, failed: Failed, order: Hashable
    ) -> None:
        """Store one event by the next group commit; ``folded(seq, verdict)`` once the writer
        folded it, else ``failed(seq, index, why)`` (``seq`` 0: perhaps not stored; ``index``
        its place in the stored message). Its place is taken: an event submitted after it
        with the same ``order`` (its connection), or published after :meth:`flush`, goes
        after it."""
        entry = _Entry(subject, payload, folded, failed, order)
        if not self._unacked and not self._group:  # nothing in flight: it goes at once
            self.commit([entry])
            return
        self._group.append(entry)
        if self._flush_due is None:
            self._flush_due = self._loop.call_later(GROUP_WAIT_S, self.flush)

    def flush(self) -> None:
        """Send the calls gathered so far now (before another publish that must follow
        them on the connection: a call taking another path behind them)."""
        if self._flush_due is not None:
            self._flush_due.cancel()
            self._flush_due = None
        group, self._group = self._group, []
        if group:
            self.commit(group)

    def commit(self, entries: list[_Entry]) -> None:
        """Publish ``entries``' events, in record batches by subject (:func:`by_message`),
        each told its own verdict: one group commit. Queued on the connection together, so
        nats-py's flusher sends them in one write; the next group waits for their acks (at
        most ``GROUP_WAIT_S``)."""
        deadline = self._loop.time() + self.answer_within_s
        self.commits += 1
        self.committed += len(entries)
        if len(entries) == 1:
            self._send(_Message(entries), deadline)
            return
        limit = batch_limit(self.nc.max_payload)
        for batch in by_message(entries, limit):
            self._send(_Message(batch), deadline)

    def _send(self, message: _Message, deadline: float) -> None:
        entries = message.entries
        if len(entries) == 1:
            payload = entries[0].payload
        else:
            payload = encode_batch_of([entry.payload for entry in entries])
        msg_id = f"{self._run}{next(self._ids)}"
        self._waiting[msg_id] = message
        self._deadlines.append((deadline, msg_id))
        self.writer.await_fold(msg_id, self._on_fold(msg_id, message))
        self.messages += 1
        try:
            fast_publish.publish(
                self.nc, entries[0].subject, payload, self._prefix + msg_id, msg_id
            )
        except (nats.errors.Error, OSError) as exc:
            message.acked = True  # no ack to wait for
            self.writer.forget_fold(msg_id)
            if self._waiting.pop(msg_id, None) is not None:
                message.fail(0, f"not sent: {describe(exc)}")
            return
        self._unacked += 1

    def _on_fold(
        self, msg_id: str, message: _Message
    ) -> Callable[[int, Verdict | list[Verdict] | None], None]:
        def on_fold(seq: int, verdict: Verdict | list[Verdict] | None) -> None:
            if self._waiting.pop(msg_id, None) is None:
                return
            self._settled(message)
            entries = message.entries
            if verdict is None:
                message.fail(message.seq, "the lease holder's writer stopped before it folded it")
            elif not isinstance(verdict, list):  # one event's, or a batch refused whole
                for entry in entries:
                    entry.folded(seq, verdict)
            elif len(entries) == 1 or len(verdict) != len(entries):
                message.fail(seq, "another message was stored under this message's id")
            else:
                for entry, each in zip(entries, verdict, strict=True):
                    entry.folded(seq, each)

        return on_fold

    def _settled(self, message: _Message) -> None:
        """``message`` is acked, folded or failed: once all of its group's are, the calls
        gathered meanwhile go."""
        if message.acked:
            return
        message.acked = True
        self._unacked -= 1
        if not self._unacked and not self.closed:
            self.flush()

    async def _on_ack(self, msg: Msg) -> None:  # where nats-py's queue cannot be bypassed
        self._acked(msg)

    def _acked(self, msg: Msg) -> None:
        msg_id = msg.subject[len(self._prefix) :]
        message = self._waiting.get(msg_id)
        if message is None:
            return  # answered already: the fold came first
        try:
            ack = ACK_DECODER.decode(msg.data) if msg.data else None
        except msgspec.DecodeError:
            ack = None
        if ack is not None and ack.error is None and ack.seq:
            message.seq = ack.seq
            self._settled(message)
            return
        # Refused (or no stream took it): nothing is stored.
        self.writer.forget_fold(msg_id)
        del self._waiting[msg_id]
        self._settled(message)
        error = None if ack is None else ack.error
        why = "no stream took it" if error is None else error.description or str(error)
        message.fail(0, f"not stored: {why}")

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            now, deadlines = self._loop.time(), self._deadlines
            while deadlines and deadlines[0][0] <= now:
                _, msg_id = deadlines.popleft()
                message = self._waiting.pop(msg_id, None)
                if message is not None:
                    self.writer.forget_fold(msg_id)
                    self._settled(message)
                    message.fail(
                        message.seq,
                        f"not folded within {self.answer_within_s:g}s: perhaps stored",
                    )
            if not self._waiting:
                deadlines.clear()

    def _fail_all(self, why: str) -> None:
        if self._flush_due is not None:
            self._flush_due.cancel()
            self._flush_due = None
        waiting, self._waiting = self._waiting, {}
        group, self._group = self._group, []
        self._deadlines.clear()
        self._unacked = 0
        for msg_id, message in waiting.items():
            self.writer.forget_fold(msg_id)
            message.fail(message.seq, why)
        for entry in group:  # never sent: nothing of it is stored
            entry.failed(0, 0, f"not sent: {why}")
