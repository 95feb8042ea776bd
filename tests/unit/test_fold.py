"""The one fold of the log (seqstate.fold): each rule and each kind of refusal, the
poison pills that once killed the writer, and that the fold never raises and never depends on
the caller's stack.

Each message is ``(seq, log_time_ns, subject, payload)``; a verdict is the Delta (applied) or a
``Refusal(kind, reason)``. The rules, in order: size, decode, subject, bounds, apply.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    decode_event,
    encode_deltas,
    encode_event,
)
from seqstate.bounds import MAX_SUM, RankBounds
from seqstate.fold import (
    KINDS,
    MAX_EVENT_BYTES,
    OUT_OF_BOUNDS,
    TOO_LARGE,
    UNDECODABLE,
    WRONG_SUBJECT,
    control_subject,
    routers_subject,
    subject_of,
    worker_subject,
)

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

NS = "default"
CONTROL = control_subject(NS)
# A 1 KB message of nested arrays: the writer once died on it ("maximum recursion depth
# exceeded while deserializing an object"), every restart died on it, and replay crashed.
REPRO = b"\x92\x01" + b"\x91" * 1000 + b"\xc0"
REPRO_SUBJECT = "seqstate.events.default.2.0"
_raw = msgspec.msgpack.encode


def on_own(event: Event) -> tuple[str, bytes]:
    return subject_of(NS, event), encode_event(event)


def new_fold(rules: FoldRules | None = None, **state: Any) -> Fold:
    return Fold(SequenceState(**{"expiry_s": None, **state}), rules or FoldRules(NS))


def feed(fold: Fold, messages: list[tuple[str, bytes]], t0: int = 1) -> list[Delta | Refusal]:
    return [fold(seq, seq * 1000, s, p) for seq, (s, p) in enumerate(messages, t0)]


def refusal(verdict: object) -> Refusal:
    assert type(verdict) is Refusal, verdict
    return verdict


# ---- rule 1: size ----------------------------------------------------------------------------


def test_an_event_over_the_limit_is_too_large_and_one_at_it_is_applied() -> None:
    overhead = len(encode_event(AddRequest(request_id="x" * 300, worker_id=1))) - 300
    limit = 600
    fold = new_fold(FoldRules(NS, max_event_bytes=limit))
    fits = AddRequest(request_id="x" * (limit - overhead), worker_id=1)
    over = AddRequest(request_id="y" * (limit - overhead + 1), worker_id=1)
    assert len(encode_event(fits)) == limit
    applied, refused = feed(fold, [on_own(fits), on_own(over)])
    assert type(applied) is Delta and applied.outcome == "applied" and applied.seq == 1
    assert refusal(refused) == (
        TOO_LARGE,
        f"refused: an event of {limit + 1} bytes; its delta would not fit a message "
        f"(at most {limit} bytes of event)",
        None,
    )
    assert list(fold.state.requests.owner) == [fits.request_id]


def test_the_default_limit_is_the_writers_old_default() -> None:
    """1 MiB (nats-server's default max_payload) less 4 KiB of headers and 1 KiB of delta."""
    assert MAX_EVENT_BYTES == FoldRules().max_event_bytes == 1_048_576 - 4096 - 1024


def test_the_issues_large_add_is_refused_by_the_default_rule() -> None:
    """A 1,044,081-byte AddRequest (116,000 hashes) was dead-lettered by the
    writer but booked by replay and rebuild; now every fold refuses it, by a setting."""
    event = AddRequest(
        request_id="big", worker_id=1, block_hashes=list(range(2**40, 2**40 + 116_000))
    )
    data = encode_event(event)
    assert len(data) > MAX_EVENT_BYTES
    (verdict,) = feed(new_fold(), [(worker_subject(NS, 1, 0), data)])
    assert refusal(verdict).kind == TOO_LARGE


# ---- rule 2: decode --------------------------------------------------------------------------


def test_the_issues_nested_message_is_undecodable_and_changes_nothing() -> None:
    fold = new_fold()
    before = fold.state.snapshot()
    (verdict,) = feed(fold, [(REPRO_SUBJECT, REPRO)])
    assert refusal(verdict) == (
        UNDECODABLE,
        "malformed event bytes: nested deeper than 16 levels",  # whatever the caller's stack
        None,
    )
    assert fold.state.snapshot() == before


@pytest.mark.parametrize("depth", [10, 500, 1000, 5000, 200_000])
def test_nesting_of_any_depth_anywhere_is_undecodable(depth: int) -> None:
    """In the event's place, after a valid event (a trailing envelope element, once skipped:
    recursively), in a field's place, and as the whole message."""
    nested = b"\x91" * depth + b"\xc0"
    valid = encode_event(Free(request_id="a", worker_id=2))
    assert valid[0] == 0x92
    field = _raw([SCHEMA_VERSION, {"type": "Free", "request_id": "a", "worker_id": 2}])
    in_field = field.replace(b"\xa9worker_id\x02", b"\xa9worker_id" + nested)
    assert in_field != field
    for data in (b"\x92\x01" + nested, b"\x93" + valid[1:] + nested, in_field, nested):
        (verdict,) = feed(new_fold(), [(REPRO_SUBJECT, data)])
        assert refusal(verdict).kind == UNDECODABLE, data[:8]


def test_a_trailing_envelope_element_is_refused_not_skipped() -> None:
    valid = encode_event(Free(request_id="a", worker_id=2))
    (verdict,) = feed(new_fold(), [(REPRO_SUBJECT, b"\x93" + valid[1:] + b"\xc0")])
    assert refusal(verdict) == (
        UNDECODABLE,
        "invalid event envelope: Expected `array` of at most length 2, got 3",
        None,
    )


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "malformed event bytes: Input data was truncated"),
        (
            b"\xc1",
            "malformed event bytes: MessagePack data is malformed: invalid opcode '\\xc1' (byte 0)",
        ),
        (_raw([7, {}]), "unsupported schema version 7 (this build reads 1)"),
        (b"\xdc\x00\x02\xcd\x01\x00\x80", "unsupported schema version 256 (this build reads 1)"),
        (_raw([-3, None]), "unsupported schema version -3 (this build reads 1)"),
        (_raw(["1", {}]), "invalid event envelope: Expected `int`, got `str` - at `$[0]`"),
        (
            _raw([1, {"type": "Free", "request_id": "a", "worker_id": -1}]),
            "invalid event: Expected `int` >= 0 - at `$.worker_id`",
        ),
    ],
)
def test_undecodable_reasons_name_what_is_wrong(data: bytes, reason: str) -> None:
    (verdict,) = feed(new_fold(), [(REPRO_SUBJECT, data)])
    assert refusal(verdict) == (UNDECODABLE, reason, None)


def test_a_huge_array_header_is_undecodable_without_allocating_it() -> None:
    """Headers that claim 2^32-1 hashes, or ids of 4 GiB, in a few bytes."""
    head = _raw([1, {"type": "AddRequest", "request_id": "a", "worker_id": 1, "block_hashes": []}])
    claims = head.replace(b"\xacblock_hashes\x90", b"\xacblock_hashes\xdd\xff\xff\xff\xff")
    long_id = _raw([1, {"type": "Free", "worker_id": 1, "request_id": "a"}]).replace(
        b"\xaarequest_id\xa1a", b"\xaarequest_id\xdb\xff\xff\xff\xff"
    )
    for data in (claims, long_id, b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff"):
        (verdict,) = feed(new_fold(), [(worker_subject(NS, 1, 0), data)])
        assert refusal(verdict).kind == UNDECODABLE


def stack_depth() -> int:
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1  # type: ignore[assignment]
    return depth


def at_depth(depth: int, call: Callable[[], object]) -> object:
    """``call()`` with the stack ``depth`` frames deep."""
    return call() if stack_depth() >= depth else at_depth(depth, call)


HOSTILE = [
    REPRO,
    b"\x92\x01" + b"\x91" * 400 + b"\xc0",
    b"\x92\x01" + b"\x81\xa1k" * 900 + b"\xc0",
    b"\x93" + encode_event(Tick())[1:] + b"\x91" * 950 + b"\xc0",
    b"\x92\x01" + b"\x91" * 990 + b"\xc0",
]


def test_a_verdict_does_not_depend_on_how_deep_the_caller_is() -> None:
    """Python's recursion limit counts the caller's frames too: a decoder that recursed would
    refuse at one depth what it applied at another (a writer's stack against a replay's)."""
    limit = sys.getrecursionlimit()
    shallow = [feed(new_fold(), [(CONTROL, data)]) for data in HOSTILE]
    assert all(type(v) is Refusal and v.kind == UNDECODABLE for (v,) in shallow)
    for depth in (limit // 2, limit - 40):
        deep = [at_depth(depth, lambda d=d: feed(new_fold(), [(CONTROL, d)])) for d in HOSTILE]
        assert deep == shallow


# ---- rule 3: subject -------------------------------------------------------------------------


def test_each_event_is_applied_on_its_own_subject() -> None:
    events: list[Event] = [
        WorkerAdded(worker_id=3, dp_size=2),
        RouterHeartbeat(router_id="r"),
        AddRequest(request_id="a", worker_id=3, dp_rank=1, prefill_tokens=5, router_id="r"),
        AddOutputBlock(request_id="a", worker_id=3, dp_rank=1),
        MarkPrefillCompleted(request_id="a", worker_id=3, dp_rank=1),
        Free(request_id="a", worker_id=3, dp_rank=1),
        Tick(),
        RouterGoodbye(router_id="r"),
        WorkerRemoved(worker_id=3),
    ]
    verdicts = feed(new_fold(), [on_own(e) for e in events])
    assert all(type(v) is Delta and v.outcome == "applied" for v in verdicts), verdicts
    assert [subject_of(NS, e) for e in events[:3]] == [
        CONTROL,
        "seqstate.events.default.routers",
        "seqstate.events.default.3.1",
    ]


def test_a_routers_lifecycle_is_taken_on_the_routers_subject_and_on_control_as_before() -> None:
    """RouterPublisher sends heartbeats and goodbyes on ``.routers`` (the router role may not
    publish on control); logs written before that subject have them on control."""
    events = [RouterHeartbeat(router_id="r"), RouterGoodbye(router_id="r")]
    for subject in (routers_subject(NS), CONTROL):
        verdicts = feed(new_fold(), [(subject, encode_event(e)) for e in events])
        assert all(type(v) is Delta and v.outcome == "applied" for v in verdicts), verdicts
    fold = new_fold()
    for subject in (routers_subject(NS), "seqstate.events.default.routers.x"):
        (verdict,) = feed(fold, [(subject, encode_event(Tick()))])
        assert refusal(verdict).kind == WRONG_SUBJECT
    (verdict,) = feed(fold, [("seqstate.events.default.1.0", encode_event(events[0]))])
    assert refusal(verdict).reason == (
        "refused: RouterHeartbeat on subject 'seqstate.events.default.1.0'; it belongs on "
        "'seqstate.events.default.routers'"
    )
    (verdict,) = feed(
        fold, [(routers_subject(NS), encode_event(AddRequest(request_id="a", worker_id=1)))]
    )
    assert refusal(verdict).kind == WRONG_SUBJECT


@pytest.mark.parametrize(
    ("subject", "event", "reason"),
    [
        (  # an AddRequest for worker 5 on subject .1.0
            "seqstate.events.default.1.0",
            AddRequest(request_id="a", worker_id=5),
            "refused: AddRequest of worker 5 rank 0 on subject 'seqstate.events.default.1.0'; "
            "it belongs on 'seqstate.events.default.5.0'",
        ),
        (
            "seqstate.events.default.5.1",
            Free(request_id="a", worker_id=5),
            "refused: Free of worker 5 rank 0 on subject 'seqstate.events.default.5.1'; "
            "it belongs on 'seqstate.events.default.5.0'",
        ),
        (
            CONTROL,
            MarkPrefillCompleted(request_id="a", worker_id=5),
            "refused: MarkPrefillCompleted of worker 5 rank 0 on subject "
            "'seqstate.events.default.control'; it belongs on 'seqstate.events.default.5.0'",
        ),
        (  # a router's credential on its worker's subject cannot remove a worker
            "seqstate.events.default.1.0",
            WorkerRemoved(worker_id=1),
            "refused: WorkerRemoved on subject 'seqstate.events.default.1.0'; it belongs on "
            "'seqstate.events.default.control'",
        ),
        (
            "seqstate.events.default.1.0",
            Tick(),
            "refused: Tick on subject 'seqstate.events.default.1.0'; it belongs on "
            "'seqstate.events.default.control'",
        ),
        (
            "seqstate.events.default.01.0",
            AddRequest(request_id="a", worker_id=1),
            "refused: AddRequest of worker 1 rank 0 on subject 'seqstate.events.default.01.0'; "
            "it belongs on 'seqstate.events.default.1.0'",
        ),
        (
            "seqstate.events.other.1.0",
            AddRequest(request_id="a", worker_id=1),
            "refused: AddRequest of worker 1 rank 0 on subject 'seqstate.events.other.1.0'; "
            "it belongs on 'seqstate.events.default.1.0'",
        ),
        (
            "seqstate.events.default.1.0.x",
            AddRequest(request_id="a", worker_id=1),
            "refused: AddRequest of worker 1 rank 0 on subject 'seqstate.events.default.1.0.x'; "
            "it belongs on 'seqstate.events.default.1.0'",
        ),
        (
            "seqstate.events.default.controlx",
            WorkerAdded(worker_id=1),
            "refused: WorkerAdded on subject 'seqstate.events.default.controlx'; it belongs on "
            "'seqstate.events.default.control'",
        ),
    ],
)
def test_an_event_on_another_subject_is_refused_naming_its_own(
    subject: str, event: Event, reason: str
) -> None:
    fold = new_fold()
    before = fold.state.snapshot()
    (verdict,) = feed(fold, [(subject, encode_event(event))])
    assert refusal(verdict) == (WRONG_SUBJECT, reason, event)
    assert fold.state.snapshot() == before


def test_a_flood_of_invented_subjects_is_forgotten_and_decides_alike() -> None:
    fold = new_fold()
    event = encode_event(Free(request_id="a", worker_id=1))
    for i in range(70_000):
        fold(i + 1, i, f"seqstate.events.default.x{i}", event)
    assert len(fold._routes) <= 65_536
    (verdict,) = feed(fold, [(worker_subject(NS, 1, 0), event)], t0=70_001)
    assert type(verdict) is Delta and verdict.outcome == "unknown_request"


# ---- rule 4: bounds --------------------------------------------------------------------------


def test_rank_bounds_refuse_with_their_reason() -> None:
    fold = new_fold(FoldRules(NS, bounds=RankBounds(per_worker=4, total=10)))
    (verdict,) = feed(fold, [on_own(WorkerAdded(worker_id=1, dp_size=4096))])
    assert refusal(verdict)[:2] == (
        OUT_OF_BOUNDS,
        "refused: worker 1 would have 4096 ranks, over the bound of 4 per worker "
        "(max_ranks_per_worker)",
    )


def test_two_adds_of_2_63_prefill_tokens_on_one_rank_the_second_refused() -> None:
    """Their sum passed u64, ``encode_deltas`` raised OverflowError and the
    writer died for good. The second is refused with the sum it would make; every delta and
    the snapshot still encode."""
    fold = new_fold()
    adds = [AddRequest(request_id=r, worker_id=1, prefill_tokens=2**63) for r in ("a", "b")]
    first, second = feed(fold, [on_own(e) for e in adds])
    assert type(first) is Delta and first.outcome == "applied"
    assert refusal(second) == (
        OUT_OF_BOUNDS,
        f"refused: the prefill tokens pending on worker 1 rank 0 would sum to {2**64}, over "
        f"the bound of {MAX_SUM} (u64); AddRequest 'b' is not booked",
        adds[1],
    )
    encode_deltas([first])
    assert SequenceState.restore(fold.state.snapshot()).snapshot() == fold.state.snapshot()
    assert fold.state.slot(1).prefill.full_tokens == 2**63  # type: ignore[union-attr]


def test_u64_max_on_a_rank_with_prefill_pending_is_refused_and_after_its_mark_applied() -> None:
    fold = new_fold()
    small = AddRequest(request_id="a", worker_id=1, prefill_tokens=1)
    huge = AddRequest(request_id="b", worker_id=1, prefill_tokens=2**64 - 1)
    untracked = AddRequest(
        request_id="c", worker_id=1, prefill_tokens=2**64 - 1, track_prefill_tokens=False
    )
    verdicts = feed(
        fold,
        [
            on_own(small),
            on_own(huge),
            on_own(untracked),  # books no prefill: applied
            on_own(MarkPrefillCompleted(request_id="a", worker_id=1)),
            on_own(huge),  # nothing pending now: u64 max alone fits
        ],
    )
    kinds = [v.kind if type(v) is Refusal else v.outcome for v in verdicts]  # type: ignore[union-attr]
    assert kinds == ["applied", OUT_OF_BOUNDS, "applied", "applied", "applied"]
    assert fold.state.slot(1).prefill.full_tokens == 2**64 - 1  # type: ignore[union-attr]
    encode_deltas([v for v in verdicts if type(v) is Delta])  # type: ignore[misc]
    fold.state.snapshot()


def test_modeled_milliseconds_are_bounded_too() -> None:
    fold = new_fold()
    feed(fold, [on_own(AddRequest(request_id="a", worker_id=1, prefill_tokens=1))])
    prefill = fold.state.slot(1).prefill  # type: ignore[union-attr]
    prefill.modeled_ms_sum = MAX_SUM - 5  # as ~2*10^7 adds of 10^12 ms would leave it
    late = AddRequest(request_id="b", worker_id=1, prefill_tokens=1, expected_prefill_ms=6.0)
    ok = AddRequest(request_id="c", worker_id=1, prefill_tokens=1, expected_prefill_ms=5.0)
    over, fits = feed(fold, [on_own(late), on_own(ok)], t0=2)
    assert refusal(over).reason == (
        f"refused: the modeled prefill milliseconds pending on worker 1 rank 0 would sum to "
        f"{MAX_SUM + 1}, over the bound of {MAX_SUM} (u64); AddRequest 'b' is not booked"
    )
    assert type(fits) is Delta and fits.outcome == "applied"


# ---- every message, every path ---------------------------------------------------------------


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.binary(max_size=300),
    subject=st.sampled_from([CONTROL, REPRO_SUBJECT, "seqstate.events.default.x", "", "a.b"]),
)
def test_no_bytes_on_any_subject_make_the_fold_raise(data: bytes, subject: str) -> None:
    fold = new_fold()
    verdict = fold(1, 1, subject, data)
    if type(verdict) is Refusal:
        assert verdict.kind in KINDS and verdict.reason
    else:
        assert subject == subject_of(NS, decode_event(data))


def test_kinds_are_the_dead_letters_words() -> None:
    assert KINDS == ("undecodable", "too_large", "out_of_bounds", "wrong_subject")
