"""The writer and the projector as NATS services, found the way any NATS service is found.

Operators already ask NATS what runs (``nats micro list``, ``nats micro info``, ``nats micro
stats``): each running writer and projector registers with nats.micro, so it shows there with
its namespace, streams and bucket (info metadata), and its position, lag and counters (the
stats of its one endpoint). That endpoint, ``seqstate.svc.<ns>.<kind>.status``, answers a
request with the same status as JSON, for a script that wants it without the CLI.

One service per running consumer: a writer and a projector in one process (``seqstate run``,
``serve-http``) are two services, so each shows where it runs, and a standby that is not
running its pipeline does not show at all. Registering costs a few subscriptions; nothing runs
per event.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final

import msgspec
import nats.errors
import nats.micro
from nats.aio.client import Client
from nats.micro.request import Request
from nats.micro.service import Service

from projector.settings.config import Config

log = logging.getLogger("seqstate.discovery")

NAMES: Final = {"writer": "seqstate-writer", "projector": "seqstate-projector"}
DESCRIPTIONS: Final = {
    "writer": "folds lifecycle events into the write model and stores their deltas",
    "projector": "writes the deltas into the registry bucket that schedulers read",
}


def status_subject(config: Config, kind: str) -> str:
    return f"seqstate.svc.{config.namespace}.{kind}.status"


def _version() -> str:
    try:
        return version("seqstate")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0.0.0"


@contextlib.asynccontextmanager
async def announced(
    nc: Client, config: Config, kind: str, status: Callable[[], dict[str, Any]]
) -> AsyncIterator[Service | None]:
    """Registered as a NATS service while inside; ``status()`` gives its stats and answers
    its status endpoint. A server that refuses the registration (no permission for
    ``$SRV.>``, say) costs a warning, never the consumer: discovery is for operators."""
    try:
        service = await nats.micro.add_service(
            nc,
            name=NAMES[kind],
            version=_version(),
            description=DESCRIPTIONS[kind],
            metadata={
                "namespace": config.namespace,
                "events_stream": config.events_stream,
                "deltas_stream": config.deltas_stream,
                "registry_bucket": config.registry_bucket,
            },
            stats_handler=lambda _: status(),
        )

        async def answer(request: Request) -> None:
            await request.respond(msgspec.json.encode(status()))

        await service.add_endpoint(
            name="status", subject=status_subject(config, kind), handler=answer
        )
    except (nats.errors.Error, OSError) as exc:
        log.warning("not registered as a NATS service (%s): %s", NAMES[kind], exc)
        yield None
        return
    try:
        yield service
    finally:
        with contextlib.suppress(nats.errors.Error, OSError):
            await service.stop()
