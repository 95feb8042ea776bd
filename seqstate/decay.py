"""The prefill decay arithmetic of a time-free :class:`~seqstate.loads.PrefillSnapshot`.

Kept as plain functions in a module of their own so the compiled build compiles them: the
registry evaluates them once per rank on every scheduler read. ``PrefillSnapshot`` exposes them
as methods for everyone else.

All arithmetic is integer (nanoseconds, tokens): results are exact and identical on every
machine. Dynamo's f64 evaluation can differ from the exact rational value by one token in the
anchor-only path, where we take the exact ceiling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from seqstate.loads import PrefillSnapshot

NS_PER_MS: Final = 1_000_000


def active_tokens(snap: PrefillSnapshot, now_ns: int) -> int:
    """Prefill tokens still pending at ``now_ns`` (decayed)."""
    since = snap.anchored_since_ns
    if since is None:
        return 0
    elapsed = now_ns - since
    if elapsed < 0:
        elapsed = 0
    duration = snap.anchor_duration_ns
    tokens = snap.anchor_tokens
    if snap.modeled_ms is None:
        # Some prefill is unmodeled: only the anchor decays, and never past its own tokens.
        if duration is None:
            remaining = tokens
        elif duration == 0 or elapsed >= duration:
            remaining = 0
        else:
            remaining = -((-tokens * (duration - elapsed)) // duration)
        return snap.full_tokens - tokens + remaining
    # Every prefill is modeled: the anchor's rate keeps draining later prefills (spillover).
    if duration is None:  # cannot happen while modeled_ms is known
        return snap.full_tokens
    completed = tokens if duration == 0 else tokens * elapsed // duration
    left = snap.full_tokens - completed
    return left if left > 0 else 0


def modeled_remaining_ms(snap: PrefillSnapshot, now_ns: int) -> int | None:
    """Modeled milliseconds of prefill left at ``now_ns``; None if any prefill is unmodeled."""
    modeled = snap.modeled_ms
    if modeled is None:
        return None
    since = snap.anchored_since_ns
    if since is None:
        return modeled
    if snap.anchor_duration_ns is None:  # cannot happen while modeled_ms is known
        return None
    elapsed_ms = (now_ns - since) // NS_PER_MS if now_ns > since else 0
    left = modeled - elapsed_ms
    return left if left > 0 else 0
