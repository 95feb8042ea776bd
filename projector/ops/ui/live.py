"""The live page's point: read off the running process's consumers when the page asks (once a
second), never a refold. The process keeps nothing for the page; the page keeps its last
:data:`~projector.ops.ui.page.MAX_POINTS` points itself, so memory is bounded on both sides.

A writer's point comes from its authoritative state (requests' ages, Dynamo's publishers
included); a projector alone has only its image of the bucket (loads and counts). The events
counted are the stream positions handled, so the page's events/s is the log's rate.

One process may run the consumers of many namespaces (``serve-http`` runs a pipeline for each
tracker whose lease it holds): ``/ui?namespace=NS`` shows one, and the page links the others.
A page stays on the namespace it opened with: its data URL names it.
"""

from __future__ import annotations

import time
from typing import Any, Final
from urllib.parse import quote

from projector.ops.metrics import WRITER, Metrics
from projector.ops.ui.page import render
from projector.ops.ui.sample import Point, of_image, of_state

PAGE_URL: Final = "/ui"
DATA_URL: Final = "/ui/data"
MAX_LINKS: Final = 100  # namespaces linked from one page; any other is still /ui?namespace=NS
SHOWN_NAME_CHARS: Final = 80  # of a namespace asked for that runs nowhere here, in the answer


def running(metrics: Metrics) -> list[tuple[str, Any]]:
    """``(role, consumer)`` of each consumer the process runs now, one per namespace: its writer
    if it runs one there, else its projector; by namespace."""
    chosen: dict[str, tuple[str, Any]] = {}
    for source, items in metrics.consumers():
        for consumer in items:
            have = chosen.get(consumer.namespace)
            if have is None or (have[0] != WRITER and source.role == WRITER):
                chosen[consumer.namespace] = (source.role, consumer)
    return [chosen[ns] for ns in sorted(chosen)]


def _of(metrics: Metrics, namespace: str | None) -> tuple[str, Any] | None:
    here = running(metrics)
    if namespace is None:
        return here[0] if here else None
    return next(((r, c) for r, c in here if c.namespace == namespace), None)


def point(metrics: Metrics, namespace: str | None = None) -> Point | None:
    """This second's point of ``namespace`` (None: the first running), or None while none of it
    runs (starting, restarting, its lease held by another replica)."""
    found = _of(metrics, namespace)
    if found is None:
        return None
    role, consumer = found
    now = time.time()
    dead = sum(consumer.dead_letters.counts.values())
    if role == WRITER:
        out = of_state(consumer.state, now, consumer.applied.value, dead)
    else:
        out = of_image(consumer.image.loads, now, consumer.flushed.value, dead)
    out["namespace"], out["role"] = consumer.namespace, role
    return out


def page(metrics: Metrics, namespace: str | None = None) -> str | None:
    """The page of ``namespace`` (None: the first running, else one that waits for any), or None
    when none of it runs here."""
    found = _of(metrics, namespace)
    if found is None and namespace is not None:
        return None
    here = [c.namespace for _, c in running(metrics)]
    if found is None:
        who, data_url = "starting", DATA_URL
    else:
        shown = found[1].namespace
        who, data_url = f"namespace {shown}, {found[0]}", f"{DATA_URL}?namespace={quote(shown)}"
        here.remove(shown)
    links = [(ns, f"{PAGE_URL}?namespace={quote(ns)}") for ns in here[:MAX_LINKS]]
    more = len(here) - len(links)
    return render(
        "seqstate live",
        f"{who}; one point a second from {data_url}",
        data_url=data_url,
        links=links,
        links_more=more,
    )


def not_here(metrics: Metrics, namespace: str) -> str:
    """One line for a namespace asked for that no consumer here runs, and which ones do."""
    asked = namespace if len(namespace) <= SHOWN_NAME_CHARS else namespace[:SHOWN_NAME_CHARS] + "…"
    here = [c.namespace for _, c in running(metrics)]
    listed = ", ".join(here[:MAX_LINKS]) + (
        f" and {len(here) - MAX_LINKS} more" if len(here) > MAX_LINKS else ""
    )
    return f"no consumer of namespace {asked!r} runs in this process now; " + (
        f"here: {listed}" if here else "none runs here yet"
    )
