"""``seqstate serve-http``: Dynamo's standalone slot-tracker HTTP API, durable underneath."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from projector.nats.connection import closed_for_good, connect, require_url
from projector.ops import flags
from projector.ops.commands.command import CliError, Command
from projector.ops.commands.signals import catch_signals, until_signal
from projector.settings.checks import bearer_problem
from projector.settings.config import Config, env_name

log = logging.getLogger("seqstate")


async def cmd_serve_http(args: argparse.Namespace, config: Config) -> int:
    """Dynamo's standalone slot-tracker API, durable underneath (see projector/slot_service)."""
    from projector.bucket.projection import BucketUnfit, check_bucket_fits
    from projector.http.http_server import close, serve
    from projector.http.slot_service import SlotService
    from projector.http.tracker_names import TrackerNameTooLong, namespace_for
    from projector.write.writer import EventLimitUnfit, check_event_limit

    token = bearer_token(config)
    try:  # a deployment's name is part of every tracker's namespace
        namespace_for("", "", config.namespace)
    except TrackerNameTooLong:
        raise CliError(
            f"--namespace: {len(config.namespace)} characters leave no room for the names "
            "of a tracker in its namespace (a token of NATS subjects): use a shorter one"
        ) from None
    host = config.http_host
    catch_signals()
    async with (
        connect(require_url(config), service=True, config=config) as nc,
        slot_metrics(nc, config, service := SlotService(nc, config)) as metrics,
    ):
        # Every tracker's pipeline would refuse this server: said once, here, not by calls
        # that each wait for a pipeline that never runs.
        try:
            check_event_limit(nc.max_payload, config.max_event_bytes)
            check_bucket_fits(nc.max_payload)
        except (EventLimitUnfit, BucketUnfit) as exc:
            raise CliError(str(exc)) from None
        metrics.starting = "starting: opening the trackers"
        await service.start()
        try:
            server = await serve(
                service,
                host,
                config.http_port,
                token=token,
                max_connections=config.http_max_connections,
            )
        except OSError as exc:
            await service.stop()
            raise CliError(
                f"cannot listen on {host}:{config.http_port}: {exc.strerror or exc}"
            ) from None
        metrics.starting = ""
        port = server.port  # --http-port 0: the one chosen
        log.info(
            "serving the slot-tracker API on http://%s:%d (%d trackers, %s event loop)%s",
            host,
            port,
            len(service.trackers),
            "uvloop"
            if type(asyncio.get_running_loop()).__module__.startswith("uvloop")
            else "asyncio",
            ", bearer token required" if token is not None else "",
        )
        if token is None and not _loopback(host):
            log.warning(
                "serving on %s without a token: anyone who reaches port %d can book and "
                "free capacity (set SEQSTATE_HTTP_TOKEN or --http-token-file)",
                host,
                port,
            )
        try:
            await until_signal(server.serve_forever(), _lost(nc))
        finally:
            await close(server)
            await service.stop()
    return 0


async def _lost(nc: Client) -> None:
    """Ends serve-http when its NATS client is closed for good (its credentials refused): it
    cannot serve a call without NATS, and must not look alive meanwhile."""
    why = await closed_for_good(nc)
    raise CliError(f"NATS closed the connection for good ({why}): serve-http cannot go on")


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


def bearer_token(config: Config) -> bytes | None:
    """The token calls must carry (None: none is asked): ``--http-token``, or the first line
    of ``--http-token-file``. The file's content is never shown, even when it is no token."""
    if config.http_token is not None:
        return config.http_token.encode()
    path = config.http_token_file
    if path is None:
        return None
    named = f"--http-token-file/{env_name('http_token_file')} {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not text"
        raise CliError(f"{named}: cannot read it ({why})") from None
    token = text.strip()
    problem = bearer_problem(token)
    if problem:
        raise CliError(f"{named}: not a bearer token: {problem}")
    return token.encode()


def _loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (a name is taken at its word)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_serve_http_flags(serve_http: argparse.ArgumentParser) -> None:
    """``--host`` and ``--port``, the names Dynamo's tracker takes, as aliases of the settings
    ``--http-host`` and ``--http-port`` (so that the drop-in starts as it was started)."""
    serve_http.add_argument(
        "--host", dest="cfg_http_host", metavar="HOST", help="the same as --http-host"
    )
    serve_http.add_argument(
        "--port", dest="cfg_http_port", metavar="PORT", help="the same as --http-port"
    )


SERVE_HTTP = Command(
    "serve-http",
    "Dynamo's standalone slot-tracker HTTP API, durable: "
    "each (model_name, routing_group) a namespace of the ledger",
    cmd_serve_http,
    (
        *flags.READ,
        *flags.PROVISION,
        # The rules are the slot tracker's, always; a grace, a Dynamo capture and its lease
        # have no place there.
        *(s for s in flags.WRITER if s not in ("rules", "worker_grace_s", *flags.LEASE)),
        *flags.PROJECTOR,
        *flags.METRICS,
        *flags.HTTP,
    ),
    add_serve_http_flags,
)
