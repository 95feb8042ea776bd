"""The projector's reading of DELTAS messages, hashes left encoded, against the core's reader:
the same messages taken, the same refused with the same reason, the same bucket bytes."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from projector.bucket.image import BucketImage
from projector.bucket.raw_deltas import read_deltas
from projector.wire.values import KEY_HASHES
from seqstate import Delta, RankChange, decode_deltas, encode_deltas
from seqstate.deltas import Booking
from seqstate.loads import EMPTY_LOAD

U64 = 2**64


def booking_delta(hashes: list[int], seq: int = 5) -> Delta:
    booking = Booking(seq % 7, f"r{seq}", hashes)
    return Delta("applied", seq, changes=[RankChange((1, 0), EMPTY_LOAD, [], [booking])], seq=seq)


def read_both(data: bytes) -> tuple[str, str]:
    """What each reader makes of ``data``: the bucket's writes, or why it refused."""
    out = []
    for raw in (False, True):
        try:
            deltas, in_range = read_deltas(data) if raw else (decode_deltas(data), False)
        except msgspec.DecodeError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
            continue
        image = BucketImage("ns")
        why = image.refusal(deltas)
        assert not (in_range and why), "read as in range, and refused for a number"
        if not why:
            for delta in deltas:
                image.apply(delta)
        out.append(why or repr(image.take()))
    return out[0], out[1]


RNG = random.Random(7)


@pytest.mark.parametrize(
    "hashes",
    [
        [],
        [0],
        [1, 2, 3],  # small ones: not the writer's 9-byte form
        [U64 - 1],
        [RNG.getrandbits(64) | 2**63 for _ in range(15)],  # a fixarray
        [RNG.getrandbits(64) | 2**63 for _ in range(136)],  # an array 16
        [RNG.getrandbits(64) | 2**63 for _ in range(70_000)],  # an array 32, many parts
        [RNG.getrandbits(64) | 2**63 for _ in range(KEY_HASHES + 1)],  # one part key
        [2**40, 5, U64 - 1],  # mixed encodings
        [-1, 3],  # not u64: refused, as before
        [-(2**63)],
    ],
)
def test_a_booking_reads_as_the_core_reads_it(hashes: list[int]) -> None:
    core, raw = read_both(encode_deltas([booking_delta(hashes)]))
    assert raw == core
    assert ("not a u64" in core) == any(h < 0 for h in hashes)


def _message(
    hashes: object,
    outcome: str = "applied",
    rank: object = (1, 0),
    released: object = (),
    slot: object = 0,
    **more: object,
) -> bytes:
    load = [0, 0, [0, 0, None, None, 0]]
    change = [rank, load, released, [[slot, "a", hashes]]]
    return msgspec.msgpack.encode([{"outcome": outcome, "at_ns": 1, "changes": [change], **more}])


@pytest.mark.parametrize(
    "data",
    [
        _message([7], rank=(-1, 0)),
        _message([7], rank=(1, 2**32)),
        _message([7], rank=(U64 - 1, 2**32 - 1)),  # the largest in range
        _message([7], released=[3, -2]),
        _message([7], slot=-1),
        _message([2**63], slot=-1),
        _message([-7], slot=5),
        _message([7], added_ranks=[[-5, 0]]),
        _message([7], removed_ranks=[[1, 2**32]]),
        _message([7], removed_ranks=[[1, 0]], added_ranks=[[2, -1]], slot=-4),
        _message([7], rank=(-1, 0), outcome="bogus"),  # a defect too: undecodable
    ],
)
def test_a_number_out_of_range_is_refused_as_the_core_readers_deltas_are(data: bytes) -> None:
    core, raw = read_both(data)
    assert raw == core


@pytest.mark.parametrize(
    "data",
    [
        _message([1, 2, "x"]),
        _message("nope"),
        _message([1.5]),
        _message([[[[]]]]),
        _message([7], outcome="bogus"),
        _message(["x"], outcome="bogus"),  # two defects: the core's is the one named
        b"\xc1",
        b"",
        _message([1, 2])[:-1],
    ],
)
def test_a_defect_is_refused_with_the_core_readers_reason(data: bytes) -> None:
    core, raw = read_both(data)
    assert core.startswith(("DecodeError", "ValidationError"))
    assert raw == core


def test_hashes_nested_too_deeply_are_the_core_readers_error() -> None:
    empty = _message([])
    at = empty.rindex(b"\x90")
    data = empty[:at] + b"\x91" * 100_000 + b"\x90" + empty[at + 1 :]
    core, raw = read_both(data)
    assert raw == core


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-(2**63), max_value=U64 - 1), max_size=40))
def test_any_hashes_read_alike(hashes: list[int]) -> None:
    core, raw = read_both(encode_deltas([booking_delta(hashes), booking_delta(hashes[::-1], 6)]))
    assert raw == core
