"""RegistryView: a scheduler's local replica of the registry bucket; reads in microseconds.

The view watches the namespace's keys and folds each value into a
:class:`~seqstate.PromptRegistry` as a synthetic :class:`~seqstate.Delta` (a rank's new load,
a slot's request released and the new one booked, a removed rank), so ``loads`` and
``potential_loads`` are the core's own code over the same data the writer's registry holds: no
second implementation of the rules. A slot value costs the view the hashes of that one
request, whatever the size of its rank's set.

Time: values carry their prefill anchors in log time. The view keeps one estimate of the log's
clock, anchored at receive time: each value received at local monotonic time ``t`` with
``as_of = a`` proves the log had reached at least ``a`` by ``t``, so the estimate is the largest
``a + (now - t)`` seen. No clock synchronisation is needed between the scheduler and the
server. Passing ``now_ns`` explicitly evaluates decay at that log time instead (exact
comparisons, replays).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import msgspec
from nats.aio.client import Client
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from projector.bucket import CurrentValues
from projector.config import Config
from projector.progress import Progress
from projector.values import Rank, decode_load, decode_position, decode_request, parse_key
from seqstate import Delta, LoadRow, PotentialLoadRow, PromptRegistry, RankChange
from seqstate.deltas import Booking
from seqstate.errors import SeqstateError
from seqstate.loads import EMPTY_LOAD

log = logging.getLogger("seqstate.reader")


class RegistryUnavailable(SeqstateError, RuntimeError):
    """The bucket does not exist (no projector has run in this account) or cannot be watched."""


@dataclass(frozen=True)
class Staleness:
    applied_seq: int  # the newest event sequence the view reflects
    as_of_ns: int  # the log time of that event
    age_s: float  # seconds since the view last heard from the projector (inf: never)


class RegistryView:
    """``async with RegistryView(nc, namespace="prod") as view: view.potential_loads(...)``."""

    def __init__(
        self,
        nc: Client,
        *,
        namespace: str | None = None,
        config: Config | None = None,
        initial_timeout: float = 30.0,
    ) -> None:
        # One rule, as in RouterPublisher: ``namespace``, when given, wins over ``config``'s.
        config = (config or Config()).with_namespace(namespace)
        self.nc = nc
        self.config = config
        self.registry = PromptRegistry()
        self.applied_seq = 0
        self.as_of_ns = 0
        self.values_received = 0
        self.bad_values = 0
        self._initial_timeout = initial_timeout
        self._clock_offset_ns: int | None = None  # log time minus local monotonic time
        self._heard_at: float | None = None
        self._position = Progress()  # applied_seq, for wait_for
        self._task: asyncio.Task[None] | None = None
        self._watcher: KeyValue.KeyWatcher | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> RegistryView:
        """Watch the bucket; returns once the current values have been received."""
        try:
            kv = await self.nc.jetstream().key_value(self.config.registry_bucket)
        except BucketNotFoundError:
            raise RegistryUnavailable(
                f"bucket {self.config.registry_bucket!r} does not exist: is a projector running?"
            ) from None
        self._watcher = await kv.watch(f"{self.config.namespace}.>")
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        self._task = asyncio.create_task(self._follow(self._watcher, ready))
        try:
            await asyncio.wait_for(asyncio.shield(ready), self._initial_timeout)
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()
            self._watcher = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def __aenter__(self) -> RegistryView:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _follow(self, watcher: KeyValue.KeyWatcher, ready: asyncio.Future[None]) -> None:
        current = CurrentValues(self.nc, self.config)
        async for entry in watcher:
            if entry is not None:
                deleted = entry.operation in (KV_DEL, KV_PURGE)
                self.receive(entry.key, entry.value, deleted=deleted)
                self._position.advance(self.applied_seq)
            if not ready.done() and await current.done_after(entry):
                ready.set_result(None)

    # ---- folding values ---------------------------------------------------------------------

    def receive(self, key: str, value: bytes | None, *, deleted: bool = False) -> None:
        """Fold one bucket entry into the replica; a damaged value is counted and skipped."""
        kind, rank, slot = parse_key(self.config.namespace, key)
        if kind == "lease":  # who writes, not what: renewed every second even when nothing moves
            return
        self.values_received += 1
        self._heard_at = time.monotonic()
        try:
            if kind == "position" and not deleted and value:
                position = decode_position(value)
                self.applied_seq = max(self.applied_seq, position.applied_seq)
                self._observe(position.as_of)
            elif kind == "load" and rank is not None:
                if deleted or not value:
                    self.registry.apply(Delta("applied", 0, removed_ranks=[rank]))
                else:
                    load = decode_load(value)
                    self._observe(load.as_of)
                    self.registry.apply(Delta("applied", 0, [RankChange(rank, load.rank_load())]))
            elif kind == "req" and rank is not None:
                current = self.registry.load_of(rank)
                if current is None and (deleted or not value):
                    return  # the rest of a removed rank
                booked = []
                if not deleted and value:
                    request = decode_request(value)
                    if not request.empty:
                        booked = [Booking(slot, request.request_id, request.hash_list())]
                change = RankChange(rank, current or EMPTY_LOAD, [slot], booked)
                self.registry.apply(Delta("applied", 0, [change]))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self.bad_values += 1
            log.warning("skipping unreadable value of %s: %s", key, exc)

    def _observe(self, as_of_ns: int) -> None:
        self.as_of_ns = max(self.as_of_ns, as_of_ns)
        offset = as_of_ns - time.monotonic_ns()
        if self._clock_offset_ns is None or offset > self._clock_offset_ns:
            self._clock_offset_ns = offset

    # ---- reads ------------------------------------------------------------------------------

    def log_now_ns(self) -> int:
        """The view's estimate of the log's current time (receive-time anchored)."""
        if self._clock_offset_ns is None:
            return time.time_ns()
        return time.monotonic_ns() + self._clock_offset_ns

    def loads(self, now_ns: int | None = None) -> list[LoadRow]:
        """One row per rank, sorted by (worker_id, dp_rank); decay at ``now_ns`` (log time)."""
        return self.registry.loads(self.log_now_ns() if now_ns is None else now_ns)

    def potential_loads(
        self, block_hashes: Sequence[int], isl_tokens: int, now_ns: int | None = None
    ) -> list[PotentialLoadRow]:
        """What each rank's load would be with this request booked there (see PromptRegistry)."""
        now = self.log_now_ns() if now_ns is None else now_ns
        return self.registry.potential_loads(block_hashes, isl_tokens, now)

    def overlap_depths(self, block_hashes: Sequence[int]) -> dict[Rank, int]:
        return self.registry.overlap_depths(block_hashes)

    def staleness(self) -> Staleness:
        age = float("inf") if self._heard_at is None else time.monotonic() - self._heard_at
        return Staleness(self.applied_seq, self.as_of_ns, age)

    async def wait_for(self, seq: int, timeout: float | None = None) -> None:
        """Read-your-writes: return once the view reflects event sequence ``seq``."""
        await self._position.wait(seq, timeout)
