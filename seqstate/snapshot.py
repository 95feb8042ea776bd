"""Write-model snapshots: the whole authoritative state as deterministic msgpack bytes.

Everything that can influence a later event's outcome is captured, in the iteration order
the live structures use (ranks, requests, prefill FIFO, fractional weights, tombstones), so
that restoring and folding the rest of a log gives the same bytes as one uninterrupted fold.
What can be derived (block reference counts, RequestIndex, prefill sums, the registry) is
rebuilt on restore instead of stored. Running float totals are stored verbatim because
recomputing them could round differently.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Final

import msgspec
from msgspec import Struct

from seqstate.errors import SeqstateError
from seqstate.publishers import MAX_PUBLISHERS
from seqstate.recent import RecentIds
from seqstate.sequences import ActiveSequences, RequestState
from seqstate.state import SequenceState
from seqstate.topology import WorkerDpRange, WorkerTopologyError

# Version 2 stores the remembered ids (tombstones, ended, removed workers) as columns (see
# _Memory); a version 1 snapshot, with one (id, value, time) triple per id, still restores.
SNAPSHOT_VERSION: Final = 2
READABLE_VERSIONS: Final = (1, 2)
MAGIC: Final = b"SQST"


class SnapshotError(SeqstateError, ValueError):
    """Bytes that are not a usable snapshot: wrong magic, version, or a damaged body."""


class _Request(Struct, array_like=True):
    request_id: str
    hashes: list[int]
    added_ns: int
    expected_output_tokens: int | None
    marked: bool
    outputs: list[float] | None
    lora_name: str | None
    # Added after version 1 shipped (trailing, so older snapshots still decode): the slot the
    # request holds; -1 in an older snapshot, whose requests then take slots 0, 1, ... in order.
    slot: int = -1
    router_id: str = ""  # who added it ("" when the router did not say): trailing, as above


class _Slot(Struct, array_like=True):
    worker_id: int
    dp_rank: int
    last_expiry_check_ns: int
    requests: list[_Request]
    prefills: list[tuple[str, int, int | None]]
    anchor_ns: int | None
    fractions: list[tuple[int, float]]
    deficit: float
    output_weight: float


class _Departed(Struct, array_like=True):
    worker_id: int
    until_ns: int
    slots: list[_Slot]


class _Memory(Struct, array_like=True):
    """Remembered ids. Version 1: ``entries``, one (id, value, written_ns) each. Version 2:
    ``entries`` empty and three columns (RecentIds.columns): decoding a list of strings, a byte
    string and a list of small ints builds no tuple per id, which for the 250,000 ended ids a
    busy writer keeps is most of a restart."""

    entries: list[tuple[str, int, int]]
    evicted: int
    ids: list[str] = []
    values: bytes = b""
    gaps: list[int] = []


class _State(Struct, array_like=True):
    version: int
    expiry_s: float | None
    lazy_workers: bool
    max_tombstones: int
    max_ended: int
    now_ns: int
    ranges: list[tuple[int, int, int]]
    slots: list[_Slot]
    tombstones: _Memory
    ended: _Memory
    counters: dict[str, int]
    # Added after version 1 shipped: trailing, with defaults, so older snapshots still decode.
    forget_lazy_after_s: float | None = None
    idle_since: list[tuple[int, int, int]] = []
    orphan_after_s: float | None = None
    routers: list[tuple[str, int]] = []  # live routers, oldest heard first
    worker_grace_s: float | None = None
    departed: list[_Departed] = []  # workers removed within their grace, deadline order
    slot_tracker: bool = False
    block_size: int | None = None  # the namespace's (the tracker's, under the slot-tracker rules)
    # Dynamo publishers (seqstate.publishers): each (id, last_sequence, heard_ns, holes,
    # restarts, late), least recently heard first; the bound; the totals (holes, late,
    # forgotten), which outlive a forgotten publisher. Restarts are no longer counted (0): an
    # id's sequence 0 after a higher one is late, since Dynamo draws a new id at every start.
    publishers: list[tuple[int, int, int, int, int, int]] = []
    max_publishers: int = MAX_PUBLISHERS
    publisher_totals: tuple[int, int, int] = (0, 0, 0)
    # The publishers that lost the most, (id, holes), most first. None: a snapshot from before
    # it, whose publishers counted restarts, which this build counts as late (in their rows
    # and, second of publisher_totals, instead of a total of late messages it did not keep).
    lossiest: list[tuple[int, int]] | None = None
    # The request lease (SequenceState.lease_scan_s; None: the age limit) and each live
    # request's lease, (id, log time it was taken or last moved), in lease order.
    lease_scan_s: float | None = None
    leases: list[tuple[str, int]] = []
    # Workers removed for good, oldest first (None: a snapshot from before them, none).
    removed_workers: _Memory | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_State)


def _encode_slot(state: SequenceState, rank: tuple[int, int], slot: ActiveSequences) -> _Slot:
    lora = state.requests.lora
    router_of = state.requests.router_of
    blocks = slot.blocks
    prefill = slot.prefill
    return _Slot(
        rank[0],
        rank[1],
        slot.last_expiry_check_ns,
        [
            _Request(
                rid,
                r.hashes,
                r.added_ns,
                r.expected_output_tokens,
                r.marked,
                r.outputs,
                lora.get(rid),
                r.slot,
                router_of.get(rid, ""),
            )
            for rid, r in slot.requests.items()
        ],
        [(rid, t, d) for rid, (t, d) in prefill.prefills.items()],
        prefill.anchor_ns,
        list(blocks.fractions.items()),
        blocks.deficit,
        blocks.output_weight,
    )


def encode_state(state: SequenceState) -> bytes:
    publishers = state.publishers
    slots = [_encode_slot(state, rank, slot) for rank, slot in state.workers.slots.items()]
    parked = state.departures.slots
    departed = [
        _Departed(worker_id, until, [_encode_slot(state, rank, parked[rank]) for rank in ranks])
        for worker_id, (until, ranks) in state.departures.workers.items()
    ]
    body = _State(
        SNAPSHOT_VERSION,
        state.expiry_s,
        state.lazy_workers,
        state.tombstones.capacity,
        state.ended.capacity,
        state.now_ns,
        [(w.worker_id, w.dp_start, w.dp_size) for w in state.workers.ranges.values()],
        slots,
        _memory(state.tombstones),
        _memory(state.ended),
        state.counters,
        state.forget_lazy_after_s,
        [(w, r, since) for (w, r), since in state.idle_since.items()],
        state.orphan_after_s,
        list(state.routers.items()),
        state.worker_grace_s,
        departed,
        state.slot_tracker,
        state.block_size,
        [(pid, last, heard, holes, 0, late) for pid, last, heard, holes, late in publishers.rows()],
        publishers.capacity,
        (publishers.holes, publishers.late, publishers.forgotten),
        publishers.lossy(),
        state.lease_scan_s,
        [(rid, at) for rid, _, at in state.leases.items()],
        _removed(state),
    )
    return MAGIC + _encoder.encode(body)


def _removed(state: SequenceState) -> _Memory | None:
    removed = state.removed_workers
    if not removed.entries and not removed.evicted:
        return None  # as a snapshot from before them has it
    return _memory(removed)


def _memory(ids: RecentIds) -> _Memory:
    return _Memory([], ids.evicted, *ids.columns())


def _load_memory(ids: RecentIds, memory: _Memory, version: int) -> None:
    if version == 1:
        if memory.ids or memory.values or memory.gaps:
            raise ValueError("a version 1 memory with columns")
        ids.load(memory.entries)
    elif memory.entries:
        raise ValueError(f"a version {version} memory with entries")
    else:
        ids.load_columns(memory.ids, memory.values, memory.gaps)
    ids.evicted = memory.evicted


def decode_state(data: bytes | bytearray | memoryview, *, registry: bool = True) -> SequenceState:
    """The state ``data`` holds; ``registry=False`` leaves its registry unbuilt and deferred
    (:meth:`SequenceState.defer_registry`), for a writer that never reads it."""
    raw = bytes(data)
    if not raw.startswith(MAGIC):
        raise SnapshotError("not a seqstate snapshot (bad magic)")
    try:
        body = _decoder.decode(raw[len(MAGIC) :])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SnapshotError(f"damaged snapshot: {exc}") from None
    except RecursionError:  # an unknown field's value nested past the recursion limit
        raise SnapshotError("damaged snapshot: nested too deeply") from None
    if body.version not in READABLE_VERSIONS:
        raise SnapshotError(
            f"snapshot version {body.version} is not readable (this build reads "
            f"{', '.join(map(str, READABLE_VERSIONS))})"
        )
    try:
        return _rebuild(body, registry)
    except (
        KeyError,
        ValueError,
        TypeError,
        OverflowError,
        AssertionError,
        WorkerTopologyError,
    ) as exc:
        raise SnapshotError(f"inconsistent snapshot: {exc!r}") from None


def _rebuild(body: _State, registry: bool) -> SequenceState:
    state = SequenceState(
        body.expiry_s,
        body.lazy_workers,
        max_tombstones=body.max_tombstones,
        max_ended=body.max_ended,
        forget_lazy_after_s=body.forget_lazy_after_s,
        orphan_after_s=body.orphan_after_s,
        worker_grace_s=body.worker_grace_s,
        slot_tracker=body.slot_tracker,
        max_publishers=body.max_publishers,
        lease_scan_s=body.lease_scan_s,
    )
    state.now_ns = body.now_ns
    state.block_size = body.block_size
    for worker_id, dp_start, dp_size in body.ranges:
        state.workers.ranges[worker_id] = WorkerDpRange(worker_id, dp_start, dp_size)
    for s in body.slots:
        state.workers.adopt((s.worker_id, s.dp_rank), _decode_slot(state, s))
    for d in body.departed:
        slots = {(s.worker_id, s.dp_rank): _decode_slot(state, s) for s in d.slots}
        state.departures.restore(d.worker_id, d.until_ns, slots)
    for worker in state.workers.ranges.values():
        worker.validate()
        for dp_rank in worker.ranks():
            if (worker.worker_id, dp_rank) not in state.workers.slots:
                raise ValueError(f"registered rank {(worker.worker_id, dp_rank)} has no slot")
    _load_memory(state.tombstones, body.tombstones, body.version)
    _load_memory(state.ended, body.ended, body.version)
    state.counters.update(body.counters)
    state.idle_since = {(w, r): since for w, r, since in body.idle_since}
    _restore_leases(state, body)
    state.routers = dict(body.routers)
    _restore_publishers(state, body)
    if registry:
        for delta in state.projection():
            state.registry.apply(delta)
    else:
        state.defer_registry()
    return state


def _restore_leases(state: SequenceState, body: _State) -> None:
    """The leases in their order, and the workers removed for good."""
    if state.lease_scan_ns:
        state.leases.load([(rid, 0, at) for rid, at in body.leases])
        if body.leases:
            scan = state.lease_scan_ns
            state.lease_due_ns = (body.leases[0][1] // scan + 2) * scan
    live = set(state.requests.owner) if state.lease_scan_ns else set()
    times = [at for _, at in body.leases]
    if set(state.leases.entries) != live or len(body.leases) != len(live):
        raise ValueError("the leases disagree with the live requests")
    if any(a > b for a, b in pairwise(times)):
        raise ValueError("the leases are not in time order")
    if body.removed_workers is not None:
        removed = body.removed_workers
        for key in removed.ids if body.version > 1 else [k for k, _, _ in removed.entries]:
            if not key.isdigit() or str(int(key)) != key:
                raise ValueError(f"a removed worker {key!r} that is no worker id")
            if int(key) in state.workers.by_worker or int(key) in state.departures:
                raise ValueError(f"worker {key} both removed for good and present")
        _load_memory(state.removed_workers, body.removed_workers, body.version)


def _restore_publishers(state: SequenceState, body: _State) -> None:
    """The publishers' table and counts; an older snapshot's restarts become late messages."""
    publishers = state.publishers
    rows = [
        (pid, last, heard, holes, late + restarts)
        for pid, last, heard, holes, restarts, late in body.publishers
    ]
    publishers.load(rows, body.lossiest)
    publishers.holes, publishers.late, publishers.forgotten = body.publisher_totals
    if body.lossiest is None:  # the total counted restarts: add the late its rows counted
        publishers.late += sum(row[5] for row in body.publishers)


def _decode_slot(state: SequenceState, s: _Slot) -> ActiveSequences:
    """One rank's requests, blocks and prefill, indexed in ``state``'s RequestIndex."""
    owner = state.requests.owner
    lora = state.requests.lora
    rank = (s.worker_id, s.dp_rank)
    slot = ActiveSequences(s.last_expiry_check_ns, state.age_expiry_ns)
    blocks = slot.blocks
    for i, r in enumerate(s.requests):
        if r.request_id in owner:
            raise ValueError(f"request {r.request_id!r} on two ranks")
        blocks.acquire(r.hashes)
        slot.requests[r.request_id] = RequestState(
            r.hashes,
            r.added_ns,
            r.expected_output_tokens,
            r.marked,
            r.outputs,
            i if r.slot < 0 else r.slot,
        )
        if r.outputs:
            blocks.outputs += len(r.outputs)
        owner[r.request_id] = rank
        if r.lora_name is not None:
            lora[r.request_id] = r.lora_name
        if r.router_id:
            state.requests.set_router(r.request_id, r.router_id)
    slot.restore_slots()
    blocks.fractions = dict(s.fractions)
    blocks.deficit = s.deficit
    blocks.output_weight = s.output_weight
    blocks.recount()
    for request_id, tokens, duration_ns in s.prefills:
        slot.prefill.insert(request_id, tokens, duration_ns, 0)
    slot.prefill.anchor_ns = s.anchor_ns
    slot.check_invariants()
    return slot
