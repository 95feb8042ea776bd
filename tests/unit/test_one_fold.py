"""Every path folds the log through the one fold, and so they agree.

The writer folds message by message (restarting from its snapshots), a replay folds batches
from its fast reader or messages from nats-py (``projector.write.log_fold._Folder``), rebuild and
verify replay: on hypothesis-generated logs mixing good events with hostile messages (random
bytes, nesting of any depth, integers at and past their bounds, arrays that claim billions of
items, truncated events, events on another subject, events over the size rule), each path
gives the same verdict for every message, kind and reason alike, every delta encodes, and
the write models are byte-identical. Dynamo's own replica-sync messages are mixed in (on the
namespace's capture subject and elsewhere, from a few publishers whose sequences jump, restart
and repeat, seqstate's own resync publisher among them, and hostile ones too): every path
decides on them alike.
"""

from __future__ import annotations

import itertools
import random

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from projector.write.log_fold import _Folder
from seqstate import (
    SCHEMA_VERSION,
    AddOutputBlock,
    AddRequest,
    Delta,
    Event,
    Fold,
    FoldRules,
    Free,
    MarkPrefillCompleted,
    Refusal,
    RouterGoodbye,
    RouterHeartbeat,
    SequenceState,
    Tick,
    WorkerAdded,
    WorkerRemoved,
    encode_delta,
    encode_deltas,
    encode_event,
)
from seqstate.bounds import RankBounds
from seqstate.dynamo import DynamoMessage, captured_subject, encode_dynamo, resync_publisher_id
from seqstate.fold import control_subject, subject_of, worker_subject

NS = "fz"
RULES = FoldRules(NS, max_event_bytes=8000, bounds=RankBounds(per_worker=3, total=6, routers=3))
RANKS = [(w, r) for w in range(3) for r in range(2)]
IDS = st.sampled_from([f"r{i}" for i in range(8)])
TOKENS = st.sampled_from([0, 1, 500, 2**63, 2**64 - 1])
_raw = msgspec.msgpack.encode

EVENTS: st.SearchStrategy[Event] = st.one_of(
    st.builds(
        AddRequest,
        IDS,
        st.integers(0, 2),
        dp_rank=st.integers(0, 1),
        block_hashes=st.lists(st.integers(0, 2**64 - 1), max_size=4),
        prefill_tokens=TOKENS,
        expected_prefill_ms=st.none() | st.sampled_from([0.0, 5.5, 1e12]),
        track_prefill_tokens=st.booleans(),
        router_id=st.sampled_from(["", "ra", "rb"]),
    ),
    st.builds(MarkPrefillCompleted, IDS, st.integers(0, 2), dp_rank=st.integers(0, 1)),
    st.builds(Free, IDS, st.integers(0, 2), dp_rank=st.integers(0, 1)),
    st.builds(AddOutputBlock, IDS, st.integers(0, 2), dp_rank=st.integers(0, 1)),
    st.builds(WorkerAdded, st.integers(0, 4), dp_size=st.integers(1, 4)),
    st.builds(WorkerRemoved, st.integers(0, 4)),
    st.just(Tick()),
    st.builds(RouterHeartbeat, st.sampled_from(["ra", "rb", "rc", "rd"])),
    st.builds(RouterGoodbye, st.sampled_from(["ra", "rb"])),
)
DYNAMO_ON = captured_subject(NS, "dyn.backend.generate")
SUBJECTS = st.sampled_from(
    [control_subject(NS), worker_subject(NS, 1, 0), f"seqstate.events.{NS}.x", "a.b", DYNAMO_ON]
)
DYNAMO: st.SearchStrategy[DynamoMessage] = st.builds(
    DynamoMessage,
    publisher_id=st.sampled_from([11, 2**64 - 1, 2**64 - 1, resync_publisher_id(NS)]),
    sequence=st.integers(0, 3),  # holes, restarts, repeats
    published_at_ms=st.integers(0, 2**64 - 1),
    request_id=IDS,
    worker_id=st.integers(0, 2),
    dp_rank=st.integers(0, 1),
    router_id=st.sampled_from([5, 2**64 - 1]),
    lora_name=st.none() | st.just("l"),
    op=st.sampled_from(["AddRequest", "MarkPrefillCompleted", "Free"]),
    token_sequence=st.none() | st.lists(st.integers(0, 2**64 - 1), max_size=4),
    track_prefill_tokens=st.booleans(),
    expected_output_tokens=st.none() | st.integers(0, 2**32 - 1),
    prefill_tokens=st.none() | TOKENS,
    expected_prefill_duration=st.none()
    | st.tuples(st.sampled_from([0, 5, 5, 10**9, 2**64 - 1]), st.integers(0, 2**32 - 1)),
)


@st.composite
def dynamo(draw: st.DrawFn) -> tuple[str, bytes]:
    """A Dynamo message: on the capture subject, or another; whole, or made hostile."""
    data = encode_dynamo(draw(DYNAMO))
    subject = draw(
        st.sampled_from(
            [DYNAMO_ON] * 6 + [worker_subject(NS, 1, 0), captured_subject("other", "a.b.c")]
        )
    )
    depth = draw(st.sampled_from([3, 14, 200, 950, 5000]))
    data = draw(
        st.sampled_from(
            [
                data,
                data,
                data,
                data,
                data,
                data[: draw(st.integers(0, len(data) - 1))],  # truncated
                bytes([data[0] + 1]) + data[1:] + b"\xa1x" + b"\x91" * depth + b"\xc0",
                bytes([data[0] + 1]) + data[1:] + b"\xa1x" + b"\x81\xa1k" * depth + b"\xc0",
            ]
        )
    )
    return subject, data


@st.composite
def hostile(draw: st.DrawFn) -> tuple[str, bytes]:
    """A message no router should send, on some subject."""
    good = encode_event(draw(EVENTS))
    depth = draw(st.sampled_from([3, 200, 950, 1000, 5000]))
    nest = b"\x91" * depth + b"\xc0"
    payload = draw(
        st.sampled_from(
            [
                draw(st.binary(max_size=60)),  # random bytes
                b"\x92\x01" + nest,  # nested arrays, at several depths
                b"\x93" + good[1:] + nest,  # a trailing element after a valid event
                b"\x92\x01" + b"\x81\xa1k" * depth + b"\xc0",  # maps: the tag search skips
                b"\x92\x01\x84\xa1k" + nest + b"\xa4type\xa4Free\xaarequest_id\xa1a"
                b"\xa9worker_id\x01",  # a deep value before the tag of a Free
                _raw([SCHEMA_VERSION, {"type": "Free", "request_id": "a", "worker_id": 2**64 - 1}]),
                _raw([SCHEMA_VERSION, {"type": "Free", "request_id": "a", "worker_id": -(2**63)}]),
                _raw([2**64 - 1, {}]),
                _raw([SCHEMA_VERSION, {"type": "AddRequest", "request_id": "a", "worker_id": 1}])[
                    :-1
                ]
                + b"\xa1z",  # a broken field name
                b"\x92\x01\x83\xa4type\xaaAddRequest\xaarequest_id\xa1a\xacblock_hashes"
                b"\xdd\xff\xff\xff\xff",  # an array that claims 2^32-1 hashes
                good[: draw(st.integers(0, max(0, len(good) - 1)))],  # truncated
                encode_event(AddRequest("big", 1, block_hashes=list(range(2**60, 2**60 + 900)))),
            ]
        )
    )
    return draw(SUBJECTS), payload


@st.composite
def message(draw: st.DrawFn) -> tuple[str, bytes]:
    kind = draw(
        st.sampled_from(["own", "own", "own", "own", "misrouted", "hostile", "dynamo", "dynamo"])
    )
    if kind == "hostile":
        return draw(hostile())
    if kind == "dynamo":
        return draw(dynamo())
    event = draw(EVENTS)
    subject = subject_of(NS, event)
    if kind == "misrouted":
        w, r = draw(st.sampled_from(RANKS))
        subject = draw(st.sampled_from([control_subject(NS), worker_subject(NS, w, r)]))
    return subject, encode_event(event)


@st.composite
def logs(draw: st.DrawFn) -> list[tuple[int, int, str, bytes]]:
    messages = draw(st.lists(message(), min_size=5, max_size=80))
    gaps = draw(st.lists(st.sampled_from([0, 1, 10**9, 40 * 10**9]), min_size=len(messages)))
    out, at = [], 1_700_000_000 * 10**9
    for seq, ((subject, payload), gap) in enumerate(zip(messages, gaps, strict=False), 1):
        at += gap
        out.append((seq, at, subject, payload))
    return out


def new_state() -> SequenceState:
    return SequenceState(expiry_s=60.0, orphan_after_s=30.0, forget_lazy_after_s=90.0)


Verdicts = dict[int, tuple[str, str]]  # seq -> (outcome or refusal kind, reason)


def as_writer(
    log: list[tuple[int, int, str, bytes]], crashes: list[int]
) -> tuple[bytes, Verdicts, list[bytes]]:
    """As the writer folds: one message at a time, its registry deferred, snapshots along the
    way, and at each crash point a restart from the newest snapshot, folding again from there
    (the verdicts of the events folded twice must not change)."""
    state = new_state()
    state.defer_registry()
    fold = Fold(state, RULES)
    snapshots = [(0, state.snapshot())]
    verdicts: Verdicts = {}
    deltas: dict[int, bytes] = {}
    i = 0
    crashed = set()
    while i < len(log):
        seq, at, subject, payload = log[i]
        verdict = fold(seq, at, subject, payload)
        if type(verdict) is Refusal:
            seen = (verdict.kind, verdict.reason)
        else:
            assert isinstance(verdict, Delta) and verdict.seq == seq
            encode_deltas([verdict])  # every delta the writer makes is storable
            seen = (verdict.outcome, "")
            deltas.setdefault(seq, encode_delta(verdict))
            assert deltas[seq] == encode_delta(verdict)
        assert verdicts.setdefault(seq, seen) == seen, f"event {seq} refolded to another verdict"
        if seq % 7 == 0:
            snapshots.append((seq, fold.state.snapshot()))
        i += 1
        if seq in crashes and seq not in crashed:  # killed here: restart from a snapshot
            crashed.add(seq)
            at_seq, data = snapshots[-1]
            fold.state = SequenceState.restore(data)
            fold.state.defer_registry()
            i = at_seq  # the log index of the event after it
    return fold.state.snapshot(), verdicts, [deltas[s] for s in sorted(deltas)]


def as_replay(
    log: list[tuple[int, int, str, bytes]], cuts: list[int] | None
) -> tuple[bytes, Verdicts]:
    """As ``fold_stream`` folds: the registry deferred without changes, then batches cut at
    ``cuts`` (the fast reader), or one message at a time (nats-py) when None."""
    state = new_state()
    state.defer_registry(changes=False)
    refused: Verdicts = {}

    def on_refused(seq: int, why: Refusal) -> None:
        refused[seq] = (why.kind, why.reason)

    last = log[-1][0]
    folder = _Folder(state, 1, last, None, None, RULES, on_refused)
    if cuts is None:
        for message in log:
            folder(*message)
    else:
        bounds = [0, *sorted(c for c in cuts if 0 < c < len(log)), len(log)]
        for a, b in itertools.pairwise(bounds):
            if a < b:
                folder.fold_batch(log[a:b])
    assert folder.finished and folder.count == len(log) and folder.dead == len(refused)
    state.sync_registry()
    return state.snapshot(), refused


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(log=logs(), seed=st.integers(0, 2**32))
def test_writer_and_replay_paths_reach_the_same_verdicts_and_bytes(
    log: list[tuple[int, int, str, bytes]], seed: int
) -> None:
    rng = random.Random(seed)
    crashes = rng.sample([seq for seq, *_ in log], min(3, len(log)))
    cuts = [rng.randrange(len(log) + 1) for _ in range(rng.randint(0, 4))]
    written, verdicts, deltas = as_writer(log, crashes)
    uninterrupted, same, same_deltas = as_writer(log, [])
    assert (written, verdicts, deltas) == (uninterrupted, same, same_deltas)
    refused = {seq: v for seq, v in verdicts.items() if v[1]}
    assert len(verdicts) == len(log)
    for cut in (cuts, None):
        replayed, replay_refused = as_replay(log, cut)
        assert replay_refused == refused
        assert replayed == written
    # What the writer wrote restores to the same bytes (its snapshot is readable, bounded).
    assert SequenceState.restore(written).snapshot() == written
