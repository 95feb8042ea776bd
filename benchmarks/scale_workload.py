"""``scale.py``'s fleet: the ranks, their live requests, and the events that fill and churn them.

Every block hash is a distinct pseudo-random u64 (a bijective mix of a counter), so no two
requests share a hash and a rank's set is exactly ``requests x blocks``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final

from seqstate import AddRequest, Event, Free, MarkPrefillCompleted

WORKERS: Final = 8
TOKENS_PER_BLOCK: Final = 16
MASK64: Final = (1 << 64) - 1
GOLDEN: Final = 0x9E3779B97F4A7C15  # odd: n -> n * GOLDEN mod 2**64 is a bijection
QUERIES: Final = 24


def unique_hashes(first: int, count: int) -> list[int]:
    """``count`` distinct pseudo-random u64s: counter values ``first..`` through a bijection
    (multiply by an odd constant, then xor-shift), so no two calls ever overlap."""
    out = []
    for n in range(first, first + count):
        x = (n * GOLDEN) & MASK64
        out.append(x ^ (x >> 29))
    return out


@dataclass(frozen=True)
class Point:
    set_per_rank: int  # active prompt hashes per rank
    blocks: int  # blocks (hashes) per request

    @property
    def requests_per_rank(self) -> int:
        return max(1, self.set_per_rank // self.blocks)

    @property
    def label(self) -> str:
        return f"{self.set_per_rank:,}/rank x {self.blocks} blocks"


class Workload:
    """Live requests per rank (oldest first) and the events that fill and churn them."""

    def __init__(self, point: Point) -> None:
        self.point = point
        self.ranks = [(w, 0) for w in range(WORKERS)]
        self.live: list[deque[tuple[str, list[int]]]] = [deque() for _ in self.ranks]
        self._next_hash = 1
        self._next_request = 0
        self._next_rank = 0

    def _add(self, index: int) -> list[Event]:
        worker, rank = self.ranks[index]
        blocks = self.point.blocks
        hashes = unique_hashes(self._next_hash, blocks)
        self._next_hash += blocks
        request_id = f"r{self._next_request}"
        self._next_request += 1
        self.live[index].append((request_id, hashes))
        tokens = blocks * TOKENS_PER_BLOCK
        return [
            AddRequest(
                request_id=request_id,
                worker_id=worker,
                dp_rank=rank,
                block_hashes=hashes,
                prefill_tokens=tokens,
                expected_prefill_ms=round(20 + 0.05 * tokens, 2),
                expected_output_tokens=256,
            ),
            MarkPrefillCompleted(request_id=request_id, worker_id=worker, dp_rank=rank),
        ]

    def fill(self) -> list[Event]:
        events: list[Event] = []
        for _ in range(self.point.requests_per_rank):
            for index in range(len(self.ranks)):
                events.extend(self._add(index))
        return events

    def step(self) -> list[Event]:
        """Free the oldest live request of the next rank; add one of the same size there."""
        index = self._next_rank
        self._next_rank = (index + 1) % len(self.ranks)
        worker, rank = self.ranks[index]
        old, _ = self.live[index].popleft()
        return [Free(request_id=old, worker_id=worker, dp_rank=rank), *self._add(index)]

    def steps(self, events: int) -> list[list[Event]]:
        return [self.step() for _ in range(max(1, round(events / 3)))]

    def queries(self) -> list[tuple[list[int], int]]:
        """Queries with known answers of every kind: a live request's whole prompt, its first
        half, its first half then unknown hashes, and hashes no rank holds."""
        out: list[tuple[list[int], int]] = []
        fresh = 1 << 62  # counter values far beyond any the workload uses
        for k in range(QUERIES):
            queue = self.live[k % len(self.live)]
            _, hashes = queue[(k * 7) % len(queue)]
            half = hashes[: max(1, len(hashes) // 2)]
            kind = k % 4
            if kind == 0:
                query = hashes
            elif kind == 1:
                query = half
            elif kind == 2:
                query = half + unique_hashes(fresh + k * 4096, len(hashes) - len(half))
            else:
                query = unique_hashes(fresh + k * 4096, len(hashes))
            out.append((query, len(query) * TOKENS_PER_BLOCK))
        return out
