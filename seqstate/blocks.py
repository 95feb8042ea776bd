"""Prompt-block reference counts of one worker rank, with fractional weights.

A prompt block is *present* while at least one live request on the rank references it;
shared prefixes count once. Block hashes are chained sequence hashes (each one commits to
its whole prefix), so a per-hash count is exact and much cheaper in Python than a prefix
trie: it is Dynamo's hash-refcount generation, which gives the same numbers as its trie
generation whenever hashes are chained.

Output (decode) blocks are exclusive to their request and never part of prompt membership,
so they are held per request as a list of weights, not as hashes.

``active_blocks`` is ``round(Σ weights)`` rounded half away from zero, as Rust's ``f64::round``.
"""

from __future__ import annotations

import math


def round_half_away(value: float) -> int:
    """Rust's ``f64::round`` for the non-negative sums we produce (Python rounds half to even)."""
    return math.floor(value + 0.5) if value >= 0 else -math.floor(-value + 0.5)


def _without(hashes: list[int], shared: set[int]) -> list[int]:
    """``hashes`` minus ``shared``, in order. With chained hashes the shared blocks are a
    prefix of the prompt, so this is usually one slice."""
    k = len(shared)
    if shared.issuperset(hashes[:k]):
        return hashes[k:]
    return [h for h in hashes if h not in shared]


class BlockTracker:
    """Present prompt hashes with reference counts, and re-weighted (fractional) hashes.

    ``present`` holds every hash some live request references; ``extra`` holds, for hashes
    referenced more than once, the references beyond the first. Most blocks have a single
    owner, so a prompt is acquired and released with C-level set operations and only its
    shared blocks cost a Python step each.

    Weighted totals are running floats (``deficit`` is Σ(1 - f) over fractional present
    blocks, ``output_weight`` is Σ output weights); both are carried in snapshots verbatim so a
    restored tracker rounds exactly like the original.
    """

    __slots__ = (
        "active_blocks",
        "deficit",
        "extra",
        "fractions",
        "output_weight",
        "outputs",
        "present",
    )

    def __init__(self) -> None:
        self.present: set[int] = set()
        self.extra: dict[int, int] = {}
        self.fractions: dict[int, float] = {}
        self.deficit = 0.0
        self.output_weight = 0.0
        self.outputs = 0  # number of live output blocks
        # round(Σ weights), kept current by every mutation: read once per event.
        self.active_blocks = 0

    @property
    def refs(self) -> dict[int, int]:
        """Reference count of every present hash (inspection; not used on the hot path)."""
        extra = self.extra
        return {h: 1 + extra.get(h, 0) for h in self.present}

    def recount(self) -> None:
        """Recompute ``active_blocks`` after a change of weights or outputs."""
        if not self.fractions and self.output_weight == self.outputs:
            self.active_blocks = len(self.present) + self.outputs
        else:
            self.active_blocks = round_half_away(
                len(self.present) + self.output_weight - self.deficit
            )

    def acquire(self, hashes: list[int]) -> tuple[list[int], list[int]]:
        """Reference a prompt. Returns ``(held, stored)``: the hashes the request now holds
        (the prompt, without repeats) and those that became present, in prompt order."""
        present = self.present
        shared = present.intersection(hashes)
        size = len(present)
        present.update(hashes)
        grown = len(present) - size
        if grown != len(hashes) - len(shared):
            # A hash repeated within one prompt (never with chained hashes) names one block.
            hashes = list(dict.fromkeys(hashes))
        if grown:
            if self.fractions or self.output_weight != self.outputs:
                self.recount()
            else:
                self.active_blocks += grown
        if not shared:
            return hashes, hashes
        extra = self.extra
        for h in shared:
            extra[h] = extra.get(h, 0) + 1
        return hashes, _without(hashes, shared)

    def release(self, hashes: list[int], output_weights: list[float] | None) -> list[int]:
        """Drop a request's references (``hashes`` as returned held by :meth:`acquire`);
        returns the prompt hashes that became absent."""
        weighted = bool(self.fractions) or self.output_weight != self.outputs
        extra = self.extra
        shared = extra.keys() & hashes if extra else None
        if shared:
            for h in shared:
                count = extra[h]
                if count == 1:
                    del extra[h]
                else:
                    extra[h] = count - 1
            removed = _without(hashes, shared)
        else:
            removed = hashes
        self.present.difference_update(removed)
        if output_weights:
            weighted = True
            self.outputs -= len(output_weights)
            if self.outputs == 0:
                self.output_weight = 0.0
            else:
                for w in output_weights:
                    self.output_weight -= w
        if weighted:
            if removed and self.fractions:
                fractions = self.fractions
                for h in removed:
                    f = fractions.pop(h, None)
                    if f is not None:
                        self.deficit -= 1.0 - f
                if not fractions:
                    self.deficit = 0.0
            self.recount()
        else:
            self.active_blocks -= len(removed)
        return removed

    def add_output(self, output_weights: list[float]) -> None:
        output_weights.append(1.0)
        self.outputs += 1
        self.output_weight += 1.0
        self.recount()

    def set_exclusive_fraction(
        self, hashes: list[int], output_weights: list[float], fraction: float
    ) -> None:
        """Re-weight every block only this request holds (its outputs, its unshared prompt)."""
        for i, w in enumerate(output_weights):
            self.output_weight += fraction - w
            output_weights[i] = fraction
        extra = self.extra
        fractions = self.fractions
        for h in hashes:
            if h not in extra:
                old = fractions.get(h, 1.0)
                fractions[h] = fraction
                self.deficit += old - fraction
        self.recount()

    def check_invariants(self, prompts: list[list[int]], outputs: list[list[float]]) -> None:
        """Compare the counts with a recomputation from the live requests (tests)."""
        expected: dict[int, int] = {}
        for hashes in prompts:
            for h in hashes:
                expected[h] = expected.get(h, 0) + 1
        assert expected == self.refs, "block refcounts disagree with live requests"
        active = self.active_blocks
        self.recount()
        assert active == self.active_blocks, "active_blocks was not kept current"
        assert all(count > 0 for count in self.extra.values())
        assert set(self.fractions) <= self.present
        assert self.outputs == sum(len(w) for w in outputs)
        assert math.isclose(self.output_weight, sum(sum(w) for w in outputs), abs_tol=1e-9)
        assert math.isclose(
            self.deficit, sum(1.0 - f for f in self.fractions.values()), abs_tol=1e-9
        )
