"""The pictures' points and page are bounded whatever the state holds.

A report of a log of any length is at most ``MAX_POINTS + 2`` points per series, and a point at
most :data:`MAX_WORKERS` ranks, :data:`MAX_PUBLISHERS` publishers and :data:`OLDEST` requests:
so the page's size has a ceiling, measured here on a state that exceeds every bound.
"""

from __future__ import annotations

import json

from projector.ops.ui.page import MAX_POINTS, render
from projector.ops.ui.sample import ID_CHARS, MAX_PUBLISHERS, MAX_WORKERS, OLDEST, of_state
from projector.settings.config import Config
from seqstate import AddRequest, Free, SequenceState

S = 1_000_000_000
BIG_WORKER = 18391909055928191313  # Dynamo's ids run to 20 digits


def crowded() -> SequenceState:
    """100 workers of 2 ranks, 2,000 requests, 50 Dynamo publishers."""
    state = Config().new_state()
    for i in range(2000):
        worker = BIG_WORKER - i % 100
        event = AddRequest(
            request_id=f"request-{i:05d}-{'x' * 1000}",  # cut at ID_CHARS
            worker_id=worker,
            dp_rank=i % 2,
            block_hashes=list(range(i, i + 1 + i % 7)),
            prefill_tokens=10 * i,
        )
        state.apply(event, S + i * S // 100)  # 10 ms apart
    for p in range(50):
        state.publishers.heard(2**53 + p, 0, S)
        state.publishers.heard(2**53 + p, 10**12, S)  # a hole of 10^12 - 1 messages
    return state


def test_a_point_keeps_the_busiest_ranks_the_oldest_requests_and_recent_publishers() -> None:
    state = crowded()
    point = of_state(state, 2.0, 2000, 0)
    assert len(point["workers"]) == MAX_WORKERS
    busiest = max(slot.load().active_blocks for slot in state.workers.slots.values())
    assert max(blocks for blocks, _ in point["workers"].values()) == busiest
    assert len(point["oldest"]) == OLDEST
    assert [row[0][:13] for row in point["oldest"][:2]] == ["request-00000", "request-00001"]
    assert point["oldest"][0][1] == point["age"] == 19.99  # seconds, at the newest event's time
    assert len(point["oldest"][0][0]) == ID_CHARS
    assert len(point["publishers"]) == MAX_PUBLISHERS
    assert point["holes"] == 50 * (10**12 - 1)


def test_the_largest_report_page_is_under_one_and_a_half_megabytes() -> None:
    last = of_state(crowded(), 2.0, 2000, 0)
    point = {k: v for k, v in last.items() if k != "oldest"}  # a report's table: at the end
    page = render("seqstate report", "bounds", points=[point] * (MAX_POINTS + 1) + [last])
    assert 1_000_000 < len(page.encode()) < 1_500_000
    data = page.split('type="application/json">')[1].split("</script>")[0]
    assert len(json.loads(data)["points"]) == MAX_POINTS + 2


def test_the_oldest_requests_are_those_of_a_full_scan_after_frees() -> None:
    """A point reads each rank's first requests only (a rank holds them in add order): the
    answer must equal a scan of every live request, also once the oldest have been freed."""
    state = crowded()
    for i in range(0, 2000, 3):  # free every third, the oldest of every rank among them
        worker = BIG_WORKER - i % 100
        state.apply(Free(request_id=f"request-{i:05d}-{'x' * 1000}", worker_id=worker), 30 * S)
    point = of_state(state, 3.0, 2667, 0)
    scan = sorted(
        (request.added_ns, request_id[:ID_CHARS])
        for slot in state.workers.slots.values()
        for request_id, request in slot.requests.items()
    )[:OLDEST]
    assert [row[0] for row in point["oldest"]] == [rid for _, rid in scan]
