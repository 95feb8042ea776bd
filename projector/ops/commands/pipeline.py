"""The pipeline's commands: ``run`` (writer and projector in one process, the demo router
beside them), ``writer`` and ``projector`` apart, and ``demo``, the demo router alone.

They are together because they share how a consumer is kept running and stopped, and the
demo router's flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from nats.aio.client import Client

from projector.nats.connection import close_at_once, connect, nats_for, require_url
from projector.ops import flags
from projector.ops.commands.command import CliError, Command
from projector.ops.commands.signals import catch_signals, until_signal
from projector.settings.config import Config

if TYPE_CHECKING:
    from projector.run.pipeline import Pipeline

log = logging.getLogger("seqstate")

STOP_TIMEOUT_S = 15.0
DEFAULT_STORE_DIR = ".seqstate/jetstream"
DEFAULT_PORT = 4222  # the NATS convention, so nats://127.0.0.1:4222 works across restarts


async def cmd_run(args: argparse.Namespace, config: Config) -> int:
    """Writer and projector, restarted in process after a failure (and the demo router)."""
    from projector.run.pipeline import supervise

    check_demo_flags(args)
    feed = _discovery(config)  # a spec that cannot be followed is refused before anything runs
    port = embedded_port(args.port)
    stop = catch_signals()
    current: list[Any] = []  # the pipeline running now: the live view shows its backlog
    async with (
        nats_for(config, args.store_dir, port) as (nc, url),
        pipeline_metrics(nc, config) as metrics_of,
    ):

        def on_pipeline(pipeline: Any) -> None:
            current[:] = [] if pipeline is None else [pipeline]
            metrics_of(pipeline)

        await refuse_a_second_run(nc, config)
        started = asyncio.Event()
        newest: list[Pipeline] = []

        def told(pipeline: Pipeline | None) -> None:
            newest[:] = newest if pipeline is None else [pipeline]
            on_pipeline(pipeline)

        supervisor = asyncio.ensure_future(supervise(nc, config, started=started, on_pipeline=told))
        ready, stopped = asyncio.ensure_future(started.wait()), asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([supervisor, ready, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            stopped.cancel()
        if supervisor.done():
            supervisor.result()  # its error: it could not start
        elif not started.is_set():  # a signal while it was starting: stop at once
            supervisor.cancel()
            await asyncio.wait([supervisor])
            if not supervisor.cancelled():
                supervisor.result()  # it failed meanwhile: that is the news
            log.warning("stopped while starting%s", _how_far(newest))
            await close_at_once(nc)  # a drain would wait for the reads called off
            return 0
        else:
            log.info(
                "writer and projector running for namespace %r at %s%s",
                config.namespace,
                url,
                # Provisioned by now: Dynamo's messages from here on are stored.
                f", capturing Dynamo endpoint {', '.join(config.dynamo_endpoints)}"
                if config.dynamo_endpoints
                else "",
                extra={"namespace": config.namespace},
            )
        tasks: list[Awaitable[Any]] = [asyncio.shield(supervisor)]
        if config.dynamo_endpoints:
            tasks.append(_follow_fleet(nc, config, lambda: current[0] if current else None, feed))
        if args.demo:
            from projector.ops.demo import run_demo

            tasks.append(run_demo(nc, config, args, lambda: current[0].writer if current else None))
        try:
            # The demo stops first (it frees what it has in flight), then the pipeline, so
            # that the writer and the projector take in those frees before they stop.
            await until_signal(*tasks, duration=args.duration)
        finally:
            supervisor.cancel()
            await asyncio.wait([supervisor])
    return 0


async def _follow_fleet(
    nc: Client, config: Config, pipeline: Callable[[], Pipeline | None], feed: Any
) -> None:
    """The Dynamo fleet followed beside the pipeline (:mod:`projector.dynamo.following`)."""
    from projector.dynamo.following import follower

    if feed is not None:
        log.info("following Dynamo's discovery: %s", feed.where)
    await follower(nc, config, pipeline, feed).run()


def _discovery(config: Config) -> Any:
    if not config.dynamo_endpoints:
        return None
    from projector.dynamo.discovery_config import DiscoveryConfigError
    from projector.dynamo.following import feed_for

    try:
        return feed_for(config)
    except DiscoveryConfigError as exc:
        raise CliError(f"--dynamo-discovery: {exc}") from None


def _how_far(pipelines: list[Pipeline]) -> str:
    """Where the writer was in the log when its start was called off (for one line)."""
    if not pipelines or not (target := pipelines[0].writer.catching_up_to):
        return "; nothing is lost"
    folded = pipelines[0].writer.applied.value
    return (
        f", before the writer caught up (event {folded:,} of {target:,}); nothing is lost, "
        "the next run catches up"
    )


async def refuse_a_second_run(nc: Client, config: Config) -> None:
    """One line, at once, if the namespace's pipeline already runs on this server.

    The projector waits for the namespace's lease, and a second run's projector waited for
    the first's forever: its start timed out, it was restarted, and again, while its writer
    folded the same events beside the first's. So a live holder of the lease refuses the run
    (a dead one's lease is taken over, as the projector would); taken here only to be asked.
    """
    from nats.js.errors import BucketNotFoundError

    from projector.nats.lease import LeaseHeld
    from projector.run.assemble import build_lease

    lease = build_lease(nc, config, "projector")
    try:
        await lease.acquire(wait=False)
    except BucketNotFoundError:
        return  # nothing provisioned yet: nothing runs here
    except LeaseHeld as exc:
        raise CliError(
            f"{exc}: one run per namespace and server; stop that one first, or use another "
            "--namespace"
        ) from None
    await lease.release()


@contextlib.asynccontextmanager
async def pipeline_metrics(nc: Client, config: Config) -> AsyncIterator[Callable[[Any], None]]:
    """The metrics port of ``run`` (when set); yields what the supervisor tells of each
    pipeline it starts (None once one has stopped). The per-worker gauges come from the
    writer's authoritative state; the projector adds its counters and position only."""
    from projector.ops.health import serving
    from projector.ops.metrics import PROJECTOR, WRITER, Metrics

    current: list[Any] = []
    metrics = Metrics(nc, ready_lag_events=config.ready_lag_events, ready_lag_s=config.ready_lag_s)
    metrics.follow(WRITER, lambda: [p.writer for p in current])
    metrics.follow(PROJECTOR, lambda: [p.projector for p in current], per_worker=False)

    def on_pipeline(pipeline: Any) -> None:
        current[:] = [] if pipeline is None else [pipeline]
        if pipeline is not None:
            metrics.hook(WRITER, pipeline.writer)
            metrics.hook(PROJECTOR, pipeline.projector)

    async with serving(metrics, config):
        yield on_pipeline


class _Consumer(Protocol):
    async def run(self) -> None: ...
    def stop(self) -> None: ...


async def run_consumer(
    config: Config, make: Callable[[Client, Config], _Consumer], role: str
) -> int:
    """One consumer until a signal, which *stops* it (final flush, final snapshot).

    A consumer that fails, or that fails while stopping, makes the command fail: the error
    is raised (one line, exit 1) so that its supervisor restarts it, never hidden behind the
    exit status of a signal. With ``--metrics-port`` its metrics and health are served
    meanwhile (``role``: ``writer`` or ``projector``).
    """
    from projector.ops.health import serving
    from projector.ops.metrics import Metrics

    catch_signals()
    async with connect(require_url(config), service=True, config=config) as nc:
        consumer = make(nc, config)
        metrics = Metrics(
            nc, ready_lag_events=config.ready_lag_events, ready_lag_s=config.ready_lag_s
        )
        metrics.follow(role, lambda: [consumer])
        metrics.hook(role, consumer)
        async with serving(metrics, config):
            return await _until_stopped(consumer)


async def _until_stopped(consumer: _Consumer) -> int:
    task = asyncio.ensure_future(consumer.run())
    try:
        await until_signal(asyncio.shield(task))  # a signal stops it, never cancels it
    finally:
        consumer.stop()
        done, _ = await asyncio.wait([task], timeout=STOP_TIMEOUT_S)
    if not done:
        raise CliError(f"the consumer did not stop within {STOP_TIMEOUT_S:g}s")
    task.result()  # its failure, if it failed while stopping
    return 0


async def cmd_writer(args: argparse.Namespace, config: Config) -> int:
    from projector.run.assemble import build_writer

    return await run_consumer(config, build_writer, "writer")


async def cmd_projector(args: argparse.Namespace, config: Config) -> int:
    from projector.run.assemble import build_projector

    return await run_consumer(config, build_projector, "projector")


async def cmd_demo(args: argparse.Namespace, config: Config) -> int:
    from projector.ops.demo import run_demo

    check_demo_flags(args)
    catch_signals()
    async with connect(require_url(config), service=True, config=config) as nc:
        await until_signal(run_demo(nc, config, args), duration=args.duration)
    return 0


def check_demo_flags(args: argparse.Namespace) -> None:
    """The demo router's numbers, checked before anything connects: a speed-up of 0 divided
    the arrival rate by zero (a traceback) once the run had started."""
    for flag, value in (("--speedup", args.speedup), ("--rate", args.rate)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise CliError(f"{flag} {value:g}: must be a positive number")
    for flag, count in (("--workers", args.workers), ("--dp-size", args.dp_size)):
        if count < 1:
            raise CliError(f"{flag} {count}: must be at least 1")


def embedded_port(port: int) -> int:
    """``--port``, checked: a port, or 0 for any free one (as a socket means it; the server
    is told so, see :class:`~projector.nats.server.NatsServer`)."""
    if not 0 <= port < 65536:
        raise CliError(f"--port {port}: must be a port (1-65535), or 0 for any free port")
    return port


def add_demo_flags(parser: argparse.ArgumentParser) -> None:
    """The demo router's workload: the same for ``run --demo`` as for ``demo``."""
    group = parser.add_argument_group("demo router")
    group.add_argument(
        "--workers", type=int, default=8, metavar="N", help="workers to drive (default: 8)"
    )
    group.add_argument(
        "--dp-size",
        type=int,
        default=1,
        metavar="N",
        help="data-parallel ranks per worker (default: 1)",
    )
    group.add_argument(
        "--trace", type=Path, metavar="PATH", help="replay a Mooncake-format JSONL trace"
    )
    group.add_argument(
        "--speedup",
        type=float,
        metavar="X",
        help="time compression (default: 10 for a trace, 1 otherwise)",
    )
    group.add_argument(
        "--rate",
        type=float,
        default=40.0,
        metavar="PER_S",
        help="synthetic arrivals per second (default: 40)",
    )
    group.add_argument(
        "--seed", type=int, default=0, metavar="N", help="synthetic workload seed (default: 0)"
    )
    group.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="stop after this many seconds (default: run until Ctrl-C)",
    )
    group.add_argument("--no-live", action="store_true", help="no live table; a line per second")


def add_run_flags(run: argparse.ArgumentParser) -> None:
    """The embedded nats-server's place and port, and the demo router beside the pipeline."""
    run.add_argument(
        "--store-dir",
        type=Path,
        metavar="PATH",
        default=Path(os.environ.get("SEQSTATE_STORE_DIR", DEFAULT_STORE_DIR)),
        help=f"the embedded server's JetStream directory (default: "
        f"{DEFAULT_STORE_DIR}) [env SEQSTATE_STORE_DIR]",
    )
    run.add_argument(
        "--port",
        type=int,
        metavar="N",
        default=os.environ.get("SEQSTATE_PORT", DEFAULT_PORT),  # argparse converts a string
        help=f"the embedded server's client port, refused if taken; 0: any free one "
        f"(default: {DEFAULT_PORT}) [env SEQSTATE_PORT]",
    )
    run.add_argument("--demo", action="store_true", help="also run the demo router + live view")
    add_demo_flags(run)


_CONSUMER = flags.READ + flags.PROVISION + flags.DYNAMO
RUN = Command(
    "run",
    "writer + projector in one process; an embedded nats-server unless NATS_URL is set",
    cmd_run,
    _CONSUMER + flags.FOLLOW + flags.WRITER + flags.PROJECTOR + flags.LAG + flags.METRICS,
    add_run_flags,
)
WRITER = Command(
    "writer",
    "the write-model consumer: SEQSTATE_EVENTS to SEQSTATE_DELTAS",
    cmd_writer,
    _CONSUMER + flags.WRITER + flags.LAG + flags.METRICS,
)
PROJECTOR = Command(
    "projector",
    "the read-model consumer: SEQSTATE_DELTAS to the registry bucket",
    cmd_projector,
    _CONSUMER + flags.PROJECTOR + flags.LAG + flags.METRICS,
)
DEMO = Command(
    "demo",
    "the demo router alone, against a running pipeline",
    cmd_demo,
    flags.READ + flags.PROVISION,
    add_demo_flags,
)
