"""The writer's side of SEQSTATE_DELTAS: a gap-free, ordered chain of deltas, one writer at a time.

Pipelined publishes lose the middle of a sequence when the server dies: the messages in flight
at the crash are gone while later ones, sent after the client reconnected, are stored, and a
writer restarted after the newest stored delta never sees the hole (the bucket stayed wrong
for good). So the chain is built one message at a time: a message is sent only once the
previous one is stored, and carries

- ``Nats-Expected-Last-Subject-Sequence``: the stream sequence of the previous message on this
  namespace's subject, so the server stores it only right after that one. A second writer of
  the namespace (or a message from nowhere) breaks the compare-and-set instead of interleaving;
- ``Seqstate-Prev-Source-Seq``: the source sequence the previous message ended at, so the
  projector can check that each message continues the last (see projection.py);
- ``Nats-Msg-Id``: its last source sequence (and part), so a retry after a lost ack is
  stored once.

No message exceeds the server's payload limit: a batch is cut by bytes, and a delta too large
for a message on its own (an expiry releasing very many requests) is cut into parts
(:func:`seqstate.deltas.split_delta`, deterministic for a given limit). A message may end in
the middle of an event's parts; it then says so (``Seqstate-Source-Part``), its
``Seqstate-Prev-Source-Seq`` successors keep naming the last *whole* event, and a writer
restarted there skips the parts already stored.

One message in flight costs nothing in throughput: while it travels, what the writer folds
gathers into the next message (up to ``MAX_BATCH`` deltas and under the payload limit), so a
live event still goes out alone and at once, and a backlog goes out in large batches.

A publish that fails (the server restarting, a leader election) is retried with the same
headers for ``retry_for_s``; if the server did store it before the failure, the
compare-and-set reports the subject's last sequence and the message found there is ours. A
writer that cannot store a delta for that long fails (``WriterStalled``) and its process
exits non-zero: a restart resumes from the last stored delta, which by construction has no
hole before it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from projector.nats.failures import describe, explain
from projector.nats.progress import Progress
from projector.nats.tasks import cancel
from projector.wire.chain import chain_problem, source_part, source_seq
from projector.wire.headers import (
    EXPECTED_LAST_SUBJECT_SEQ,
    MSG_ID,
    PREV_SOURCE_SEQ,
    SOURCE_PART,
    SOURCE_SEQ,
)
from projector.wire.sizes import DELTA_HEADROOM, largest_event
from seqstate import Delta, decode_deltas, encode_deltas
from seqstate.deltas import as_parts, split_delta
from seqstate.errors import SeqstateError

log = logging.getLogger("seqstate.writer")

WRONG_LAST_SEQUENCE = 10071  # JetStream's error code when that expectation fails
MAX_BATCH = 256  # deltas per message
# Deltas folded but not stored; the fold waits beyond this. 64 full messages keep the one in
# flight busy; more only holds memory while the deltas lag (a writer catching up kept 100,000,
# ~100 MB, with no gain in rate).
MAX_PENDING = 16_384
ACK_TIMEOUT_S = 2.0  # per attempt: a request in flight when the server died never returns
RETRY_FOR_S = 60.0
MAX_BACKOFF_S = 1.0


class WriterStalled(SeqstateError, RuntimeError):
    """Deltas could not be stored; the writer stops so a restart can resume cleanly."""


class AnotherWriter(WriterStalled):
    """Another writer publishes deltas for this namespace: two writers would corrupt the chain."""


class DeltaUnstorable(WriterStalled):
    """One delta alone exceeds the server's payload limit."""


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
    ) -> None:
        self._js = js
        self._settings = settings
        self._max_payload = max_payload
        self._limit = max_payload - DELTA_HEADROOM
        self._retry_for_s = retry_for_s
        self._pending: deque[Delta] = deque()
        self._wake = asyncio.Event()
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

    def append(self, delta: Delta) -> None:
        """Queue ``delta`` (its ``seq`` set, in source order) to be stored after the others."""
        if self.stored_part is not None and delta.seq == self.stored_part[0]:
            # A restart inside this event's parts: store only those not stored yet (a record
            # batch's parts come one by one: forgotten once past the last one stored).
            done = self.stored_part[1]
            fresh = [p for p in self._split(delta) if p.part > done]
            if fresh:
                self.stored_part = None
            self._pending.extend(fresh)
        else:
            self._pending.append(delta)
        self.appended = delta.seq or self.appended
        self._wake.set()

    def append_parts(self, deltas: list[Delta]) -> None:
        """Queue the deltas of one stored message's events (a record batch's, one ``seq``)
        as the parts of one delta: cut to fit a message now, numbered on across them
        (:func:`seqstate.deltas.as_parts`), so the chain and the projector see one event."""
        if len(deltas) == 1:
            self.append(deltas[0])
            return
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
    def backlogged(self) -> bool:
        return len(self._pending) > MAX_PENDING

    async def room(self) -> None:
        """Wait while too much is folded but not stored (the server away), or fail."""
        while self.backlogged and self.failure is None:
            oldest = self._pending[0].seq or 0
            try:
                await self.stored.wait(oldest, timeout=self._retry_for_s + 2 * ACK_TIMEOUT_S)
            except TimeoutError:
                raise WriterStalled(
                    f"no delta stored for {self._retry_for_s:g}s while {len(self._pending)} wait"
                ) from None
        self._raise_failure()

    async def flush(self) -> None:
        """Until every delta appended so far is stored."""
        target = self.appended
        if self.stored.value >= target:
            return
        self._raise_failure()
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

    # ---- the one message in flight ----------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                count, payload = self._next_message()
                last = self._pending[count - 1]
                started = time.perf_counter()
                await self._store(payload, last)
                if self.on_store is not None:
                    self.on_store(time.perf_counter() - started)
                for _ in range(count):
                    self._pending.popleft()
                self.messages += 1
                self.deltas += count

    def _next_message(self) -> tuple[int, bytes]:
        """As many pending deltas as fit in one message: ``(count, payload)``."""
        count = min(len(self._pending), MAX_BATCH)
        while True:
            payload = encode_deltas(list(islice(self._pending, count)))
            if len(payload) <= self._limit:
                return count, payload
            if count == 1:
                # One delta alone too large: cut it into parts in its place, and go on.
                parts = self._split(self._pending.popleft())
                self._pending.extendleft(reversed(parts))
                count = min(len(self._pending), MAX_BATCH)
                continue
            count //= 2

    async def _store(self, payload: bytes, last_delta: Delta) -> None:
        subject = self._settings.deltas_subject
        last = last_delta.seq or 0
        msg_id = f"{self._settings.namespace}:{last}"
        headers = {
            SOURCE_SEQ: str(last),
            PREV_SOURCE_SEQ: str(self.stored.value),
            EXPECTED_LAST_SUBJECT_SEQ: str(self.last_stream_seq),
        }
        if last_delta.more:  # the message ends inside the event's parts
            msg_id = f"{msg_id}.{last_delta.part}"
            headers[SOURCE_PART] = str(last_delta.part)
        headers[MSG_ID] = msg_id
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._retry_for_s
        backoff = 0.05
        while True:
            try:
                ack = await self._js.publish(
                    subject, payload, headers=headers, timeout=ACK_TIMEOUT_S
                )
                stored_at = ack.seq
                break
            except APIError as exc:
                if exc.err_code != WRONG_LAST_SEQUENCE:
                    error: Exception = exc
                else:
                    found = await self._after_wrong_last(msg_id)
                    if found is not None:
                        stored_at = found
                        break
                    headers[EXPECTED_LAST_SUBJECT_SEQ] = str(self.last_stream_seq)
                    continue
            except (TimeoutError, nats.errors.Error) as exc:
                error = exc
            why = await explain(self._js._nc, error, self._settings.deltas_stream)
            if loop.time() >= deadline:
                raise WriterStalled(
                    f"a delta publish failed for {self._retry_for_s:g}s: {why}"
                ) from None
            log.warning("delta publish failed, retrying in %.2fs: %s", backoff, why)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
        self.last_stream_seq = stored_at
        self.stored.advance(last - 1 if last_delta.more else last)

    async def _after_wrong_last(self, msg_id: str) -> int | None:
        """The subject moved on without us: our own retried message, or someone else's.

        Returns the stream sequence where our message is stored, or None to retry after a
        message no writer wrote (now expected). Raises if another writer's delta is there.
        """
        raw = await self._js.get_last_msg(
            self._settings.deltas_stream, self._settings.deltas_subject
        )
        seq = raw.seq or 0
        headers = raw.headers or {}
        source = source_seq(headers, raw.data)
        if headers.get(MSG_ID) == msg_id and headers.get(PREV_SOURCE_SEQ) == str(self.stored.value):
            return seq  # stored before its ack was lost
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
