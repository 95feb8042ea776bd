"""The rules of the delta chain, shared by the side that writes it and the sides that read it.

The writer (:mod:`projector.write.delta_log`) builds SEQSTATE_DELTAS as a chain: each message
names the event the previous one ended at (``Seqstate-Prev-Source-Seq``), holds deltas of later
events in order, and says where it ends (``Seqstate-Source-Seq``, ``Seqstate-Source-Part``).
The projector checks each message by these rules, and the lag measure reads where the chain
ends; written once here, a reader cannot drift from the writer, nor need the writer's code.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import msgspec

from projector.wire.headers import PREV_SOURCE_SEQ, SOURCE_PART, SOURCE_SEQ
from seqstate import Delta, decode_deltas


def chain_problem(prev: str | None, deltas: Sequence[Delta]) -> str:
    """Why a DELTAS message cannot be a writer's ("" if it can), by the chain's own rules.

    A writer's message names (``Seqstate-Prev-Source-Seq``) the event the previous message
    ended at, and holds deltas of later events, each with its sequence, in order. Whether the
    events exist is for the caller to check against the log.
    """
    if prev is None or not prev.isdigit():
        return f"not a writer's delta: no valid {PREV_SOURCE_SEQ} header"
    if any(d.seq is None for d in deltas):
        return "not a writer's delta: a delta without its event sequence"
    for a, b in pairwise(deltas):
        if not (b.seq > a.seq if not a.more else b.seq == a.seq and b.part == a.part + 1):  # type: ignore[operator]
            return "not a writer's delta: its event sequences are out of order"
    if deltas and (deltas[0].seq or 0) <= int(prev):
        return f"not a writer's delta: it starts at event {deltas[0].seq}, not after {prev}"
    return ""


def covered_source(headers: dict[str, str] | None, data: bytes | None) -> int | None:
    """The last event whose delta is wholly stored once a writer's DELTAS message is (the one
    before its last when it ends inside that event's parts); None for anything else."""
    source = source_seq(headers, data)
    if source is None:
        return None
    return source - 1 if source_part(headers) is not None else source


def source_part(headers: dict[str, str] | None) -> int | None:
    """The part a writer's message ends at, if it ends inside an event's parts."""
    raw = (headers or {}).get(SOURCE_PART)
    return int(raw) if raw is not None and raw.isdigit() else None


def source_seq(headers: dict[str, str] | None, data: bytes | None) -> int | None:
    """The source sequence a writer's delta message ends at; None for anything else."""
    try:
        if headers and SOURCE_SEQ in headers:
            return int(headers[SOURCE_SEQ])
        deltas = decode_deltas(data or b"")
        return deltas[-1].seq if deltas else None
    except (ValueError, IndexError, msgspec.DecodeError):
        return None
