"""A service's NATS client reconnects after any connection the server ends, an ``-ERR`` included.

nats-py closed the client for good at an ``-ERR`` such as "maximum control line exceeded" (one
publish on a 5,000-byte subject): the service then answered on without NATS, for ever.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from eventually import eventually

from projector.nats.connection import connect
from projector.nats.server import NatsServer


async def test_a_service_client_reconnects_after_the_server_ends_its_connection_for_an_error(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="seqstate")
    async with connect(nats_server.url, service=True) as nc:
        sub = await nc.subscribe("reconnect.check")
        await nc.publish("x" * 5000, b"")  # over the server's 4,096-byte control line
        await eventually(
            lambda: nc.stats["reconnects"] == 1 and nc.is_connected,
            what="the client reconnected",
        )
        await nc.publish("reconnect.check", b"after")
        assert (await sub.next_msg(timeout=10)).data == b"after"
        assert not nc.is_closed
    said = [r.getMessage() for r in caplog.records if r.name == "seqstate"]
    assert "nats: maximum control line exceeded" in said
    assert said.index("nats: disconnected, reconnecting") < said.index("nats: reconnected")


async def test_a_flush_called_off_before_its_pong_leaves_the_client_reading(
    nats_server: NatsServer,
) -> None:
    """nats-py set the result of the oldest PING's future at each PONG; a flush cut short
    (cancelled by a stop, or timed out on a busy machine) left its future cancelled, and its
    PONG raised InvalidStateError in the read loop, which stopped reading for good: every
    later request timed out on a client that still said it was connected."""
    async with connect(nats_server.url, service=True) as nc:
        sub = await nc.subscribe("pong.check")
        for _ in range(3):
            flushing = asyncio.ensure_future(nc.flush(5))
            await asyncio.sleep(0)  # its PING is written; its PONG cannot be read yet
            flushing.cancel()
            await asyncio.wait([flushing])
        await nc.flush(5)  # a PONG each for the three called off, then this one's
        await nc.publish("pong.check", b"after")
        assert (await sub.next_msg(timeout=5)).data == b"after"
        assert nc.is_connected
