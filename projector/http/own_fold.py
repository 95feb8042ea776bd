"""The lease holder's calls: stored one message each, answered from its own writer's fold.

Why: a durable call used to wait for two JetStream round trips back to back (its event's
publish and ack, then the writer's delta read back from the deltas stream by an outcome
follower) and cost about 6.5 NATS messages of client parsing. The process that
holds a namespace's lease runs that namespace's writer, so it need not read the writer's
verdict back from the deltas: it hears it.

- Calls are stored by group commit (:meth:`OwnFold.commit`): while one group's events wait
  for their acks, the calls that come meanwhile gather, and go out together, in the order
  they came, once the group before them is acked (or after ``GROUP_WAIT_S``, so that an ack
  lost in a reconnect never holds calls back). A lone call goes out in the turn of the loop
  it came in; under load each send to the server carries many calls. Each event has its own
  ``Nats-Msg-Id`` and a reply subject under one wildcard subscription: no request, future
  or task per call. (Measured, a JetStream atomic batch costs the server ~2.4 ms per batch
  on a file stream, against ~17 µs per plain publish; BENCHMARKS.md. A record batch, many
  events in one stored message, would be one publish of :meth:`OwnFold.commit`.)
- Each call is answered from the writer's fold of its own stored message, which the writer's
  consumer hands over with the message's msg-id (:meth:`Writer.await_fold`). So the answer
  is by construction what every replay of the log decides for that message: same position,
  same log time (the event's time is the log's, fixed when it is stored, before its answer),
  whatever else the log holds around it. Nothing needs fencing or stamping: a router or
  another replica publishing at the same moment only changes where the event lands, and the
  fold says what that means.
- The ack only says when the event was *not* stored (an error: ``503``, nothing stored) and
  where it was (its sequence: a call whose event this writer did not fold, because the lease
  moved on, is answered from the deltas, as a replica that does not hold the lease answers).
  No ack and no fold within ``answer_within_s``: ``503``, perhaps stored. Never a guess.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections import deque
from collections.abc import Callable

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from projector.nats import direct_delivery, fast_publish
from projector.nats.failures import describe
from projector.nats.pub_ack import ACK_DECODER
from projector.write.writer import Writer
from seqstate.fold import Verdict

log = logging.getLogger("seqstate.slots")

SWEEP_S = 1.0
# A group whose acks have not all come by then no longer holds the next one back.
GROUP_WAIT_S = 0.002

Folded = Callable[[int, Verdict], None]  # (stream sequence, verdict)
Failed = Callable[[int, str], None]  # (stream sequence if known stored else 0, why)


class _Entry:
    __slots__ = ("acked", "failed", "folded", "payload", "seq", "subject")

    def __init__(self, subject: str, payload: bytes, folded: Folded, failed: Failed) -> None:
        self.subject = subject
        self.payload = payload
        self.folded = folded
        self.failed = failed
        self.seq = 0  # from the ack, once it came
        self.acked = False  # its ack, its fold or its failure came: its group waits no more


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
        self._waiting: dict[str, _Entry] = {}
        self._deadlines: deque[tuple[float, str]] = deque()
        self._group: list[_Entry] = []  # calls gathered for the next commit, in order
        self._unacked = 0  # events of the commit in flight not acked (nor folded) yet
        self._flush_due: asyncio.Handle | None = None  # the next group's send, scheduled
        self.commits = 0  # group commits made
        self.committed = 0  # events sent by them
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
        """Stop; every call not answered yet is failed (its ack's sequence, if it came, lets
        the caller answer it from the deltas)."""
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

    def submit(self, subject: str, payload: bytes, folded: Folded, failed: Failed) -> None:
        """Store one event by the next group commit; ``folded(seq, verdict)`` once the writer
        folded it, else ``failed(seq, why)`` (``seq`` 0: perhaps not stored). Its place is
        taken: an event submitted after it, or published after :meth:`flush`, goes after it."""
        entry = _Entry(subject, payload, folded, failed)
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
        """Publish ``entries``' events in order, each told its own verdict: one group commit.
        Queued on the connection together, so nats-py's flusher sends them in one write; the
        next group waits for their acks (at most ``GROUP_WAIT_S``)."""
        deadline = self._loop.time() + self.answer_within_s
        self.commits += 1
        self.committed += len(entries)
        for entry in entries:
            msg_id = f"{self._run}{next(self._ids)}"
            self._waiting[msg_id] = entry
            self._deadlines.append((deadline, msg_id))
            self.writer.await_fold(msg_id, self._on_fold(msg_id, entry))
            try:
                fast_publish.publish(
                    self.nc, entry.subject, entry.payload, self._prefix + msg_id, msg_id
                )
            except (nats.errors.Error, OSError) as exc:
                entry.acked = True  # no ack to wait for
                self.writer.forget_fold(msg_id)
                if self._waiting.pop(msg_id, None) is not None:
                    entry.failed(0, f"not sent: {describe(exc)}")
                continue
            self._unacked += 1

    def _on_fold(
        self, msg_id: str, entry: _Entry
    ) -> Callable[[int, Verdict | list[Verdict] | None], None]:
        def on_fold(seq: int, verdict: Verdict | list[Verdict] | None) -> None:
            if self._waiting.pop(msg_id, None) is None:
                return
            self._settled(entry)
            if verdict is None:
                entry.failed(entry.seq, "the lease holder's writer stopped before it folded it")
            elif isinstance(verdict, list):  # it sent one event: a batch is not its message
                entry.failed(seq, "a record batch was stored under this call's message id")
            else:
                entry.folded(seq, verdict)

        return on_fold

    def _settled(self, entry: _Entry) -> None:
        """``entry``'s event is acked, folded or failed: once all of its group's are, the
        calls gathered meanwhile go."""
        if entry.acked:
            return
        entry.acked = True
        self._unacked -= 1
        if not self._unacked and not self.closed:
            self.flush()

    async def _on_ack(self, msg: Msg) -> None:  # where nats-py's queue cannot be bypassed
        self._acked(msg)

    def _acked(self, msg: Msg) -> None:
        msg_id = msg.subject[len(self._prefix) :]
        entry = self._waiting.get(msg_id)
        if entry is None:
            return  # answered already: the fold came first
        try:
            ack = ACK_DECODER.decode(msg.data) if msg.data else None
        except msgspec.DecodeError:
            ack = None
        if ack is not None and ack.error is None and ack.seq:
            entry.seq = ack.seq
            self._settled(entry)
            return
        # Refused (or no stream took it): nothing is stored.
        self.writer.forget_fold(msg_id)
        del self._waiting[msg_id]
        self._settled(entry)
        error = None if ack is None else ack.error
        why = "no stream took it" if error is None else error.description or str(error)
        entry.failed(0, f"not stored: {why}")

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            now, deadlines = self._loop.time(), self._deadlines
            while deadlines and deadlines[0][0] <= now:
                _, msg_id = deadlines.popleft()
                entry = self._waiting.pop(msg_id, None)
                if entry is not None:
                    self.writer.forget_fold(msg_id)
                    self._settled(entry)
                    entry.failed(
                        entry.seq, f"not folded within {self.answer_within_s:g}s: perhaps stored"
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
        for msg_id, entry in waiting.items():
            self.writer.forget_fold(msg_id)
            entry.failed(entry.seq, why)
        for entry in group:  # never sent: nothing of it is stored
            entry.failed(0, f"not sent: {why}")
