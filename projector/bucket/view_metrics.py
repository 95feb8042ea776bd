"""A registry view's per-worker gauges, for a scheduler's own Prometheus registry (opt-in).

The same four ``seqstate_worker_*{namespace, worker, dp_rank}`` gauges that the writer and the
projector export (:mod:`projector.ops.metrics`), read from a :class:`RegistryView` at scrape
time: a scheduler that reads the bucket exports what it routes on, and nothing is counted per
update. Kept with the view, so that the view's ``export_metrics`` needs nothing of the process
wings above it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from seqstate.decay import active_tokens, modeled_remaining_ms
from seqstate.loads import RankLoad

if TYPE_CHECKING:
    from projector.bucket.reader import RegistryView

WORKER_LABELS = ("namespace", "worker", "dp_rank")

# One rank's gauges: (namespace, worker, dp_rank, load, log time to evaluate the decay at).
RankRow = tuple[str, int, int, RankLoad, int]


def view_ranks(view: RegistryView) -> Iterator[RankRow]:
    """A registry view's loads, at the log time of the newest value it received (none for a
    rank whose load value does not decode: unknown is not idle)."""
    registry, namespace, unreadable = view.registry, view.config.namespace, view.unreadable
    for rank in registry.ranks():
        load = registry.load_of(rank)
        if load is not None and rank not in unreadable:
            yield namespace, rank[0], rank[1], load, view.as_of_ns


def worker_families(rows: Iterable[RankRow]) -> list[Metric]:
    """The four per-(worker, dp_rank) gauges. A rank whose prefill has no modeled duration
    (Dynamo's MissingExpectedDuration) has no ``remaining_prefill_ms`` sample: unknown is not 0."""
    blocks = GaugeMetricFamily(
        "seqstate_worker_active_blocks",
        "KV blocks held by the rank's active requests",
        labels=WORKER_LABELS,
    )
    tokens = GaugeMetricFamily(
        "seqstate_worker_active_prefill_tokens",
        "prefill tokens still pending on the rank (decayed at the state's log time)",
        labels=WORKER_LABELS,
    )
    requests = GaugeMetricFamily(
        "seqstate_worker_active_requests", "requests in flight on the rank", labels=WORKER_LABELS
    )
    remaining = GaugeMetricFamily(
        "seqstate_worker_remaining_prefill_ms",
        "modeled milliseconds of prefill left on the rank, at the state's log time",
        labels=WORKER_LABELS,
    )
    for namespace, worker, rank, load, now in rows:
        labels = [namespace, str(worker), str(rank)]
        blocks.add_metric(labels, load.active_blocks)
        tokens.add_metric(labels, active_tokens(load.prefill, now))
        requests.add_metric(labels, load.active_requests)
        ms = modeled_remaining_ms(load.prefill, now)
        if ms is not None:
            remaining.add_metric(labels, ms)
    return [blocks, tokens, requests, remaining]


class ViewCollector(Collector):
    """The per-worker gauges of registry views, for a scheduler's own process (opt-in)::

        registry.register(view_collector(view))

    ``views`` is a list, or a function returning the views alive at each scrape."""

    def __init__(self, views: Iterable[RegistryView] | Callable[[], Iterable[RegistryView]]):
        self._views = views if callable(views) else (lambda kept=list(views): kept)

    def collect(self) -> Iterator[Metric]:
        rows: list[RankRow] = []
        seen: set[str] = set()
        for view in self._views():
            if view.config.namespace not in seen:
                seen.add(view.config.namespace)
                rows.extend(view_ranks(view))
        yield from worker_families(rows)


def view_collector(
    *views: RegistryView, each: Callable[[], Iterable[RegistryView]] | None = None
) -> ViewCollector:
    """A collector of the views' per-worker gauges (``seqstate_worker_*{namespace, worker,
    dp_rank}``), read at scrape time; register it in your own registry. ``each``: a function
    returning the views to report at each scrape, instead of fixed ones."""
    return ViewCollector(each if each is not None else list(views))
