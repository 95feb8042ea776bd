"""The writer's side of SEQSTATE_DELTAS: a gap-free, ordered chain of deltas, one writer at a time.

Pipelined publishes lose the middle of a sequence when the server dies: the messages in flight
at the crash are gone while later ones, sent after the client reconnected, are stored, and a
writer restarted after the newest stored delta never sees the hole (the bucket stayed wrong
for good). So an append is stored whole or not at all, and only right after the previous one:
where the stream takes atomic batches (nats-server 2.12+; :func:`projector.nats.resources.
ensure` turns ``allow_atomic`` on), an append is one batch of up to ``MAX_BATCH_MESSAGES``
messages sent back to back, which the server stores together at the batch's commit or not at
all; on an older server it is one message. One append is in flight at a time, and its first
message carries

- ``Nats-Expected-Last-Subject-Sequence``: the stream sequence of the previous message on this
  namespace's subject, so the server stores it only right after that one. A second writer of
  the namespace (or a message from nowhere) breaks the compare-and-set instead of interleaving.

Every message carries

- ``Seqstate-Prev-Source-Seq``: the source sequence the previous message ended at, so the
  projector can check that each message continues the last (see projection.py);
- ``Nats-Msg-Id``: its last source sequence (and part), so a retry after a lost ack is
  stored once (the server refuses a batch holding an id it has: the retry then finds the
  batch stored, as it finds a message whose ack was lost).

No message exceeds the server's payload limit: a batch is cut by bytes, and a delta too large
for a message on its own (an expiry releasing very many requests) is cut into parts
(:func:`seqstate.deltas.split_delta`, deterministic for a given limit). A message may end in
the middle of an event's parts; it then says so (``Seqstate-Source-Part``), its
``Seqstate-Prev-Source-Seq`` successors keep naming the last *whole* event, and a writer
restarted there skips the parts already stored.

One append in flight costs little in throughput: while it travels, what the writer folds
gathers into the next (up to ``MAX_BATCH`` deltas a message and under the payload limit, up to
``MAX_BATCH_MESSAGES`` messages a batch), so a backlog goes out in large batches, thousands of
deltas per round trip. A steady stream of live events, each folded on its own, stores at
most one message per ``LINGER_S`` (5 ms): a delta that comes within that time of the last
store lingers for those of the events folded right after it, so that calls made one at a time
share a message; an event after a quiet spell goes at once, and so does a full message or a
:meth:`DeltaLog.flush`. The linger only delays an append: the chain, its compare-and-set and a
restart's resumption are the same.

A publish that fails (the server restarting, a leader election) is retried with the same
headers for ``retry_for_s``; if the server did store it before the failure, the
compare-and-set reports the subject's last sequence and the message found there is ours (the
last of the batch, or of a prefix of it: only the rest is sent again). A
writer that cannot store a delta for that long fails (``WriterStalled``) and its process
exits non-zero: a restart resumes from the last stored delta, which by construction has no
hole before it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from projector.aio.progress import Progress
from projector.aio.tasks import cancel
from projector.nats.client_internals import client_of
from projector.nats.failures import describe, explain
from projector.wire.chain import chain_problem, source_part, source_seq
from projector.wire.headers import (
    BATCH_COMMIT,
    BATCH_ID,
    BATCH_SEQUENCE,
    EXPECTED_LAST_SUBJECT_SEQ,
    MSG_ID,
    PREV_SOURCE_SEQ,
    SOURCE_PART,
    SOURCE_SEQ,
)
from projector.wire.sizes import DELTA_HEADROOM, largest_event
from seqstate import Delta, decode_deltas
from seqstate.deltas import as_parts, encode_delta, join_deltas, message_size, split_delta
from seqstate.errors import SeqstateError

log = logging.getLogger("seqstate.writer")

WRONG_LAST_SEQUENCE = 10071  # JetStream's error code when that expectation fails
DUPLICATE_IN_BATCH = 10201  # an atomic batch holds a message id the server has stored already
MAX_BATCH = 256  # deltas per message
# Messages and bytes per atomic batch (the server takes up to 1,000 messages): one round trip
# stores up to 8,192 deltas while the fold gathers the next batch.
MAX_BATCH_MESSAGES = 32
MAX_BATCH_BYTES = 8 << 20
# Deltas folded but not stored (the batch in flight included); the fold waits beyond this.
# Two full batches: one in flight, the next gathering; more only holds memory while the deltas
# lag (a writer catching up kept 100,000, ~100 MB, with no gain in rate).
MAX_PENDING = 2 * MAX_BATCH_MESSAGES * MAX_BATCH
# The least time between two stores of live deltas: a delta that comes sooner after the last
# store waits for the deltas of the events folded right after it, to share one message (and
# its ack, its deliveries to every follower and the projector's work) with them. At one call
# at a time, each event had a message of its own, about a third of serve-http's work per call.
# A delta after a quiet spell goes at once, so an isolated event is as fresh as before; under
# a steady stream the bucket and every follower see an event at most this much later. A full
# message, or a flush (a writer stopping, a caller waiting), goes at once.
# 5 ms, not 2: serve-http spent 190 µs of CPU per call at one connection, against 227.
LINGER_S = 0.005
ACK_TIMEOUT_S = 2.0  # per attempt: a request in flight when the server died never returns
RETRY_FOR_S = 60.0
MAX_BACKOFF_S = 1.0


class WriterStalled(SeqstateError, RuntimeError):
    """Deltas could not be stored; the writer stops so a restart can resume cleanly."""


class AnotherWriter(WriterStalled):
    """Another writer publishes deltas for this namespace: two writers would corrupt the chain."""


class DeltaUnstorable(WriterStalled):
    """One delta alone exceeds the server's payload limit."""


class _Queued(NamedTuple):
    """A delta folded and not sent yet, encoded as it was appended (while its objects were
    fresh: kept as objects until a batch was cut, a catch-up's deltas cost as much again to
    encode and free then, thousands of them later), with what the chain's headers need."""

    seq: int
    part: int
    more: bool
    data: bytes


@dataclass(frozen=True)
class _Message:
    """One DELTAS message of a batch: its deltas' encoding, how many, and the first and last
    (the chain's headers name them)."""

    payload: bytes
    count: int
    first: _Queued
    last: _Queued


@dataclass(frozen=True)
class DeltaLogSettings:
    """The names a delta log writes to (and checks a stranger's delta against)."""

    namespace: str
    events_stream: str
    deltas_stream: str
    deltas_subject: str


class DeltaLog:
    """Appends deltas to the namespace's subject of SEQSTATE_DELTAS, in order, without holes."""

    def __init__(
        self,
        js: JetStreamContext,
        settings: DeltaLogSettings,
        *,
        max_payload: int,
        retry_for_s: float = RETRY_FOR_S,
        linger_s: float = LINGER_S,
    ) -> None:
        self._js = js
        self._settings = settings
        self._max_payload = max_payload
        self._limit = max_payload - DELTA_HEADROOM
        self._retry_for_s = retry_for_s
        self._pending: deque[_Queued] = deque()  # folded, not sent yet
        self._flight = 0  # deltas of the batch being stored
        self._flight_first = 0  # the first one's source sequence
        # Whether the stream takes atomic batches (nats-server 2.12+, ``allow_atomic``): read
        # by :meth:`take_batches`; without, one message is in flight at a time.
        self._atomic = False
        self._batch_prefix = f"{os.getpid():x}.{id(self):x}.{time.time_ns():x}"
        self._batches = 0
        self._wake = asyncio.Event()
        self._linger_s = linger_s
        self._lingering: asyncio.Future[None] | None = None  # the linger under way
        self._hurried_to = 0  # a flush waits for the deltas up to this event: no linger
        self._last_store = -math.inf  # loop time the last store began
        self._task: asyncio.Task[None] | None = None
        self.stored = Progress()  # the last event whose delta (all its parts) is stored
        self.appended = 0  # source sequence of the last delta appended
        # (event, part) of the last part stored when the chain ends inside an event's parts.
        self.stored_part: tuple[int, int] | None = None
        self.last_stream_seq = 0  # stream sequence of the subject's last message
        self.failure: BaseException | None = None
        self.messages = 0
        self.deltas = 0
        # Told how long storing each message took, retries included, in seconds (the metrics'
        # histogram: the writer's unit of flushing).
        self.on_store: Callable[[float], None] | None = None

    async def take_batches(self) -> None:
        """Learn whether the stream takes atomic batches: a writer's, before it appends (a
        reader of the chain's position, ``status``, needs not know, nor the right to ask)."""
        info = await self._js.stream_info(self._settings.deltas_stream)
        self._atomic = bool(info.config.allow_atomic)

    async def open(self) -> int:
        """Find where the chain stands (the subject's last message); its source sequence.

        A message on the subject that no writer wrote is stepped over (the projector
        dead-letters it), never trusted or fatal.
        """
        stream, subject = self._settings.deltas_stream, self._settings.deltas_subject
        try:
            raw = await self._js.get_last_msg(stream, subject)
        except NotFoundError:
            return 0
        self.last_stream_seq = seq = raw.seq or 0
        while True:
            if raw.subject == subject:
                source = await self._writer_source(raw.headers or {}, raw.data)
                if source is not None:
                    part = source_part(raw.headers)
                    if part is not None:  # stored up to part ``part`` of event ``source``
                        self.stored_part = (source, part)
                        source -= 1
                    self.stored.advance(source)
                    self.appended = source
                    return source
                log.warning("delta message %d is not a writer's; looking further back", seq)
            seq -= 1
            if seq < 1:
                return 0
            try:
                raw = await self._js.get_msg(stream, seq)
            except NotFoundError:
                return 0

    def start(self, on_failure: Callable[[BaseException], None]) -> None:
        """Start storing in the background; ``on_failure`` hears of a failure once."""

        async def run() -> None:
            try:
                await self._run()
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                self.failure = exc
                log.error("writer stopping: %s", describe(exc))
                on_failure(exc)

        self._task = asyncio.create_task(run(), name="seqstate-deltas")

    async def close(self) -> None:
        await cancel(self._task)

    def append(self, delta: Delta, data: bytes | None = None) -> None:
        """Queue ``delta`` (its ``seq`` set, in source order) to be stored after the others;
        ``data``: its encoding, when the caller has it."""
        if self.stored_part is not None and delta.seq == self.stored_part[0]:
            # A restart inside this event's parts: store only those not stored yet (a record
            # batch's parts come one by one: forgotten once past the last one stored).
            done = self.stored_part[1]
            fresh = [p for p in self._split(delta) if p.part > done]
            if fresh:
                self.stored_part = None
            for part in fresh:
                self._queue(part)
        else:
            self._queue(delta, data)
        self.appended = delta.seq or self.appended
        self._wake.set()
        if self._lingering is not None and len(self._pending) >= MAX_BATCH:
            self._hurry()  # a message is full: lingering gathers no more

    def _queue(self, delta: Delta, data: bytes | None = None) -> None:
        """Encode ``delta`` onto the pending ones; one too large for a message on its own is
        cut into parts in its place."""
        if data is None:
            data = encode_delta(delta)
        if len(data) + 1 > self._limit:  # with the one byte of a message's array head
            for part in self._split(delta):
                data = encode_delta(part)
                if len(data) + 1 > self._limit:
                    raise DeltaUnstorable(
                        f"a part of the delta of event {delta.seq} takes {len(data)} bytes, "
                        f"over the {self._limit} of a message"
                    )
                self._pending.append(_Queued(part.seq or 0, part.part, part.more, data))
            return
        self._pending.append(_Queued(delta.seq or 0, delta.part, delta.more, data))

    def append_parts(self, deltas: list[Delta]) -> None:
        """Queue the deltas of one stored message's events (a record batch's, one ``seq``)
        as the parts of one delta: cut to fit a message now, numbered on across them
        (:func:`seqstate.deltas.as_parts`), so the chain and the projector see one event."""
        if len(deltas) == 1:
            self.append(deltas[0])
            return
        # Mostly none needs cutting: each is numbered and encoded once, as it is stored. One
        # that fits a message numbered fits it as the fold made it (part 0, not more: the
        # numbers only add fields), so these are the parts the cut below would make.
        before = [(delta.part, delta.more) for delta in deltas]
        if not any(number or more for number, more in before):
            encoded = [encode_delta(delta) for delta in as_parts(deltas)]
            if all(len(data) + 1 <= self._limit for data in encoded):
                for delta, data in zip(deltas, encoded, strict=True):
                    self.append(delta, data)
                return
            for delta, (number, more) in zip(deltas, before, strict=True):
                delta.part, delta.more = number, more
        for part in as_parts([p for delta in deltas for p in self._split(delta)]):
            self.append(part)

    def _split(self, delta: Delta) -> list[Delta]:
        try:
            return split_delta(delta, self._limit)
        except ValueError as exc:
            raise DeltaUnstorable(str(exc)) from None

    @property
    def max_event(self) -> int:
        """The largest event whose delta surely fits one message."""
        return largest_event(self._max_payload)

    @property
    def atomic(self) -> bool:
        """Whether appends go out in atomic batches (else one message at a time)."""
        return self._atomic

    @property
    def backlogged(self) -> bool:
        return len(self._pending) + self._flight > MAX_PENDING

    async def room(self) -> None:
        """Wait while too much is folded but not stored (the server away), or fail."""
        while self.backlogged and self.failure is None:
            oldest = self._flight_first if self._flight else self._pending[0].seq
            try:
                await self.stored.wait(oldest, timeout=self._retry_for_s + 2 * ACK_TIMEOUT_S)
            except TimeoutError:
                waiting = len(self._pending) + self._flight
                raise WriterStalled(
                    f"no delta stored for {self._retry_for_s:g}s while {waiting} wait"
                ) from None
        self._raise_failure()

    async def flush(self) -> None:
        """Until every delta appended so far is stored."""
        target = self.appended
        if self.stored.value >= target:
            return
        self._raise_failure()
        self._hurried_to = max(self._hurried_to, target)
        self._hurry()
        waiting = asyncio.ensure_future(self.stored.wait(target))
        tasks: list[asyncio.Future[None]] = [waiting]
        if self._task is not None:
            tasks.append(self._task)
        try:
            await asyncio.wait(
                tasks,
                timeout=self._retry_for_s + 2 * ACK_TIMEOUT_S,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            waiting.cancel()
        self._raise_failure()
        if self.stored.value < target:
            raise WriterStalled(
                f"deltas up to event {target} were not stored in time "
                f"(stored up to event {self.stored.value})"
            )

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise WriterStalled(f"deltas are not being stored: {self.failure}")

    # ---- the batch in flight ----------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                await self._linger()
                batch = self._next_batch()
                self._last_store = asyncio.get_running_loop().time()
                started = time.perf_counter()
                await self._store(batch)
                if self.on_store is not None:
                    self.on_store(time.perf_counter() - started)

    async def _linger(self) -> None:
        """Until ``linger_s`` after the last store began, wait for more deltas to join the
        pending ones, unless they fill a message already (by count or bytes) or a flush waits
        for them."""
        pending = self._pending
        loop = asyncio.get_running_loop()
        wait = self._last_store + self._linger_s - loop.time()
        if (
            wait <= 0
            or len(pending) >= MAX_BATCH
            or self.stored.value < self._hurried_to
            or message_size(len(pending), sum(len(q.data) for q in pending)) > self._limit
        ):
            return
        self._lingering = waiting = loop.create_future()
        timer = loop.call_later(wait, self._hurry)
        try:
            await waiting
        finally:
            timer.cancel()
            self._lingering = None

    def _hurry(self) -> None:
        """End the linger under way, if any."""
        lingering = self._lingering
        if lingering is not None and not lingering.done():
            lingering.set_result(None)

    def _next_batch(self) -> list[_Message]:
        """The messages of the next append: as many as one atomic batch takes, or one (a
        stream without atomic batches). Taken off the pending deltas: ``_flight`` holds them
        until they are stored."""
        batch: list[_Message] = []
        size = 0
        limit = MAX_BATCH_MESSAGES if self._atomic else 1
        while self._pending and len(batch) < limit and size < MAX_BATCH_BYTES:
            message = self._next_message()
            batch.append(message)
            size += len(message.payload)
        self._flight = sum(m.count for m in batch)
        self._flight_first = batch[0].first.seq
        return batch

    def _next_message(self) -> _Message:
        """As many pending deltas as fit in one message (at most ``MAX_BATCH``, halved until
        they fit), taken off the pending ones."""
        pending = self._pending
        count = min(len(pending), MAX_BATCH)
        while True:
            queued = list(islice(pending, count))
            size = sum(len(q.data) for q in queued)
            if message_size(count, size) <= self._limit or count == 1:
                for _ in range(count):
                    pending.popleft()
                payload = join_deltas([q.data for q in queued])
                return _Message(payload, count, queued[0], queued[-1])
            count //= 2

    def _headers(self, batch: list[_Message], batch_id: str) -> list[dict[str, str]]:
        """Each message's headers: the chain (where it ends, where the one before it ended),
        its id, and on the first the compare-and-set; in a batch of several, its place in the
        batch (a live event's message goes out alone, as a plain publish)."""
        out = []
        prev = self.stored.value
        for index, message in enumerate(batch):
            last_delta = message.last
            last = last_delta.seq
            msg_id = f"{self._settings.namespace}:{last}"
            headers = {SOURCE_SEQ: str(last), PREV_SOURCE_SEQ: str(prev)}
            if index == 0:
                headers[EXPECTED_LAST_SUBJECT_SEQ] = str(self.last_stream_seq)
            if last_delta.more:  # the message ends inside the event's parts
                msg_id = f"{msg_id}.{last_delta.part}"
                headers[SOURCE_PART] = str(last_delta.part)
            headers[MSG_ID] = msg_id
            if len(batch) > 1:  # a message alone is stored whole or not by itself
                headers[BATCH_ID] = batch_id
                headers[BATCH_SEQUENCE] = str(index + 1)
                if index == len(batch) - 1:
                    headers[BATCH_COMMIT] = "1"
            out.append(headers)
            prev = last - 1 if last_delta.more else last
        return out

    async def _store(self, batch: list[_Message]) -> None:
        """Store ``batch`` right after the subject's last message, all of it or none, retried
        until stored (a prefix found stored is not sent again) or for ``retry_for_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._retry_for_s
        backoff = 0.05
        while batch:
            headers = self._headers(batch, self._new_batch_id())
            try:
                stored_at = await self._publish(batch, headers)
            except APIError as exc:
                if exc.err_code not in (WRONG_LAST_SEQUENCE, DUPLICATE_IN_BATCH):
                    error: Exception = exc
                else:
                    found = await self._after_wrong_last(headers)
                    if found is not None:
                        done, stored_at = found
                        self._stored(batch[:done], stored_at)
                        batch = batch[done:]
                        continue
                    if exc.err_code == DUPLICATE_IN_BATCH:
                        raise WriterStalled(
                            "a delta message with the id of one of this batch's is stored, "
                            "but not last on the subject: a restart resumes after the last"
                        ) from None
                    continue
            except (TimeoutError, nats.errors.Error) as exc:
                error = exc
            else:
                self._stored(batch, stored_at)
                return
            why = await explain(client_of(self._js), error, self._settings.deltas_stream)
            if loop.time() >= deadline:
                raise WriterStalled(
                    f"a delta publish failed for {self._retry_for_s:g}s: {why}"
                ) from None
            log.warning("delta publish failed, retrying in %.2fs: %s", backoff, why)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _publish(self, batch: list[_Message], headers: list[dict[str, str]]) -> int:
        """Send the messages (all but the last without waiting: the server answers the
        batch's commit for all of them); the stream sequence of the last."""
        subject = self._settings.deltas_subject
        publish = client_of(self._js).publish
        for message, message_headers in zip(batch[:-1], headers[:-1], strict=True):
            await publish(subject, message.payload, headers=message_headers)
        ack = await self._js.publish(
            subject, batch[-1].payload, headers=headers[-1], timeout=ACK_TIMEOUT_S
        )
        return ack.seq

    def _stored(self, messages: list[_Message], stored_at: int) -> None:
        """``messages`` are stored, the last at stream sequence ``stored_at``."""
        if not messages:
            return
        self.last_stream_seq = stored_at
        last_delta = messages[-1].last
        last = last_delta.seq
        count = sum(m.count for m in messages)
        self._flight -= count
        self.messages += len(messages)
        self.deltas += count
        self.stored.advance(last - 1 if last_delta.more else last)

    def _new_batch_id(self) -> str:
        self._batches += 1
        return f"{self._batch_prefix}.{self._batches}"

    async def _after_wrong_last(self, sent: list[dict[str, str]]) -> tuple[int, int] | None:
        """The subject moved on without us: our own message (of a batch whose ack was lost, or
        the prefix of one), or someone else's.

        Returns ``(messages of the batch found stored, stream sequence of the last of them)``,
        or None to retry after a message no writer wrote (now expected). Raises if another
        writer's delta is there.
        """
        raw = await self._js.get_last_msg(
            self._settings.deltas_stream, self._settings.deltas_subject
        )
        seq = raw.seq or 0
        headers = raw.headers or {}
        source = source_seq(headers, raw.data)
        for index, ours in enumerate(sent):
            if (
                headers.get(MSG_ID) == ours[MSG_ID]
                and headers.get(PREV_SOURCE_SEQ) == ours[PREV_SOURCE_SEQ]
            ):
                return index + 1, seq  # stored before its ack was lost
        if await self._plausible(headers, raw.data):
            raise AnotherWriter(
                f"another writer stored deltas for namespace {self._settings.namespace!r} (up to "
                f"event {source}, message {seq}): stop the other writer; a restart resumes"
            )
        log.warning(
            "delta message %d on %s is not a writer's: stepping over it",
            seq,
            self._settings.deltas_subject,
        )
        self.last_stream_seq = seq
        return None

    async def _writer_source(self, headers: dict[str, str], data: bytes | None) -> int | None:
        """Where a writer's message ends (its source sequence); None for a message no writer
        of this namespace could have stored. A message that merely decodes is not enough:
        a broken copy of a writer's message, stored last, once made a restarting writer
        resume from the copy's older event, and then stop on its predecessor's real chain
        as if another writer had written it."""
        if not await self._plausible(headers, data):
            return None
        return source_seq(headers, data)

    async def _plausible(self, headers: dict[str, str], data: bytes | None) -> bool:
        """Could a writer of this namespace have stored this message (as the projector asks)?"""
        try:
            deltas = decode_deltas(data or b"")
        except msgspec.DecodeError:
            return False
        if chain_problem(headers.get(PREV_SOURCE_SEQ), deltas) or not deltas:
            return False
        info = await self._js.stream_info(self._settings.events_stream)
        return (deltas[-1].seq or 0) <= info.state.last_seq
