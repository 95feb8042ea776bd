"""The permission suites' fixtures: a nats-server under the shipped role config, and the
writer and the projector, each signed in as itself.

A test module loads them with ``pytest_plugins = ("permissions_fixtures",)`` and never imports
this module: pytest imports it as a plugin, and rewrites its asserts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from permissions_kit import role_config, started_roles_server

from projector.bucket.projection import Projector
from projector.nats.connection import connect
from projector.run.assemble import build_projector, build_writer
from projector.write.writer import Writer


@pytest.fixture(scope="module")
def roles_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with started_roles_server(tmp_path_factory.mktemp("roles") / "js") as url:
        yield url


@pytest.fixture
async def pipeline(roles_server: str) -> AsyncIterator[tuple[Writer, Projector]]:
    """The writer and the projector, each signed in as itself (a snapshot every 5 events);
    the writer forwards the namespace's Dynamo capture (``dynamo.backend.generate``)."""
    writer_config = role_config(
        roles_server, "writer", snapshot_every_events=5, dynamo_endpoint="dynamo.backend.generate"
    )
    projector_config = role_config(roles_server, "projector")
    async with (
        connect(roles_server, service=True, config=writer_config) as wnc,
        connect(roles_server, service=True, config=projector_config) as pnc,
    ):
        writer, projector = build_writer(wnc, writer_config), build_projector(pnc, projector_config)
        tasks = [asyncio.create_task(writer.run()), asyncio.create_task(projector.run())]
        started = asyncio.gather(writer.caught_up.wait(), projector.caught_up.wait())
        done, _ = await asyncio.wait(
            [started, *tasks], timeout=30, return_when=asyncio.FIRST_COMPLETED
        )
        assert started in done, [t.exception() for t in tasks if t.done()]
        try:
            yield writer, projector
        finally:
            writer.stop()
            projector.stop()
            await asyncio.wait(tasks, timeout=10)
            for task in tasks:
                task.cancel()
