"""A sequence position that others can wait on, cheaply enough to advance on every message.

The writer, the projector and the RegistryView each advance a position once per message;
an ``asyncio.Condition`` would take a lock and wake every waiter each time. Here advancing is
an integer compare unless someone is waiting, and each waiter is woken once, when its own
sequence is reached.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class Progress:
    def __init__(self, value: int = 0) -> None:
        self.value = value
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._ids = itertools.count()

    def advance(self, value: int) -> None:
        if value > self.value:
            self.value = value
        waiters = self._waiters
        while waiters and waiters[0][0] <= self.value:
            _, _, future = heapq.heappop(waiters)
            if not future.done():
                future.set_result(None)

    async def wait(self, seq: int, timeout: float | None = None) -> None:
        """Until the position reaches ``seq``; ``TimeoutError`` after ``timeout`` seconds."""
        if self.value >= seq:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (seq, next(self._ids), future))
        await asyncio.wait_for(future, timeout)

    def release(self, seq: int) -> None:
        """Wake the waiters of exactly ``seq`` now: their sequence was settled another way (an
        event the writer refused, which no later position would name)."""
        if not any(target == seq for target, _, _ in self._waiters):
            return
        kept = []
        for item in self._waiters:
            if item[0] == seq:
                if not item[2].done():
                    item[2].set_result(None)
            else:
                kept.append(item)
        heapq.heapify(kept)
        self._waiters = kept
