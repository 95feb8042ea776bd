"""Publishes the server refused, as a Prometheus counter: where a refusal happens, it is counted.

A full events stream (or a full disk) refuses a router's events in the router's process: the
ledger never sees them, so no seqstate process can count them. Each
:class:`~projector.route.publisher.RouterPublisher` keeps its count (``publisher.refused``, by a
word for why: ``stream_full``, ``storage_full``, ``permission``, ``other``), and a router exports
it with :func:`publisher_collector`; the writer's own refused Ticks are exported the same way
by the pipeline's metrics (role ``writer``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from projector.route.publisher import RouterPublisher

# (namespace, role, counts by reason)
RefusedRow = tuple[str, str, Mapping[str, int]]


def refused_family(rows: Iterable[RefusedRow]) -> CounterMetricFamily:
    """``seqstate_publishes_refused_total{namespace, role, reason}``."""
    family = CounterMetricFamily(
        "seqstate_publishes_refused",
        "publish attempts the server refused (a full stream, a full disk, a permission), by "
        "who published (router, writer) and why; each retry that is refused again counts",
        labels=("namespace", "role", "reason"),
    )
    totals: dict[tuple[str, str, str], int] = {}
    for namespace, role, counts in rows:
        for reason, n in counts.items():
            key = (namespace, role, reason)
            totals[key] = totals.get(key, 0) + n
    for labels, n in sorted(totals.items()):
        family.add_metric(list(labels), n)
    return family


class PublisherCollector(Collector):
    """Router publishers' refusals, read at scrape time (see :func:`publisher_collector`)."""

    def __init__(self, each: Callable[[], Iterable[RouterPublisher]]) -> None:
        self._each = each

    def collect(self) -> Iterator[Metric]:
        yield refused_family((p.config.namespace, "router", p.refused) for p in self._each())


def publisher_collector(
    *publishers: RouterPublisher, each: Callable[[], Iterable[RouterPublisher]] | None = None
) -> PublisherCollector:
    """A collector of the publishers' refused attempts, for a router's own registry::

        registry.register(publisher_collector(publisher))

    ``each``: a function returning the publishers to report at each scrape."""
    kept = list(publishers)
    return PublisherCollector(each if each is not None else lambda: kept)
