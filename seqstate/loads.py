"""Time-free load snapshots and the decay math that reads them, on either side of the wire.

A rank's load is stored without time: the prefill part keeps its anchor instant, and every
read evaluates decay at the reader's ``now``. The writer's registry, the projector and a
scheduler's KV replica all import these types, so one implementation of the arithmetic
serves them all.

All arithmetic is integer (nanoseconds, tokens) so results are exact and identical on every
machine; Dynamo's f64 evaluation can differ from the exact rational value by one token in the
anchor-only path, where we take the exact ceiling.
"""

from __future__ import annotations

from msgspec import Struct

from seqstate.decay import active_tokens, modeled_remaining_ms


class PrefillSnapshot(Struct, array_like=True, frozen=True, gc=False):
    """Time-free view of a rank's prefill state; decay is evaluated at read time.

    ``anchored_since_ns`` is None when nothing is prefilling. ``modeled_ms`` is the sum of the
    whole-millisecond durations of all active prefills, or None as soon as one lacks a
    duration (Dynamo's MissingExpectedDuration).
    """

    full_tokens: int = 0
    anchor_tokens: int = 0
    anchor_duration_ns: int | None = None
    anchored_since_ns: int | None = None
    modeled_ms: int | None = 0

    def active_tokens(self, now_ns: int) -> int:
        """Prefill tokens still pending at ``now_ns`` (decayed)."""
        return active_tokens(self, now_ns)

    def modeled_remaining_ms(self, now_ns: int) -> int | None:
        """Modeled milliseconds of prefill left at ``now_ns``; None if any prefill is unmodeled."""
        return modeled_remaining_ms(self, now_ns)


EMPTY_PREFILL = PrefillSnapshot()


class RankLoad(Struct, array_like=True, frozen=True, gc=False):
    """What the read model needs of a rank after a mutation; time-free."""

    active_blocks: int = 0
    active_requests: int = 0
    prefill: PrefillSnapshot = PrefillSnapshot()


EMPTY_LOAD = RankLoad()


class LoadRow(Struct, frozen=True, gc=False):
    """One rank's load at a read's ``now``: blocks held, prefill tokens still pending (decayed),
    live requests, and the modeled prefill milliseconds left (None: a prefill is unmodeled)."""

    worker_id: int
    dp_rank: int
    active_blocks: int
    active_prefill_tokens: int
    active_requests: int
    modeled_remaining_prefill_ms: int | None


class PotentialLoadRow(Struct, frozen=True, gc=False):
    """One rank's load if a request were booked there: prefill tokens with its prompt, decode
    blocks with the blocks it does not share with the rank, and the live requests now."""

    worker_id: int
    dp_rank: int
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_requests: int


class OverlapRow(Struct, frozen=True, gc=False):
    worker_id: int
    dp_rank: int
    overlap_blocks: int  # the query's longest prefix active on the rank, in blocks
