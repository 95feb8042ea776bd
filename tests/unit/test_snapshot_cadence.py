"""When the writer snapshots by count: every N events while snapshots are small, and a large one
only every ``size / 64`` events, so that snapshotting costs each event about the same however
large the state grows (ended ids alone make a ~5 MB snapshot)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from projector.write import snapshotter as snapshotter_module
from projector.write.snapshotter import (
    BYTES_PER_EVENT,
    SnapshotSettings,
    SnapshotStats,
    Snapshotter,
)
from seqstate import AddRequest, Free, SequenceState, WorkerAdded


class _Store:
    def __init__(self) -> None:
        self.saved: list[int] = []

    async def open(self) -> None:
        pass

    async def save(self, data: bytes, seq: int, at_ns: int) -> Any:
        self.saved.append(seq)
        return SimpleNamespace(name=f"at-{seq}")

    async def prune(self, keep: int) -> list[str]:
        return []


class _Deltas:
    async def flush(self) -> None:
        pass


async def _snapshotter(every_events: int) -> tuple[Snapshotter, _Store]:
    store = _Store()
    snapshotter = Snapshotter(
        store,  # type: ignore[arg-type]
        SnapshotSettings(every_events=every_events, every_s=0.0, keep=3),
        SimpleNamespace(retain_events=None),  # type: ignore[arg-type]
        SnapshotStats(),
        _Deltas(),  # type: ignore[arg-type]
    )
    await snapshotter.open(lambda exc: None)
    return snapshotter, store


def _state_with_ended(ended: int) -> SequenceState:
    state = SequenceState(expiry_s=300.0)
    state.apply(WorkerAdded(worker_id=1), 1)
    for n in range(ended):
        state.apply(AddRequest(request_id=f"req-{n:06d}", worker_id=1, block_hashes=[n]), 2 + n)
        state.apply(Free(request_id=f"req-{n:06d}", worker_id=1), 2 + n)
    return state


@pytest.fixture(autouse=True)
def _no_encode_spacing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spacing by encode time depends on the machine: out of the way here."""
    monkeypatch.setattr(snapshotter_module, "ENCODE_SHARE", float("inf"))


async def test_a_small_snapshot_is_followed_by_the_next_after_n_events() -> None:
    snapshotter, store = await _snapshotter(every_events=5)
    small = _state_with_ended(1)
    assert len(small.snapshot()) < 5 * BYTES_PER_EVENT
    await snapshotter.now(small, 10)
    assert store.saved == [10]
    assert not snapshotter.due(14)
    assert snapshotter.due(15)


async def test_a_large_snapshot_spaces_the_next_by_its_size() -> None:
    snapshotter, store = await _snapshotter(every_events=5)
    large = _state_with_ended(5_000)
    size = len(large.snapshot())
    assert size // BYTES_PER_EVENT > 1_000  # far beyond 5 events
    await snapshotter.now(large, 100)
    assert not snapshotter.due(100 + size // BYTES_PER_EVENT - 1)
    assert snapshotter.due(100 + size // BYTES_PER_EVENT)
    # Small again (the ended ids forgotten): every 5 events again.
    await snapshotter.now(_state_with_ended(0), 100 + size // BYTES_PER_EVENT)
    assert snapshotter.due(100 + size // BYTES_PER_EVENT + 5)
    assert store.saved == [100, 100 + size // BYTES_PER_EVENT]


async def test_no_snapshot_by_count_when_asked_for_none() -> None:
    snapshotter, _ = await _snapshotter(every_events=0)
    await snapshotter.now(_state_with_ended(3), 10)
    assert not snapshotter.due(10**9)
