"""The live page's point: read off the running process's consumers when the page asks (once a
second), never a refold. The process keeps nothing for the page; the page keeps its last
:data:`~projector.ops.ui.page.MAX_POINTS` points itself, so memory is bounded on both sides.

A writer's point comes from its authoritative state (requests' ages, Dynamo's publishers
included); a projector alone has only its image of the bucket (loads and counts). The events
counted are the stream positions handled, so the page's events/s is the log's rate.
"""

from __future__ import annotations

import time
from typing import Any

from projector.ops.metrics import WRITER, Metrics
from projector.ops.ui.page import render
from projector.ops.ui.sample import Point, of_image, of_state

DATA_URL = "/ui/data"


def _first(metrics: Metrics) -> tuple[str, Any] | None:
    """The consumer the page shows: a writer if the process runs one, else its projector."""
    found = [(s.role, c) for s, items in metrics.consumers() for c in items]
    found.sort(key=lambda pair: pair[0] != WRITER)
    return found[0] if found else None


def point(metrics: Metrics) -> Point | None:
    """This second's point, or None while no consumer runs (starting, restarting)."""
    first = _first(metrics)
    if first is None:
        return None
    role, consumer = first
    now = time.time()
    dead = sum(consumer.dead_letters.counts.values())
    if role == WRITER:
        out = of_state(consumer.state, now, consumer.applied.value, dead)
    else:
        out = of_image(consumer.image.loads, now, consumer.flushed.value, dead)
    out["namespace"], out["role"] = consumer.namespace, role
    return out


def page(metrics: Metrics) -> str:
    first = _first(metrics)
    who = "starting" if first is None else f"namespace {first[1].namespace}, {first[0]}"
    return render("seqstate live", f"{who}; one point a second from {DATA_URL}", data_url=DATA_URL)
