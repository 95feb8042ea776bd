"""The projector: folds SEQSTATE_DELTAS into the registry bucket that schedulers watch.

It is the single writer of the bucket. Per rank it keeps the latest time-free load and the set
of active prompt-block hashes (exactly what a :class:`~seqstate.PromptRegistry` learns from
the deltas, in the per-rank form the bucket stores); the hash-to-ranks index that answers
potential-load queries is built by each reader from these values, so the projector, which
never answers a query, does not pay for it.

Writes are coalesced: a delta only marks its ranks dirty, and a flush at most every
``flush_interval_s`` (5 ms by default) writes each dirty key once, pipelined, then the
namespace's position key once those writes are acknowledged. Under load a flush simply covers
more deltas. A flush that fails (a disconnect, a leader election) keeps its keys dirty and is
retried with backoff: the bucket lags, it never misses a change.

On start the projector reads the bucket back (position, loads and block sets) and resumes from
the delta after the recorded position. Replaying deltas the bucket already partly reflects is
harmless: a load is absolute and a block change is a set insert or removal, applied in order.
Deltas whose source sequence is not past the position are skipped. A delta that does not
decode is dead-lettered with its reason and counted; the projector goes on.

It writes only under the namespace's lease (:mod:`projector.lease`), taken before it reads the
bucket back: a second projector of the namespace waits for the first to go, and a
``seqstate rebuild`` refuses to run meanwhile. Losing the lease to another holder ends the run
with :class:`~projector.lease.LeaseLost` without another write; a lease not renewed for a
while (the server away) only holds the writes back, like a failing flush.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KV_DEL, KV_OP

from projector.bucket import read_bucket
from projector.config import Config
from projector.dead_letters import DeadLetters
from projector.delta_log import chain_problem
from projector.lease import DEFAULT_TTL_S, Lease, LeaseLost
from projector.progress import Progress
from projector.resources import ensure
from projector.retry import ATTEMPT_TIMEOUT_S, retrying
from projector.stream import PREV_SOURCE_SEQ, last_seq_of, log_time_ns
from projector.tasks import attempt, cancel
from projector.values import (
    Position,
    Rank,
    blocks_key,
    encode_blocks,
    encode_load,
    encode_position,
    load_key,
    position_key,
)
from seqstate import Delta, RankLoad, SequenceState, decode_deltas
from seqstate.errors import SeqstateError

log = logging.getLogger("seqstate.projector")

MAX_BACKOFF_S = 2.0
ACK_TIMEOUT_S = 5.0


class BucketLost(SeqstateError, RuntimeError):
    """The registry bucket was deleted while the projector ran; a restart recreates it."""


class DeltaGap(SeqstateError, RuntimeError):
    """The deltas stream is missing deltas: the projector cannot follow it exactly."""


@dataclass
class ProjectorStats:
    deltas: int = 0
    skipped: int = 0
    dead_letters: int = 0
    flushes: int = 0
    keys_written: int = 0
    keys_deleted: int = 0
    flush_failures: int = 0


class Projector:
    """One projector per namespace. ``await projector.run()`` until cancelled or ``stop()``.

    ``lease_ttl_s``: how long a SIGKILLed projector on another machine keeps a successor
    waiting; ``lease_renew_s`` (a third of it by default): how often the lease is renewed.
    """

    def __init__(
        self,
        nc: Client,
        config: Config,
        *,
        lease_ttl_s: float = DEFAULT_TTL_S,
        lease_renew_s: float | None = None,
    ) -> None:
        self.nc = nc
        self.config = config
        self.lease: Lease | None = None  # every write of the bucket checks it first
        self._lease_ttl_s, self._lease_renew_s = lease_ttl_s, lease_renew_s
        self.stats = ProjectorStats()
        self._js = nc.jetstream()
        self.dead_letters = DeadLetters(self._js, config, max_payload=nc.max_payload)
        self.loads: dict[Rank, RankLoad] = {}
        self.blocks: dict[Rank, set[int]] = {}
        # What each value reflects: the source sequence (and log time) of the last delta that
        # changed it. A pure function of the delta stream, so a projector that crashed and
        # resumed writes the very bytes an uninterrupted one writes.
        self.load_stamps: dict[Rank, tuple[int, int]] = {}
        self.block_stamps: dict[Rank, int] = {}
        self.applied_seq = 0  # source (event) sequence of the last delta applied
        self.as_of = 0  # its log time
        self.delta_seq = 0  # its sequence in the DELTAS stream
        self._dirty_loads: set[Rank] = set()
        self._dirty_blocks: set[Rank] = set()
        self._removed: set[Rank] = set()
        self._position_dirty = False
        self._dirty = asyncio.Event()
        self._stopping = asyncio.Event()
        self.flushed = Progress()  # the source sequence the bucket's position reflects
        self._target = 0
        self._events_last = 0  # the events stream's last sequence, as last looked up
        self._failure: BaseException | None = None
        self.caught_up = asyncio.Event()

    # ---- lifecycle --------------------------------------------------------------------------

    async def run(self) -> None:
        await ensure(self.nc, self.config)
        lease = Lease(self.nc, self.config, "projector", ttl_s=self._lease_ttl_s,
                      renew_s=self._lease_renew_s, on_lost=self._lease_lost)  # fmt: skip
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

    def _lease_lost(self, exc: LeaseLost) -> None:
        self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        log.error("projector stopping: %s", exc)
        if self._failure is None:
            self._failure = exc
        self._stopping.set()

    async def _project(self) -> None:
        await self.resume()
        target = await last_seq_of(self._js, self.config.deltas_stream, self.config.deltas_subject)
        self._target = target
        if self.delta_seq >= target:
            self.caught_up.set()
        sub = await self._js.subscribe(
            self.config.deltas_subject,
            stream=self.config.deltas_stream,
            ordered_consumer=True,
            idle_heartbeat=1.0,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            config=api.ConsumerConfig(opt_start_seq=self.delta_seq + 1),
            cb=self._on_message,
        )
        flusher = asyncio.create_task(self._flush_loop())
        try:
            await self._stopping.wait()
            await attempt(sub.unsubscribe())
            if self._failure is None:  # a failed projector (its lease lost) writes no more
                await self.flush()
        finally:
            await cancel(flusher)
            await attempt(sub.unsubscribe())
        if self._failure is not None:
            raise self._failure

    async def _on_message(self, msg: Msg) -> None:
        if self._stopping.is_set():
            return
        try:
            await self.handle(msg)
        except Exception as exc:  # the client would swallow a callback's error
            log.error("projector stopping: %r", exc)
            self._failure = exc
            self._stopping.set()
            return
        if not self.caught_up.is_set() and self.delta_seq >= self._target:
            self.caught_up.set()
        await asyncio.sleep(0)  # a backlog would otherwise starve the flush loop

    def stop(self) -> None:
        self._stopping.set()

    async def resume(self) -> None:
        """Load the bucket's values of this namespace back into memory."""
        bucket = await read_bucket(self.nc, self.config)
        if bucket.unreadable:
            # A damaged value is rewritten from the deltas: rebuild from the start.
            key, (_, why) = next(iter(bucket.unreadable.items()))
            log.warning("bucket value %s unreadable (%s): replaying all deltas", key, why)
            self._removed.update(bucket.loads, bucket.blocks)
            for rank, _ in bucket.unreadable.values():
                if rank is not None:
                    self._removed.add(rank)
            return
        if (pos := bucket.position) is not None:
            self.applied_seq, self.as_of, self.delta_seq = pos.applied_seq, pos.as_of, pos.delta_seq
            self.flushed.value = pos.applied_seq
        for rank, value in bucket.loads.items():
            self.loads[rank] = value.rank_load()
            self.load_stamps[rank] = (value.applied_seq, value.as_of)
            self.blocks[rank] = set()
        for rank, (stamp, hashes) in bucket.blocks.items():
            self.blocks[rank] = hashes
            self.block_stamps[rank] = stamp
        # A rank whose load key is gone was removed; a blocks value alone is a leftover.
        for rank in [r for r in self.blocks if r not in self.loads]:
            del self.blocks[rank]
            self.block_stamps.pop(rank, None)
            self._removed.add(rank)
        log.info("resumed at source seq %d (delta %d) with %d ranks", self.applied_seq,
                 self.delta_seq, len(self.loads))  # fmt: skip

    def reset_to(
        self, state: SequenceState, applied_seq: int, delta_seq: int, *, stale: set[Rank]
    ) -> None:
        """Take ``state``'s read model as the whole truth (``seqstate rebuild``).

        Every rank is written anew, stamped with ``applied_seq``; ranks in ``stale`` that the
        state does not have are deleted; the position resumes the projector after ``delta_seq``.
        """
        self._reset()
        self._removed.clear()
        for delta in state.projection():
            delta.seq = applied_seq
            self.apply(delta)
        self._removed = {rank for rank in stale if rank not in self.loads}
        self.applied_seq, self.delta_seq = applied_seq, delta_seq
        self.as_of = state.now_ns
        self._position_dirty = True

    def _reset(self) -> None:
        self._removed.update(self.loads, self.blocks)
        self.loads.clear()
        self.blocks.clear()
        self.load_stamps.clear()
        self.block_stamps.clear()
        self.applied_seq = self.as_of = self.delta_seq = self.flushed.value = 0

    # ---- folding deltas ---------------------------------------------------------------------

    async def handle(self, msg: Msg) -> None:
        """Apply one DELTAS message. The position moves to it only once it is fully handled:
        a flush that runs while this awaits (a dead letter, a look-up) must not record a
        message as handled whose deltas are not applied yet."""
        delta_seq, _ = log_time_ns(msg)
        try:
            deltas = decode_deltas(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await self._dead_letter(msg, delta_seq, f"delta does not decode: {exc}")
            self._passed(delta_seq)
            return
        why = await self._implausible(msg, delta_seq, deltas)
        if why:
            await self._dead_letter(msg, delta_seq, why)
            self._passed(delta_seq)
            return
        for delta in deltas:
            if delta.seq is not None and delta.seq <= self.applied_seq:
                self.stats.skipped += 1
                continue
            self.apply(delta)
        self._passed(delta_seq)

    def _passed(self, delta_seq: int) -> None:
        """The position moves past message ``delta_seq``, whatever it held."""
        self.delta_seq = delta_seq
        self._position_dirty = True
        self._dirty.set()

    async def _implausible(self, msg: Msg, delta_seq: int, deltas: list[Delta]) -> str:
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
        if last is not None and last > self._events_last:
            stream = self.config.events_stream
            info = await retrying(
                lambda: asyncio.wait_for(self._js.stream_info(stream), ATTEMPT_TIMEOUT_S),
                f"looking up stream {stream}",
            )
            self._events_last = info.state.last_seq
            if last > self._events_last:
                return (f"not a writer's delta: event {last} is beyond the events stream "
                        f"(its last is {self._events_last})")  # fmt: skip
        if prev > self.applied_seq:
            raise DeltaGap(
                f"the deltas of namespace {self.config.namespace!r} have a gap: message "
                f"{delta_seq} continues from event {prev}, but the bucket reflects event "
                f"{self.applied_seq}; deltas were lost, so the bucket cannot follow them "
                f"(`seqstate rebuild` re-derives it from the events)"
            )
        return ""

    def apply(self, delta: Delta) -> None:
        self.stats.deltas += 1
        seq = self.applied_seq if delta.seq is None else delta.seq
        stamp = (seq, delta.at_ns)
        for rank in delta.removed_ranks:
            key = (rank[0], rank[1])
            self.loads.pop(key, None)
            self.blocks.pop(key, None)
            self.load_stamps.pop(key, None)
            self.block_stamps.pop(key, None)
            self._dirty_loads.discard(key)
            self._dirty_blocks.discard(key)
            self._removed.add(key)
        for rank in delta.added_ranks:
            self._touch((rank[0], rank[1]), stamp, blocks=True)
        for change in delta.changes:
            rank = (change.rank[0], change.rank[1])
            hashes = self._touch(rank, stamp, blocks=bool(change.removed or change.stored))
            if change.removed:
                hashes.difference_update(change.removed)
            if change.stored:
                hashes.update(change.stored)
            self.loads[rank] = change.load
        self.applied_seq = seq
        self.as_of = max(self.as_of, delta.at_ns)
        self._position_dirty = True
        self._dirty.set()

    def _touch(self, rank: Rank, stamp: tuple[int, int], *, blocks: bool) -> set[int]:
        hashes = self.blocks.get(rank)
        if hashes is None:
            hashes = self.blocks[rank] = set()
            self.loads.setdefault(rank, RankLoad())
            self._removed.discard(rank)
            blocks = True  # a rank added anew must overwrite what a removed one left
        self._dirty_loads.add(rank)
        self.load_stamps[rank] = stamp
        if blocks:
            self._dirty_blocks.add(rank)
            self.block_stamps[rank] = stamp[0]
        return hashes

    # ---- writing the bucket -------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.config.flush_interval_s
        backoff = interval
        while True:
            await self._dirty.wait()
            started = loop.time()
            try:
                await self.flush()
                backoff = interval
            except LeaseLost as exc:
                self._lease_lost(exc)
                return
            except Exception as exc:  # the bucket must catch up, not die
                self.stats.flush_failures += 1
                if await self._bucket_gone():
                    self._fail(BucketLost(
                        f"the bucket {self.config.registry_bucket} was deleted under the "
                        "projector; a restart recreates it and rewrites it from the deltas"
                    ))  # fmt: skip
                    return
                log.warning("flush failed, retrying in %.2fs: %r", backoff, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            # At most one write per key per interval: the next flush starts no sooner.
            await asyncio.sleep(max(0.0, interval - (loop.time() - started)))

    async def _bucket_gone(self) -> bool:
        """Whether the bucket no longer exists (deleted by hand): no retry can write it then."""
        try:
            await asyncio.wait_for(self._js.key_value(self.config.registry_bucket),
                                   ATTEMPT_TIMEOUT_S)  # fmt: skip
        except BucketNotFoundError:
            return True
        except Exception:  # the server away: not known to be gone
            return False
        return False

    async def flush(self) -> None:
        """Write every dirty key once, then the position; on failure everything stays dirty."""
        self._dirty.clear()
        if not (self._position_dirty or self._dirty_loads or self._dirty_blocks or self._removed):
            return
        loads, blocks, removed = self._dirty_loads, self._dirty_blocks, self._removed
        self._dirty_loads, self._dirty_blocks, self._removed = set(), set(), set()
        self._position_dirty = False
        position = Position(self.applied_seq, self.as_of, self.delta_seq)
        try:
            await self._write(loads, blocks, removed, position)
        except BaseException:
            # Put back what this flush owed, unless a later delta superseded it.
            self._dirty_loads |= {r for r in loads if r in self.loads}
            self._dirty_blocks |= {r for r in blocks if r in self.blocks}
            self._removed |= {r for r in removed if r not in self.loads}
            self._position_dirty = True
            self._dirty.set()
            raise
        self.stats.flushes += 1
        self.flushed.advance(position.applied_seq)

    async def _write(
        self, loads: set[Rank], blocks: set[Rank], removed: set[Rank], position: Position
    ) -> None:
        self._check_lease()
        ns = self.config.namespace
        puts = self.values(loads, blocks)
        futures = [await self._put(key, value) for key, value in puts]
        for rank in sorted(removed):
            futures.append(await self._put(load_key(ns, rank), b"", delete=True))
            futures.append(await self._put(blocks_key(ns, rank), b"", delete=True))
        # publish_async has no deadline of its own: an ack lost to a disconnect would hang here.
        if futures:
            await asyncio.wait_for(asyncio.gather(*futures), ACK_TIMEOUT_S)
        self._check_lease()  # the acks can take long: still ours before the position moves?
        await asyncio.wait_for(await self._put(position_key(ns), encode_position(position)),
                               ACK_TIMEOUT_S)  # fmt: skip
        self.stats.keys_written += len(puts)
        self.stats.keys_deleted += 2 * len(removed)

    def values(self, loads: set[Rank], blocks: set[Rank]) -> list[tuple[str, bytes]]:
        """The bucket's ``(key, value)`` of these ranks' loads and block sets, as held now."""
        ns = self.config.namespace
        puts: list[tuple[str, bytes]] = []
        for rank in sorted(loads):
            if (load := self.loads.get(rank)) is not None:
                seq, as_of = self.load_stamps[rank]
                puts.append((load_key(ns, rank), encode_load(rank, load, seq, as_of)))
        for rank in sorted(blocks):
            if (hashes := self.blocks.get(rank)) is not None:
                puts.append((blocks_key(ns, rank), encode_blocks(hashes, self.block_stamps[rank])))
        return puts

    def _check_lease(self) -> None:
        if self.lease is not None:
            self.lease.check()

    async def _put(self, key: str, value: bytes, *, delete: bool = False) -> asyncio.Future[object]:
        headers = {KV_OP: KV_DEL} if delete else None
        subject = f"$KV.{self.config.registry_bucket}.{key}"
        future: asyncio.Future[object] = await self._js.publish_async(  # type: ignore[assignment]
            subject, value, headers=headers
        )
        return future

    async def wait_flushed(self, seq: int) -> None:
        """Return once the bucket's position reflects source sequence ``seq`` or later."""
        await self.flushed.wait(seq)

    # ---- bad input --------------------------------------------------------------------------

    async def _dead_letter(self, msg: Msg, delta_seq: int, reason: str) -> None:
        self.stats.dead_letters += 1
        await self.dead_letters.put(self.config.deltas_stream, delta_seq, msg.subject, msg.data,
                                    reason)  # fmt: skip
