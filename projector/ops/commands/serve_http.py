"""``seqstate serve-http``: Dynamo's standalone slot-tracker HTTP API, durable underneath."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from nats.aio.client import Client

from projector.nats.connection import connect, require_url
from projector.ops import flags
from projector.ops.commands.command import CliError, Command
from projector.ops.commands.signals import catch_signals, until_signal
from projector.wire.config import Config

log = logging.getLogger("seqstate")


async def cmd_serve_http(args: argparse.Namespace, config: Config) -> int:
    """Dynamo's standalone slot-tracker API, durable underneath (see projector/slot_service)."""
    from projector.http.http_server import close, serve
    from projector.http.slot_service import SlotService

    catch_signals()
    async with (
        connect(require_url(config), service=True, config=config) as nc,
        slot_metrics(nc, config, service := SlotService(nc, config)) as metrics,
    ):
        metrics.starting = "starting: opening the trackers"
        await service.start()
        try:
            server = await serve(service, args.host, args.port)
        except OSError as exc:
            await service.stop()
            raise CliError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
        metrics.starting = ""
        log.info(
            "serving the slot-tracker API on http://%s:%d (%d trackers)",
            args.host,
            args.port,
            len(service.trackers),
        )
        try:
            await until_signal(server.serve_forever())
        finally:
            await close(server)
            await service.stop()
    return 0


@contextlib.asynccontextmanager
async def slot_metrics(nc: Client, config: Config, service: Any) -> AsyncIterator[Any]:
    """The metrics port of ``serve-http`` (when set): the per-worker gauges from its view of
    each tracker namespace; the counters and positions of the pipelines this replica runs
    (those whose lease it holds: none is required for it to be ready)."""
    from projector.ops.health import serving
    from projector.ops.metrics import PROJECTOR, VIEW, WRITER, Metrics

    def pipelines() -> list[Any]:
        return [
            t.standby.pipeline
            for t in list(service.trackers.values())
            if t.standby.pipeline is not None
        ]

    metrics = Metrics(nc, ready_lag_events=config.ready_lag_events, ready_lag_s=config.ready_lag_s)
    metrics.follow(VIEW, lambda: [t.view for t in list(service.trackers.values())], required=False)
    metrics.follow(
        WRITER, lambda: [p.writer for p in pipelines()], per_worker=False, required=False
    )
    metrics.follow(
        PROJECTOR, lambda: [p.projector for p in pipelines()], per_worker=False, required=False
    )
    async with serving(metrics, config):
        yield metrics


def add_serve_http_flags(serve_http: argparse.ArgumentParser) -> None:
    """Dynamo's defaults, so that the drop-in listens where its clients already look."""
    serve_http.add_argument(
        "--host",
        default=os.environ.get("SEQSTATE_HTTP_HOST", "0.0.0.0"),
        help="the address to listen on (default: 0.0.0.0, as Dynamo's) [env SEQSTATE_HTTP_HOST]",
    )
    serve_http.add_argument(
        "--port",
        type=int,
        metavar="N",
        default=int(os.environ.get("SEQSTATE_HTTP_PORT", "8091")),
        help="the port (default: 8091, as Dynamo's) [env SEQSTATE_HTTP_PORT]",
    )


SERVE_HTTP = Command(
    "serve-http",
    "Dynamo's standalone slot-tracker HTTP API, durable: "
    "each (model_name, routing_group) a namespace of the ledger",
    cmd_serve_http,
    (
        *flags.READ,
        *flags.PROVISION,
        # The rules are the slot tracker's, always; a grace has no place there.
        *(s for s in flags.WRITER if s not in ("rules", "worker_grace_s")),
        *flags.PROJECTOR,
        *flags.METRICS,
    ),
    add_serve_http_flags,
)
