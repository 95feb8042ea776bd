"""Byte-level fuzz of what a role may publish: one generator for every fuzz test.

A fuzzer that only draws well-typed events finds nothing a decoder did not already expect.
This one starts from valid events of every kind, at the edges of their ranges, and breaks
them the ways bytes break: cut short anywhere, bytes flipped, inserted, deleted, repeated,
two events spliced; and the ways an attacker breaks msgpack: an integer header swapped for
u64 max, i64 min or a NaN, an array, map or string header that claims 2^32-1 items, nesting
of any depth (a thousand levels once killed the writer), ext and bin types where a string
belongs, a valid event with a trailing element. Subjects are those a role may publish to:
a router's worker subjects (ids at u64 max included) and its routers subject, the
operator's control subject, and tokens that are not numbers.

Driven by a ``random.Random``: the core's tests seed it from hypothesis (a failing seed is
reported and replayed), the tests on real processes from a fixed seed (the same corpus at
every run).
"""

from __future__ import annotations

import random
import struct

import msgspec

from seqstate import (
    SCHEMA_VERSION,
    AddOutputBlock,
    AddRequest,
    Event,
    Free,
    MarkPrefillCompleted,
    RouterGoodbye,
    RouterHeartbeat,
    Tick,
    WorkerAdded,
    WorkerRemoved,
    encode_event,
)
from seqstate.fold import control_subject, routers_subject, subject_of, worker_subject

U64 = 2**64 - 1
_raw = msgspec.msgpack.encode

# Headers that claim more than any message holds: array32, map32, str32, bin32 of 2^32-1.
BOMBS = [
    b"\xdd\xff\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff",
    b"\xdb\xff\xff\xff\xff",
    b"\xc6\xff\xff\xff\xff",
]
# Integers and floats no field expects: u64 max, i64 min, -1, NaN, infinity, a half float.
NUMBERS = [
    b"\xcf" + b"\xff" * 8,
    b"\xd3\x80" + b"\x00" * 7,
    b"\xff",
    b"\xcb" + struct.pack(">d", float("nan")),
    b"\xcb" + struct.pack(">d", float("inf")),
    b"\xca\x7f\x80\x00\x00",
]
# Values of types no field has: ext (fixext and ext8), bin where a string belongs, nil.
ODD = [b"\xd4\x01\x00", b"\xc7\x03\x05abc", b"\xc4\x03abc", b"\xc0", b"\xc2", b"\xc3"]


def events(rng: random.Random, ns: str) -> list[Event]:
    """Valid events of every kind, several at the edges of their ranges."""
    rid = rng.choice(["a", "b", "c", "x" * rng.randint(1, 300), "é路.*>\x00"])
    worker = rng.choice([0, 1, 2, 3, U64, 2**63])
    dp = rng.choice([0, 1, 2**32 - 1])
    hashes = [rng.randrange(2**64) for _ in range(rng.choice([0, 1, 4, 64]))]
    return [
        AddRequest(
            rid,
            worker,
            dp_rank=dp,
            block_hashes=hashes,
            prefill_tokens=rng.choice([0, 7, 2**63, U64]),
            expected_prefill_ms=rng.choice([None, 0.0, 12.5, 1e12]),
            track_prefill_tokens=rng.random() < 0.8,
            expected_output_tokens=rng.choice([None, 0, 100, 2**32]),
            router_id=rng.choice(["", "ra", "rb"]),
        ),
        MarkPrefillCompleted(rid, worker, dp_rank=dp),
        Free(rid, worker, dp_rank=dp),
        AddOutputBlock(rid, worker, dp_rank=dp),
        WorkerAdded(rng.choice([1, 2, 9, U64]), dp_size=rng.choice([1, 2, 4096])),
        WorkerRemoved(rng.choice([1, 2, U64])),
        Tick(),
        RouterHeartbeat(rng.choice(["ra", "rb", "r" * 256])),
        RouterGoodbye(rng.choice(["ra", "rb"])),
    ]


def _header_at(rng: random.Random, data: bytes, first: int, last: int) -> int | None:
    spots = [i for i, b in enumerate(data) if first <= b <= last and i > 0]
    return rng.choice(spots) if spots else None


def _swap(data: bytes, at: int, new: bytes) -> bytes:
    return data[:at] + new + data[at + 1 :]


def nested(rng: random.Random) -> bytes:
    """Arrays or maps nested 1 to 200,000 deep, log-uniform (a thousand killed the writer)."""
    depth = int(10 ** rng.uniform(0, 5.3))
    unit = rng.choice([b"\x91", b"\x81\xa1k", b"\x92\x01"])
    return unit * depth + b"\xc0"


def mutate(rng: random.Random, data: bytes, other: bytes) -> bytes:
    """``data`` broken one way, chosen at random (``other``: another event, for splices)."""
    n = len(data)
    kind = rng.randrange(13)
    at = rng.randrange(n + 1)
    if kind == 0:  # cut short
        return data[: rng.randrange(n)] if n else data
    if kind == 1:  # bytes flipped
        out = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            if out:
                out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        return bytes(out)
    if kind == 2:  # random bytes inserted
        return data[:at] + rng.randbytes(rng.randint(1, 16)) + data[at:]
    if kind == 3:  # a range deleted
        return data[:at] + data[at + rng.randint(1, 16) :]
    if kind == 4:  # a range repeated
        end = min(n, at + rng.randint(1, 32))
        return data[:end] + data[at:end] * rng.randint(1, 50) + data[end:]
    if kind == 5:  # two events spliced
        return data[:at] + other[rng.randrange(len(other) + 1) :]
    if kind == 6:  # an integer header swapped for a number no field expects
        i = _header_at(rng, data, 0x00, 0x7F)
        return data if i is None else _swap(data, i, rng.choice(NUMBERS))
    if kind == 7:  # an array, map or string header that claims 2^32-1 items
        i = _header_at(rng, data, 0x80, 0xBF)
        return data if i is None else _swap(data, i, rng.choice(BOMBS))
    if kind == 8:  # a deep value where a field's value was
        i = _header_at(rng, data, 0x00, 0x7F)
        return data if i is None else _swap(data, i, nested(rng))
    if kind == 9:  # a type no field has
        i = _header_at(rng, data, 0x00, 0xBF)
        return data if i is None else _swap(data, i, rng.choice(ODD))
    if kind == 10:  # a trailing element after a valid event
        return b"\x93" + data[1:] + rng.choice([nested(rng), b"\x01", *BOMBS])
    if kind == 11:  # the envelope: another version, or not an envelope
        return rng.choice([_raw([rng.choice([0, 2, U64]), {}]), data[1:], b"\x91" + data[1:]])
    return rng.randbytes(rng.randint(0, 64))  # random bytes


def payload(rng: random.Random, ns: str) -> bytes:
    """One hostile payload."""
    pool = [encode_event(e) for e in events(rng, ns)]
    if rng.random() < 0.1:
        return b"\x92" + bytes([SCHEMA_VERSION]) + nested(rng)  # nested arrays, any depth
    data = rng.choice(pool)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        data = mutate(rng, data, rng.choice(pool))
    return data


def subject(rng: random.Random, ns: str, event: Event | None = None) -> str:
    """A subject a router or the operator may publish to: mostly the event's own."""
    if event is not None and rng.random() < 0.7:
        return subject_of(ns, event)
    return rng.choice(
        [
            worker_subject(ns, rng.choice([0, 1, 2, U64]), rng.choice([0, 1])),
            routers_subject(ns),
            control_subject(ns),
            f"seqstate.events.{ns}.x.0",
            f"seqstate.events.{ns}.{U64 + 1}.0",
            f"seqstate.events.{ns}.-1.0",
            f"seqstate.events.{ns}.1.0.9",
        ]
    )


def huge(rng: random.Random) -> AddRequest:
    """An AddRequest of 100,000 to 116,000 hashes: about the largest event the writer takes,
    or just past it (116,000 hashes, 1,044,081 bytes, once split the writer from replay)."""
    count = rng.randint(100_000, 116_000)
    return AddRequest(f"huge-{count}", rng.choice([1, 2]), block_hashes=list(range(count)))


def messages(
    rng: random.Random, ns: str, n: int, hostile: float = 0.5, big: float = 0.0
) -> list[tuple[str, bytes]]:
    """``n`` messages: a share ``hostile`` broken, a share ``big`` huge AddRequests, the rest
    valid events on subjects a role may publish them to (their own, mostly)."""
    out = []
    for _ in range(n):
        if rng.random() < big:
            event = huge(rng)
            out.append((subject_of(ns, event), encode_event(event)))
        elif rng.random() < hostile:
            out.append((subject(rng, ns), payload(rng, ns)))
        else:
            event = rng.choice(events(rng, ns))
            out.append((subject(rng, ns, event), encode_event(event)))
    return out
