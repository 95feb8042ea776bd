"""The projector: folds SEQSTATE_DELTAS into the registry bucket that schedulers watch.

It is the single writer of the bucket. What to write is decided by a pure fold, the
:class:`~projector.bucket.image.BucketImage`: a booking becomes its slot's value (and a long
prompt's part keys), a release an empty value, a load its rank's load key. The projector
keeps each rank's load and slot count, never the hashes, so its memory and its cost per delta
follow what the delta changed. The hash-to-ranks index that answers potential-load queries
is built by each reader from the slot values, so the projector, which never answers a query,
does not pay for it.

Writes are coalesced: a delta only marks its keys dirty, and a flush at most every
``flush_interval_s`` (5 ms by default) writes each dirty key once, pipelined, then the
namespace's position key once those writes are acknowledged. Under load a flush simply covers
more deltas. A flush that fails (a disconnect, a leader election) keeps its keys dirty and is
retried with backoff: the bucket lags, it never misses a change.

On start the projector reads the bucket back (position, loads and slot keys) and resumes from
the delta after the recorded position. Replaying deltas the bucket already partly reflects is
harmless: every value is absolute (a load, a slot's request), applied in order.
Deltas whose source sequence is not past the position are skipped. A delta that does not
decode is refused (:class:`~projector.nats.stream.Refused`): the runner dead-letters it with its
reason, the projector counts it and goes on.

Its collaborators (dead letters, lease, the bucket's reader, the server's provisioning) are
built by :mod:`projector.run.assemble` and handed in; it reads only :class:`ProjectorSettings`
of the configuration.

It writes only under the namespace's lease (:mod:`projector.nats.lease`), taken before it reads the
bucket back: a second projector of the namespace waits for the first to go, and a
``seqstate rebuild`` refuses to run meanwhile. Losing the lease to another holder ends the run
with :class:`~projector.nats.lease.LeaseLost` without another write; a lease not renewed for a
while (the server away) only holds the writes back, like a failing flush.

Its lag (deltas stored but not yet in the bucket) is looked up every ``lag_check_s``
(:mod:`projector.nats.lag`): ``projector.lag`` is the last measurement, and the log says when it
falls behind and when it has caught up, as the writer's does. Each renewal of its lease carries
the last measurement into the bucket, where a scheduler, which may read nothing else, sees
that the projector lives and how far the bucket is behind the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KV_DEL, KV_OP

from projector.aio.progress import Progress
from projector.aio.tasks import cancel, until_set
from projector.bucket.contents import BucketView
from projector.bucket.image import BucketImage, Write
from projector.bucket.raw_deltas import read_deltas
from projector.nats.client_internals import acked_jetstream
from projector.nats.consumer import OrderedConsumer
from projector.nats.dead_letters import IMPLAUSIBLE, UNDECODABLE
from projector.nats.failures import ATTEMPT_TIMEOUT_S, describe, explain, retrying
from projector.nats.feed import DEFAULT_WINDOW
from projector.nats.host import Host
from projector.nats.lag import Lag, LagWatch, LagWatched, WatchSettings
from projector.nats.lease import Lease, LeaseLost
from projector.nats.stream import DeadLetterSink, Refused, log_time_ns
from projector.wire.chain import chain_problem
from projector.wire.headers import PREV_SOURCE_SEQ
from projector.wire.values import (
    LARGEST_VALUE,
    Heartbeat,
    load_key,
    part_key,
    slot_key,
    tracker_key,
)
from seqstate import Delta, SequenceState
from seqstate.errors import SeqstateError

log = logging.getLogger("seqstate.projector")

MAX_BACKOFF_S = 2.0
ACK_TIMEOUT_S = 5.0


class BucketLost(SeqstateError, RuntimeError):
    """The registry bucket was deleted while the projector ran; a restart recreates it."""


class DeltaGap(SeqstateError, RuntimeError):
    """The deltas stream is missing deltas: the projector cannot follow it exactly."""


class BucketUnfit(SeqstateError, ValueError):
    """The server's payload limit is under what one bucket value may take."""


def check_bucket_fits(max_payload: int) -> None:
    """BucketUnfit if a long prompt's keys would never be written to a server whose payload
    limit is ``max_payload``."""
    if max_payload < LARGEST_VALUE:
        raise BucketUnfit(
            f"the server's max_payload of {max_payload:,} bytes is under the "
            f"{LARGEST_VALUE:,} one bucket value may take (4,096 hashes of a long prompt "
            "beside a request id of up to 4 KiB); raise nats-server's max_payload"
        )


@dataclass
class ProjectorStats:
    deltas: int = 0
    skipped: int = 0
    dead_letters: int = 0
    flushes: int = 0
    keys_written: int = 0
    keys_deleted: int = 0
    flush_failures: int = 0

    @property
    def kv_writes(self) -> int:
        """Puts and deletes of the bucket: each key written or deleted, and one position put
        per flush."""
        return self.keys_written + self.keys_deleted + self.flushes


@dataclass(frozen=True)
class ProjectorSettings:
    """What the projector reads of the configuration: its names and its flush interval."""

    namespace: str
    events_stream: str
    deltas_stream: str
    deltas_subject: str
    registry_bucket: str
    flush_interval_s: float
    window: int = DEFAULT_WINDOW  # delta messages received and not yet applied, at most


# A lease of the namespace for the projector, not yet taken, that calls ``on_lost`` if lost.
LeaseMaker = Callable[[Callable[[LeaseLost], None]], Lease]


class Projector(LagWatched):
    """One projector per namespace. ``await projector.run()`` until cancelled or ``stop()``.

    Built by :func:`projector.run.assemble.build_projector`. ``lease`` makes the lease it takes
    at each run (its TTL and renewal are the maker's); ``held_lease`` instead: one its caller
    holds already (a standby pipeline's), used, never taken or given back here, whose loss must
    reach :meth:`lease_lost`. ``read_bucket()`` reads the namespace's bucket back;
    ``measure_lag(applied, delta_seq)`` looks the lag up on the server.
    ``projector.lag`` (the last measurement) and ``await projector.measure_lag()`` (one now):
    deltas stored but not yet in the bucket, and the oldest one's log time.
    """

    def __init__(
        self,
        nc: Client,
        settings: ProjectorSettings,
        *,
        dead_letters: DeadLetterSink,
        host: Host,
        lease: LeaseMaker,
        read_bucket: Callable[[], Awaitable[BucketView]],
        lag: WatchSettings,
        measure_lag: Callable[[int, int], Awaitable[Lag]],
        held_lease: Lease | None = None,
        stored_up_to: Callable[[], int] | None = None,
    ) -> None:
        self.nc = nc
        self._held_lease = held_lease
        # Where a writer runs beside it: the last event that writer folded, which the events
        # stream holds (a writer folds only what it read there). A delta naming no later
        # event needs no look at the stream: without it, nearly every delta message asked
        # the server for the stream's info, a round trip per call at one connection.
        self._stored_up_to = stored_up_to
        self._make_lease = lease
        self.settings = settings
        self.lease: Lease | None = None  # every write of the bucket checks it first
        self.stats = ProjectorStats()
        self._js = acked_jetstream(nc)  # an error ack fails its write at once
        self.dead_letters = dead_letters  # written by the runner; counted (metrics) there
        self._host = host
        self._read_bucket = read_bucket
        self._lag_of = measure_lag
        self.image = BucketImage(settings.namespace)
        self.delta_seq = 0  # sequence in the DELTAS stream of the last message handled
        self._position_dirty = False
        self._dirty = asyncio.Event()
        self._stopping = asyncio.Event()
        self.flushed = Progress()  # the source sequence the bucket's position reflects
        self.flushed_delta_seq = 0  # the DELTAS message the bucket's position reflects
        self._events_last = 0  # the events stream's last sequence, as last looked up
        self._measured_at: float | None = None  # monotonic time of the last lag measurement
        self._failure: BaseException | None = None
        # The DELTAS stream is read by the shared runner; this projector is its processor.
        self._consumer = OrderedConsumer(
            self._js,
            settings.deltas_stream,
            settings.deltas_subject,
            self,
            on_failure=self._fail,
            dead_letters=dead_letters,
            window=settings.window,
        )
        self.caught_up = self._consumer.caught_up
        self.lag_watch = LagWatch("projector", self._measure_lag, lag, log)
        # Told how long each flush that wrote took, in seconds (the metrics' histogram).
        self.on_flush: Callable[[float], None] | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    @property
    def namespace(self) -> str:
        return self.settings.namespace

    async def run(self) -> None:
        async with self._host.announce("projector", self.status):
            await self._run()

    def status(self) -> dict[str, Any]:
        """What ``nats micro stats`` and the status endpoint show (projector.nats.services)."""
        lag, stats = self.lag, self.stats
        return {
            "kind": "projector",
            "namespace": self.settings.namespace,
            "applied_seq": self.flushed.value,
            "delta_seq": self.flushed_delta_seq,
            "deltas": stats.deltas,
            "flushes": stats.flushes,
            "keys_written": stats.keys_written,
            "keys_deleted": stats.keys_deleted,
            "dead_letters": stats.dead_letters,
            "holds_lease": self.lease is not None,
            "lag_events": lag.events,
            "lag_s": lag.oldest_age_s,
        }

    async def _run(self) -> None:
        check_bucket_fits(self.nc.max_payload)
        # Provisioning asks again while a restarting server is silent: a stop must not wait.
        await until_set(self._stopping, self._host.provision())
        if self._stopping.is_set():  # stopped while provisioning: nothing started
            return
        if self._held_lease is not None:
            self.lease = self._held_lease
            await self._project()
            return
        lease = self._make_lease(self.lease_lost)
        if not await self._acquire(lease):
            return
        self.lease = lease
        try:
            await self._project()
        finally:
            await lease.release()

    async def _acquire(self, lease: Lease) -> bool:
        """Take the lease, waiting as long as a live holder keeps it; False if stopped first."""
        acquiring = asyncio.ensure_future(lease.acquire(wait=True))
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait([acquiring, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not acquiring.done():
                acquiring.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await acquiring
        if acquiring.cancelled():
            return False
        acquiring.result()  # its error, if it failed
        if self._stopping.is_set():
            await lease.release()
            return False
        return True

    def lease_lost(self, exc: LeaseLost) -> None:
        self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        log.error(
            "projector stopping: %s",
            describe(exc),
            extra={"namespace": self.settings.namespace, "stream_seq": self.applied_seq},
        )
        self._consumer.halt()
        if self._failure is None:
            self._failure = exc
        self._stopping.set()

    async def _project(self) -> None:
        await until_set(self._stopping, self.resume())
        if self._stopping.is_set():  # stopped (or failed) while reading the bucket back
            if self._failure is not None:
                raise self._failure
            return
        await self._consumer.start(after=self.delta_seq)
        flusher = asyncio.create_task(self._flush_loop())
        watcher = asyncio.create_task(self.lag_watch.run(), name="seqstate-projector-lag")
        if self.lease is not None:
            self.lease.beat = self._heartbeat
        try:
            await self._stopping.wait()
            await cancel(watcher)  # a stop is no news of a lag
            await self._consumer.stop()
            if self._failure is None:  # a failed projector (its lease lost) writes no more
                await self.flush()
        finally:
            if self.lease is not None:
                self.lease.beat = None
            await cancel(watcher)
            await cancel(flusher)
            await self._consumer.stop()
        if self._failure is not None:
            raise self._failure

    def stop(self) -> None:
        self._consumer.halt()
        self._stopping.set()

    @property
    def applied_seq(self) -> int:
        """Source (event) sequence of the last event whose delta is wholly applied."""
        return self.image.applied_seq

    async def resume(self) -> None:
        """Load the bucket's values of this namespace back into the image."""
        bucket = await self._read_bucket()
        if bucket.unreadable:
            # A damaged value is rewritten from the deltas: rebuild from the start, deleting
            # whatever the deltas do not write again.
            key, (_, why) = next(iter(bucket.unreadable.items()))
            log.warning("bucket value %s unreadable (%s): replaying all deltas", key, why)
            self.image.owe(every_key(self.settings.namespace, bucket))
            return
        self.image.restore(bucket)
        if (pos := bucket.position) is not None:
            self.delta_seq = self.flushed_delta_seq = pos.delta_seq
            self.flushed.value = pos.applied_seq
        log.info(
            "resumed at source seq %d (delta %d) with %d ranks",
            self.applied_seq,
            self.delta_seq,
            len(self.image.loads),
            extra={"namespace": self.settings.namespace, "stream_seq": self.applied_seq},
        )

    def reset_to(
        self, state: SequenceState, applied_seq: int, delta_seq: int, *, stale: list[str]
    ) -> None:
        """Take ``state``'s read model as the whole truth (``seqstate rebuild``).

        Every rank and live request is written anew, stamped with ``applied_seq``; keys in
        ``stale`` that the state does not write are deleted; the position resumes the projector
        after ``delta_seq``.
        """
        self.image = BucketImage(self.settings.namespace)
        for delta in state.projection():
            delta.seq = applied_seq
            self.image.apply(delta)
        self.image.as_of = state.now_ns
        self.image.owe([(key, None) for key in stale])
        self.delta_seq = delta_seq
        self.flushed.value = self.flushed_delta_seq = 0
        self._position_dirty = True

    # ---- folding deltas ---------------------------------------------------------------------

    async def handle(self, msg: Msg) -> Refused | None:
        """Apply one DELTAS message, or refuse it. The position moves to it only once it is
        fully handled: a flush that runs while this awaits (a look-up, the runner's dead
        letter) must not record a message as handled whose deltas are not applied yet."""
        delta_seq, _ = log_time_ns(msg)
        try:
            deltas, in_range = read_deltas(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Refused(UNDECODABLE, f"delta does not decode: {exc}")
        why = await self._implausible(msg, delta_seq, deltas, in_range)
        if why:
            return Refused(IMPLAUSIBLE, why)
        for delta in deltas:
            if delta.seq is not None and delta.seq <= self.applied_seq:
                self.stats.skipped += 1
                continue
            self.apply(delta)
        self._passed(delta_seq)
        return None

    def dead_lettered(self, seq: int, refused: Refused) -> None:
        """Its dead letter is stored: counted, and the position moves past it."""
        self.stats.dead_letters += 1
        self._passed(seq)

    def _passed(self, delta_seq: int) -> None:
        """The position moves past message ``delta_seq``, whatever it held."""
        self.delta_seq = delta_seq
        self._position_dirty = True
        self._dirty.set()

    async def _implausible(
        self, msg: Msg, delta_seq: int, deltas: list[Delta], in_range: bool
    ) -> str:
        """Why this message cannot be a writer's next deltas ("" if it can); raises on a gap.

        A writer chains its messages (each names the event the previous one ended at) and
        only writes deltas of events the log holds, in order. A message that breaks those
        rules was not written by a writer of this namespace and is dead-lettered; one that
        continues from *later* than the bucket means deltas were lost, and applying it would
        make the bucket wrong for good, so the projector stops and says so.
        """
        raw = (msg.headers or {}).get(PREV_SOURCE_SEQ)
        problem = chain_problem(raw, deltas)
        if problem:
            return problem
        prev = int(raw or 0)
        seqs = [d.seq for d in deltas]
        last = seqs[-1] if seqs else prev
        if last is not None and last > self._events_last and self._stored_up_to is not None:
            self._events_last = max(self._events_last, self._stored_up_to())
        if last is not None and last > self._events_last:
            stream = self.settings.events_stream
            info = await retrying(
                lambda: asyncio.wait_for(self._js.stream_info(stream), ATTEMPT_TIMEOUT_S),
                f"looking up stream {stream}",
            )
            self._events_last = info.state.last_seq
            if last > self._events_last:
                return (
                    f"not a writer's delta: event {last} is beyond the events stream "
                    f"(its last is {self._events_last})"
                )
        # A chain that breaks right after the message before it (no message of the stream
        # between them was removed) lost nothing: that message is not a writer's, and is
        # refused. Only a break across removed messages is a gap the bucket cannot follow.
        follows = delta_seq == self.delta_seq + 1
        partial = self.image.partial
        if (
            partial is not None
            and deltas
            and (deltas[0].seq, deltas[0].part) != (partial[0], partial[1] + 1)
        ):
            if follows:
                return (
                    f"not a writer's delta: event {partial[0]} is half applied (part "
                    f"{partial[1]}), and it does not continue it"
                )
            raise DeltaGap(
                f"the deltas of namespace {self.settings.namespace!r} have a gap: message "
                f"{delta_seq} does not continue event {partial[0]} after its part {partial[1]}"
            )
        if prev > self.applied_seq:
            if follows:
                return (
                    f"not a writer's delta: it continues from event {prev}, but the message "
                    f"before it ended at event {self.applied_seq}"
                )
            raise DeltaGap(
                f"the deltas of namespace {self.settings.namespace!r} have a gap: message "
                f"{delta_seq} continues from event {prev}, but the bucket reflects event "
                f"{self.applied_seq}; deltas were lost, so the bucket cannot follow them "
                f"(`seqstate rebuild` re-derives it from the events)"
            )
        # Its numbers' ranges, unless the decoder found them all in range already.
        return "" if in_range else self.image.refusal(deltas)

    def apply(self, delta: Delta) -> None:
        self.stats.deltas += 1
        self.image.apply(delta)
        self._position_dirty = True
        self._dirty.set()

    # ---- writing the bucket -------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.settings.flush_interval_s
        backoff = interval
        while True:
            await self._dirty.wait()
            started = loop.time()
            try:
                await self.flush()
                backoff = interval
            except LeaseLost as exc:
                self.lease_lost(exc)
                return
            except Exception as exc:  # the bucket must catch up, not die
                self.stats.flush_failures += 1
                if await self._bucket_gone():
                    self._fail(
                        BucketLost(
                            f"the bucket {self.settings.registry_bucket} was deleted under the "
                            "projector; a restart recreates it and rewrites it from the deltas"
                        )
                    )
                    return
                why = await explain(self.nc, exc, f"KV_{self.settings.registry_bucket}")
                log.warning("flush failed, retrying in %.2fs: %s", backoff, why)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            # At most one write per key per interval: the next flush starts no sooner.
            await asyncio.sleep(max(0.0, interval - (loop.time() - started)))

    async def _bucket_gone(self) -> bool:
        """Whether the bucket no longer exists (deleted by hand): no retry can write it then."""
        try:
            await asyncio.wait_for(
                self._js.key_value(self.settings.registry_bucket), ATTEMPT_TIMEOUT_S
            )
        except BucketNotFoundError:
            return True
        except Exception:  # the server away: not known to be gone
            return False
        return False

    async def flush(self) -> None:
        """Write every key owed once, then the position; on failure everything stays owed."""
        self._dirty.clear()
        if not (self._position_dirty or self.image.dirty):
            return
        writes = self.image.take()
        self._position_dirty = False
        delta_seq = self.delta_seq
        position = self.image.position(delta_seq)
        applied = self.applied_seq
        started = time.perf_counter()
        try:
            await self._write(writes, position)
        except BaseException:
            self.image.owe(writes)  # unless a later delta superseded them
            self._position_dirty = True
            self._dirty.set()
            raise
        if self.on_flush is not None:
            self.on_flush(time.perf_counter() - started)
        self.stats.flushes += 1
        self.flushed_delta_seq = max(self.flushed_delta_seq, delta_seq)
        self.flushed.advance(applied)

    async def _write(self, writes: list[Write], position: tuple[str, bytes]) -> None:
        self._check_lease()
        futures = [
            await self._put(key, value or b"", delete=value is None) for key, value in writes
        ]
        # publish_async has no deadline of its own: an ack lost to a disconnect would hang here.
        if futures:
            acks = asyncio.gather(*futures)
            try:
                await asyncio.wait_for(acks, ACK_TIMEOUT_S)
            finally:  # a flush cut short (a stop) leaves it holding a CancelledError: taken
                if acks.done() and not acks.cancelled():
                    acks.exception()
        self._check_lease()  # the acks can take long: still ours before the position moves?
        await asyncio.wait_for(await self._put(*position), ACK_TIMEOUT_S)
        deleted = sum(value is None for _, value in writes)
        self.stats.keys_written += len(writes) - deleted
        self.stats.keys_deleted += deleted

    def _check_lease(self) -> None:
        if self.lease is not None:
            self.lease.check()

    async def _put(self, key: str, value: bytes, *, delete: bool = False) -> asyncio.Future[object]:
        headers = {KV_OP: KV_DEL} if delete else None
        subject = f"$KV.{self.settings.registry_bucket}.{key}"
        future: asyncio.Future[object] = await self._js.publish_async(  # type: ignore[assignment]
            subject, value, headers=headers
        )
        return future

    async def _measure_lag(self) -> Lag:
        lag = await self._lag_of(self.flushed.value, self.flushed_delta_seq)
        self._measured_at = time.monotonic()
        return lag

    def _heartbeat(self) -> Heartbeat | None:
        """The last lag measurement, for the lease's next renewal (None: none taken yet)."""
        if self._measured_at is None:
            return None
        return self.lag.heartbeat(time.monotonic() - self._measured_at)

    async def wait_flushed(self, seq: int) -> None:
        """Return once the bucket's position reflects source sequence ``seq`` or later."""
        await self.flushed.wait(seq)


def every_key(namespace: str, bucket: BucketView) -> list[Write]:
    """A delete of every read-model key the bucket holds (damaged ones and strays too)."""
    keys = [load_key(namespace, rank) for rank in bucket.loads]
    keys += [
        slot_key(namespace, rank, slot) for rank, slots in bucket.slots.items() for slot in slots
    ]
    keys += [
        part_key(namespace, rank, slot, part)
        for (rank, slot), parts in bucket.parts.items()
        for part in parts
    ]
    keys += list(bucket.unreadable)
    keys += bucket.strays
    if bucket.tracker is not None:
        keys.append(tracker_key(namespace))
    return [(key, None) for key in keys]
