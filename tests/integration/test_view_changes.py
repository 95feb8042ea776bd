"""A RegistryView tells its scheduler when it moves: ``on_change`` callbacks and the
``changes()`` iterator, on a real pipeline. Both follow the view's position (``applied_seq``),
which the projector writes after each flush's other keys.

The idle Ticks of the writer are events too, so the position may pass the last event a test
published; the assertions compare with the view's own position where that matters.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from eventually import eventually
from nats.aio.client import Client
from pipeline_kit import fresh_config

from projector.bucket.reader import RegistryView
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline


async def test_callbacks_see_each_move_a_failing_one_is_logged_and_a_handle_unsubscribes(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    config = fresh_config("vc")
    async with Pipeline(nc, config), RegistryView(nc, config=config) as view:
        pub = RouterPublisher(nc, router_id="vc", config=config)
        seen: list[tuple[int, int]] = []  # (position, active requests) at each call
        later: list[int] = []

        def record(v: RegistryView) -> None:
            seen.append((v.applied_seq, sum(r.active_requests for r in v.loads())))

        def broken(v: RegistryView) -> None:
            raise RuntimeError("a scheduler's bug")

        handle = view.on_change(record)
        view.on_change(broken)
        view.on_change(lambda v: later.append(v.applied_seq))
        first = await pub.add("a", 1, block_hashes=[1, 2])
        await view.wait_for(first, timeout=30)
        # Called before wait_for returns: the position it waited for was announced.
        assert seen and seen[-1][0] == view.applied_seq >= first
        assert seen[-1][1] == 1
        second = await pub.add("b", 1, block_hashes=[3])
        await view.wait_for(second, timeout=30)
        positions = [p for p, _ in seen]
        assert positions == sorted(set(positions)) and positions[-1] == view.applied_seq
        assert seen[-1][1] == 2
        assert "a change listener of the registry view failed" in caplog.text
        assert "RuntimeError: a scheduler's bug" in caplog.text
        handle()  # unsubscribed: no more calls
        view.remove_listener(broken)
        calls = len(seen)
        caplog.clear()
        third = await pub.free("a", 1)
        await view.wait_for(third, timeout=30)
        assert len(seen) == calls
        assert later[-1] == view.applied_seq >= third  # the other listener still called
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert view.loads()[0].active_requests == 1


async def test_changes_yields_each_move_and_a_slow_consumer_gets_only_the_latest(
    nc: Client,
) -> None:
    config = fresh_config("vi")
    async with Pipeline(nc, config), RegistryView(nc, config=config) as view:
        pub = RouterPublisher(nc, router_id="vi", config=config)
        got: list[int] = []

        async def follow() -> None:
            async for seq in view.changes():
                got.append(seq)

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0)  # the iterator subscribes before the first event
        last = 0
        for i in range(3):
            last = await pub.add(f"r{i}", 1, block_hashes=[i])
        await view.wait_for(last, timeout=30)
        await eventually(lambda: got, lambda g: g and g[-1] >= last, what="iterator at last")
        assert got == sorted(set(got))  # increasing, never the same position twice

        # A consumer that does not pull while the view moves: one value when it asks again,
        # the latest, however many moves it missed.
        slow = view.changes()
        pending = asyncio.ensure_future(anext(slow))
        await asyncio.sleep(0)  # subscribed, waiting for the next move
        await pub.add("n", 2, block_hashes=[9])
        assert await asyncio.wait_for(pending, timeout=30) <= view.applied_seq
        for i in range(20):
            last = await pub.add(f"s{i}", 2, block_hashes=[100 + i])
        await view.wait_for(last, timeout=30)
        latest = await anext(slow)  # a set flag, no wait: the position right now
        assert latest == view.applied_seq >= last
        nxt = asyncio.ensure_future(anext(slow))
        await asyncio.sleep(0)
        assert not nxt.done()  # nothing queued behind the latest
        moved = await pub.free("s0", 2)
        assert await asyncio.wait_for(nxt, timeout=30) >= moved
        await slow.aclose()
        assert len(view._moved) == 1  # the closed iterator let go of its flag

    # Stopping the view ends its iterators.
    await asyncio.wait_for(follower, timeout=30)
    assert got[-1] == view.applied_seq
