"""RecentIds: the bounded, time-limited memory of ended ids and tombstones, packed compactly."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqstate.recent import STALE_SLACK, RecentIds

pytestmark = pytest.mark.core

S = 1_000_000_000


def test_values_and_times_come_back_exact_and_in_write_order() -> None:
    ids = RecentIds(retention_ns=60 * S, capacity=10)
    ids.put("a", 2, 5 * S)
    ids.put("b", 0, 2**62)  # a log time far in the future still packs exactly
    ids.put("a", 1, 7 * S)  # a rewrite moves the id to the end
    assert list(ids.items()) == [("b", 0, 2**62), ("a", 1, 7 * S)]
    assert (ids.get("a"), ids.get("b"), ids.get("c")) == (1, 0, None)
    assert ids.pop("a") == 1 and "a" not in ids and ids.pop("a") is None


def test_the_oldest_go_first_by_count_and_by_age() -> None:
    ids = RecentIds(retention_ns=10 * S, capacity=3)
    for n, rid in enumerate("abcd"):
        ids.put(rid, 0, n * S)
    assert [rid for rid, _, _ in ids.items()] == ["b", "c", "d"] and ids.evicted == 1
    assert ids.due_ns == 11 * S  # b, written at 1 s, leaves at 11 s
    ids.prune(12 * S + 1)
    assert [rid for rid, _, _ in ids.items()] == ["d"]


def test_a_rewritten_id_is_forgotten_by_its_last_write() -> None:
    ids = RecentIds(retention_ns=10 * S, capacity=100)
    ids.put("a", 0, 1 * S)
    ids.put("a", 2, 5 * S)
    ids.prune(11 * S + 1)  # past the first write's retention, not the second's
    assert ids.get("a") == 2
    ids.prune(15 * S + 1)
    assert "a" not in ids


def test_stale_queue_entries_stay_bounded() -> None:
    ids = RecentIds(retention_ns=10**6 * S, capacity=5)
    for n in range(10 * STALE_SLACK):
        ids.put("x", 0, n)
        ids.pop("x")
    assert len(ids._queue) <= 2 * len(ids) + STALE_SLACK + 1


def test_a_snapshot_round_trip_keeps_order_values_and_times() -> None:
    ids = RecentIds(retention_ns=60 * S, capacity=10)
    for n, rid in enumerate("abc"):
        ids.put(rid, n, n * S)
    again = RecentIds(retention_ns=60 * S, capacity=10)
    again.load(list(ids.items()))
    assert list(again.items()) == list(ids.items()) and again.due_ns == ids.due_ns
    again.put("d", 0, 3 * S)
    ids.put("d", 0, 3 * S)
    assert list(again.items()) == list(ids.items())


def test_take_before_returns_the_ids_written_before_a_time_oldest_first() -> None:
    """A lease scan's expiries: ids moved by a later write, or taken out, are not returned
    for their old place."""
    ids = RecentIds(retention_ns=2**64, capacity=2**64)
    for n, rid in enumerate("abcde"):
        ids.put(rid, 0, n * S)
    ids.put("b", 0, 10 * S)  # moved behind e
    ids.pop("c")
    assert ids.oldest_ns() == 0 and ids.written_ns("b") == 10 * S
    assert ids.take_before(4 * S) == ["a", "d"]
    assert ids.take_before(4 * S) == []
    assert ids.oldest_ns() == 4 * S and ids.written_ns("a") is None
    assert ids.take_before(11 * S) == ["e", "b"]
    assert len(ids) == 0 and ids.oldest_ns() is None


def _columns_afresh(ids: RecentIds) -> tuple[list[str], bytes, list[int]]:
    """What ``columns`` must give: the entries as they are, computed from nothing kept."""
    rows = list(ids.items())
    times = [at for _, _, at in rows]
    gaps = times[:1] + [b - a for a, b in pairwise(times)]
    return [rid for rid, _, _ in rows], bytes(value for _, value, _ in rows), gaps


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "put", "rewrite", "pop", "pop_entry", "prune", "load"]),
        st.integers(0, 40),  # which id (put: a new one past the last)
        st.integers(0, 255),  # its value
        st.sampled_from([0, 0, 1, 7, 100]),  # log time passing
        st.booleans(),  # columns taken after it
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.sampled_from([3, 8, 1000]), retention=st.sampled_from([30, 10**6]), ops=_OPS)
def test_columns_equal_a_fresh_computation_whatever_came_between_two(
    capacity: int, retention: int, ops: list[tuple[str, int, int, int, bool]]
) -> None:
    """``columns`` reuses what the last columns hold; the oldest ids gone, ids written again
    (the newest among them: back in the same place, with another value), taken out (as the
    state takes an ended id out of the dict), pruned or loaded, they equal those made from
    nothing."""
    ids = RecentIds(retention, capacity)
    now, made = 10**18, 0
    for op, which, value, passing, look in ops:
        now += passing
        held = list(ids.entries)
        if op == "put":
            ids.put(f"r{made}", value, now)
            made += 1
        elif op == "rewrite" and held:
            ids.put(held[which % len(held)], value, now)
        elif op == "pop" and held:
            ids.pop(held[which % len(held)])
        elif op == "pop_entry" and held:
            ids.entries.pop(held[-1 - which % len(held)])
        elif op == "prune":
            ids.prune(now)
        elif op == "load":
            again = RecentIds(retention, capacity)
            again.load_columns(*_columns_afresh(ids))
            ids = again
        if look:
            assert ids.columns() == _columns_afresh(ids)
    assert ids.columns() == _columns_afresh(ids)


def test_columns_taken_again_reuse_the_unchanged_and_add_the_new() -> None:
    ids = RecentIds(retention_ns=60 * S, capacity=4)
    for n, rid in enumerate("abcd"):
        ids.put(rid, n, (n + 1) * S)
    assert ids.columns() == (["a", "b", "c", "d"], bytes([0, 1, 2, 3]), [S, S, S, S])
    ids.put("e", 9, 7 * S)  # a evicted
    ids.put("d", 5, 7 * S)  # d written again: now the newest
    assert ids.columns() == (["b", "c", "e", "d"], bytes([1, 2, 9, 5]), [2 * S, S, 4 * S, 0])
