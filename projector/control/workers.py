"""The control plane for workers: register, remove and list them, through the log.

Topology changes are events like any other (``WorkerAdded``, ``WorkerRemoved``), so a replay
rebuilds the same workers and every reader sees a change at the same point of the log as the
requests around it. This module is what an operator or a discovery agent calls instead of
hand-writing those events: it checks a change before it is published, publishes it with the
publisher's guarantees (stored exactly once, or a :class:`PublishError`), and then waits
until the read model shows it, so that "added" means a scheduler can see the worker.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js.errors import BucketNotFoundError

from projector.bucket.contents import read_bucket
from projector.nats.stream import stop_watch
from projector.route.publisher import RouterPublisher
from projector.settings.config import Config
from projector.wire.values import LoadValue, decode_position, position_key
from seqstate.errors import SeqstateError
from seqstate.events import EventDecodeError, WorkerAdded, WorkerRemoved

DEFAULT_WAIT_S = 10.0


class WorkerControlError(SeqstateError, RuntimeError):
    """A worker change that was refused, before publishing or by the writer."""


class WorkerNotRegistered(WorkerControlError):
    """Removing a worker the read model does not know (no rank of it is in the bucket)."""


class WorkerRefused(WorkerControlError):
    """A registration that breaks a bound, or that the writer did not apply."""


class WorkerChange(msgspec.Struct, frozen=True):
    """What a change did: its event's stream sequence and, once the read model shows it
    (``applied``), the worker's ranks there."""

    worker_id: int
    seq: int
    applied: bool
    dp_ranks: list[int]


class WorkerSummary(msgspec.Struct, frozen=True):
    """One worker as the read model shows it: its ranks and their summed load."""

    worker_id: int
    dp_ranks: list[int]
    active_blocks: int
    active_requests: int
    prefill_tokens: int  # the full prefill tokens still queued on its ranks


class WorkerControl:
    """``await WorkerControl(nc, namespace="prod").add(7, dp_size=2)``."""

    def __init__(
        self,
        nc: Client,
        *,
        namespace: str | None = None,
        config: Config | None = None,
        wait_s: float = DEFAULT_WAIT_S,
    ) -> None:
        self.config = (config or Config()).with_namespace(namespace)
        self.nc = nc
        self.wait_s = wait_s
        # A msg-id prefix of its own: two control calls never deduplicate each other.
        self._publisher = RouterPublisher(
            nc, router_id=f"control-{uuid.uuid4().hex[:12]}", config=self.config
        )

    async def add(
        self, worker_id: int, dp_start: int = 0, dp_size: int = 1, *, block_size: int | None = None
    ) -> WorkerChange:
        """Register (or re-range) a worker. A worker removed within the grace period
        (``worker_grace_s``) comes back with its requests. ``block_size`` (tokens per KV
        block) becomes the namespace's, which schedulers read as ``RegistryView.block_size``."""
        try:
            event = WorkerAdded(
                worker_id=worker_id, dp_start=dp_start, dp_size=dp_size, block_size=block_size
            )
            self._publisher.check(event)  # the bounds of every field, as the writer checks
        except (EventDecodeError, ValueError) as exc:
            raise WorkerRefused(f"worker {worker_id}: {exc}") from None
        if dp_size > self.config.max_ranks_per_worker:
            raise WorkerRefused(
                f"worker {worker_id}: {dp_size} ranks, more than max_ranks_per_worker "
                f"({self.config.max_ranks_per_worker})"
            )
        seq = await self._publisher.publish(event)
        change = await self._settle(worker_id, seq)
        wanted = list(range(dp_start, dp_start + dp_size))
        if change.applied and not set(wanted) <= set(change.dp_ranks):
            raise WorkerRefused(
                f"worker {worker_id}: event {seq} was not applied (a rank bound?); see the "
                f"dead letters on {self.config.dead_letter_subject}"
            )
        return change

    async def remove(self, worker_id: int, *, final: bool | None = None) -> WorkerChange:
        """Remove a worker and every rank of it. Its requests end, unless it is added back
        within the grace period; its keys leave the bucket either way.

        ``final`` removes it for good: no grace, and a late request for it is refused until it
        is added again. None (the default): for good in a namespace fed by Dynamo (a Dynamo
        worker never comes back under its id), else not, so that a worker known only by its
        requests comes back with the next one, as it always has."""
        if not await self._ranks(worker_id):
            raise WorkerNotRegistered(
                f"worker {worker_id} has no rank in the registry (namespace "
                f"{self.config.namespace!r}): nothing to remove"
            )
        if final is None:
            final = bool(self.config.dynamo_endpoints)
        seq = await self._publisher.publish(WorkerRemoved(worker_id=worker_id, final=final))
        return await self._settle(worker_id, seq)

    async def workers(self) -> list[WorkerSummary]:
        """Every worker with a rank in the read model (registered or lazy), by id."""
        try:
            view = await read_bucket(self.nc, self.config, keys="load.>")
        except BucketNotFoundError:
            return []
        by_worker: dict[int, list[LoadValue]] = defaultdict(list)
        for (worker_id, _), load in sorted(view.loads.items()):
            by_worker[worker_id].append(load)
        return [
            WorkerSummary(
                worker_id,
                [load.dp_rank for load in loads],
                sum(load.active_blocks for load in loads),
                sum(load.active_requests for load in loads),
                sum(load.prefill.full_tokens for load in loads),
            )
            for worker_id, loads in by_worker.items()
        ]

    # ---- reading the result back ------------------------------------------------------------

    async def _ranks(self, worker_id: int) -> list[int]:
        try:
            view = await read_bucket(self.nc, self.config, keys=f"load.{worker_id}.*")
        except BucketNotFoundError:
            return []
        return sorted(dp_rank for _, dp_rank in view.loads)

    async def _settle(self, worker_id: int, seq: int) -> WorkerChange:
        applied = await self._applied(seq)
        ranks = await self._ranks(worker_id) if applied else []
        return WorkerChange(worker_id, seq, applied, ranks)

    async def _applied(self, seq: int) -> bool:
        """Waits (up to ``wait_s``) until the bucket's position has passed event ``seq``."""
        if self.wait_s <= 0:
            return False
        try:
            kv = await self.nc.jetstream().key_value(self.config.registry_bucket)
        except BucketNotFoundError:
            return False
        watcher = await kv.watch(position_key(self.config.namespace))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        try:
            while (remaining := deadline - loop.time()) > 0:
                try:
                    entry = await watcher.updates(timeout=remaining)
                except nats.errors.TimeoutError:
                    return False
                if entry is None or not entry.value:
                    continue  # the end of the current values, or a delete
                if decode_position(entry.value).applied_seq >= seq:
                    return True
            return False
        finally:
            await stop_watch(self.nc.jetstream(), watcher)
