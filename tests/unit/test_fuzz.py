"""Byte-level fuzz of every reader of what a role may publish, in the core and with no server.

Routers' and the operator's subjects go through the one fold (the writer's and every
replay's): it must give a verdict for any bytes, never raise, never take a sum past what a
delta carries, and what it applies must encode and restore to the same bytes. The writer's
deltas go through the projector's decoder and its chain and slot rules: any bytes give deltas
or a decode error, never anything else, and whatever they let through folds into the bucket
image without raising. The bucket's values go through a view's decoders: any bytes decode
or raise the errors the view catches. ``tests/fault/test_fault_fuzz.py`` sends the same
corpus to real processes.
"""

from __future__ import annotations

import contextlib
import random

import msgspec
import pytest
from fuzz_bytes import messages, mutate, nested
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from projector.bucket.image import BucketImage
from projector.wire.chain import chain_problem
from projector.wire.values import decode_load, decode_position, decode_request, decode_tracker
from seqstate import (
    Delta,
    Fold,
    FoldRules,
    Refusal,
    SequenceState,
    decode_deltas,
    encode_deltas,
)
from seqstate.bounds import MAX_SUM, RankBounds

pytestmark = pytest.mark.core

NS = "fz"
S = 1_000_000_000
FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _sums_fit(state: SequenceState) -> None:
    for slot in state.workers.slots.values():
        assert 0 <= slot.prefill.full_tokens <= MAX_SUM
        assert 0 <= slot.prefill.modeled_ms_sum <= MAX_SUM


@FUZZ
@given(seed=st.integers(0, 2**64 - 1))
def test_the_fold_gives_a_verdict_for_any_bytes_on_any_subject(seed: int) -> None:
    rng = random.Random(seed)
    rules = FoldRules(NS, max_event_bytes=4000, bounds=RankBounds(per_worker=4, total=8))
    fold = Fold(SequenceState(expiry_s=30.0, orphan_after_s=20.0), rules)
    again = Fold(SequenceState(expiry_s=30.0, orphan_after_s=20.0), rules)
    for seq, (subject, data) in enumerate(messages(rng, NS, 60), 1):
        verdict = fold(seq, seq * S, subject, data)
        assert verdict == again(seq, seq * S, subject, data)  # a verdict is a pure function
        if type(verdict) is Refusal:
            assert verdict.kind and verdict.reason
        else:
            assert isinstance(verdict, Delta) and verdict.seq == seq
            assert decode_deltas(encode_deltas([verdict])) == [verdict]
        _sums_fit(fold.state)
    snapshot = fold.state.snapshot()
    assert SequenceState.restore(snapshot).snapshot() == snapshot == again.state.snapshot()


def _writer_deltas(rng: random.Random) -> list[bytes]:
    """What a writer stores for a fuzzed log: one message of deltas per applied event."""
    fold = Fold(SequenceState(expiry_s=30.0), FoldRules(NS, max_event_bytes=4000))
    out = []
    for seq, (subject, data) in enumerate(messages(rng, NS, 30, hostile=0.2), 1):
        verdict = fold(seq, seq * S, subject, data)
        if type(verdict) is Delta:
            out.append(encode_deltas([verdict]))
    return out or [encode_deltas([Delta("applied", S, seq=1)])]


@FUZZ
@given(seed=st.integers(0, 2**64 - 1))
def test_the_projector_decodes_or_refuses_any_delta_bytes(seed: int) -> None:
    """Any bytes on the deltas subject decode or raise ``msgspec.DecodeError``; what decodes
    passes the chain and slot rules or is refused with a reason, and what passes folds into
    the image and its writes without raising."""
    rng = random.Random(seed)
    image = BucketImage(NS)
    stored = _writer_deltas(rng)
    for n in range(80):
        data = rng.choice(stored)
        if n % 2:
            data = mutate(rng, data, rng.choice(stored))
        try:
            deltas = decode_deltas(data)
        except msgspec.DecodeError:
            continue
        prev = str(min((d.seq or 0 for d in deltas), default=1) - 1)
        if chain_problem(prev, deltas) or image.refusal(deltas):
            continue
        for delta in deltas:
            image.apply(delta)
        image.take()
    image.position(1)


VALUES = [
    b'{"worker_id":1,"dp_rank":0,"active_blocks":3,"active_requests":1,"prefill_tokens":5,'
    b'"applied_seq":9,"as_of":1}',
    b'{"applied_seq":9,"as_of":1,"delta_seq":3}',
    b'{"block_size":16}',
    msgspec.msgpack.encode([9, "req", [1, 2, 3]]),
]


@FUZZ
@given(seed=st.integers(0, 2**64 - 1))
def test_a_view_reads_any_bucket_value_or_names_it_unreadable(seed: int) -> None:
    """What a view catches (``msgspec.DecodeError``, ``ValueError``) is all a value can raise."""
    rng = random.Random(seed)
    for _ in range(60):
        data = mutate(rng, rng.choice(VALUES), rng.choice(VALUES))
        if rng.random() < 0.1:
            data = nested(rng)
        for decode in (decode_load, decode_request, decode_position, decode_tracker):
            with contextlib.suppress(msgspec.DecodeError, ValueError):
                decode(data)
