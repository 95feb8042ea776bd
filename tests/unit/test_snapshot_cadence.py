"""When the writer snapshots by count: every N events while snapshots are small, and a large one
only every ``size / 64`` events, so that snapshotting costs each event about the same however
large the state grows (ended ids alone make a ~5 MB snapshot); and, whatever that spacing,
at the first event past each multiple of ``history_every``, even with a save under way."""

from __future__ import annotations

import asyncio
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
        self.started: list[int] = []  # saves begun, in order
        self.go = asyncio.Event()  # a save finishes once this is set
        self.go.set()

    async def open(self) -> None:
        pass

    async def save(self, data: bytes, seq: int, at_ns: int) -> Any:
        self.started.append(seq)
        await self.go.wait()
        self.saved.append(seq)
        return SimpleNamespace(name=f"at-{seq}")

    async def prune(self, keep: int, history_every: int | None, history_keep: int) -> list[str]:
        return []


class _Deltas:
    async def flush(self) -> None:
        pass


async def _snapshotter(
    every_events: int, history_every: int | None = None
) -> tuple[Snapshotter, _Store]:
    store = _Store()
    snapshotter = Snapshotter(
        store,  # type: ignore[arg-type]
        SnapshotSettings(
            every_events=every_events,
            every_s=0.0,
            keep=3,
            history_every=history_every,
            history_keep=40 if history_every else 0,
        ),
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


async def test_history_snapshots_come_at_each_multiple_whatever_the_spacing_and_saves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large state spaces snapshots by count far beyond 50 events, and one encode is owed 50
    encodes' time: the first event at or past each multiple of 50 gets one all the same, even
    while the save before it is under way (it is stored right after it)."""
    monkeypatch.setattr(snapshotter_module, "ENCODE_SHARE", 0.02)  # as the writer has it
    snapshotter, store = await _snapshotter(every_events=10_000, history_every=50)
    large = _state_with_ended(5_000)
    assert len(large.snapshot()) // BYTES_PER_EVENT > 1_000
    store.go.clear()  # every save waits: the server is slow
    taken = []
    for seq in range(1, 131):
        if snapshotter.due(seq):
            snapshotter.take(large, seq)
            taken.append(seq)
        await asyncio.sleep(0)
    # 50 is saving, 100 waits behind it: no third is encoded while two are held.
    assert taken == [50, 100] and store.started == [50] and store.saved == []
    store.go.set()
    await snapshotter.settle(5)
    assert store.saved == [50, 100]
    assert not snapshotter.due(149) and snapshotter.due(150)  # and on, every 50 events
    assert snapshotter.stats.snapshot_failures == 0


async def test_history_is_owed_from_the_last_snapshot_on_and_not_when_off() -> None:
    snapshotter, _ = await _snapshotter(every_events=0, history_every=50)
    await snapshotter.now(_state_with_ended(3), 120)
    assert not snapshotter.due(149)
    assert snapshotter.due(150)
    off, _ = await _snapshotter(every_events=0, history_every=None)
    await off.now(_state_with_ended(3), 120)
    assert not off.due(10**9)


async def test_no_snapshot_by_count_just_before_a_history_one() -> None:
    """The one by count due at 90 is taken (the history one at 100 is 10 events away, as far
    as the next by count); due at 95 after one at 85, it is left to the history one at 100."""
    snapshotter, store = await _snapshotter(every_events=10, history_every=50)
    small = _state_with_ended(1)
    await snapshotter.now(small, 80)
    assert snapshotter.due(90)
    await snapshotter.now(small, 85)
    assert not snapshotter.due(95) and not snapshotter.due(99)
    assert snapshotter.due(100)
    assert store.saved == [80, 85]
