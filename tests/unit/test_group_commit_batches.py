"""How serve-http's lease holder cuts a group commit into stored messages
(:func:`projector.http.own_fold.by_message`): record batches by subject, each connection's
calls stored in the order it sent them, every batch within its bounds."""

from __future__ import annotations

import random
from dataclasses import dataclass

from projector.http.own_fold import by_message
from seqstate.batches import MAX_EVENTS, batch_size


@dataclass
class Call:
    subject: str
    payload: bytes
    order: str  # its connection
    name: str = ""


def _names(batches: list[list[Call]]) -> list[list[str]]:
    return [[call.name for call in batch] for batch in batches]


def test_calls_of_different_connections_share_their_subjects_batches() -> None:
    calls = [Call(s, b"e", f"c{i}", f"{s}{i}") for i, s in enumerate("ABAABCB")]
    assert _names(by_message(calls, 1 << 20)) == [["A0", "A2", "A3"], ["B1", "B4", "B6"], ["C5"]]


def test_a_connections_call_never_joins_a_batch_before_its_previous_call() -> None:
    calls = [
        Call("A", b"e", "one", "a1"),
        Call("B", b"e", "one", "b1"),
        Call("A", b"e", "two", "a2"),  # another connection: joins the first batch
        Call("A", b"e", "one", "a3"),  # behind b1 on its connection: a batch after it
        Call("B", b"e", "one", "b2"),  # behind a3: after it too
        Call("B", b"e", "two", "b3"),  # two's last call is in the first batch: joins b2's
    ]
    assert _names(by_message(calls, 1 << 20)) == [["a1", "a2"], ["b1"], ["a3"], ["b2", "b3"]]


def test_a_batch_is_cut_at_the_payload_limit_and_at_its_most_events() -> None:
    calls = [Call("A", bytes(100), f"c{i}", str(i)) for i in range(10)]
    limit = batch_size(4, 400)
    assert [len(batch) for batch in by_message(calls, limit)] == [4, 4, 2]
    many = [Call("A", b"e", f"c{i}") for i in range(MAX_EVENTS + 1)]
    assert [len(batch) for batch in by_message(many, 1 << 30)] == [MAX_EVENTS, 1]


def test_any_group_keeps_each_connections_order_within_bounds() -> None:
    rng = random.Random(7)
    for _ in range(200):
        calls = [
            Call(rng.choice("ABCD"), bytes(rng.randrange(1, 60)), rng.choice("xyz"), str(n))
            for n in range(rng.randrange(1, 40))
        ]
        limit = rng.choice([200, 400, 1 << 20])
        batches = by_message(calls, limit)
        stored = [call for batch in batches for call in batch]
        assert sorted(stored, key=lambda c: int(c.name)) == calls  # each call once
        for connection in "xyz":
            assert [c for c in stored if c.order == connection] == [
                c for c in calls if c.order == connection
            ]
        for batch in batches:
            assert len({call.subject for call in batch}) == 1
            size = sum(len(call.payload) for call in batch)
            assert len(batch) == 1 or batch_size(len(batch), size) <= limit
