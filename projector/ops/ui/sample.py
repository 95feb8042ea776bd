"""One point of the pictures: what the report and the live page plot, read off a state.

The report samples the state the one fold builds as the log's time passes; the live page asks
the running process for one point a second. Both go through here, so that the two pages plot
the same quantities, and the page's script (``page.js``) turns a list of points into charts.

A point is bounded whatever the state holds: at most :data:`MAX_WORKERS` ranks (the busiest),
:data:`MAX_PUBLISHERS` Dynamo publishers (the most recently heard) and :data:`OLDEST` requests
(their ids cut at :data:`ID_CHARS` characters). A report keeps the table of the oldest requests
(``oldest``) in its last point only; every point has the oldest one's ``age``. Counters are
cumulative; the page takes their differences (events/s, a publisher's capture rate between two
points), so a point never depends on the one before it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from itertools import islice
from typing import Any, Final

from seqstate import RankLoad, SequenceState

MAX_WORKERS: Final = 32
MAX_PUBLISHERS: Final = 20
OLDEST: Final = 10
ID_CHARS: Final = 64  # of a request id shown: ids have no length limit of their own
NS_PER_S: Final = 1_000_000_000

Point = dict[str, Any]


def rank_name(rank: tuple[int, int]) -> str:
    return f"{rank[0]}/{rank[1]}"


def worker_loads(loads: Iterable[tuple[tuple[int, int], RankLoad]]) -> dict[str, list[int]]:
    """``{"worker/rank": [active blocks, prefill tokens]}`` of the busiest ranks."""
    busiest = heapq.nlargest(
        MAX_WORKERS, loads, key=lambda row: (row[1].active_blocks, row[1].prefill.full_tokens)
    )
    return {
        rank_name(rank): [load.active_blocks, load.prefill.full_tokens] for rank, load in busiest
    }


def of_state(state: SequenceState, t_s: float, events: int, dead_letters: int) -> Point:
    """The write model's point at ``t_s``: loads, counters, the oldest requests in flight
    (their age at the state's log time) and each recent Dynamo publisher's count.

    A rank holds its requests in add order (add times never decrease: its age expiry stops at
    the first young one), so the oldest of all are among each rank's first :data:`OLDEST`: a
    point costs what the ranks are, never what the live requests are.
    """
    now = state.now_ns
    live = (
        (request.added_ns, request_id, rank)
        for rank, slot in state.workers.slots.items()
        for request_id, request in islice(slot.requests.items(), OLDEST)
    )
    oldest = [
        [request_id[:ID_CHARS], round(max(0, now - added) / NS_PER_S, 3), rank_name(rank)]
        for added, request_id, rank in heapq.nsmallest(OLDEST, live)
    ]
    publishers = state.publishers
    recent = list(publishers.entries.items())[-MAX_PUBLISHERS:]
    return {
        "t": t_s,
        "events": events,
        "dead": dead_letters,
        "holes": publishers.holes,
        "age": oldest[0][1] if oldest else 0,
        "workers": worker_loads((rank, slot.load()) for rank, slot in state.workers.slots.items()),
        "oldest": oldest,
        "publishers": {str(pid): [p.last_sequence, p.holes] for pid, p in recent},
    }


def of_image(loads: dict[tuple[int, int], RankLoad], t_s: float, events: int, dead: int) -> Point:
    """A projector's point: its image of the bucket knows loads and counts, not requests'
    ages nor Dynamo's publishers (those stay out of the point, and the page says so)."""
    return {"t": t_s, "events": events, "dead": dead, "workers": worker_loads(loads.items())}
