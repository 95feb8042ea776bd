"""The demo router: drives N workers through the real pipeline, routing with RegistryView.

It behaves as a KV-aware router would: for each request it asks the view for every rank's
potential load, books the request on the cheapest rank (prefill tokens still to compute, in
blocks, plus decode blocks), tells the log the prefill it expects (the prompt minus the prefix
already cached there), marks the prefill done after the modeled prefill time and frees the
request after its decode time. The workload is built in (synthetic, shaped like production
traffic) or a Mooncake-format trace. On a clean stop it frees every request still in flight, as
a draining router does, so the next run starts from an empty pool.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext
from rich.console import RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from projector.aio.tasks import cancel_all
from projector.bucket.reader import RegistryView
from projector.nats.connection import refused_or
from projector.nats.lag import Lag, writer_lag
from projector.nats.resources import ensure
from projector.ops.live import staleness_said
from projector.ops.workload import (
    MOONCAKE_BLOCK_TOKENS,
    SYNTHETIC_BLOCK_TOKENS,
    DemoRequest,
    WorkloadError,
    mooncake,
    synthetic,
    trace_extent,
)
from projector.route.publisher import PublishError, RouterPublisher
from projector.settings.config import Config
from seqstate import PotentialLoadRow, WorkerAdded

log = logging.getLogger("seqstate.demo")


@dataclass
class DemoStats:
    routed: int = 0
    completed: int = 0
    refused: int = 0  # requests the log would not take (a full stream): not routed
    in_flight: int = 0
    cached_blocks: int = 0
    prompt_blocks: int = 0
    peak_requests: int = 0
    started: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def as_dict(self, view: RegistryView) -> dict[str, object]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        s = view.staleness()
        hit = self.cached_blocks / self.prompt_blocks if self.prompt_blocks else 0.0
        return {
            "routed": self.routed,
            "in flight": self.in_flight,
            "req/s": f"{self.routed / elapsed:.1f}",
            "prefix hit": f"{hit:.0%}",
            "applied seq": s.applied_seq,
            "view age": f"{s.age_s * 1000:.0f} ms",
            "view": staleness_said(s),
        }


def clock(seconds: float) -> str:
    """``1:02:03`` or ``2:03``: a span as an operator reads it."""
    whole = max(int(seconds + 0.5), 0)
    h, rest = divmod(whole, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


@dataclass
class ReplayProgress:
    """Where a replay is: requests routed of the total, the workload's own time, and an ETA.

    ``total`` and ``span_s`` (the workload time of the last arrival) are known for a trace;
    a synthetic workload has neither (it runs until stopped), and its ETA is the end of
    ``--duration`` when one is given. The workload time is the replay's wall time times the
    speed-up, so it is the trace's own clock (``timestamp`` of the lines being replayed).
    """

    speedup: float
    total: int | None = None
    span_s: float | None = None
    duration_s: float | None = None

    def fields(self, routed: int, elapsed_s: float) -> dict[str, str]:
        trace_s = elapsed_s * self.speedup
        out: dict[str, str] = {}
        if self.total:
            out["progress"] = f"{routed}/{self.total} ({routed / self.total:.0%})"
        if self.span_s is not None:
            trace_s = min(trace_s, self.span_s)
            out["trace time"] = f"{clock(trace_s)}/{clock(self.span_s)}"
        else:
            out["trace time"] = clock(trace_s)
        eta: float | None = None
        if self.span_s is not None:
            eta = (self.span_s - trace_s) / self.speedup
        if self.duration_s is not None:
            left = self.duration_s - elapsed_s
            eta = left if eta is None else min(eta, left)
        if self.total and routed >= self.total:
            out["eta"] = "draining"
        else:
            out["eta"] = "until stopped" if eta is None else clock(max(eta, 0.0))
        return out

    def fraction(self, routed: int, elapsed_s: float) -> float | None:
        if self.total:
            return min(routed / self.total, 1.0)
        if self.duration_s:
            return min(elapsed_s / self.duration_s, 1.0)
        return None


def choose(rows: list[PotentialLoadRow], block_tokens: int) -> PotentialLoadRow:
    """The rank with the least prefill (in blocks) plus decode blocks; then fewest requests."""
    return min(
        rows,
        key=lambda r: (
            r.potential_prefill_tokens / block_tokens + r.potential_decode_blocks,
            r.active_requests,
        ),
    )


class DemoRouter:
    def __init__(
        self,
        nc: Client,
        config: Config,
        *,
        workers: int,
        dp_size: int = 1,
        workload: Iterator[DemoRequest],
        block_tokens: int,
    ) -> None:
        self.nc = nc
        self.config = config
        self.workers = workers
        self.dp_size = dp_size
        self.workload = workload
        self.block_tokens = block_tokens
        self.router_id = f"demo-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.publisher = RouterPublisher(
            nc, namespace=config.namespace, router_id=self.router_id, config=config
        )
        self.view = RegistryView(nc, config=config)
        self.stats = DemoStats()
        self._live: dict[str, tuple[int, int]] = {}  # request id -> rank, while in flight
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await ensure(self.nc, self.config)
        await self.publisher.start()  # heartbeats: if this process dies, its load is freed
        for worker in range(self.workers):
            await self.publisher.publish(WorkerAdded(worker_id=worker, dp_size=self.dp_size))
        await self.view.start()
        await self.view.wait_for(self.publisher.last_sequence or 0, timeout=30)

    async def drive(self) -> None:
        """Route the workload at its arrival times until it ends (or the task is cancelled)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for request in self.workload:
            delay = t0 + request.arrival_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await self.route(request)
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def route(self, request: DemoRequest) -> None:
        request_id = f"{self.router_id}:{request.request_id}"
        hashes = list(request.block_hashes)
        best = choose(self.view.potential_loads(hashes, request.isl_tokens), self.block_tokens)
        rank = (best.worker_id, best.dp_rank)
        cached = self.view.overlap_depths(hashes).get(rank, 0)
        self._live[request_id] = rank
        self.stats.routed += 1
        self.stats.in_flight += 1
        self.stats.prompt_blocks += len(hashes)
        self.stats.cached_blocks += cached
        self.stats.peak_requests = max(self.stats.peak_requests, self.stats.in_flight)
        try:
            await self.publisher.add(
                request_id,
                rank[0],
                rank[1],
                block_hashes=hashes,
                prefill_tokens=max(request.isl_tokens - cached * self.block_tokens, 0),
                expected_prefill_ms=request.prefill_ms,
                expected_output_tokens=request.output_tokens,
            )
        except PublishError as exc:  # a full stream: the request is turned away, said once
            self._refused(request_id, exc)
            return
        task = asyncio.create_task(self._lifecycle(request_id, rank, request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _refused(self, request_id: str, exc: PublishError) -> None:
        if self._live.pop(request_id, None) is not None:
            self.stats.in_flight -= 1
        self.stats.refused += 1
        if self.stats.refused == 1:
            log.warning("demo: a request was refused, and is not routed: %s", exc)

    async def _lifecycle(self, request_id: str, rank: tuple[int, int], r: DemoRequest) -> None:
        await asyncio.sleep(r.prefill_ms / 1000)
        with contextlib.suppress(PublishError):  # refused: its Free is tried all the same
            await self.publisher.mark_prefill_completed(request_id, rank[0], rank[1])
        await asyncio.sleep(r.decode_ms / 1000)
        await self._free(request_id)
        self.stats.completed += 1

    async def _free(self, request_id: str) -> None:
        rank = self._live.pop(request_id, None)
        if rank is not None:
            self.stats.in_flight -= 1
            with contextlib.suppress(PublishError):  # refused: the ledger expires it
                await self.publisher.free(request_id, rank[0], rank[1])

    async def drain(self) -> None:
        """Cancel the lifecycles and free what is still in flight (a clean router shutdown)."""
        await cancel_all(list(self._tasks), None)
        await asyncio.gather(*(self._free(rid) for rid in list(self._live)))
        with contextlib.suppress(Exception):  # the frees above left it nothing to free
            await self.publisher.close()
        last = await self.publisher.flush()
        if last:
            with contextlib.suppress(TimeoutError):
                await self.view.wait_for(last, timeout=10)
        await self.view.stop()


def progress_of(args: argparse.Namespace) -> ReplayProgress:
    """What the replay is measured against: the trace's extent, or only ``--duration``."""
    if args.trace is not None:
        total, span_s = trace_extent(args.trace)
        speedup = 10.0 if args.speedup is None else args.speedup
        return ReplayProgress(speedup, total, span_s, args.duration)
    return ReplayProgress(1.0 if args.speedup is None else args.speedup, duration_s=args.duration)


def progress_line(progress: ReplayProgress, stats: DemoStats) -> RenderableType:
    """A bar (when there is a total to measure against) and the progress fields."""
    elapsed = stats.elapsed()
    fields = progress.fields(stats.routed, elapsed)
    text = Text()
    for i, (key, value) in enumerate(fields.items()):
        text.append("   " if i else "")
        text.append(f"{key} ", style="dim")
        text.append(value, style="bold")
    fraction = progress.fraction(stats.routed, elapsed)
    if fraction is None:
        return text
    bar = ProgressBar(total=1.0, completed=fraction, width=30)
    grid = Table.grid(padding=(0, 1))
    grid.add_row(bar, text)
    return grid


def workload_from(args: argparse.Namespace) -> tuple[Iterator[DemoRequest], int, str]:
    """The workload the flags ask for, its block size and a name for the title."""
    if args.trace is not None:
        speedup = 10.0 if args.speedup is None else args.speedup
        name = f"trace {args.trace.name} at {speedup:g}x"
        return iter(mooncake(args.trace, speedup=speedup)), MOONCAKE_BLOCK_TOKENS, name
    speedup = 1.0 if args.speedup is None else args.speedup
    if args.rate <= 0:
        raise WorkloadError(f"--rate {args.rate}: must be positive")
    # --rate is the wall-clock arrival rate: the workload's own rate is that before speed-up.
    name = f"synthetic workload, {args.rate:g} req/s" + (
        f" at {speedup:g}x" if speedup != 1 else ""
    )
    requests = synthetic(seed=args.seed, rate_per_s=args.rate / speedup, speedup=speedup)
    return iter(requests), SYNTHETIC_BLOCK_TOKENS, name


class Backlog:
    """What the live view shows of the backlog: the writer's last lag measurement, and the
    publishes refused (the demo's, and the writer's Ticks). In ``run --demo`` the pipeline's
    own writer measures it; beside a pipeline of another process, the demo measures it the
    way ``seqstate status`` does, every ``every_s``, as long as its role may read the
    streams (the ``demo`` role may not: then the refusals alone)."""

    def __init__(
        self,
        nc: Client,
        config: Config,
        publisher: RouterPublisher,
        writer: Callable[[], Any] | None = None,
        every_s: float = 2.0,
    ) -> None:
        self._nc, self._config, self._publisher = nc, config, publisher
        self._writer = writer
        self._every_s = every_s
        self._measured: Lag | None = None

    def fields(self) -> dict[str, object]:
        from projector.ops.live import backlog_fields

        writer = self._writer() if self._writer is not None else None
        lag = writer.lag if writer is not None else self._measured
        refused = sum(self._publisher.refused.values())
        if writer is not None:
            refused += sum(writer.stats.publishes_refused.values())
        return backlog_fields(lag, refused)

    async def measure(self) -> None:
        """Until cancelled (or refused): measure from outside, when no writer is at hand."""
        if self._writer is not None:
            return
        js = self._nc.jetstream()
        while True:
            try:  # a refusal is this role's answer (the demo role reads no stream), not news
                self._measured = await refused_or(self._nc, self._lag(js))
            except Exception as exc:  # its role may not read the streams: no backlog shown
                log.debug("demo: the backlog is not measured: %r", exc)
                return
            await asyncio.sleep(self._every_s)

    async def _lag(self, js: JetStreamContext) -> Lag:
        from projector.ops.status import writer_position

        folded = await writer_position(self._nc, self._config)
        return await writer_lag(js, self._config, folded, capture=True)


async def run_demo(
    nc: Client,
    config: Config,
    args: argparse.Namespace,
    writer: Callable[[], Any] | None = None,
) -> None:
    """The demo router plus a live table (or a line per second with ``--no-live``), and the
    backlog beneath it (``writer``: the pipeline's writer now, in ``run --demo``)."""
    from rich.console import Console, Group
    from rich.live import Live

    from projector.ops.live import render

    workload, block_tokens, name = workload_from(args)
    progress = progress_of(args)
    router = DemoRouter(
        nc,
        config,
        workers=args.workers,
        dp_size=args.dp_size,
        workload=workload,
        block_tokens=block_tokens,
    )
    await router.start()
    title = f"seqstate demo · {config.namespace} · {args.workers} workers · {name}"
    console = Console()
    backlog = Backlog(nc, config, router.publisher, writer)
    measuring = asyncio.create_task(backlog.measure())
    driver = asyncio.create_task(router.drive())
    try:
        if args.no_live or not console.is_terminal:
            while not driver.done():
                s = router.stats.as_dict(router.view)
                where = progress.fields(router.stats.routed, router.stats.elapsed())
                s.update(where)
                s.update(backlog.fields())
                print(" ".join(f"{k}={v}" for k, v in s.items()), flush=True)
                await asyncio.wait([driver], timeout=1.0)
        else:
            with Live(console=console, auto_refresh=False, transient=False) as live:
                while not driver.done():
                    stats = router.stats.as_dict(router.view) | backlog.fields()
                    table = render(router.view.loads(), title=title, stats=stats)
                    live.update(Group(table, progress_line(progress, router.stats)), refresh=True)
                    await asyncio.wait([driver], timeout=0.25)
        driver.result()
    finally:
        measuring.cancel()
        await cancel_all([driver], None)
        await router.drain()
        st = router.stats
        hit = st.cached_blocks / st.prompt_blocks if st.prompt_blocks else 0.0
        print(
            f"demo: routed {st.routed} requests ({st.completed} completed, "
            f"peak {st.peak_requests} in flight, prefix hit {hit:.0%}"
            + (f", {st.refused} refused by the log" if st.refused else "")
            + f"); last event {router.publisher.last_sequence}",
            flush=True,
        )
