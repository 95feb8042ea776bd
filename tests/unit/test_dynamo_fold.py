"""Dynamo's own replica-sync messages through the one fold: the real capture folded
in order, as a Dynamo replica applies a peer's event but stricter, and loss made visible.

Messages come on the namespace's capture subject (``seqstate.events.<ns>.dynamo.<NS>.<C>.<E>``,
what the events stream's rewrite gives them) with the capture's own times as log times.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest
from dynamo_capture import (
    BIG_WORKER,
    CAPTURE,
    EDGES,
    ENDPOINT,
    FRONTEND_A,
    FRONTEND_B,
    NO_RANK,
    SMALL_WORKER,
    SUBJECT,
    WORKER_DP1,
    WORKER_DP2,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seqstate import (
    AddRequest,
    Delta,
    Fold,
    FoldRules,
    Free,
    Refusal,
    SequenceState,
    decode_delta,
    encode_delta,
    encode_event,
)
from seqstate.batches import encode_batch_of
from seqstate.bounds import RankBounds
from seqstate.deltas import Hole, split_delta
from seqstate.dynamo import (
    DynamoMessage,
    captured_subject,
    core_event,
    decode_dynamo,
    encode_dynamo,
    resync_publisher_id,
)
from seqstate.fold import OUT_OF_BOUNDS, TOO_LARGE, UNDECODABLE, WRONG_SUBJECT, subject_of
from seqstate.snapshot import _State, decode_state

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

NS = "dyn"
ON = captured_subject(NS, ENDPOINT)
MESSAGES = [decode_dynamo(c.data) for c in CAPTURE]
RANKS = [(BIG_WORKER, 0), (BIG_WORKER, 1), (SMALL_WORKER, 0)]


def new_fold(rules: FoldRules | None = None, **state: Any) -> Fold:
    return Fold(SequenceState(**state), rules or FoldRules(NS))


def fold_capture(fold: Fold, upto: int | None = None) -> list[Delta | Refusal]:
    """The capture's first ``upto`` messages (all by default), in order, at their times."""
    return [fold(i, c.t_ns, ON, c.data) for i, c in enumerate(CAPTURE[:upto], 1)]


def applied(verdict: object) -> Delta:
    assert type(verdict) is Delta, verdict
    return verdict


def refused(verdict: object) -> Refusal:
    assert type(verdict) is Refusal, verdict
    return verdict


def rank_numbers(state: SequenceState) -> dict[tuple[int, int], tuple[int, int, int]]:
    """(active blocks, requests, prefill tokens pending) of each rank."""
    out = {}
    for rank in RANKS:
        slot = state.slot(*rank)
        if slot is None:  # not created yet
            out[rank] = (0, 0, 0)
            continue
        load = slot.load()
        out[rank] = (load.active_blocks, load.active_requests, slot.prefill.full_tokens)
    return out


def message(base: DynamoMessage, **changes: Any) -> bytes:
    return encode_dynamo(msgspec.structs.replace(base, **changes))


# ---- the whole capture ------------------------------------------------------------------------


def test_the_capture_folds_to_zero_everywhere_after_its_drain() -> None:
    fold = new_fold()
    verdicts = fold_capture(fold)
    state = fold.state
    outcomes = [applied(v).outcome for v in verdicts]
    # 40 adds, 40 frees and 40 first Marks applied; 35 repeated Marks change nothing.
    assert (outcomes.count("applied"), outcomes.count("duplicate")) == (120, 35)
    assert all(
        v.outcome == "duplicate"
        for v, m in zip(verdicts, MESSAGES, strict=True)
        if m.op != "MarkPrefillCompleted" and v.outcome != "applied"  # type: ignore[union-attr]
    )
    assert len(state.requests) == 0
    assert rank_numbers(state) == dict.fromkeys(RANKS, (0, 0, 0))
    assert state.counters["worker_mismatch"] == state.counters["unknown_request"] == 0
    assert state.counters["mark_before_add"] == 0 and state.counters["expired"] == 0
    assert state.publishers.rows() == [  # least recently heard first
        (WORKER_DP1, 13, CAPTURE[126].t_ns, 0, 0),
        (WORKER_DP2, 25, CAPTURE[147].t_ns, 0, 0),
        (FRONTEND_A, 55, CAPTURE[152].t_ns, 0, 0),
        (FRONTEND_B, 58, CAPTURE[154].t_ns, 0, 0),
    ]
    assert (state.publishers.holes, state.publishers.late) == (0, 0)
    assert all(applied(v).hole is None for v in verdicts)
    state.check_invariants()


def test_exact_numbers_after_the_first_adds_and_marks() -> None:
    fold = new_fold()
    fold_capture(fold, 6)  # frontend A's six adds
    assert rank_numbers(fold.state) == {
        (BIG_WORKER, 0): (12 + 19, 2, 200 + 311),
        (BIG_WORKER, 1): (19, 1, 314),
        # 13, 9 and 9 blocks, the last two sharing a prefix of 8
        (SMALL_WORKER, 0): (13 + 9 + 9 - 8, 3, 220 + 157 + 147),
    }
    fold_capture_from(fold, 6, 12)  # frontend B's six adds, some on prefixes already held
    assert rank_numbers(fold.state) == {
        (BIG_WORKER, 0): (54, 4, 200 + 311 + 244 + 343),
        (BIG_WORKER, 1): (31, 3, 314 + 181 + 181),
        (SMALL_WORKER, 0): (46, 5, 220 + 157 + 147 + 182 + 320),
    }
    # The dp-2 worker's own Marks (router_id == worker_id) end two prefills; frontend A's
    # Marks of the same requests then are duplicates and change nothing.
    fold_capture_from(fold, 12, 14)
    after_workers = rank_numbers(fold.state)
    assert after_workers[(BIG_WORKER, 0)] == (54, 4, 200 + 244 + 343)
    assert after_workers[(BIG_WORKER, 1)] == (31, 3, 181 + 181)
    verdicts = fold_capture_from(fold, 14, 18)  # the other worker's two Marks, then A's two
    assert [applied(v).outcome for v in verdicts] == [
        "applied",
        "applied",
        "duplicate",
        "duplicate",
    ]
    assert rank_numbers(fold.state) == {
        **after_workers,
        (SMALL_WORKER, 0): (46, 5, 1026 - 220 - 157),  # then B's Marks: 649 pending
    }


def fold_capture_from(fold: Fold, start: int, stop: int) -> list[Delta | Refusal]:
    return [fold(i + 1, CAPTURE[i].t_ns, ON, CAPTURE[i].data) for i in range(start, stop)]


def naive(upto: int) -> dict[tuple[int, int], tuple[int, int, int]]:
    """A model that shares nothing with the core: each live request's hashes, prefill and
    whether a Mark came, per rank; blocks are the union of the live requests' hashes."""
    live: dict[str, tuple[tuple[int, int], list[int], int, bool]] = {}
    for m in MESSAGES[:upto]:
        if m.op == "AddRequest":
            assert m.request_id not in live
            live[m.request_id] = (
                (m.worker_id, m.dp_rank),
                m.token_sequence or [],
                m.prefill_tokens or 0,
                False,
            )
        elif m.op == "MarkPrefillCompleted":
            rank, hashes, tokens, _ = live[m.request_id]
            live[m.request_id] = (rank, hashes, tokens, True)
        else:
            del live[m.request_id]
    out = {}
    for rank in RANKS:
        mine = [r for r in live.values() if r[0] == rank]
        blocks = len({h for r in mine for h in r[1]})
        out[rank] = (blocks, len(mine), sum(r[2] for r in mine if not r[3]))
    return out


def test_after_every_message_each_rank_is_what_a_naive_model_says() -> None:
    fold = new_fold()
    peak = 0
    for i, captured in enumerate(CAPTURE):
        applied(fold(i + 1, captured.t_ns, ON, captured.data))
        assert rank_numbers(fold.state) == naive(i + 1), f"after message {i}"
        peak = max(peak, len(fold.state.requests))
    assert peak == 12


def test_dynamos_raw_subject_folds_alike() -> None:
    fold = new_fold()
    verdicts = [fold(i, c.t_ns, SUBJECT, c.data) for i, c in enumerate(CAPTURE, 1)]
    reference = new_fold()
    assert [applied(v).outcome for v in verdicts] == [
        applied(v).outcome for v in fold_capture(reference)
    ]
    assert fold.state.snapshot() == reference.state.snapshot()


def test_the_time_is_the_logs_never_the_publishers_clock() -> None:
    fold, skewed = new_fold(), new_fold()
    fold_capture(fold)
    for i, (c, m) in enumerate(zip(CAPTURE, MESSAGES, strict=True), 1):
        applied(skewed(i, c.t_ns, ON, message(m, published_at_ms=(i * 7919) % 1000)))
    assert skewed.state.snapshot() == fold.state.snapshot()


# ---- by id, as Dynamo's replicas ----------------------------------------------------------------


def test_a_free_naming_another_worker_frees_the_request_by_its_id() -> None:
    fold = new_fold()
    fold_capture(fold, 1)  # 5af77f4d... on the big worker, rank 0
    add = MESSAGES[0]
    free = message(
        add,
        op="Free",
        sequence=1,
        worker_id=SMALL_WORKER,
        dp_rank=1,
        token_sequence=None,
        prefill_tokens=None,
    )
    delta = applied(fold(2, CAPTURE[1].t_ns, ON, free))
    assert delta.outcome == "applied"
    assert [c.rank for c in delta.changes] == [(BIG_WORKER, 0)]
    assert rank_numbers(fold.state)[(BIG_WORKER, 0)] == (0, 0, 0)
    assert fold.state.slot(SMALL_WORKER, 1) is None  # the named rank is not even created
    assert fold.state.counters["worker_mismatch"] == 1


def test_a_free_before_its_add_keeps_the_late_add_from_leaking() -> None:
    """Dynamo's replica forgets a Free of an unknown id, and the late Add then leaks its
    blocks until expiry (reference §7.4); the core's tombstone supersedes the late Add."""
    fold = new_fold()
    add = MESSAGES[0]
    free = message(add, op="Free", sequence=2)
    assert applied(fold(1, 10, ON, free)).outcome == "unknown_request"
    late_add = message(add, sequence=1)
    assert applied(fold(2, 20, ON, late_add)).outcome == "superseded"
    assert len(fold.state.requests) == 0 and fold.state.slot(BIG_WORKER, 0) is None
    # Out of order within one publisher: the late Add is counted as late, not as a hole.
    assert fold.state.publishers[FRONTEND_A].late == 1
    assert fold.state.publishers.holes == 0


def test_a_workers_mark_before_the_routers_add_books_no_prefill() -> None:
    """The worker and the router are two publishers: the worker's Mark can reach the log
    before the router's Add. Dynamo's replica loses that Mark and keeps the prefill charged."""
    fold = new_fold()
    add, mark = MESSAGES[3], MESSAGES[12]  # 02613d29...: frontend A's Add, the worker's Mark
    assert add.request_id == mark.request_id
    assert applied(fold(1, 10, ON, CAPTURE[12].data)).outcome == "unknown_request"
    assert applied(fold(2, 20, ON, CAPTURE[3].data)).outcome == "applied"
    slot = fold.state.slot(BIG_WORKER, 0)
    assert slot is not None and slot.load().active_blocks == 19 and slot.prefill.full_tokens == 0
    assert fold.state.counters["mark_before_add"] == 1


def test_repeated_marks_and_a_workers_own_mark_are_harmless() -> None:
    fold = new_fold()
    fold_capture(fold, 12)
    before = rank_numbers(fold.state)
    mark = MESSAGES[12]  # the worker's own
    assert applied(fold(13, CAPTURE[12].t_ns, ON, CAPTURE[12].data)).outcome == "applied"
    assert fold.state.routers == {}  # the worker named as a router is no live router
    for seq, sequence in ((14, 1), (15, 2)):
        again = message(mark, sequence=sequence)
        assert applied(fold(seq, CAPTURE[12].t_ns, ON, again)).outcome == "duplicate"
    numbers = rank_numbers(fold.state)
    assert numbers[(BIG_WORKER, 0)] == (before[(BIG_WORKER, 0)][0], 4, 200 + 244 + 343)
    assert numbers[(BIG_WORKER, 1)] == before[(BIG_WORKER, 1)]


def test_a_dynamo_router_never_heartbeats_and_its_requests_are_never_orphaned() -> None:
    """Orphaning frees a router's requests after a heartbeat and then silence; a Dynamo
    router sends no heartbeat, so its requests end by their Free or by expiry alone."""
    fold = new_fold(orphan_after_s=1.0, expiry_s=300.0)
    fold_capture(fold, 12)
    assert fold.state.requests.router_of[MESSAGES[0].request_id] == "60572485714993071"
    hour = CAPTURE[11].t_ns + 3600 * 10**9
    tick = applied(
        fold(13, CAPTURE[11].t_ns + 200 * 10**9, "seqstate.events.dyn.control", encode_event_tick())
    )
    assert tick.orphaned == [] and tick.expired == [] and len(fold.state.requests) == 12
    tick = applied(fold(14, hour, "seqstate.events.dyn.control", encode_event_tick()))
    assert tick.orphaned == [] and len(tick.expired) == 12  # expiry, never orphaning


def encode_event_tick() -> bytes:
    from seqstate import Tick

    return encode_event(Tick())


# ---- loss made visible --------------------------------------------------------------------------


def test_a_dropped_message_is_exactly_one_hole_of_its_publisher() -> None:
    fold = new_fold()
    dropped = 36  # frontend B's sequence 12 (an AddRequest)
    assert (MESSAGES[dropped].publisher_id, MESSAGES[dropped].sequence) == (FRONTEND_B, 12)
    holes = []
    for i, c in enumerate(CAPTURE):
        if i != dropped:
            verdict = applied(fold(i + 1, c.t_ns, ON, c.data))
            if verdict.hole is not None:
                holes.append((i, verdict.hole))
    assert holes == [(40, Hole(FRONTEND_B, 12, 1))]  # B's next message names it
    assert MESSAGES[40].publisher_id == FRONTEND_B
    publishers = fold.state.publishers
    assert publishers[FRONTEND_B].holes == 1 and publishers.holes == 1
    assert [publishers[p].holes for p in (FRONTEND_A, WORKER_DP1, WORKER_DP2)] == [0, 0, 0]
    # The lost Add's request: its Mark and Free found no id (the Free left a tombstone).
    assert fold.state.counters["unknown_request"] == 3
    assert len(fold.state.requests) == 0


def test_a_hole_survives_a_split_delta_and_the_wire() -> None:
    fold = new_fold()
    fold(1, 1, ON, CAPTURE[0].data)
    delta = applied(fold(2, 2, ON, message(MESSAGES[1], sequence=5)))
    assert delta.hole == Hole(FRONTEND_A, 1, 4)
    assert decode_delta(encode_delta(delta)).hole == delta.hole
    wide = Delta("applied", 2, added_ranks=[(BIG_WORKER, r) for r in range(200)], hole=delta.hole)
    parts = split_delta(wide, 256 + 24 * 10)
    assert len(parts) == 20 and parts[0].hole == delta.hole
    assert all(p.hole is None for p in parts[1:])


def test_a_late_zero_is_late_and_opens_no_hole_after_it() -> None:
    """Dynamo draws a new publisher id at every start: an id's sequence 0 after a higher one
    is no restart but a late (or forged) message, and the publisher's next message in order
    reveals no hole."""
    fold = new_fold()
    fold_capture(fold, 6)  # frontend A, sequences 0-5
    late_zero = message(MESSAGES[0], request_id="late-zero", sequence=0)
    delta = applied(fold(7, CAPTURE[5].t_ns, ON, late_zero))
    assert delta.outcome == "applied" and delta.hole is None
    then = message(MESSAGES[1], request_id="in-order", sequence=6)
    assert applied(fold(8, CAPTURE[5].t_ns, ON, then)).hole is None
    publisher = fold.state.publishers[FRONTEND_A]
    assert (publisher.late, publisher.holes, publisher.last_sequence) == (1, 0, 6)
    assert (fold.state.publishers.late, fold.state.publishers.holes) == (1, 0)


def test_a_duplicate_is_counted_as_late_never_as_a_hole() -> None:
    fold = new_fold()
    fold_capture(fold, 6)
    again = applied(fold(7, CAPTURE[5].t_ns, ON, CAPTURE[3].data))  # A's sequence 3 again
    assert again.outcome == "duplicate" and again.hole is None
    publisher = fold.state.publishers[FRONTEND_A]
    assert (publisher.late, publisher.holes, publisher.last_sequence) == (1, 0, 5)
    assert applied(fold(8, CAPTURE[6].t_ns, ON, message(MESSAGES[33], sequence=6))).hole is None


def test_a_publisher_first_seen_mid_sequence_has_no_hole() -> None:
    """What a publisher sent before the log began was never the log's to miss."""
    fold = new_fold()
    delta = applied(fold(1, 1, ON, CAPTURE[40].data))  # B's sequence 13, first seen
    assert delta.hole is None and fold.state.publishers[FRONTEND_B].last_sequence == 13
    assert fold.state.publishers.holes == 0


def test_publishers_are_bounded_the_least_recently_heard_forgotten() -> None:
    fold = new_fold(max_publishers=2)
    fold_capture(fold, 13)  # A, then B, then the dp-2 worker: A is forgotten
    publishers = fold.state.publishers
    assert [row[0] for row in publishers.rows()] == [FRONTEND_B, WORKER_DP2]
    assert publishers.forgotten == 1
    restored = SequenceState.restore(fold.state.snapshot())
    assert restored.publishers.rows() == publishers.rows()
    assert (restored.publishers.capacity, restored.publishers.forgotten) == (2, 1)


def test_an_out_of_bounds_add_after_a_hole_says_both() -> None:
    rules = FoldRules(NS, bounds=RankBounds(total=2))
    fold = new_fold(rules)
    fold_capture(fold, 2)  # two ranks of the big worker
    verdict = refused(fold(3, 3, ON, message(MESSAGES[2], sequence=4)))  # a third rank
    assert verdict.kind == OUT_OF_BOUNDS
    assert verdict.reason == (
        "refused: the write model would hold 3 ranks, over the bound of 2 (max_ranks) (and "
        f"2 message(s) of Dynamo publisher {FRONTEND_A} before it, from sequence 2, never "
        "reached the log)"
    )
    assert isinstance(verdict.event, AddRequest)
    assert fold.state.publishers[FRONTEND_A].holes == 2  # counted all the same


def test_prefill_sums_are_bounded_as_for_seqstates_own_adds() -> None:
    fold = new_fold()
    first = message(MESSAGES[0], prefill_tokens=2**64 - 1)
    applied(fold(1, 1, ON, first))
    second = message(MESSAGES[3], sequence=1, prefill_tokens=1)
    verdict = refused(fold(2, 2, ON, second))
    assert (
        verdict.kind == OUT_OF_BOUNDS and "over the bound of 18446744073709551615" in verdict.reason
    )


# ---- seqstate's own resync ----------------------------------------------------------------------


def test_the_resync_publishers_messages_are_echoes_that_change_nothing() -> None:
    fold = new_fold()
    fold_capture(fold, 12)
    before = fold.state.snapshot()
    resync = resync_publisher_id(NS)
    for n, m in enumerate(MESSAGES[:12]):  # the requests in flight, republished
        echo = applied(
            fold(13 + n, CAPTURE[11].t_ns + n, ON, message(m, publisher_id=resync, sequence=n))
        )
        assert echo.outcome == "echo" and not echo.changes and echo.seq == 13 + n
    assert fold.state.counters["echo"] == 12
    assert resync not in fold.state.publishers
    after = SequenceState.restore(fold.state.snapshot())
    after.counters["echo"] = 0
    assert after.snapshot() == before
    # Another namespace's resync publisher is any publisher here.
    other = message(MESSAGES[0], publisher_id=resync_publisher_id("other"), request_id="x")
    assert applied(fold(99, CAPTURE[11].t_ns, ON, other)).outcome == "applied"


# ---- subjects, sizes, bytes ---------------------------------------------------------------------


def test_a_dynamo_message_on_a_seqstate_subject_and_the_reverse_are_wrong_subject() -> None:
    fold = new_fold()
    verdict = refused(fold(1, 1, "seqstate.events.dyn.1.0", CAPTURE[0].data))
    assert verdict.kind == WRONG_SUBJECT
    assert verdict.reason == (
        f"refused: a Dynamo AddRequest of publisher {FRONTEND_A} on subject "
        "'seqstate.events.dyn.1.0'; the namespace's Dynamo messages belong on "
        "'seqstate.events.dyn.dynamo.<NS>.<COMPONENT>.<ENDPOINT>'"
    )
    assert verdict.event == core_event(MESSAGES[0])
    own = Free(request_id="r", worker_id=1)
    verdict = refused(fold(2, 2, ON, encode_event(own)))
    assert verdict.kind == WRONG_SUBJECT
    assert verdict.reason == (
        f"refused: Free of worker 1 rank 0 on subject {ON!r}; it belongs on {subject_of(NS, own)!r}"
    )
    # Another namespace's capture is not this namespace's.
    verdict = refused(fold(3, 3, captured_subject("other", ENDPOINT), CAPTURE[0].data))
    assert verdict.kind == WRONG_SUBJECT
    assert len(fold.state.requests) == 0 and len(fold.state.publishers) == 0


def test_bytes_that_are_neither_are_undecodable_with_dynamos_reason() -> None:
    fold = new_fold()
    verdict = refused(fold(1, 1, ON, CAPTURE[0].data[:40]))
    assert verdict == Refusal(
        UNDECODABLE, "malformed Dynamo envelope bytes: Input data was truncated"
    )
    deep = b"\x91" * 5000 + b"\xc0"
    assert refused(fold(2, 2, ON, deep)).kind == UNDECODABLE


@pytest.mark.parametrize("name", EDGES)
def test_an_operators_edge_is_refused_with_its_reason_and_the_fold_goes_on(name: str) -> None:
    """Refused as undecodable (the dead letter's kind) with the decoder's reason, on the
    namespace's capture subject and on Dynamo's own; nothing booked, its publisher not counted
    (the message is no lifecycle event of it), and the capture after it folds as without it."""
    data, reason = EDGES[name]
    fold = new_fold()
    for seq, subject in enumerate((ON, SUBJECT), 1):
        assert refused(fold(seq, CAPTURE[0].t_ns, subject, data)) == Refusal(UNDECODABLE, reason)
    assert len(fold.state.requests) == 0 and len(fold.state.publishers) == 0
    assert "" not in fold.state.requests.owner
    clean = new_fold()
    for seq, c in enumerate(CAPTURE, 3):
        assert fold(seq, c.t_ns, ON, c.data) == clean(seq, c.t_ns, ON, c.data)
    assert fold.state.snapshot() == clean.state.snapshot()


def test_a_worker_without_its_dp_rank_books_on_rank_0() -> None:
    """A worker map without ``dp_rank``: the worker's one rank, 0, as any other Add."""
    fold = new_fold()
    verdict = fold(1, CAPTURE[0].t_ns, ON, NO_RANK)
    assert not isinstance(verdict, Refusal)
    request_id = decode_dynamo(NO_RANK).request_id
    assert fold.state.requests.owner == {request_id: (BIG_WORKER, 0)}


def test_a_dynamo_message_on_a_malformed_capture_subject_is_wrong_subject() -> None:
    """A capture subject whose endpoint part is not three tokens is no capture subject: a
    Dynamo message there is refused, naming where the namespace's Dynamo messages belong."""
    fold = new_fold()
    for seq, subject in enumerate(
        ("seqstate.events.dyn.dynamo.dynamo.backend", "seqstate.events.dyn.dynamo.a.b.c.d"), 1
    ):
        verdict = refused(fold(seq, seq, subject, CAPTURE[0].data))
        assert verdict.kind == WRONG_SUBJECT
        assert verdict.reason == (
            f"refused: a Dynamo AddRequest of publisher {FRONTEND_A} on subject {subject!r}; "
            "the namespace's Dynamo messages belong on "
            "'seqstate.events.dyn.dynamo.<NS>.<COMPONENT>.<ENDPOINT>'"
        )
    assert len(fold.state.requests) == 0 and len(fold.state.publishers) == 0


def test_the_size_rule_comes_first() -> None:
    fold = new_fold(FoldRules(NS, max_event_bytes=300))
    assert refused(fold(1, 1, ON, CAPTURE[0].data)).kind == TOO_LARGE  # 412 bytes
    assert applied(fold(2, 2, ON, CAPTURE[12].data)).outcome == "unknown_request"


# ---- 64 bits everywhere -------------------------------------------------------------------------


def test_worker_ids_above_2_63_through_state_delta_and_snapshot() -> None:
    fold = new_fold()
    fold_capture(fold, 12)
    delta = applied(fold(13, CAPTURE[12].t_ns, ON, CAPTURE[12].data))
    assert delta.changes[0].rank == (BIG_WORKER, 0) and BIG_WORKER > 2**63
    assert decode_delta(encode_delta(delta)) == delta
    data = fold.state.snapshot()
    restored = decode_state(data)
    assert restored.snapshot() == data
    assert rank_numbers(restored) == rank_numbers(fold.state)
    hashes = restored.slot(BIG_WORKER, 0).requests[MESSAGES[0].request_id].hashes  # type: ignore[union-attr]
    assert hashes == MESSAGES[0].token_sequence and max(hashes) > 2**63


def test_a_fold_restored_mid_capture_ends_byte_identical() -> None:
    whole = new_fold()
    fold_capture(whole)
    for cut in (1, 12, 36, 77, 120, 154):
        first = new_fold()
        fold_capture(first, cut)
        resumed = Fold(SequenceState.restore(first.state.snapshot()), FoldRules(NS))
        fold_capture_from(resumed, cut, len(CAPTURE))
        assert resumed.state.snapshot() == whole.state.snapshot(), cut


# ---- Dynamo's messages fold as the seqstate events they are -------------------------------------

IDS = st.sampled_from([f"q{i}" for i in range(6)])
DYNAMO = st.builds(
    DynamoMessage,
    publisher_id=st.sampled_from([1, 2, 2**64 - 1]),
    sequence=st.just(0),
    published_at_ms=st.integers(0, 2**64 - 1),
    request_id=IDS,
    worker_id=st.sampled_from([0, 2**63 + 5, 2**64 - 1]),
    dp_rank=st.integers(0, 1),
    router_id=st.sampled_from([7, 2**64 - 1]),
    lora_name=st.none() | st.just("lora-a"),
    op=st.sampled_from(["AddRequest", "MarkPrefillCompleted", "Free"]),
    token_sequence=st.none() | st.lists(st.sampled_from([1, 2, 3, 2**64 - 1]), max_size=4),
    track_prefill_tokens=st.booleans(),
    expected_output_tokens=st.none() | st.integers(0, 2**32 - 1),
    prefill_tokens=st.none() | st.sampled_from([0, 16, 300]),
    expected_prefill_duration=st.none() | st.tuples(st.integers(0, 5), st.integers(0, 999_999_999)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    messages=st.lists(DYNAMO, max_size=40), gaps=st.lists(st.integers(0, 40 * 10**9), min_size=40)
)
def test_a_dynamo_message_folds_as_its_seqstate_event_on_its_own_subject(
    messages: list[DynamoMessage], gaps: list[int]
) -> None:
    """The same lifecycle, as Dynamo's bytes on the capture subject or as seqstate's events on
    their ranks' subjects: the same outcomes, the same ranks, byte for byte (publishers
    aside); and each delta encodes."""
    dynamo, own = new_fold(expiry_s=60.0), new_fold(expiry_s=60.0)
    sequences: dict[int, int] = {}
    at = 1_800_000_000 * 10**9
    for seq, (m, gap) in enumerate(zip(messages, gaps, strict=False), 1):
        at += gap
        sequence = sequences[m.publisher_id] = sequences.get(m.publisher_id, -1) + 1
        m.sequence = sequence
        event = core_event(m)
        a = dynamo(seq, at, ON, encode_dynamo(m))
        b = own(seq, at, subject_of(NS, event), encode_event(event))
        assert type(a) is type(b)
        if type(a) is Refusal:
            assert (a.kind, a.reason) == (b.kind, b.reason)  # type: ignore[union-attr]
        else:
            assert encode_delta(a) == encode_delta(b)  # type: ignore[arg-type]
    assert dynamo.state.publishers.holes == 0
    dynamo.state.publishers.entries.clear()
    assert dynamo.state.snapshot() == own.state.snapshot()


# ---- snapshots ----------------------------------------------------------------------------------


def test_a_snapshot_keeps_the_publishers_in_order_with_their_counts() -> None:
    fold = new_fold()
    for i, c in enumerate(CAPTURE):
        if i not in (36, 50):  # two holes of frontend B
            fold(i + 1, c.t_ns, ON, c.data)
    fold(200, CAPTURE[-1].t_ns, ON, message(MESSAGES[0], request_id="again", sequence=0))
    publishers = fold.state.publishers
    assert (publishers.holes, publishers.late) == (2, 1)
    restored = SequenceState.restore(fold.state.snapshot())
    assert restored.publishers.rows() == publishers.rows()
    assert (restored.publishers.holes, restored.publishers.late) == (2, 1)
    assert restored.publishers.lossy() == publishers.lossy() == [(FRONTEND_B, 2)]
    assert restored.snapshot() == fold.state.snapshot()


def test_a_snapshot_written_before_publishers_existed_is_still_read() -> None:
    """The publishers are trailing fields of the snapshot with defaults: a snapshot from an
    older build (without them) restores with no publisher known, and the fold goes on."""
    fold = new_fold()
    fold_capture(fold, 12)
    data = fold.state.snapshot()
    magic, body = data[:4], msgspec.msgpack.decode(data[4:])
    older = magic + msgspec.msgpack.encode(body[: _State.__struct_fields__.index("publishers")])
    restored = SequenceState.restore(older)
    assert len(restored.publishers) == 0 and restored.publishers.capacity == 4096
    assert rank_numbers(restored) == rank_numbers(fold.state)
    resumed = Fold(restored, FoldRules(NS))
    assert all(applied(v).hole is None for v in fold_capture_from(resumed, 12, len(CAPTURE)))
    assert len(restored.requests) == 0


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.binary(max_size=300)
    | st.sampled_from([c.data[:n] for c in CAPTURE[:3] for n in range(len(c.data))])
)
def test_no_bytes_on_a_dynamo_subject_make_the_fold_raise(data: bytes) -> None:
    fold = new_fold()
    verdict = fold(1, 1, ON, data)
    if type(verdict) is Refusal:
        assert verdict.kind in (UNDECODABLE, WRONG_SUBJECT) and verdict.reason
    else:
        assert decode_dynamo(data)  # only a whole Dynamo message is applied


# ---- bursts stored as record batches (the capture's forwarder) ------------------------------

POISON = b"\x81\xa4oops\xc1"  # a map that is no Dynamo message


def stored_as(items: list[bytes]) -> bytes:
    """How the forwarder stores a run of Dynamo messages: a lone one as it is, else a batch."""
    return items[0] if len(items) == 1 else encode_batch_of(items)


def unprefixed(verdict: Delta | Refusal) -> object:
    """A verdict as a message alone gets it: a batch's refusal names its index first, and a
    delta of a batch carries its index."""
    if isinstance(verdict, Refusal):
        return verdict._replace(reason=re.sub(r"^event \d+ of the batch: ", "", verdict.reason))
    return encode_delta(msgspec.structs.replace(verdict, index=0))


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=60), st.integers(0, len(CAPTURE)))
def test_bursts_as_batches_fold_as_each_message_alone(cuts: list[int], poison_at: int) -> None:
    """The capture (a poison message somewhere in it) cut into bursts of any sizes, each
    stored as one message (a batch, or a lone message as it is): every Dynamo message gets
    the verdict it gets handed over alone at its burst's sequence and time, in order, and the
    write models are byte for byte the same."""
    data = [c.data for c in CAPTURE]
    data.insert(poison_at, POISON)
    bursts, start = [], 0
    for size in cuts * (len(data) // max(1, sum(cuts)) + 1):
        if start >= len(data):
            break
        bursts.append(data[start : start + size])
        start += size
    batched, alone = new_fold(), new_fold()
    got: list[object] = []
    want: list[object] = []
    for seq, burst in enumerate(bursts, 1):
        at_ns = CAPTURE[min(seq, len(CAPTURE) - 1)].t_ns
        verdict = batched(seq, at_ns, ON, stored_as(burst))
        got += [unprefixed(v) for v in (verdict if isinstance(verdict, list) else [verdict])]
        want += [unprefixed(alone(seq, at_ns, ON, item)) for item in burst]  # type: ignore[arg-type]
    assert got == want
    assert batched.state.snapshot() == alone.state.snapshot()
    assert sum(isinstance(v, Refusal) for v in got) == 1


def test_a_poison_message_in_a_burst_is_refused_alone_with_its_index() -> None:
    """A message that is no Dynamo message between two of the capture's: refused alone,
    named by its index; its neighbours applied, its publisher's sequence untouched."""
    fold = new_fold()
    verdicts = fold(
        1, CAPTURE[0].t_ns, ON, encode_batch_of([CAPTURE[0].data, POISON, CAPTURE[1].data])
    )
    assert isinstance(verdicts, list) and len(verdicts) == 3
    first, poison, third = verdicts
    assert (applied(first).index, applied(third).index) == (0, 2)
    assert refused(poison).kind == UNDECODABLE
    assert refused(poison).reason.startswith("event 1 of the batch: malformed Dynamo envelope")
    assert fold.state.publishers.holes == 0
