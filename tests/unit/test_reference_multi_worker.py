"""Reference catalogue 9.6 (Dynamo ``multi_worker.rs``), ported onto :class:`SequenceState`.

Dynamo's ``ActiveSequencesMultiWorker`` calls become events folded with ``state.apply(event,
at_ns)`` at explicit log times (no clock, no sleeps). ``make_sequences()`` registers worker
(1,0) and ``make_multi_sequences()`` workers (1,0) and (2,0), with ``WorkerAdded`` at t=0.
Replica-applied events (#30-#35) are events applied from the log (``router_id="99"``); their
"receive time" is the event's log time. ``RequireRegistered`` is
``SequenceState(lazy_workers=False)``; ``reconcile_workers([])`` is a ``WorkerRemoved`` per
worker; Dynamo's ``DuplicateRequest`` / ``WorkerNotFound`` errors are the outcomes
``duplicate`` / ``unknown_worker``. Dynamo's ``PrefillTokenDeltas`` are added per rank to
``potential_loads(..., isl_tokens=0, ...)``.

Replaced (our design replaces the mechanism):
* #1 ``active_request_expiry_duration_override_uses_positive_seconds`` and
  #2 ``active_request_expiry_duration_override_falls_back_to_default`` parse an environment
  variable; our expiry is a constructor argument, tested instead by
  ``test_active_request_expiry_duration_is_a_constructor_argument`` and
  ``test_active_request_expiry_duration_defaults_to_300_seconds`` (the invalid "0" case is #3).
* #39 ``free_cleans_stale_request_mapping_when_worker_slot_is_missing``: a mapping without its
  slot cannot be reached through ``apply`` (the index is only written together with the slot,
  and a removed worker takes its mappings with it); tested instead by
  ``test_free_after_worker_removal_is_unknown_request_with_empty_index``.

Departs from Dynamo (our rules, docs/architecture.md "The rules"):
* #11 ``worker_targeted_cleanup_ignores_a_different_owner``: Mark/Free look a request up by id
  alone, so a Free naming another worker still frees the owner and counts
  ``worker_mismatch``; tested by ``test_worker_targeted_cleanup_frees_the_owner_by_id``.
* #38 ``free_is_idempotent_after_request_is_removed``: the second Free is the no-op outcome
  ``unknown_request`` (Dynamo: Ok) and, the id having ended recently, leaves no tombstone.
* #31/#32 ``replica_sync_*_receive_time_*``: decay is anchored at the event's log time, not at
  a replica's local receive time.
* #37 ``strict_add_after_worker_removal_cannot_recreate_worker`` is a race in Dynamo; the log
  serialises it, so both orders are tested.

Skipped:
* #5-#8 (replica-sync enqueue, ``ActiveLoad`` publishing/observation, publish-failure log
  limiter): no such mechanism; the log is the replication.
* #21-#29 (replica batching, coalesced side-effect flushing, receive errors, cancellation; #23
  is also Rust-specific concurrency): no such mechanism; every event is folded individually.
"""

from __future__ import annotations

import hashlib

import pytest

from seqstate import (
    AddOutputBlock,
    AddRequest,
    Free,
    MarkPrefillCompleted,
    SequenceState,
    Tick,
    WorkerAdded,
    WorkerRemoved,
)
from seqstate.deltas import Delta
from seqstate.loads import LoadRow, PotentialLoadRow

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000
REMOTE = "99"

Rank = tuple[int, int]


# ---- helpers ---------------------------------------------------------------------------


def make_sequences(expiry_s: float | None = 300.0, lazy_workers: bool = True) -> SequenceState:
    state = SequenceState(expiry_s=expiry_s, lazy_workers=lazy_workers)
    assert state.apply(WorkerAdded(worker_id=1), 0).outcome == "applied"
    return state


def make_multi_sequences(expiry_s: float | None = 300.0) -> SequenceState:
    state = make_sequences(expiry_s)
    assert state.apply(WorkerAdded(worker_id=2), 0).outcome == "applied"
    return state


def add(
    state: SequenceState,
    request_id: str,
    rank: Rank,
    hashes: list[int],
    at_s: float,
    tokens: int = 0,
    seconds: float | None = None,
    **extra: object,
) -> Delta:
    """Book a request; ``tokens``/``seconds`` is Dynamo's prefill hint (0 tokens = no hint)."""
    event = AddRequest(
        request_id=request_id,
        worker_id=rank[0],
        dp_rank=rank[1],
        block_hashes=hashes,
        prefill_tokens=tokens,
        expected_prefill_ms=None if seconds is None else seconds * 1000,
        **extra,  # type: ignore[arg-type]
    )
    return state.apply(event, round(at_s * S))


def mark(state: SequenceState, request_id: str, rank: Rank, at_s: float) -> Delta:
    event = MarkPrefillCompleted(request_id=request_id, worker_id=rank[0], dp_rank=rank[1])
    return state.apply(event, round(at_s * S))


def free(state: SequenceState, request_id: str, rank: Rank, at_s: float) -> Delta:
    return state.apply(
        Free(request_id=request_id, worker_id=rank[0], dp_rank=rank[1]), round(at_s * S)
    )


def rows(state: SequenceState, at_s: float) -> dict[Rank, LoadRow]:
    return {(r.worker_id, r.dp_rank): r for r in state.registry.loads(round(at_s * S))}


def potential(state: SequenceState, query: list[int], at_s: float) -> dict[Rank, PotentialLoadRow]:
    return {
        (r.worker_id, r.dp_rank): r
        for r in state.registry.potential_loads(query, 0, round(at_s * S))
    }


def naive_loads(state: SequenceState, query: list[int], at_s: float) -> dict[Rank, tuple]:
    """(potential blocks, active tokens, requests) per rank, recomputed from the write model."""
    result = {}
    for rank, slot in state.workers.slots.items():
        depth = 0
        for h in query:
            if h not in slot.blocks.refs:
                break
            depth += 1
        result[rank] = (
            slot.blocks.active_blocks + len(query) - depth,
            slot.active_tokens(round(at_s * S)),
            len(slot.requests),
        )
    return result


def registry_loads(state: SequenceState, query: list[int], at_s: float) -> dict[Rank, tuple]:
    return {
        rank: (row.potential_decode_blocks, row.potential_prefill_tokens, row.active_requests)
        for rank, row in potential(state, query, at_s).items()
    }


def chained_hashes(tokens: list[int], block_size: int, lora_name: str | None = None) -> list[int]:
    """Chained u64 hashes of complete blocks, seeded with the LoRA name (Dynamo's scheme)."""
    parent = hashlib.blake2b((lora_name or "").encode(), digest_size=8).digest()
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=8)
        for token in tokens[start : start + block_size]:
            h.update(token.to_bytes(4, "little"))
        parent = h.digest()
        hashes.append(int.from_bytes(parent, "little"))
    return hashes


def assert_completely_drained(state: SequenceState, at_s: float) -> None:
    for row in state.registry.loads(round(at_s * S)):
        assert (row.active_blocks, row.active_prefill_tokens, row.active_requests) == (0, 0, 0)
    assert len(state.requests) == 0
    assert state.active_lora_counts() == {}
    assert state.registry.membership_size() == 0
    for slot in state.workers.slots.values():
        assert slot.blocks.refs == {}
        assert slot.requests == {}
    state.check_invariants()


# ---- configuration -----------------------------------------------------------------------


def test_active_request_expiry_duration_is_a_constructor_argument() -> None:
    """Replaces #1 ``active_request_expiry_duration_override_uses_positive_seconds``."""
    state = SequenceState(expiry_s=3600.0)
    assert state.expiry_s == 3600.0
    assert state.expiry_ns == 3600 * S
    add(state, "req-1", (1, 0), [1, 2, 3], 0, tokens=12)

    # The 300 s default would have expired it here.
    assert state.apply(Tick(), 331 * S).expired == []
    # Exactly the expiry duration old is not stale (strict).
    assert state.apply(Tick(), 3600 * S).expired == []
    assert state.apply(Tick(), 3631 * S).expired == ["req-1"]
    assert rows(state, 3631)[(1, 0)].active_requests == 0


def test_active_request_expiry_duration_defaults_to_300_seconds() -> None:
    """Replaces #2 ``active_request_expiry_duration_override_falls_back_to_default``."""
    state = SequenceState()
    assert state.expiry_s == 300.0
    assert state.expiry_ns == 300 * S
    add(state, "req-1", (1, 0), [1, 2, 3], 0)

    assert state.apply(Tick(), 300 * S).expired == []
    assert state.apply(Tick(), 331 * S).expired == ["req-1"]
    assert state.counters["expired"] == 1


@pytest.mark.parametrize("expiry_s", [0, 0.0, -1.0])
def test_custom_expiry_rejects_zero_duration_at_multi_worker_boundary(expiry_s: float) -> None:
    with pytest.raises(ValueError, match="expiry_duration must be greater than zero"):
        SequenceState(expiry_s=expiry_s)


def test_worker_topology_observes_registered_and_removed_workers() -> None:
    state = SequenceState()

    registered = state.apply(WorkerAdded(worker_id=1, dp_start=0, dp_size=2), 0)
    assert sorted(registered.added_ranks) == [(1, 0), (1, 1)]
    assert registered.removed_ranks == []

    second = state.apply(WorkerAdded(worker_id=2, dp_start=0, dp_size=1), 0)
    assert second.added_ranks == [(2, 0)]
    assert second.removed_ranks == []

    removed = state.apply(WorkerRemoved(worker_id=1), 0)
    assert sorted(removed.removed_ranks) == [(1, 0), (1, 1)]
    assert removed.added_ranks == []
    assert state.registry.ranks() == [(2, 0)]
    state.check_invariants()


# ---- lifecycle & projections ------------------------------------------------------------------


def test_add_request_can_skip_prefill_token_tracking() -> None:
    state = make_sequences()

    delta = add(state, "req-1", (1, 0), [1, 2, 3], 0, tokens=12, track_prefill_tokens=False)

    assert delta.outcome == "applied"
    row = rows(state, 0)[(1, 0)]
    assert row.active_prefill_tokens == 0
    assert row.active_requests == 1
    assert row.active_blocks == 3
    slot = state.slot(1, 0)
    assert slot is not None
    assert slot.prefill.order == []
    state.check_invariants()


def test_same_id_conflicts_across_workers() -> None:
    state = make_multi_sequences()
    assert add(state, "req-1", (1, 0), [1, 2, 3], 0, tokens=12).outcome == "applied"

    conflict = add(state, "req-1", (2, 0), [4, 5], 0, tokens=8)

    assert conflict.outcome == "duplicate"
    assert conflict.changes == []
    loads = rows(state, 0)
    assert loads[(1, 0)].active_requests == 1
    assert loads[(2, 0)].active_requests == 0
    assert loads[(2, 0)].active_blocks == 0
    assert state.requests.worker_for("req-1") == (1, 0)
    assert state.counters["duplicate"] == 1
    state.check_invariants()


def test_worker_targeted_cleanup_frees_the_owner_by_id() -> None:
    """Departs from ``worker_targeted_cleanup_ignores_a_different_owner`` (Dynamo's
    ``free_if_worker`` ignores a Free naming another worker): our Free finds the request by
    id, frees it on its owner and counts the mismatch."""
    state = make_multi_sequences()
    add(state, "req-1", (2, 0), [1, 2, 3], 0, tokens=12)

    delta = free(state, "req-1", (1, 0), 1)

    assert delta.outcome == "applied"
    assert [(c.worker_id, c.dp_rank) for c in delta.changes] == [(2, 0)]
    assert state.counters["worker_mismatch"] == 1
    loads = rows(state, 1)
    assert loads[(2, 0)].active_requests == 0
    assert loads[(1, 0)].active_requests == 0
    assert state.requests.worker_for("req-1") is None
    assert_completely_drained(state, 1)


def test_modeled_remaining_prefill_time_loads_follow_multi_worker_projection() -> None:
    state = make_multi_sequences()
    a, b = (1, 0), (2, 0)
    add(state, "oldest", a, [1], 0, tokens=100, seconds=10)
    add(state, "unmodeled", b, [2], 0, tokens=12)
    add(state, "later", a, [3], 1, tokens=60, seconds=4)

    loads = rows(state, 3)
    assert loads[a].modeled_remaining_prefill_ms == 11_000
    assert loads[b].modeled_remaining_prefill_ms is None  # MissingExpectedDuration

    mark(state, "oldest", a, 3)
    slot = state.slot(*a)
    assert slot is not None
    assert slot.prefill.anchor == ("later", 3 * S)

    loads = rows(state, 5)
    assert loads[a].modeled_remaining_prefill_ms == 2_000
    assert loads[b].modeled_remaining_prefill_ms is None
    assert loads[a].active_requests == 2
    state.check_invariants()


def test_free_nonanchor_modeled_prefill_applies_anchor_credit() -> None:
    state = make_sequences()
    rank = (1, 0)
    add(state, "oldest", rank, [1], 0, tokens=100, seconds=10)
    add(state, "later", rank, [2], 0, tokens=40, seconds=4)

    before = rows(state, 5)[rank]
    assert (before.active_prefill_tokens, before.modeled_remaining_prefill_ms) == (90, 9_000)

    assert free(state, "later", rank, 5).outcome == "applied"

    slot = state.slot(*rank)
    assert slot is not None
    assert slot.prefill.anchor == ("oldest", 4 * S)
    after = rows(state, 5)[rank]
    assert (after.active_prefill_tokens, after.modeled_remaining_prefill_ms) == (90, 9_000)
    assert after.active_requests == 1
    state.check_invariants()


def test_block_membership_index_matches_naive_loads_with_output_blocks_and_prefill_updates() -> (
    None
):
    state = make_multi_sequences()
    a, b = (1, 0), (2, 0)
    add(state, "req-a", a, [1, 2, 3], 0, tokens=12)
    output = AddOutputBlock(request_id="req-a", worker_id=1, decay_fraction=0.5)
    assert state.apply(output, 0).outcome == "applied"
    mark(state, "req-a", a, 0)
    add(state, "req-b", b, [1, 2, 4], 0, tokens=12)
    query = [1, 2, 3, 5]
    deltas = {a: 8, b: 12}  # PrefillTokenDeltas: default 16, A -> 8, B -> 12

    projection = potential(state, query, 1)
    loads = rows(state, 1)
    depths = state.registry.overlap_depths(query)

    # WorkerLoadProjection {prefill, decode, requests, additional}
    assert loads[a].active_prefill_tokens == 0
    assert loads[a].active_blocks == 2
    assert loads[a].active_requests == 1
    assert len(query) - depths[a] == 1
    assert loads[b].active_prefill_tokens == 12
    assert loads[b].active_blocks == 3
    assert loads[b].active_requests == 1
    assert len(query) - depths[b] == 2

    blocks = {rank: row.potential_decode_blocks for rank, row in projection.items()}
    tokens = {rank: row.potential_prefill_tokens + deltas[rank] for rank, row in projection.items()}
    assert blocks == {a: 3, b: 5}
    assert tokens == {a: 8, b: 24}
    assert registry_loads(state, query, 1) == naive_loads(state, query, 1)
    state.check_invariants()


def test_potential_blocks_use_prefix_membership_not_set_membership() -> None:
    state = make_sequences()
    add(state, "req-1", (1, 0), [1, 2, 4, 5], 0, track_prefill_tokens=False)

    projection = potential(state, [1, 2, 3, 5], 0)

    assert projection[(1, 0)].potential_decode_blocks == 6  # 4 active + 2 (5 after a miss)
    assert state.registry.overlap_depths([1, 2, 3, 5]) == {(1, 0): 2}
    assert registry_loads(state, [1, 2, 3, 5], 0) == naive_loads(state, [1, 2, 3, 5], 0)


def test_lora_specific_sequence_hashes_do_not_cross_match() -> None:
    state = make_multi_sequences()
    tokens = list(range(1, 9))  # 8 tokens, block size 4
    base = chained_hashes(tokens, 4)
    adapter = chained_hashes(tokens, 4, "adapter-a")
    assert len(base) == len(adapter) == 2
    assert not set(base) & set(adapter)

    add(state, "base", (1, 0), base, 0, tokens=8)
    add(state, "lora", (2, 0), adapter, 0, tokens=8, lora_name="adapter-a")

    projection = potential(state, base, 0)
    assert projection[(2, 0)].potential_decode_blocks == 4  # its 2 active + 2
    assert projection[(1, 0)].potential_decode_blocks == 2  # 2 active + 0
    assert state.active_lora_counts() == {"adapter-a": 1}
    assert state.requests.lora_for("lora") == "adapter-a"
    assert registry_loads(state, base, 0) == naive_loads(state, base, 0)


def test_unit_block_size_repeated_tokens_preserve_membership_and_trim() -> None:
    state = make_multi_sequences()
    a, b = (1, 0), (2, 0)
    hashes_a = chained_hashes([7, 7, 7], 1)
    hashes_b = chained_hashes([7, 7, 8], 1)
    assert len(set(hashes_a)) == 3  # repeated tokens still give distinct chained hashes
    assert hashes_a[:2] == hashes_b[:2]
    assert hashes_a[2] != hashes_b[2]
    add(state, "req-a", a, hashes_a, 0, tokens=3)
    add(state, "req-b", b, hashes_b, 0, tokens=3)

    projection = potential(state, hashes_b, 0)
    assert projection[a].potential_decode_blocks == 4  # 3 + 1
    assert projection[b].potential_decode_blocks == 3  # 3 + 0

    free(state, "req-b", b, 1)
    projection = potential(state, hashes_b, 1)
    assert projection[a].potential_decode_blocks == 4
    assert projection[b].potential_decode_blocks == 3  # 0 + 3
    assert state.registry.hashes_of(b) == set()
    assert registry_loads(state, hashes_b, 1) == naive_loads(state, hashes_b, 1)

    free(state, "req-a", a, 2)
    assert_completely_drained(state, 2)


def test_force_expiry_clears_block_membership_index() -> None:
    state = make_sequences()
    add(state, "req-1", (1, 0), [1, 2, 3], 0, tokens=12)

    delta = state.apply(Tick(), 331 * S)

    assert delta.expired == ["req-1"]
    assert [c.released for c in delta.changes] == [[0]]  # the slot req-1 held
    assert len(state.requests) == 0
    assert state.registry.membership_size() == 0
    row = rows(state, 331)[(1, 0)]
    assert (row.active_blocks, row.active_requests, row.active_prefill_tokens) == (0, 0, 0)
    assert_completely_drained(state, 331)


def test_disabled_expiry_requires_explicit_cleanup_for_all_workers() -> None:
    state = make_sequences(expiry_s=None)
    assert state.apply(WorkerAdded(worker_id=2), 0).added_ranks == [(2, 0)]
    add(state, "initial", (1, 0), [1, 2], 0, tokens=8)
    add(state, "dynamic", (2, 0), [3], 0, tokens=4)

    delta = state.apply(Tick(), 331 * S)

    assert delta.expired == []
    loads = rows(state, 331)
    assert (loads[(1, 0)].active_requests, loads[(1, 0)].active_blocks) == (1, 2)
    assert (loads[(2, 0)].active_requests, loads[(2, 0)].active_blocks) == (1, 1)

    free(state, "initial", (1, 0), 332)
    free(state, "dynamic", (2, 0), 332)
    assert_completely_drained(state, 332)


def test_expiry_then_immediate_readd_preserves_block_membership() -> None:
    state = make_sequences()
    add(state, "req-1", (1, 0), [1, 2, 3], 0, tokens=12)

    delta = add(state, "req-2", (1, 0), [1, 2, 3], 331, tokens=12)

    assert delta.outcome == "applied"
    assert delta.expired == ["req-1"]
    [change] = delta.changes
    assert change.released == [0]  # applied before the booking, which reuses the slot
    assert [(b.slot, b.request_id, b.hashes) for b in change.booked] == [(0, "req-2", [1, 2, 3])]
    assert state.registry.hashes_of((1, 0)) == {1, 2, 3}
    assert state.registry.membership_size() == 3
    row = rows(state, 331)[(1, 0)]
    assert (row.active_blocks, row.active_requests) == (3, 1)
    assert state.requests.worker_for("req-1") is None
    assert state.requests.worker_for("req-2") == (1, 0)
    for query in [[1, 2, 3], [1, 2, 3, 4], [9]]:
        assert registry_loads(state, query, 331) == naive_loads(state, query, 331)
    state.check_invariants()


# ---- events applied from the log (Dynamo's replica sync) -----------------------------------


def test_replica_sync_add_and_free_keep_block_membership_consistent() -> None:
    state = make_sequences()
    assert add(state, "req-1", (1, 0), [1, 2, 3], 0, tokens=12, router_id=REMOTE).outcome == (
        "applied"
    )
    assert state.registry.membership_size() == 3

    assert free(state, "req-1", (1, 0), 1).outcome == "applied"

    assert len(state.requests) == 0
    assert state.registry.membership_size() == 0
    row = rows(state, 1)[(1, 0)]
    assert (row.active_blocks, row.active_requests) == (0, 0)
    assert_completely_drained(state, 1)


def test_replica_sync_modeled_remaining_prefill_time_uses_receive_time_and_clears() -> None:
    """Departs: decay is anchored at the event's log time (Dynamo: local receive time)."""
    state = make_sequences()
    rank = (1, 0)

    add(state, "req-1", rank, [1], 7, tokens=12, seconds=10, router_id=REMOTE)
    assert rows(state, 7)[rank].modeled_remaining_prefill_ms == 10_000
    assert rows(state, 8)[rank].modeled_remaining_prefill_ms == 9_000  # anchored at t=7

    mark(state, "req-1", rank, 9)
    assert rows(state, 9)[rank].modeled_remaining_prefill_ms == 0

    add(state, "req-2", rank, [2], 10, tokens=12, seconds=6, router_id=REMOTE)
    assert rows(state, 10)[rank].modeled_remaining_prefill_ms == 6_000

    free(state, "req-2", rank, 11)
    assert rows(state, 11)[rank].modeled_remaining_prefill_ms == 0
    assert rows(state, 11)[rank].active_prefill_tokens == 0
    state.check_invariants()


def test_replica_sync_nonanchor_free_applies_receive_time_anchor_credit() -> None:
    state = make_sequences()
    rank = (1, 0)
    t0 = 20
    add(state, "oldest", rank, [1], t0, tokens=100, seconds=10, router_id=REMOTE)
    add(state, "later", rank, [2], t0, tokens=40, seconds=4, router_id=REMOTE)

    assert rows(state, t0 + 5)[rank].modeled_remaining_prefill_ms == 9_000

    free(state, "later", rank, t0 + 5)

    after = rows(state, t0 + 5)[rank]
    assert after.modeled_remaining_prefill_ms == 9_000
    assert after.active_prefill_tokens == 90
    slot = state.slot(*rank)
    assert slot is not None
    assert slot.prefill.anchor == ("oldest", (t0 + 4) * S)


def test_replica_sync_add_lazily_registers_missing_worker() -> None:
    state = SequenceState()
    assert len(state.workers) == 0

    delta = add(state, "req-1", (1, 0), [1, 2, 3], 0, tokens=12, router_id=REMOTE)

    assert delta.outcome == "applied"
    assert delta.added_ranks == [(1, 0)]
    assert len(state.workers) == 1
    assert not state.workers.has_registered_workers()  # lazy: no authoritative range
    assert state.requests.worker_for("req-1") == (1, 0)
    assert state.registry.membership_size() > 0
    assert rows(state, 0)[(1, 0)].active_blocks == 3
    state.check_invariants()


def test_replica_sync_require_registered_drops_missing_worker() -> None:
    state = SequenceState(lazy_workers=False)

    delta = add(state, "req-1", (1, 0), [1, 2, 3], 0, tokens=12, router_id=REMOTE)

    assert delta.outcome == "unknown_worker"
    assert delta.changes == []
    assert delta.added_ranks == []
    assert len(state.workers) == 0
    assert state.requests.worker_for("req-1") is None
    assert state.registry.membership_size() == 0
    assert state.registry.ranks() == []
    state.check_invariants()


def test_replica_sync_require_registered_drops_event_after_worker_removal() -> None:
    state = make_sequences(lazy_workers=False)
    assert state.apply(WorkerRemoved(worker_id=1), 0).removed_ranks == [(1, 0)]

    delta = add(state, "req-1", (1, 0), [1, 2, 3], 1, tokens=12, router_id=REMOTE)

    assert delta.outcome == "unknown_worker"
    assert len(state.workers) == 0
    assert state.requests.worker_for("req-1") is None
    assert state.registry.membership_size() == 0
    state.check_invariants()


# ---- topology / idempotency -----------------------------------------------------------------


def test_worker_removal_then_readd_starts_with_empty_registry_state() -> None:
    state = make_sequences()
    add(state, "req-1", (1, 0), [1, 2, 3], 0, tokens=12)

    removed = state.apply(WorkerRemoved(worker_id=1), 1 * S)

    assert removed.removed_ranks == [(1, 0)]
    assert state.registry.membership_size() == 0
    assert state.registry.loads(1 * S) == []  # no load row, no request count for the worker
    assert len(state.requests) == 0
    state.check_invariants()

    readded = state.apply(WorkerAdded(worker_id=1, dp_start=0, dp_size=1), 2 * S)

    assert readded.added_ranks == [(1, 0)]
    row = rows(state, 2)[(1, 0)]
    assert (row.active_blocks, row.active_requests, row.active_prefill_tokens) == (0, 0, 0)
    assert state.registry.membership_size() == 0
    assert state.registry.hashes_of((1, 0)) == set()
    assert_completely_drained(state, 2)


@pytest.mark.parametrize("add_first", [True, False], ids=["add-then-remove", "remove-then-add"])
def test_strict_add_after_worker_removal_cannot_recreate_worker(add_first: bool) -> None:
    state = make_sequences(lazy_workers=False)
    if add_first:
        assert add(state, "req-1", (1, 0), [1, 2, 3], 1, tokens=12).outcome == "applied"
        state.apply(WorkerRemoved(worker_id=1), 1 * S)
    else:
        state.apply(WorkerRemoved(worker_id=1), 1 * S)
        assert add(state, "req-1", (1, 0), [1, 2, 3], 1, tokens=12).outcome == "unknown_worker"

    assert len(state.workers) == 0
    assert len(state.requests) == 0
    assert state.registry.membership_size() == 0
    assert state.registry.ranks() == []
    state.check_invariants()


def test_free_is_idempotent_after_request_is_removed() -> None:
    state = make_sequences()
    add(state, "req-1", (1, 0), [1, 2, 3], 0, tokens=12)

    first = free(state, "req-1", (1, 0), 1)
    second = free(state, "req-1", (1, 0), 2)

    assert first.outcome == "applied"
    assert second.outcome == "unknown_request"
    assert second.changes == []
    assert state.counters["tombstoned"] == 0
    assert "req-1" not in state.tombstones
    assert_completely_drained(state, 2)


def test_free_after_worker_removal_is_unknown_request_with_empty_index() -> None:
    """Replaces ``free_cleans_stale_request_mapping_when_worker_slot_is_missing``."""
    state = make_sequences()
    add(state, "req-1", (1, 0), [1, 2, 3], 0, tokens=12, lora_name="adapter")
    assert state.active_lora_counts() == {"adapter": 1}
    state.apply(WorkerRemoved(worker_id=1), 1 * S)

    delta = free(state, "req-1", (1, 0), 2)

    assert delta.outcome == "unknown_request"
    assert delta.changes == []
    assert len(state.requests) == 0
    assert state.requests.worker_for("req-1") is None
    assert state.active_lora_counts() == {}
    assert len(state.workers) == 0
    state.check_invariants()


def test_explicit_decay_time_drives_multi_worker_load_queries_consistently() -> None:
    state = make_sequences()
    rank = (1, 0)
    add(state, "req-1", rank, [1], 0, tokens=100, seconds=10)

    assert rows(state, 5)[rank].active_prefill_tokens == 50
    assert potential(state, [], 5)[rank].potential_prefill_tokens == 50
    assert any(
        (row.worker_id, row.dp_rank) == rank and row.active_prefill_tokens == 50
        for row in state.registry.loads(5 * S)
    )
    # The same state read at another instant decays by that instant only.
    assert rows(state, 0)[rank].active_prefill_tokens == 100
    assert rows(state, 10)[rank].active_prefill_tokens == 0
