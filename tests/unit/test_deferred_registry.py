"""A replay that defers the registry ends exactly where a fold that keeps it current ends."""

from __future__ import annotations

import random

import pytest

from seqstate import (
    AddRequest,
    Event,
    Free,
    MarkPrefillCompleted,
    SequenceState,
    Tick,
    WorkerAdded,
    WorkerRemoved,
)

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000


def random_log(seed: int, n: int = 600) -> list[tuple[Event, int]]:
    rng = random.Random(seed)
    log: list[tuple[Event, int]] = []
    live: list[tuple[str, int]] = []
    t = S
    for i in range(n):
        t += rng.randrange(0, 40 * S // 1000)
        roll = rng.random()
        if roll < 0.45 or not live:
            worker = rng.randrange(4)
            prefix = [1000 * (i % 3) + k for k in range(rng.randrange(0, 6))]
            hashes = prefix + [10_000 + i * 10 + k for k in range(rng.randrange(0, 4))]
            ms = rng.choice([None, 0.0, 25.0, 400.0])
            log.append(
                (
                    AddRequest(
                        request_id=f"r{i}",
                        worker_id=worker,
                        block_hashes=hashes,
                        prefill_tokens=rng.randrange(0, 900),
                        expected_prefill_ms=ms,
                    ),
                    t,
                )
            )
            live.append((f"r{i}", worker))
        elif roll < 0.65:
            rid, worker = rng.choice(live)
            log.append((MarkPrefillCompleted(request_id=rid, worker_id=worker), t))
        elif roll < 0.9:
            rid, worker = live.pop(rng.randrange(len(live)))
            log.append((Free(request_id=rid, worker_id=worker), t))
        elif roll < 0.94:
            log.append((WorkerAdded(worker_id=rng.randrange(5), dp_size=rng.randrange(1, 3)), t))
        elif roll < 0.96:
            log.append((WorkerRemoved(worker_id=rng.randrange(5)), t))
        else:
            t += 40 * S
            log.append((Tick(), t))
    return log


@pytest.mark.parametrize("changes", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_deferred_then_synced_equals_current(seed: int, changes: bool) -> None:
    log = random_log(seed)
    current = SequenceState(expiry_s=60.0)
    deferred = SequenceState(expiry_s=60.0)
    deferred.defer_registry(changes=changes)
    for event, at in log:
        full = current.apply(event, at)
        delta = deferred.apply(event, at)
        # Outcomes, expiry and topology always agree; per-rank changes only if asked for.
        assert (delta.outcome, delta.expired, delta.added_ranks, delta.removed_ranks) == (
            full.outcome,
            full.expired,
            full.added_ranks,
            full.removed_ranks,
        )
        if changes:
            assert delta == full
    assert deferred.registry.ranks() == []  # nothing was kept current meanwhile
    deferred.sync_registry()
    assert deferred.snapshot() == current.snapshot()
    now = log[-1][1] + 7 * S // 1000
    assert deferred.registry.loads(now) == current.registry.loads(now)
    for query in ([0, 1, 2], [1000, 1001], [2000, 2001, 2002, 2003], [10_005], []):
        assert deferred.registry.potential_loads(query, 64, now) == (
            current.registry.potential_loads(query, 64, now)
        )
    # And it stays current afterwards.
    more = AddRequest(request_id="late", worker_id=1, block_hashes=[0, 1], prefill_tokens=5)
    current.apply(more, now)
    deferred.apply(more, now)
    assert deferred.registry.loads(now) == current.registry.loads(now)
