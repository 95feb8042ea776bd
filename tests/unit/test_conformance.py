"""One conformance suite over every path that applies deltas (as Watermill runs one suite
over every backend): the same scenarios, the same reads, the same numbers.

The paths:

- ``registry``: :class:`~seqstate.PromptRegistry` fed each delta whole (what the writer's
  in-process state keeps);
- ``parts``: the same, fed each delta cut into small parts (what crosses the DELTAS stream
  when a delta is too large for one message);
- ``live view``: the parts folded into a :class:`~projector.bucket.image.BucketImage`, its writes
  handed, flush by flush, to a :class:`~projector.bucket.reader.RegistryView` as a KV watch would;
- ``cold view``: a new RegistryView given the bucket's current values once, in the order a
  watch delivers them (each key where its last write left it in the stream).

Each must answer ``loads``, ``potential_loads`` and ``overlap_depths`` exactly as the write
model's own registry does, and the image's slot keys must hold exactly the write model's live
requests. No server is needed: the view's ``receive`` is what its watch calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from projector.bucket.image import BucketImage
from projector.bucket.reader import RegistryView
from projector.wire.values import decode_request, parse_key
from seqstate import (
    AddOutputBlock,
    AddRequest,
    Free,
    MarkPrefillCompleted,
    PromptRegistry,
    SequenceState,
    Tick,
    WorkerAdded,
    WorkerRemoved,
)
from seqstate.deltas import split_delta

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000
NS = "conf"
BUDGET = 600  # small parts, so that most multi-request changes are cut

TimedEvents = list[tuple[object, int]]


class Paths:
    """Feeds one run of deltas to every path; ``check`` compares them with the state."""

    def __init__(self, state: SequenceState) -> None:
        self.state = state
        self.whole = PromptRegistry()
        self.parts = PromptRegistry()
        self.image = BucketImage(NS)
        self.live = RegistryView(None, namespace=NS)  # type: ignore[arg-type]
        self.bucket: dict[str, bytes] = {}  # current values, in the stream order of their write

    def apply(self, event: object, at_ns: int, seq: int) -> None:
        delta = self.state.apply(event, at_ns)
        delta.seq = seq
        self.whole.apply(delta)
        for part in split_delta(delta, BUDGET):
            self.parts.apply(part)
            self.image.apply(part)
        self.flush()

    def flush(self) -> None:
        for key, value in self.image.take():
            self.bucket.pop(key, None)  # a write moves the key to the stream's end
            if value is not None:
                self.bucket[key] = value
            self.live.receive(key, value, deleted=value is None)

    def cold(self) -> RegistryView:
        view = RegistryView(None, namespace=NS)  # type: ignore[arg-type]
        for key, value in self.bucket.items():
            view.receive(key, value)
        return view

    def check(self, queries: list[list[int]]) -> None:
        state = self.state
        want = state.registry
        now = state.now_ns
        paths: dict[str, Any] = {
            "registry": self.whole,
            "parts": self.parts,
            "live view": self.live.registry,
            "cold view": self.cold().registry,
        }
        for name, registry in paths.items():
            for t in (now, now + S, now + 30 * S):
                assert registry.loads(t) == want.loads(t), name
            for query in queries:
                for isl in (0, 700):
                    assert registry.potential_loads(query, isl, now) == want.potential_loads(
                        query, isl, now
                    ), (name, query)
                assert registry.overlap_depths(query) == want.overlap_depths(query), name
            for rank in want.ranks():
                assert registry.hashes_of(rank) == want.hashes_of(rank), (name, rank)
            assert registry.membership_size() == want.membership_size(), name
        assert self.slots() == {
            rank: {r.slot: (rid, r.hashes) for rid, r in slot.requests.items()}
            for rank, slot in state.workers.slots.items()
            if slot.requests
        }

    def slots(self) -> dict[tuple[int, int], dict[int, tuple[str, list[int]]]]:
        """The bucket's occupied slot keys, decoded."""
        out: dict[tuple[int, int], dict[int, tuple[str, list[int]]]] = {}
        for key, value in self.bucket.items():
            kind, rank, slot, _ = parse_key(NS, key)
            if kind == "req" and rank is not None:
                request = decode_request(value)
                if not request.empty:
                    out.setdefault(rank, {})[slot] = (request.request_id, request.hash_list())
        return out


def run(events: TimedEvents, *, queries: list[list[int]], **state_options: Any) -> Paths:
    paths = Paths(SequenceState(**state_options))
    for seq, (event, at_ns) in enumerate(events, 1):
        paths.apply(event, at_ns, seq)
        paths.check(queries)
    return paths


def add(rid: str, worker: int, hashes: list[int], at_s: float, dp: int = 0, **kw: Any) -> tuple:
    return AddRequest(rid, worker, dp, block_hashes=hashes, **kw), int(at_s * S)


def free(rid: str, worker: int, at_s: float, dp: int = 0) -> tuple:
    return Free(rid, worker, dp), int(at_s * S)


PREFIX = [11, 12, 13, 14]

SCENARIOS: dict[str, Callable[[], tuple[TimedEvents, dict[str, Any]]]] = {
    "shared prefixes, marks and frees": lambda: (
        [
            (WorkerAdded(1, dp_size=2), 0),
            add("a", 1, [*PREFIX, 1], 0, prefill_tokens=500, expected_prefill_ms=40.0),
            add("b", 1, [*PREFIX, 2, 3], 0.1, dp=1, prefill_tokens=700),
            add("c", 1, PREFIX[:2], 0.2, prefill_tokens=300),
            (MarkPrefillCompleted("a", 1), int(0.3 * S)),
            free("c", 1, 0.4),
            add("d", 1, [*PREFIX, 9], 0.5, prefill_tokens=64),  # takes c's slot
            free("b", 1, 0.6, dp=1),
            add("e", 1, [*PREFIX, 2], 0.7, dp=1),
        ],
        {"expiry_s": None},
    ),
    "expiry of many requests at once, then slots reused": lambda: (
        [add(f"old-request-{i:04d}", i % 3, [i, i + 1000, i + 2000], 0) for i in range(60)]
        + [add("young", 0, [5, 6], 40)]  # rank 0's check at 40 s: nothing old enough yet
        + [(Tick(), 95 * S)]  # every rank's check: all the old ones expire
        + [add(f"new-{i}", i % 3, [i, 77], 96) for i in range(9)],
        {"expiry_s": 60.0},
    ),
    "a worker removed with its requests, added again empty": lambda: (
        [
            (WorkerAdded(4, dp_size=2), 0),
            add("x", 4, [1, 2, 3], 1),
            add("y", 4, [1, 2, 4], 1, dp=1),
            add("z", 5, [1, 2], 1),  # a lazy worker sharing the prefix
            (WorkerRemoved(4), 2 * S),
            (WorkerAdded(4), 3 * S),
            add("w", 4, [1, 2, 3], 4),
        ],
        {"expiry_s": None},
    ),
    "a free before its add, output blocks and decay": lambda: (
        [
            free("early", 2, 0),
            add("early", 2, [7, 8], 0.1),  # superseded: never booked
            add("long", 2, [7, 8, 9], 0.2, prefill_tokens=90, expected_prefill_ms=10.0),
            (AddOutputBlock("long", 2), int(0.3 * S)),
            (AddOutputBlock("long", 2, decay_fraction=0.5), int(0.4 * S)),
            add("dup", 2, [7], 0.5),
            add("dup", 2, [7, 99], 0.6),  # duplicate: changes nothing
            free("long", 2, 0.7),
        ],
        {"expiry_s": None},
    ),
    "idle lazy ranks forgotten": lambda: (
        [add("s", 9, [1], 0), free("s", 9, 1), (Tick(), 70 * S), (Tick(), 700 * S)],
        {"expiry_s": 60.0, "forget_lazy_after_s": 600.0},
    ),
}

QUERIES = [[*PREFIX, 1], [*PREFIX, 2, 3], PREFIX[:1], [1, 2, 3], [7, 8, 9], [5, 6], [], [42]]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_path_answers_as_the_write_model(name: str) -> None:
    events, options = SCENARIOS[name]()
    run(events, queries=QUERIES, **options)


def test_an_expiry_cut_into_parts_lands_in_every_path() -> None:
    events, options = SCENARIOS["expiry of many requests at once, then slots reused"]()
    state = SequenceState(**options)
    deltas = [state.apply(event, at_ns) for event, at_ns in events]
    tick = next(i for i, (event, _) in enumerate(events) if isinstance(event, Tick))
    assert len(deltas[tick].expired) == 60
    assert len(split_delta(deltas[tick], BUDGET)) > 3  # the paths above got it in parts
    run(events, queries=QUERIES, **options)


# ---- random logs ----------------------------------------------------------------------------

HASHES = st.lists(st.integers(0, 40), max_size=8, unique=True)
RIDS = st.sampled_from([f"r{i}" for i in range(12)])
WORKERS = st.integers(0, 3)
DPS = st.integers(0, 1)


def _events() -> st.SearchStrategy[object]:
    return st.one_of(
        st.builds(
            AddRequest, RIDS, WORKERS, DPS, block_hashes=HASHES, prefill_tokens=st.integers(0, 500)
        ),
        st.builds(Free, RIDS, WORKERS, DPS),
        st.builds(MarkPrefillCompleted, RIDS, WORKERS, DPS),
        st.builds(AddOutputBlock, RIDS, WORKERS, DPS),
        st.builds(WorkerAdded, WORKERS, st.integers(0, 1), st.integers(1, 2)),
        st.builds(WorkerRemoved, WORKERS),
        st.just(Tick()),
    )


@settings(max_examples=120, deadline=None)
@given(
    steps=st.lists(st.tuples(_events(), st.integers(0, 40 * S)), min_size=1, max_size=40),
    lazy=st.booleans(),
)
def test_random_logs_agree_on_every_path(steps: list[tuple[object, int]], lazy: bool) -> None:
    events = list(_timed(steps))
    run(events, queries=[[0, 1, 2], [3], list(range(8)), []], expiry_s=60.0, lazy_workers=lazy)


def _timed(steps: list[tuple[object, int]]) -> Iterator[tuple[object, int]]:
    now = 0
    for event, step in steps:
        now += step
        yield event, now
