"""Dynamo publishers' counts against forged sequence numbers, and against a naive model.

Anyone allowed on Dynamo's subjects can send any publisher id and any u64 sequence. Two ids
sending 0 and then 2^64 - 1 made hole totals no snapshot could encode: saving one raised
OverflowError, and the writer died at every restart. And since Dynamo draws a new id at every
start, a sequence 0 from a known id is no restart: counting it as one moved the publisher
back, so its next message in order was taken for a hole.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqstate import SequenceState
from seqstate.deltas import Hole
from seqstate.publishers import Publishers
from seqstate.snapshot import _State

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

U64_MAX = 2**64 - 1  # the most a snapshot can hold
MOST_LOSSY = 20  # the publishers status and metrics name


class Naive:
    """The rules written out the slow way: a list for the order, a full recount of the
    lossiest after every message."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: list[int] = []  # least recently heard first
        self.last: dict[int, int] = {}
        self.heard_ns: dict[int, int] = {}
        self.late_of: dict[int, int] = {}
        self.holes_of: dict[int, int] = {}  # every id whose count is remembered
        self.holes = self.late = self.forgotten = 0

    def heard(self, pid: int, sequence: int, now_ns: int) -> Hole | None:
        hole = None
        if pid not in self.order:
            if len(self.order) == self.capacity:
                gone = self.order.pop(0)
                self.forgotten += 1
                del self.last[gone], self.heard_ns[gone], self.late_of[gone]
            self.order.append(pid)
            self.last[pid], self.late_of[pid] = sequence, 0
            self.holes_of.setdefault(pid, 0)
        else:
            self.order.remove(pid)
            self.order.append(pid)
            last = self.last[pid]
            if sequence > last + 1:
                hole = Hole(pid, last + 1, sequence - last - 1)
                self.holes_of[pid] = min(self.holes_of[pid] + hole.missing, U64_MAX)
                self.holes = min(self.holes + hole.missing, U64_MAX)
                self.last[pid] = sequence
            elif sequence == last + 1:
                self.last[pid] = sequence
            else:
                self.late_of[pid] += 1
                self.late += 1
        self.heard_ns[pid] = now_ns
        top = {pid for pid, _ in self.lossy()}
        self.holes_of = {p: h for p, h in self.holes_of.items() if p in self.last or p in top}
        return hole

    def lossy(self) -> list[tuple[int, int]]:
        counted = sorted((-h, p) for p, h in self.holes_of.items() if h)
        return [(p, -h) for h, p in counted[:MOST_LOSSY]]

    def rows(self) -> list[tuple[int, int, int, int, int]]:
        return [
            (p, self.last[p], self.heard_ns[p], self.holes_of[p], self.late_of[p])
            for p in self.order
        ]


IDS = st.sampled_from([0, 1, 2, 3, 5, 8, 13, 21, 2**53 - 1, U64_MAX])
SEQUENCES = st.sampled_from([0, 1, 2, 3, 4, 7, 2**32, 2**63, U64_MAX - 1, U64_MAX]) | st.integers(
    0, U64_MAX
)


@settings(max_examples=400, deadline=None)
@given(
    capacity=st.sampled_from([1, 2, 3, 5, 4096]),
    messages=st.lists(st.tuples(IDS, SEQUENCES), max_size=120),
    check_every=st.integers(1, 40),
)
def test_the_counts_equal_the_naive_model_and_every_snapshot_restores(
    capacity: int, messages: list[tuple[int, int]], check_every: int
) -> None:
    state = SequenceState(max_publishers=capacity)
    naive = Naive(capacity)
    for now_ns, (pid, sequence) in enumerate(messages, 1):
        assert state.publishers.heard(pid, sequence, now_ns) == naive.heard(pid, sequence, now_ns)
        if now_ns % check_every == 0:  # a writer restarting here goes on with the same counts
            data = state.snapshot()
            state = SequenceState.restore(data)
            assert state.snapshot() == data
    publishers = state.publishers
    assert publishers.rows() == naive.rows()
    assert (publishers.holes, publishers.late, publishers.forgotten) == (
        naive.holes,
        naive.late,
        naive.forgotten,
    )
    assert publishers.lossy() == naive.lossy()
    assert all(0 <= n <= U64_MAX for row in publishers.rows() for n in row)
    SequenceState.restore(state.snapshot())


def test_two_forged_publishers_saturate_the_total_and_the_snapshot_saves() -> None:
    """The probe's messages: two ids, each sequence 0 then 2^64 - 1."""
    state = SequenceState()
    for pid in (7, 9):
        assert state.publishers.heard(pid, 0, 1) is None
        assert state.publishers.heard(pid, U64_MAX, 2) == Hole(pid, 1, U64_MAX - 1)
    publishers = state.publishers
    assert publishers.holes == U64_MAX  # 2^65 - 4 messages: saturated, not wrapped
    assert publishers.lossy() == [(7, U64_MAX - 1), (9, U64_MAX - 1)]
    restored = SequenceState.restore(state.snapshot())
    assert restored.publishers.holes == U64_MAX
    assert restored.publishers.rows() == publishers.rows()


def test_a_late_zero_never_moves_a_publisher_back() -> None:
    """0, then 2^64 - 1, then 0 and 2^64 - 1 again: one hole, one late message. Counted as a
    restart, the second 0 made the second 2^64 - 1 another hole, and the publisher's own count
    passed 2^64."""
    publishers = Publishers()
    assert publishers.heard(4, 0, 1) is None
    assert publishers.heard(4, U64_MAX, 2) == Hole(4, 1, U64_MAX - 1)
    assert publishers.heard(4, 0, 3) is None
    assert publishers.heard(4, U64_MAX, 4) is None
    assert publishers.rows() == [(4, U64_MAX, 4, U64_MAX - 1, 2)]
    assert (publishers.holes, publishers.late) == (U64_MAX - 1, 2)
    assert publishers.heard(5, U64_MAX - 5, 5) is None  # first seen above 0: no hole
    assert publishers.heard(5, U64_MAX, 6) == Hole(5, U64_MAX - 4, 4)
    assert publishers.holes == U64_MAX  # saturated


def test_the_lossiest_are_still_named_after_a_flood_of_new_ids_forgot_them() -> None:
    """Publishers 1-3 lose messages, then 5,000 new ids (each with a hole of its own, smaller)
    push them out of the table of 4,096: the totals and the 20 lossiest keep them, and one
    of them heard again goes on from its count."""
    publishers = Publishers()
    for pid, lost in ((1, 500), (2, 400), (3, 300)):
        publishers.heard(pid, 0, pid)
        publishers.heard(pid, lost + 1, pid)
    for pid in range(10, 5010):
        publishers.heard(pid, 0, pid)
        publishers.heard(pid, 2 + pid % 7, pid)  # a hole of 1 to 7
    assert 1 not in publishers and publishers.forgotten == 5003 - 4096
    flood = sum(1 + pid % 7 for pid in range(10, 5010))
    assert publishers.holes == 1200 + flood
    lossy = publishers.lossy()
    assert lossy[:3] == [(1, 500), (2, 400), (3, 300)]
    assert lossy[3:] == [(pid, 7) for pid in range(13, 13 + 7 * 17, 7)]  # pid % 7 == 6
    publishers.heard(2, 10_000, 6000)  # forgotten: its first message again, no hole
    publishers.heard(2, 10_010, 6001)
    assert publishers[2].holes == 409 and publishers.lossy()[:2] == [(1, 500), (2, 409)]


def test_a_snapshot_of_the_build_that_counted_restarts_still_restores() -> None:
    """Its rows carried restarts and its totals (holes, restarts, forgotten), and it had no
    list of the lossiest: restarts are now late messages, the lossiest come from the rows."""
    state = SequenceState()
    for pid, lost in ((1, 5), (2, 3)):
        state.publishers.heard(pid, 0, 1)
        state.publishers.heard(pid, lost + 1, 2)
    magic, body = state.snapshot()[:4], msgspec.msgpack.decode(state.snapshot()[4:])
    body = body[: _State.__struct_fields__.index("lossiest")]  # no lossiest, nor after
    body[-3] = [[1, 6, 2, 5, 2, 1], [2, 4, 2, 3, 0, 4]]  # (.., holes, restarts, late)
    body[-1] = [8, 3, 0]  # (holes, restarts, forgotten): one restart of a forgotten id
    restored = SequenceState.restore(magic + msgspec.msgpack.encode(body)).publishers
    assert restored.rows() == [(1, 6, 2, 5, 3), (2, 4, 2, 3, 4)]
    assert (restored.holes, restored.late, restored.forgotten) == (8, 3 + 1 + 4, 0)
    assert restored.lossy() == [(1, 5), (2, 3)]
    assert restored.heard(1, 0, 3) is None and restored.late == 9  # late, not a restart
