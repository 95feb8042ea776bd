"""A non-holder's read position is looked up once for the reads that wait together: each
read waits for a lookup begun after it began, and a lookup's failure is each waiter's."""

from __future__ import annotations

import asyncio

import pytest

from projector.http.shared_lookup import SharedLookup


async def _steps(n: int = 10) -> None:
    """Let the loop run ``n`` turns (tasks begun by the last step take a turn or two)."""
    for _ in range(n):
        await asyncio.sleep(0)


async def test_reads_during_a_lookup_share_the_next_and_a_failure_is_each_waiters() -> None:
    gates: list[asyncio.Future[None]] = []

    async def look() -> None:
        gate = asyncio.get_running_loop().create_future()
        gates.append(gate)
        await gate

    shared = SharedLookup(look)
    first = asyncio.ensure_future(shared.wait())
    await _steps()  # the first lookup is out
    assert len(gates) == 1
    later = [asyncio.ensure_future(shared.wait()) for _ in range(5)]
    await _steps()
    assert len(gates) == 1  # they wait for the next, not this one: it began before them
    gates[0].set_result(None)
    await first
    await _steps()
    assert not any(w.done() for w in later) and len(gates) == 2
    gates[1].set_exception(RuntimeError("no stream"))
    for waiter in later:
        with pytest.raises(RuntimeError, match="no stream"):
            await waiter
    again = asyncio.ensure_future(shared.wait())
    await _steps()
    assert shared.runs == 3
    gates[2].set_result(None)
    await again
    await shared.close()
