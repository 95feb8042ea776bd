"""A subscription's messages handed over as nats-py reads them (projector.nats.direct_delivery),
against a real server: in order, none lost past nats-py's pending limits, a handler's error
contained, and the consumers built on it unchanged."""

from __future__ import annotations

import asyncio
import logging

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from projector.nats import direct_delivery


async def _round_trip(nc: Client) -> None:
    """Every message published before this has been read back by ``nc``'s reader."""
    await nc.flush()
    probe = nc.new_inbox()
    got: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def done(msg: Msg) -> None:
        got.set_result(None)

    sub = await nc.subscribe(probe, cb=done)
    await nc.publish(probe, b"")
    await asyncio.wait_for(got, 10)
    await sub.unsubscribe()


async def test_messages_are_handed_over_in_order_beyond_nats_pys_pending_limits(
    nc: Client,
) -> None:
    subject = nc.new_inbox()
    seen: list[bytes] = []
    via_callback: list[bytes] = []

    async def callback(msg: Msg) -> None:
        via_callback.append(msg.data)

    # Limits a queued subscription would overflow at once (nats-py drops beyond them).
    sub = await nc.subscribe(subject, cb=callback, pending_msgs_limit=4, pending_bytes_limit=4096)
    assert direct_delivery.attach(sub, lambda msg: seen.append(msg.data))
    sent = [b"%05d" % n + b"x" * 500 for n in range(2000)]
    for data in sent:
        await nc.publish(subject, data)
    await _round_trip(nc)
    assert seen == sent
    assert via_callback == []
    assert sub.pending_msgs == 0 and sub.pending_bytes == 0
    await sub.unsubscribe()


async def test_messages_queued_before_attaching_come_first(nc: Client) -> None:
    subject = nc.new_inbox()
    seen: list[bytes] = []
    sub = await nc.subscribe(subject)  # no callback: nats-py queues what it reads
    for n in range(5):
        await nc.publish(subject, b"%d" % n)
    await _round_trip(nc)
    assert sub.pending_msgs == 5
    assert direct_delivery.attach(sub, lambda msg: seen.append(msg.data))
    assert seen == [b"0", b"1", b"2", b"3", b"4"] and sub.pending_bytes == 0
    await nc.publish(subject, b"5")
    await _round_trip(nc)
    assert seen[-1] == b"5"
    await sub.unsubscribe()


async def test_a_handler_that_raises_loses_only_its_message(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    subject = nc.new_inbox()
    seen: list[bytes] = []

    def handler(msg: Msg) -> None:
        if msg.data == b"bad":
            raise ValueError("a bug in the handler")
        seen.append(msg.data)

    sub = await nc.subscribe(subject)
    assert direct_delivery.attach(sub, handler)
    with caplog.at_level(logging.ERROR, logger="seqstate.nats"):
        for data in (b"a", b"bad", b"b"):
            await nc.publish(subject, data)
        await _round_trip(nc)
    assert seen == [b"a", b"b"]
    assert nc.is_connected
    assert "could not be handed over" in caplog.text
    await sub.unsubscribe()


def test_a_subscription_without_nats_pys_queue_is_left_as_it_is() -> None:
    class Other:
        _pending_queue = None
        _pending_size = 0

    other = Other()
    assert not direct_delivery.attach(other, lambda msg: None)  # type: ignore[arg-type]
    assert other._pending_queue is None
