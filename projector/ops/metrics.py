"""Prometheus metrics of a seqstate process, read from the consumers' own state at scrape time.

Why a collector rather than counters bumped on every event: the fold already counts its
outcomes (``state.counters``), the consumers already count what they wrote, and the per-worker
loads *are* the state. Reading them when Prometheus asks costs nothing per event, is exactly
consistent with the state (a counter restored from a snapshot is the snapshot's), and a worker
that is removed has no series any more by construction. A scrape costs O(ranks).

What a process reports on is a list of :class:`Source`: functions that return the consumers
(or registry views) alive *now*, because ``seqstate run`` replaces a failed pipeline with a new
one and ``serve-http`` opens trackers as they are registered. Each namespace's per-worker gauges
come from the first source that covers it and asks for them, so a process exports them once
(in ``run``, from the writer's authoritative state, not again from the projector's image).

Only ``seqstate_flush_seconds`` is observed as it happens (a histogram cannot be read back from
state): the projector and the writer's delta log call a hook, set by :meth:`Metrics.hook`.

Every registry here is the process's own :class:`~prometheus_client.CollectorRegistry`, never the
global default, so tests and several pipelines in one process never see each other's series.
Labels are bounded: namespace, role, worker, rank, an outcome or a dead-letter kind; never a
request id. The core (:mod:`seqstate`) knows nothing of this: the modeled prefill time is
evaluated at the state's own log time, never a clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from projector.bucket.view_metrics import RankRow, view_ranks, worker_families
from projector.route.refusals import RefusedRow, refused_family

if TYPE_CHECKING:
    from nats.aio.client import Client

    from projector.nats.lag import Lag

WRITER, PROJECTOR, VIEW = "writer", "projector", "view"
FLUSH_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
ROLE_LABELS = ("namespace", "role")


@dataclass(frozen=True)
class Source:
    """Consumers (or views) of one role that a process reports on, as they are *now*."""

    role: str  # WRITER, PROJECTOR or VIEW
    items: Callable[[], Iterable[Any]]
    per_worker: bool = True  # export the per-worker gauges of its namespaces (first one wins)
    # Readiness: none found means not ready (starting, restarting). A serve-http replica that
    # runs no tracker's pipeline (another replica holds the leases) is ready all the same.
    required: bool = True


# ---- per-worker gauges -----------------------------------------------------------------------


def writer_ranks(writer: Any) -> Iterator[RankRow]:
    """The writer's authoritative loads, at the log time of its last event."""
    state, namespace = writer.state, writer.namespace
    now = state.now_ns
    for (worker, rank), slot in state.workers.slots.items():
        yield namespace, worker, rank, slot.load(), now


def projector_ranks(projector: Any) -> Iterator[RankRow]:
    """What the projector has folded into its image of the bucket, at that image's log time."""
    image = projector.image
    for (worker, rank), load in image.loads.items():
        yield image.namespace, worker, rank, load, image.as_of


RANKS: dict[str, Callable[[Any], Iterator[RankRow]]] = {
    WRITER: writer_ranks,
    PROJECTOR: projector_ranks,
    VIEW: view_ranks,
}


# ---- the process's metrics ---------------------------------------------------------------------


class Metrics:
    """One process's registry and what it reports on (see the module docstring).

    ``nc``: the connection whose state ``/readyz`` reports; ``ready_lag_events``: the largest
    lag (in events) at which a consumer is still ready; ``ready_lag_s``: the longest the
    oldest event not handled may have waited (None: any). A projector's lag counts what the
    writer has not handled yet too (:attr:`~projector.nats.lag.Lag.behind_events`): its bucket
    is stale as much while the writer is paused as while it is itself behind.
    """

    def __init__(
        self,
        nc: Client | None = None,
        *,
        ready_lag_events: int = 1000,
        ready_lag_s: float | None = None,
    ) -> None:
        self.nc = nc
        self.ready_lag_events = ready_lag_events
        self.ready_lag_s = ready_lag_s
        self.sources: list[Source] = []
        # Not ready for a reason of the command's own while set (serve-http: its API is not
        # listening yet), whatever the consumers say.
        self.starting = ""
        self.registry = CollectorRegistry(auto_describe=False)
        self.flush_seconds = Histogram(
            "seqstate_flush_seconds",
            "one flush: the projector's write of a batch of bucket "
            "keys (position included), the writer's store of one delta message (retries "
            "included)",
            ROLE_LABELS,
            registry=self.registry,
            buckets=FLUSH_BUCKETS,
        )
        self.registry.register(_StateCollector(self))

    def follow(
        self,
        role: str,
        items: Callable[[], Iterable[Any]],
        *,
        per_worker: bool = True,
        required: bool = True,
    ) -> None:
        """Report on what ``items()`` returns at each scrape (consumers of ``role``, or views)."""
        if role not in RANKS:
            raise ValueError(f"role {role!r}: not one of {sorted(RANKS)}")
        self.sources.append(Source(role, items, per_worker, required))

    def hook(self, role: str, consumer: Any) -> None:
        """Have ``consumer`` report its flush times into ``seqstate_flush_seconds``."""
        if role == WRITER and consumer.deltas.on_store is None:
            consumer.deltas.on_store = self._observer(consumer.namespace, role)
        elif role == PROJECTOR and consumer.on_flush is None:
            consumer.on_flush = self._observer(consumer.namespace, role)

    def _observer(self, namespace: str, role: str) -> Callable[[float], None]:
        return self.flush_seconds.labels(namespace, role).observe

    def consumers(self) -> Iterator[tuple[Source, list[Any]]]:
        """Each writer and projector source with what it holds now (views hold no position)."""
        for source in self.sources:
            if source.role != VIEW:
                yield source, list(source.items())

    def readiness(self) -> tuple[bool, str]:
        """``(ready, why)``: ready while NATS is connected and every consumer has caught up
        with its input, its last lag measurement at most ``ready_lag_events`` events behind
        what was logged and captured (Dynamo's messages waiting outside the events stream
        count), the oldest of those waiting at most ``ready_lag_s``, and the events stream
        taking what is captured (captured messages that wait at two checks in a row, none
        taken in between, make it not ready at once: the events stream refuses them).

        A consumer that has not measured its lag yet is not ready: at start it may be folding a
        backlog of any size, and only a measurement says it is not."""
        if self.nc is not None and not self.nc.is_connected:
            return False, "nats: disconnected"
        if self.starting:
            return False, self.starting
        for source, items in self.consumers():
            if not items and source.required:
                return False, f"starting: no {source.role} running yet"
            for consumer in items:
                lag, namespace = consumer.lag, consumer.namespace
                where = f"({source.role} of namespace {namespace})"
                if not lag.measured_ns:
                    return False, f"replaying: lag not measured yet {where}"
                behind = f"{lag.behind_events - lag.captured} events behind"
                if lag.captured:  # captured, and the events stream has not taken them
                    behind += (
                        f" and {lag.captured} Dynamo messages captured, waiting outside the "
                        "events stream"
                    )
                if not consumer.caught_up.is_set() or lag.behind_events > self.ready_lag_events:
                    return False, f"replaying: {behind} {where}"
                if lag.stalled:
                    return False, (
                        f"behind: the events stream took none of the {lag.captured} Dynamo "
                        f"messages captured since the last check (full?) {where}"
                    )
                if self.ready_lag_s is not None and lag.behind_s > self.ready_lag_s:
                    return False, (
                        f"replaying: {behind}, the oldest waiting "
                        f"{lag.behind_s:.1f}s (ready at {self.ready_lag_s:g}s) {where}"
                    )
        return True, "ready"


class _StateCollector(Collector):
    """Every metric read from state at scrape time (all but the flush histogram)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        metrics = self._metrics
        rows: list[RankRow] = []
        covered: set[str] = set()
        for source in metrics.sources:
            items = list(source.items())
            if source.per_worker:
                for item in items:
                    namespace = item.namespace
                    if namespace not in covered:
                        covered.add(namespace)
                        rows.extend(RANKS[source.role](item))
            if source.role != VIEW:
                for item in items:
                    metrics.hook(source.role, item)  # one a pipeline started since
        yield from worker_families(rows)
        yield from self._counters_and_positions(metrics)

    def _counters_and_positions(self, metrics: Metrics) -> Iterator[Metric]:
        events = CounterMetricFamily(
            "seqstate_events",
            "events the writer folded, by the "
            "outcome its fold counted (expired and orphaned: requests)",
            labels=("namespace", "outcome"),
        )
        dead = CounterMetricFamily(
            "seqstate_dead_letters",
            "messages dead-lettered, by a word for why",
            labels=("namespace", "role", "reason"),
        )
        deltas = CounterMetricFamily(
            "seqstate_deltas", "delta messages the writer published", labels=("namespace",)
        )
        writes = CounterMetricFamily(
            "seqstate_kv_writes",
            "bucket puts and deletes the projector made",
            labels=("namespace",),
        )
        applied = GaugeMetricFamily(
            "seqstate_applied_seq",
            "the last event handled (the projector: whose delta is in the bucket)",
            labels=ROLE_LABELS,
        )
        lag_events = GaugeMetricFamily(
            "seqstate_lag_events",
            "events stored but not yet handled, at the last lag measurement",
            labels=ROLE_LABELS,
        )
        lag_s = GaugeMetricFamily(
            "seqstate_lag_seconds",
            "how long the oldest waiting message had waited, at the last lag measurement",
            labels=ROLE_LABELS,
        )
        behind = GaugeMetricFamily(
            "seqstate_behind_events",
            "events (and captured Dynamo messages) the consumer's output does not reflect "
            "yet, what the writer has not handled included: what /readyz judges",
            labels=ROLE_LABELS,
        )
        snap_age = GaugeMetricFamily(
            "seqstate_snapshot_age_seconds",
            "seconds since the writer stored its newest snapshot",
            labels=("namespace",),
        )
        snap_bytes = GaugeMetricFamily(
            "seqstate_snapshot_bytes", "size of the writer's newest snapshot", labels=("namespace",)
        )
        publishers = GaugeMetricFamily(
            "seqstate_dynamo_publishers",
            "Dynamo processes whose replica-sync messages the writer counts (at most 4096)",
            labels=("namespace",),
        )
        lost = CounterMetricFamily(
            "seqstate_dynamo_messages_lost",
            "messages missing from a Dynamo publisher's sequence (NATS Core kept no copy); "
            "the 20 publishers that lost the most, and the namespace's total (publisher 'all')",
            labels=("namespace", "publisher"),
        )
        sent = CounterMetricFamily(
            "seqstate_dynamo_publisher_messages",
            "messages each Dynamo publisher (a frontend, a worker rank) has sent by its own "
            "sequence numbers, the last heard plus one: its rate is the publisher's capture "
            "rate, holes included (the publishers heard last, at most 4096)",
            labels=("namespace", "publisher"),
        )
        backlog = _BacklogFamilies()
        refused: list[RefusedRow] = []
        seen: set[tuple[str, str]] = set()
        for source, items in metrics.consumers():
            role = source.role
            for c in items:
                namespace = c.namespace
                if (namespace, role) in seen:
                    continue
                seen.add((namespace, role))
                for kind, n in c.dead_letters.counts.items():
                    dead.add_metric([namespace, role, kind], n)
                if role == WRITER:
                    for outcome, n in c.state.counters.items():
                        events.add_metric([namespace, outcome], n)
                    deltas.add_metric([namespace], c.deltas.messages)
                    if counted := c.state.publishers:
                        publishers.add_metric([namespace], len(counted))
                        lost.add_metric([namespace, "all"], counted.holes)
                        for publisher, n in counted.lossy():
                            lost.add_metric([namespace, str(publisher)], n)
                        for publisher, heard in counted.entries.items():
                            sent.add_metric([namespace, str(publisher)], heard.last_sequence + 1)
                    applied.add_metric([namespace, role], c.applied.value)
                    refused.append((namespace, role, c.stats.publishes_refused))
                    backlog.add(namespace, c.lag)
                    stats = c.stats
                    if stats.last_snapshot_stored_s is not None:
                        snap_age.add_metric(
                            [namespace], max(0.0, time.time() - stats.last_snapshot_stored_s)
                        )
                        snap_bytes.add_metric([namespace], stats.last_snapshot_bytes)
                else:
                    writes.add_metric([namespace], c.stats.kv_writes)
                    applied.add_metric([namespace, role], c.flushed.value)
                lag = c.lag
                if lag.measured_ns:  # never measured: no value, rather than a false 0
                    lag_events.add_metric([namespace, role], lag.events)
                    lag_s.add_metric([namespace, role], lag.oldest_age_s)
                    behind.add_metric([namespace, role], lag.behind_events)
        yield from (events, dead, deltas, writes, applied, lag_events, lag_s, snap_age, snap_bytes)
        yield from (publishers, lost, sent, behind, refused_family(refused))
        yield from backlog.families()


class _BacklogFamilies:
    """What waits outside the events stream, and how full the streams are: from the writer's
    last lag measurement (absent until it has measured; a stream's limit absent when it has
    none)."""

    def __init__(self) -> None:
        self.waiting = GaugeMetricFamily(
            "seqstate_capture_waiting_messages",
            "Dynamo messages captured for the namespace and not in the events stream yet "
            "(the events stream refuses them, full, or has not taken them yet)",
            labels=("namespace",),
        )
        self.dropped = GaugeMetricFamily(
            "seqstate_capture_dropped_messages",
            "captured Dynamo messages the capture stream dropped before the events stream "
            "took them (its byte or age limit, while the events stream refused them)",
            labels=("namespace",),
        )
        self.stream = {
            key: GaugeMetricFamily(f"seqstate_stream_{key}", what, labels=("stream",))
            for key, what in (
                ("messages", "messages stored in the stream"),
                ("bytes", "bytes stored in the stream"),
                ("max_messages", "the stream's message limit (absent: none)"),
                ("max_bytes", "the stream's byte limit (absent: none)"),
            )
        }
        self.storage = GaugeMetricFamily(
            "seqstate_jetstream_storage_bytes",
            "the account's JetStream file storage in use",
        )
        self.max_storage = GaugeMetricFamily(
            "seqstate_jetstream_max_storage_bytes",
            "the account's JetStream file storage limit (absent: none set for the account)",
        )
        self._streams: set[str] = set()

    def add(self, namespace: str, lag: Lag) -> None:
        if not lag.measured_ns:
            return
        if lag.capture is not None:
            self.waiting.add_metric([namespace], lag.capture.waiting)
            self.dropped.add_metric([namespace], lag.capture.dropped)
        for use in lag.streams:
            if use.name in self._streams:  # shared by namespaces: once
                continue
            self._streams.add(use.name)
            self.stream["messages"].add_metric([use.name], use.messages)
            self.stream["bytes"].add_metric([use.name], use.bytes)
            if use.max_messages is not None:
                self.stream["max_messages"].add_metric([use.name], use.max_messages)
            if use.max_bytes is not None:
                self.stream["max_bytes"].add_metric([use.name], use.max_bytes)
        if lag.storage is not None and not self.storage.samples:
            self.storage.add_metric([], lag.storage.bytes)
            if lag.storage.max_bytes is not None:
                self.max_storage.add_metric([], lag.storage.max_bytes)

    def families(self) -> Iterator[Metric]:
        yield from (self.waiting, self.dropped, *self.stream.values())
        yield from (self.storage, self.max_storage)
