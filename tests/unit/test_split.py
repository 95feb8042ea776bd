"""Cutting a delta into parts that fit a message: sizes, order, and the same read model."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from seqstate import AddRequest, Delta, PromptRegistry, RankChange, RankLoad, SequenceState, Tick
from seqstate.deltas import (
    Booking,
    DeltaTooLarge,
    encode_delta,
    encode_deltas,
    join_deltas,
    message_size,
    split_delta,
)

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000


def pieces(parts: list[Delta]) -> tuple[list, list, list, list]:
    released = [(tuple(c.rank), s) for p in parts for c in p.changes for s in c.released]
    booked = [
        (tuple(c.rank), b.slot, b.request_id) for p in parts for c in p.changes for b in c.booked
    ]
    expired = [rid for p in parts for rid in p.expired]
    ranks = [(tuple(r), "-") for p in parts for r in p.removed_ranks] + [
        (tuple(r), "+") for p in parts for r in p.added_ranks
    ]
    return released, booked, expired, ranks


def read_model(registry: PromptRegistry) -> tuple:
    return (
        registry.loads(0),
        {rank: registry.requests_of(rank) for rank in registry.ranks()},
        registry.membership_size(),
    )


deltas = st.builds(
    lambda ranks, expired, seq: Delta(
        "applied",
        7,
        [
            RankChange(
                (w, 0),
                RankLoad(len(booked), len(booked)),
                released,
                [Booking(slot, f"r{w}-{slot}", hashes) for slot, hashes in booked],
            )
            for w, (released, booked) in enumerate(ranks)
        ],
        removed_ranks=[(99, 0)],
        added_ranks=[(98, 0)],
        expired=expired,
        seq=seq,
    ),
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 70_000), max_size=400),
            st.lists(
                st.tuples(st.integers(0, 300), st.lists(st.integers(0, 2**64 - 1), max_size=120)),
                max_size=20,
            ),
        ),
        min_size=1,
        max_size=4,
    ),
    st.lists(st.text(max_size=40), max_size=300),
    st.integers(1, 2**40),
)


@settings(max_examples=150, deadline=None)
@given(delta=deltas, budget=st.integers(1_500, 20_000))
def test_parts_fit_keep_order_and_number_themselves(delta: Delta, budget: int) -> None:
    parts = split_delta(delta, budget)
    assert all(len(encode_delta(p)) <= budget for p in parts)
    assert [p.part for p in parts] == list(range(len(parts)))
    assert [p.more for p in parts] == [True] * (len(parts) - 1) + [False]
    assert {(p.seq, p.at_ns, p.outcome) for p in parts} == {(delta.seq, delta.at_ns, "applied")}
    assert pieces(parts) == pieces([delta])
    assert split_delta(delta, budget) == parts  # deterministic: a restarted writer agrees


def test_a_small_delta_is_its_own_single_part() -> None:
    delta = Delta("applied", 1, [RankChange((1, 0), RankLoad(1, 1), [3])], seq=5)
    assert split_delta(delta, 1_000) == [delta]
    assert (delta.part, delta.more) == (0, False)


def test_parts_applied_in_order_build_the_read_model_of_the_whole() -> None:
    """A real expiry of 3,000 requests of up to 40 hashes on two ranks, cut small; 500 stay."""
    state = SequenceState(expiry_s=60.0)
    for i in range(3_000):
        hashes = [i * 1_000 + k for k in range(40)] if i % 3 else [7, 8, 9, i * 1_000]
        state.apply(AddRequest(f"req-{i}", worker_id=i % 2, block_hashes=hashes), S)
    for i in range(500):  # young enough to stay
        state.apply(AddRequest(f"young-{i}", worker_id=i % 2, block_hashes=[7, 8, -~i]), 50 * S)
    before = PromptRegistry()
    for delta in state.projection():
        before.apply(delta)
    tick = state.apply(Tick(), 100 * S)
    assert len(tick.expired) == 3_000
    parts = split_delta(tick, 4_096)
    assert len(parts) > 3
    whole, cut = PromptRegistry(), PromptRegistry()
    # Both start from the registry as it was before the Tick.
    for registry, applied in ((whole, [tick]), (cut, parts)):
        for delta in _projection_before(before):
            registry.apply(delta)
        for delta in applied:
            registry.apply(delta)
    assert read_model(cut) == read_model(whole) == read_model(state.registry)
    assert cut.membership_size() == 500  # 7, 8 and 1..500 of the young requests


def _projection_before(registry: PromptRegistry) -> list[Delta]:
    changes = [
        RankChange(
            rank,
            registry.load_of(rank) or RankLoad(),
            booked=[Booking(s, f"x{s}", h) for s, h in registry.requests_of(rank).items()],
        )
        for rank in registry.ranks()
    ]
    return [Delta("applied", 0, changes, added_ranks=registry.ranks())]


def test_a_booking_larger_than_the_budget_cannot_be_cut() -> None:
    big = Booking(0, "r", list(range(2**40, 2**40 + 5_000)))
    delta = Delta("applied", 1, [RankChange((1, 0), RankLoad(), booked=[big])], seq=3)
    with pytest.raises(DeltaTooLarge, match="event 3"):
        split_delta(delta, 10_000)


@pytest.mark.parametrize("count", [0, 1, 15, 16, 255, 256, 65_535, 65_536])
def test_deltas_joined_one_by_one_are_the_message_encoded_at_once(count: int) -> None:
    batch = [
        Delta("applied", i, changes=[], seq=i, part=i % 3, more=bool(i % 2)) for i in range(count)
    ]
    encoded = [encode_delta(delta) for delta in batch]
    assert join_deltas(encoded) == encode_deltas(batch)
    assert message_size(count, sum(map(len, encoded))) == len(encode_deltas(batch))


@settings(max_examples=50, deadline=None)
@given(st.lists(deltas, max_size=40))
def test_any_deltas_joined_are_encoded_alike(batch: list[Delta]) -> None:
    assert join_deltas([encode_delta(delta) for delta in batch]) == encode_deltas(batch)
