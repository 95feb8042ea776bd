"""Dynamo's KV-router cost, and its choice among the costs, over the registry's loads.

Dynamo's default selector scores each rank in blocks: the prefill the rank would still have to
do for this request (its queued prefill plus the whole prompt, less the prompt's blocks already
in its cache, times ``prefill_load_scale``), plus the decode blocks it would then hold, plus an
optional charge per active request. The lowest cost wins (temperature 0), or the costs are
softmax-sampled. Kept here, pure, so that a scheduler reading a
:class:`~seqstate.PromptRegistry` (or a view of one) gets Dynamo's numbers exactly without
writing the formula again.

Left out of Dynamo's selector, on purpose: the optional decay of the overlap credit with the
rank's queued prefill, the host and disk cache tiers' credits (a caller that wants them passes
its own credited ``overlaps``), and the decode-pool special case of conditional disaggregation.

Not compiled: the module defines msgspec Structs, whose class options mypyc does not keep.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

from msgspec import Struct


class CostWeights(Struct, frozen=True):
    """The weights of Dynamo's cost, under Dynamo's names, with its defaults."""

    overlap_score_credit: float = 1.0  # blocks of prefill credited per cached prompt block
    prefill_load_scale: float = 1.0  # multiplies the credited prefill blocks
    decode_active_request_weight: float = 0.0  # blocks charged per active request
    track_prefill_tokens: bool = True  # False: prefill counts for nothing (decode blocks only)

    def __post_init__(self) -> None:
        # A negative or non-finite weight turns the cost upside down or into NaN, and every
        # choice after it is arbitrary: refused where it is made, naming the field.
        for name in ("overlap_score_credit", "prefill_load_scale", "decode_active_request_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name}={value!r}: must be a number")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value!r}: must be finite and non-negative")


DEFAULT_WEIGHTS: Final = CostWeights()


class CostRow(Struct, frozen=True, gc=False):
    """One rank's cost for one request, with the terms it is made of.

    ``cost`` and ``prefill_blocks`` are in blocks (float); ``potential_prefill_tokens`` in
    tokens; the other counts in blocks or requests.
    """

    worker_id: int
    dp_rank: int
    cost: float
    overlap_blocks: int  # the prompt blocks credited as cached on the rank
    active_overlap_blocks: int  # the prompt's longest prefix active on the rank
    prefill_blocks: float  # prefill blocks after the credit, before prefill_load_scale
    potential_prefill_tokens: int  # active prefill tokens now + isl_tokens
    potential_decode_blocks: int  # active_blocks + len(block_hashes) - active_overlap_blocks
    active_requests: int


def dynamo_cost(
    weights: CostWeights,
    block_size: int,
    isl_tokens: int,
    active_prefill_tokens: int,
    overlap_blocks: int,
    potential_decode_blocks: int,
    active_requests: int,
) -> tuple[float, float]:
    """``(cost, adjusted_prefill_blocks)`` of one rank, in blocks.

    ``isl_tokens`` is the whole prompt, cached part included: the credit of ``overlap_blocks``
    is what removes the cached part, as in Dynamo.
    """
    raw_tokens = active_prefill_tokens + isl_tokens if weights.track_prefill_tokens else 0
    adjusted = raw_tokens / block_size - weights.overlap_score_credit * overlap_blocks
    if adjusted < 0.0:
        adjusted = 0.0
    cost = (
        weights.prefill_load_scale * adjusted
        + potential_decode_blocks
        + weights.decode_active_request_weight * active_requests
    )
    return cost, adjusted


def select(costs: Sequence[float], temperature: float, u: float) -> int:
    """The index Dynamo's selector picks among ``costs``, given the uniform draw ``u``.

    The draw is the caller's (``random.random()``, or a seeded generator for a replayable
    choice): the core reads no randomness of its own. Temperature 0: the lowest cost, a tie
    broken by ``u`` (the ``floor(u * ties)``-th of the tied, in order). Above 0: a softmax over
    the costs normalised to [0, 1] by their range, ``p_i ∝ exp(-(c_i - c_min) / (range · T))``
    (uniform if every cost is equal), sampled by ``u`` over the cumulative distribution.
    """
    n = len(costs)
    if n == 0:
        raise ValueError("no costs to choose from")
    if not 0.0 <= u < 1.0:
        raise ValueError(f"u={u!r}: must be in [0, 1)")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature!r}: must be finite and non-negative")
    for c in costs:  # a NaN would slip past min and max
        if not math.isfinite(c):
            raise ValueError(f"cost {c!r}: every cost must be finite")
    low = min(costs)
    high = max(costs)
    if temperature == 0 or low == high:
        tied = [i for i, c in enumerate(costs) if c == low] if temperature == 0 else range(n)
        return tied[min(int(u * len(tied)), len(tied) - 1)]
    span = high - low
    halve = math.isinf(span)  # costs far apart overflow; halving every term is exact
    if halve:
        low, span = low / 2, high / 2 - low / 2
    weights = [math.exp(-((c / 2 if halve else c) - low) / span / temperature) for c in costs]
    target = u * sum(weights)  # the same additions, in the same order, as the walk's
    total = 0.0
    for i, weight in enumerate(weights):
        total += weight
        if target < total:
            return i
    return max(i for i, weight in enumerate(weights) if weight > 0)  # rounding at the very top
