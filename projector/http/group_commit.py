"""Group commit: the lease holder's calls stored as atomic batches, answered from its own fold.

Why: a durable call used to cost two JetStream round trips back to back (its event's publish
and ack, then the writer's delta read back by an outcome follower) and about 6.5 NATS
messages of client parsing (issue 23). The process that holds a namespace's lease runs its
writer, so it need not learn the writer's verdict from the deltas stream: it can hear it.

- Calls queue up while a batch is on its way; the next batch takes every call queued (up to
  the server's 1,000 messages), in arrival order, and stores them as one atomic batch
  (:mod:`projector.nats.batch_publish`): one ack for all of them.
- Each call is answered from the writer's fold of its own stored message, which the writer's
  consumer hands over with the message's batch id and sequence in its headers
  (:meth:`Writer.await_batch`). So the answer is, by construction, what every replay of the
  log decides for that message: same position, same log time, whatever else the log holds
  around it. Nothing has to be fenced or stamped: a router or another replica publishing at
  the same moment only changes where the batch lands, and the fold says what that means.
- When the holder cannot tell (a refused batch stores nothing; an unconfirmed one may be
  stored), the calls are answered ``503`` with the reason, never guessed; a batch the server
  stored but this writer did not fold (the lease moved on) is answered from the deltas, as a
  replica that does not hold the lease answers (``late``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import nats.errors

from projector.nats.batch_publish import (
    MAX_BATCH,
    BatchFailed,
    BatchPublisher,
    BatchUnconfirmed,
)
from projector.nats.failures import describe
from projector.write.writer import Writer
from seqstate.fold import Verdict

log = logging.getLogger("seqstate.slots")

MAX_BATCH_BYTES = 4 * 1024 * 1024  # payload per batch: a few large adds do not make one huge
# One batch stored at a time: the next forms while the last one's ack travels, and a refused
# batch's calls take the slow path before any later call is sent, so a connection's calls
# stay in its order whatever happens.
IN_FLIGHT = 1

# (stream sequence, verdict) once folded; (0, None) never: see GroupCommit.submit
Folded = Callable[[int, Verdict], None]
Failed = Callable[[int, str], None]  # (stream sequence if stored else 0, why)
Again = Callable[[str], Awaitable[None]]  # (why): store it alone, the slow way, and answer


class _Entry:
    __slots__ = ("again", "failed", "folded", "payload", "subject")

    def __init__(
        self, subject: str, payload: bytes, folded: Folded, failed: Failed, again: Again
    ) -> None:
        self.subject = subject
        self.payload = payload
        self.folded = folded
        self.failed = failed
        self.again = again


class GroupCommit:
    """One namespace's group commit, for as long as this process's ``writer`` folds it."""

    def __init__(
        self, writer: Writer, publisher: BatchPublisher, *, answer_within_s: float = 30.0
    ) -> None:
        self.writer = writer
        self.publisher = publisher
        self.answer_within_s = answer_within_s
        self._queue: list[_Entry] = []
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(IN_FLIGHT)
        self._batches: set[asyncio.Task[None]] = set()
        self._runner: asyncio.Task[None] | None = None
        self.closed = False

    def start(self) -> GroupCommit:
        self._runner = asyncio.create_task(self._run(), name="seqstate-group-commit")
        return self

    def submit(
        self, subject: str, payload: bytes, folded: Folded, failed: Failed, again: Again
    ) -> None:
        """Queue one event; ``folded(seq, verdict)`` once the writer folded it;
        ``failed(seq, why)`` if that cannot be known here (``seq`` 0: perhaps not stored);
        ``await again(why)`` if the server refused its batch (nothing stored): it is stored
        alone, before any later call is sent."""
        self._queue.append(_Entry(subject, payload, folded, failed, again))
        if len(self._queue) == 1:
            self._wake.set()

    async def close(self, why: str) -> None:
        """Stop taking calls; those queued and not sent are failed, unstored."""
        self.closed = True
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
        for task in list(self._batches):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        queued, self._queue = self._queue, []
        for entry in queued:
            entry.failed(0, why)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                await self._slots.acquire()
                batch = self._take()
                task = asyncio.create_task(self._store(batch))
                self._batches.add(task)
                task.add_done_callback(self._batches.discard)

    def _take(self) -> list[_Entry]:
        queue, size, count = self._queue, 0, 0
        for entry in queue:
            size += len(entry.payload)
            if count == MAX_BATCH or (count and size > MAX_BATCH_BYTES):
                break
            count += 1
        batch = queue[:count]
        del queue[:count]
        return batch

    async def _store(self, batch: list[_Entry]) -> None:
        """Store one batch; each of its calls is answered by the fold, or failed here."""
        left = dict(enumerate(batch, 1))  # batch sequence -> call not answered yet
        done = asyncio.get_running_loop().create_future()

        def on_fold(seq: int, number: int, verdict: Verdict | None) -> None:
            if verdict is None:  # the writer stopped: settled below
                if not done.done():
                    done.set_result(None)
                return
            entry = left.pop(number, None)
            if entry is not None:
                entry.folded(seq, verdict)
            if not left and not done.done():
                done.set_result(None)

        writer = self.writer
        batch_id = self.publisher.next_id()
        writer.await_batch(batch_id, on_fold)
        last, released = 0, False
        try:
            try:
                last = await self.publisher.publish(
                    [(e.subject, e.payload) for e in batch], batch_id
                )
            except BatchFailed as exc:
                # Nothing of it is stored (as when the stream's configuration changes while
                # the batch travels: "incomplete"): each call is stored alone, in order,
                # before the next batch goes.
                log.info("batch %s refused (%s): its calls are stored one by one", batch_id, exc)
                writer.forget_batch(batch_id)
                for entry in batch:
                    await entry.again(str(exc))
                left.clear()
            self._slots.release()
            released = True
            if left:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(done), self.answer_within_s)
            why = "the lease holder's writer stopped before it folded the call's event"
        except BatchUnconfirmed as exc:
            # Perhaps stored: if so the writer folds it soon and answers; else say so.
            self._slots.release()
            released = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(done), self.answer_within_s)
            why = f"the call's event may not be stored ({exc})"
        except (nats.errors.Error, OSError) as exc:
            why = f"the call's event could not be sent: {describe(exc)}"
        finally:
            if not released:
                self._slots.release()
            writer.forget_batch(batch_id)
        if not left:
            return
        first = last - len(batch) + 1 if last else 0
        log.warning("%d call(s) of batch %s not answered by the fold: %s", len(left), batch_id, why)
        for number, entry in left.items():
            entry.failed(first + number - 1 if first else 0, why)
