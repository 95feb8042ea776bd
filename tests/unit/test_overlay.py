"""A scheduler's overlay against the truth: whatever the view shows of the events sent so far,
the view plus the overlay count exactly what the write model holds after all of them (blocks,
requests, prefill tokens and overlap depths), and nothing stays once the view shows it all."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from projector.schedule.overlay import Overlay
from seqstate import AddRequest, Free, MarkPrefillCompleted, SequenceState

# Chained prompts share prefixes: a prompt is a prefix of one of these.
TREES = ([1, 2, 3, 4, 5, 6], [1, 2, 7, 8], [9, 10, 11], [1, 12])
RANKS = ((1, 0), (1, 1), (2, 0))
QUERIES = [tree[:n] for tree in TREES for n in range(1, len(tree) + 1)]


@dataclass
class Booked:
    rank: tuple[int, int]
    hashes: list[int]
    prefill: int


def truth(events: list[object]) -> SequenceState:
    state = SequenceState(expiry_s=None)
    for event in events:
        state.apply(event, 0)  # one instant: nothing decays, every token counts
    return state


def counts(state: SequenceState) -> dict[tuple[int, int], tuple[int, int, int]]:
    return {
        (r.worker_id, r.dp_rank): (r.active_blocks, r.active_requests, r.active_prefill_tokens)
        for r in state.registry.loads(0)
    }


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.sampled_from(RANKS),
            st.sampled_from(QUERIES),
            st.integers(0, 5000),
            st.booleans(),
        ),
        st.tuples(st.just("mark"), st.integers(0, 50)),
        st.tuples(st.just("free"), st.integers(0, 50)),
        st.tuples(st.just("catch"), st.integers(1, 4)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_view_plus_overlay_counts_what_the_write_model_holds(script: list[tuple]) -> None:
    view = SequenceState(expiry_s=None)  # what the view shows: the first ``shown`` events
    overlay = Overlay(view.registry)
    sent: list[object] = []
    shown = 0
    booked: dict[str, Booked] = {}
    serial = 0

    def check() -> None:
        want = counts(truth(sent))
        got = counts(view)
        for rank in set(want) | set(got):
            base = got.get(rank, (0, 0, 0))
            delta = overlay.get(rank)
            moved = (0, 0, 0) if delta is None else (delta.blocks, delta.requests, delta.prefill)
            assert tuple(b + m for b, m in zip(base, moved, strict=True)) == want.get(
                rank, (0, 0, 0)
            ), rank
        full = truth(sent).registry
        for rank in RANKS:
            for query in QUERIES:
                seen = view.registry.overlap_depths(query).get(rank, 0)
                assert overlay.depth(rank, query, seen) == full.overlap_depths(query).get(rank, 0)

    for op in script:
        if op[0] == "catch":
            for _ in range(op[1]):
                if shown < len(sent):
                    view.apply(sent[shown], 0)
                    shown += 1
            overlay.prune(shown)  # an event's sequence: its 1-based place in ``sent``
        elif op[0] == "add":
            _, rank, prompt, tokens, tracked = op
            request_id = f"r{serial}"
            serial += 1
            counted = tokens if tracked else 0
            entry = overlay.add(rank, prompt, counted)
            booked[request_id] = Booked(rank, list(prompt), counted)
            sent.append(
                AddRequest(
                    request_id=request_id,
                    worker_id=rank[0],
                    dp_rank=rank[1],
                    block_hashes=list(prompt),
                    prefill_tokens=tokens,
                    track_prefill_tokens=tracked,
                )
            )
            overlay.settle(entry, len(sent))
        else:
            if not booked:
                continue
            request_id = sorted(booked)[op[1] % len(booked)]
            b = booked[request_id]
            if op[0] == "mark":
                entry = overlay.mark(b.rank, b.prefill)
                b.prefill = 0
                sent.append(
                    MarkPrefillCompleted(
                        request_id=request_id, worker_id=b.rank[0], dp_rank=b.rank[1]
                    )
                )
            else:
                entry = overlay.free(b.rank, b.hashes, b.prefill)
                del booked[request_id]
                sent.append(Free(request_id=request_id, worker_id=b.rank[0], dp_rank=b.rank[1]))
            overlay.settle(entry, len(sent))
        check()
    while shown < len(sent):
        view.apply(sent[shown], 0)
        shown += 1
    overlay.prune(shown)
    assert len(overlay) == 0
    assert all(overlay.get(rank) is None for rank in RANKS)
    check()


def test_an_event_not_stored_is_taken_back_and_an_unacknowledged_one_stays() -> None:
    view = SequenceState(expiry_s=None)
    overlay = Overlay(view.registry)
    stored = overlay.add((1, 0), [1, 2, 3], 100)
    lost = overlay.add((1, 0), [1, 2, 4], 50)
    delta = overlay.get((1, 0))
    assert delta is not None and (delta.blocks, delta.requests, delta.prefill) == (4, 2, 150)
    overlay.cancel(lost)  # its publish failed: never stored
    assert (delta.blocks, delta.requests, delta.prefill) == (3, 1, 100)
    overlay.prune(10**9)  # not acknowledged yet: no sequence, so it stays whatever the view
    assert len(overlay) == 1 and overlay.depth((1, 0), [1, 2, 3], 0) == 3
    overlay.settle(stored, 7)
    overlay.prune(6)
    assert len(overlay) == 1
    overlay.prune(7)
    assert len(overlay) == 0 and overlay.get((1, 0)) is None
