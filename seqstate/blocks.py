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


class BlockTracker:
    """``refs`` counts references per prompt hash; ``fractions`` holds re-weighted hashes.

    Weighted totals are running floats (``deficit`` is Σ(1 - f) over fractional present
    blocks, ``output_weight`` is Σ output weights); both are carried in snapshots verbatim so a
    restored tracker rounds exactly like the original.
    """

    __slots__ = ("deficit", "fractions", "output_weight", "outputs", "refs")

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}
        self.fractions: dict[int, float] = {}
        self.deficit = 0.0
        self.output_weight = 0.0
        self.outputs = 0  # number of live output blocks

    @property
    def active_blocks(self) -> int:
        if not self.fractions and self.output_weight == self.outputs:
            return len(self.refs) + self.outputs
        return round_half_away(len(self.refs) + self.output_weight - self.deficit)

    def acquire(self, hashes: list[int]) -> list[int]:
        """Reference a prompt; returns the hashes that became present, in prompt order."""
        refs = self.refs
        stored: list[int] = []
        get = refs.get
        for h in hashes:
            count = get(h)
            if count is None:
                refs[h] = 1
                stored.append(h)
            else:
                refs[h] = count + 1
        return stored

    def release(self, hashes: list[int], output_weights: list[float] | None) -> list[int]:
        """Drop a request's references; returns the prompt hashes that became absent."""
        refs = self.refs
        removed: list[int] = []
        for h in hashes:
            count = refs[h]
            if count == 1:
                del refs[h]
                removed.append(h)
            else:
                refs[h] = count - 1
        if removed and self.fractions:
            fractions = self.fractions
            for h in removed:
                f = fractions.pop(h, None)
                if f is not None:
                    self.deficit -= 1.0 - f
            if not fractions:
                self.deficit = 0.0
        if output_weights:
            self.outputs -= len(output_weights)
            if self.outputs == 0:
                self.output_weight = 0.0
            else:
                for w in output_weights:
                    self.output_weight -= w
        return removed

    def add_output(self, output_weights: list[float]) -> None:
        output_weights.append(1.0)
        self.outputs += 1
        self.output_weight += 1.0

    def set_exclusive_fraction(
        self, hashes: list[int], output_weights: list[float], fraction: float
    ) -> None:
        """Re-weight every block only this request holds (its outputs, its unshared prompt)."""
        for i, w in enumerate(output_weights):
            self.output_weight += fraction - w
            output_weights[i] = fraction
        refs = self.refs
        fractions = self.fractions
        for h in hashes:
            if refs[h] == 1:
                old = fractions.get(h, 1.0)
                fractions[h] = fraction
                self.deficit += old - fraction

    def check_invariants(self, prompts: list[list[int]], outputs: list[list[float]]) -> None:
        """Compare the counts with a recomputation from the live requests (tests)."""
        expected: dict[int, int] = {}
        for hashes in prompts:
            for h in hashes:
                expected[h] = expected.get(h, 0) + 1
        assert expected == self.refs, "block refcounts disagree with live requests"
        assert set(self.fractions) <= set(self.refs)
        assert self.outputs == sum(len(w) for w in outputs)
        assert math.isclose(self.output_weight, sum(sum(w) for w in outputs), abs_tol=1e-9)
        assert math.isclose(
            self.deficit, sum(1.0 - f for f in self.fractions.values()), abs_tol=1e-9
        )
