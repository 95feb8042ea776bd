"""Reference catalogue 9.5 (Dynamo ``prompt_registry.rs``), ported onto :class:`PromptRegistry`.

All five tests are ported with the catalogue's names and numbers. The registry is driven
directly with :class:`Delta` / :class:`RankChange` values (Dynamo's
``apply_membership_delta_and_load`` / ``replace_worker_load_state`` / topology removal), loads
given as :class:`RankLoad`. Dynamo's membership deltas are full paths with a start index; ours
book a request's hashes into a slot and release the slot, so "store these hashes" is a booking
and "remove them" releases the booking that holds them. "Equals the naive
per-worker prefix scan" is checked against :func:`naive_potential_blocks`, written here.

Skipped: nothing. Departures from Dynamo: none (potential tokens are read with
``isl_tokens=0``, i.e. Dynamo's ``PrefillTokenDeltas::none()``).
"""

from __future__ import annotations

import pytest

from seqstate import Delta, PrefillSnapshot, PromptRegistry, RankChange, RankLoad
from seqstate.deltas import Booking

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000

Rank = tuple[int, int]


def load(blocks: int, requests: int = 1, prefill: PrefillSnapshot | None = None) -> RankLoad:
    return RankLoad(blocks, requests, prefill or PrefillSnapshot())


def store(registry: PromptRegistry, rank: Rank, hashes: list[int], rank_load: RankLoad) -> None:
    """Book a request holding ``hashes`` in the rank's lowest free slot."""
    held = registry.requests_of(rank)
    slot = min(set(range(len(held) + 1)) - set(held))
    booking = Booking(slot, f"req-{slot}", hashes)
    registry.apply(
        Delta(outcome="applied", at_ns=0, changes=[RankChange(rank, rank_load, booked=[booking])])
    )


def remove(registry: PromptRegistry, rank: Rank, hashes: list[int], rank_load: RankLoad) -> None:
    """Release the booking that holds exactly ``hashes``."""
    [slot] = [slot for slot, held in registry.requests_of(rank).items() if held == hashes]
    registry.apply(
        Delta(outcome="applied", at_ns=0, changes=[RankChange(rank, rank_load, released=[slot])])
    )


def naive_potential_blocks(
    held: dict[Rank, list[int]], active_blocks: dict[Rank, int], query: list[int]
) -> dict[Rank, int]:
    """active_blocks + len(query) - (longest query prefix whose hashes the rank holds)."""
    result = {}
    for rank, hashes in held.items():
        present = set(hashes)
        depth = 0
        for h in query:
            if h not in present:
                break
            depth += 1
        result[rank] = active_blocks[rank] + len(query) - depth
    return result


def potential_blocks(registry: PromptRegistry, query: list[int], now_ns: int = 0) -> dict:
    return {
        (row.worker_id, row.dp_rank): row.potential_decode_blocks
        for row in registry.potential_loads(query, 0, now_ns)
    }


def potential_tokens(registry: PromptRegistry, query: list[int], now_ns: int = 0) -> dict:
    return {
        (row.worker_id, row.dp_rank): row.potential_prefill_tokens
        for row in registry.potential_loads(query, 0, now_ns)
    }


def test_removed_hash_can_be_restored_by_later_store() -> None:
    registry = PromptRegistry()
    rank = (1, 0)

    store(registry, rank, [42], load(1))
    remove(registry, rank, [42], load(0, 0))
    assert registry.hashes_of(rank) == set()
    assert registry.overlap_depths([42]) == {}

    last = load(1)
    store(registry, rank, [42], last)

    assert registry.hashes_of(rank) == {42}
    assert registry.overlap_depths([42]) == {rank: 1}
    assert registry.load_of(rank) == last
    assert registry.load_of(rank).active_blocks == 1
    assert potential_blocks(registry, [42]) == {rank: 1}


def test_staggered_prefix_overlap_matches_naive_projection() -> None:
    registry = PromptRegistry()
    a, b, c = (1, 0), (2, 0), (3, 0)
    held = {a: list(range(1, 97)), b: list(range(1, 65)), c: list(range(1, 34))}
    active_blocks = {rank: len(hashes) for rank, hashes in held.items()}
    for rank, hashes in held.items():
        store(registry, rank, hashes, load(len(hashes)))
    query = list(range(1, 97))

    blocks = potential_blocks(registry, query)

    assert blocks == {a: 96, b: 96, c: 96}  # 96+0, 64+32, 33+63
    assert registry.overlap_depths(query) == {a: 96, b: 64, c: 33}
    assert potential_tokens(registry, query) == {a: 0, b: 0, c: 0}
    assert blocks == naive_potential_blocks(held, active_blocks, query)
    # Shorter and diverging queries agree with the naive scan too.
    for q in [list(range(1, 40)), list(range(1, 65)), [1, 2, 99, 4], [5, 6], []]:
        assert potential_blocks(registry, q) == naive_potential_blocks(held, active_blocks, q)


def test_load_only_update_preserves_prompt_membership_and_active_token_projection() -> None:
    registry = PromptRegistry()
    rank = (1, 0)
    now = 100 * S
    store(registry, rank, [1, 2, 3], load(3))

    prefill = PrefillSnapshot(
        full_tokens=12,
        anchor_tokens=10,
        anchor_duration_ns=10 * S,
        anchored_since_ns=now - 3 * S,
        modeled_ms=10_000,
    )
    registry.apply(
        Delta(outcome="applied", at_ns=now, changes=[RankChange(rank, load(5, 1, prefill))])
    )

    assert registry.hashes_of(rank) == {1, 2, 3}
    [row] = registry.loads(now)
    assert row.active_blocks == 5
    assert row.active_prefill_tokens == 9
    assert row.modeled_remaining_prefill_ms == 7_000
    [potential] = registry.potential_loads([1, 2, 3], 0, now)
    assert potential.potential_decode_blocks == 5
    assert potential.potential_prefill_tokens == 9


def test_removing_worker_clears_prompt_membership_and_load_state() -> None:
    registry = PromptRegistry()
    a, b = (1, 0), (2, 0)
    store(registry, a, [1, 2, 3], load(3))
    store(registry, b, [1, 2], load(2))

    registry.apply(Delta(outcome="applied", at_ns=0, removed_ranks=[a]))

    assert a not in registry.ranks()
    assert registry.load_of(a) is None
    assert [(row.worker_id, row.dp_rank) for row in registry.loads(0)] == [b]
    assert registry.hashes_of(a) == set()
    assert registry.overlap_depths([1, 2, 3]) == {b: 2}
    assert registry.membership_size() == 2  # hash 3 was only on A
    assert potential_blocks(registry, [1, 2, 3]) == {b: 3}


def test_dp_ranks_with_same_worker_id_remain_isolated() -> None:
    registry = PromptRegistry()
    r0, r1 = (1, 0), (1, 1)
    held = {r0: [1, 2, 3], r1: [1]}
    active_blocks = {r0: 3, r1: 1}
    store(registry, r0, held[r0], load(3))
    store(registry, r1, held[r1], load(1))
    query = [1, 2, 3]

    blocks = potential_blocks(registry, query)

    assert blocks == {r0: 3, r1: 3}  # 3+0, 1+2
    assert registry.overlap_depths(query) == {r0: 3, r1: 1}
    assert registry.hashes_of(r0) == {1, 2, 3}
    assert registry.hashes_of(r1) == {1}
    assert blocks == naive_potential_blocks(held, active_blocks, query)
