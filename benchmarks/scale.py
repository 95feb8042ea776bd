"""Fleet scale: does the cost of an event follow what it changed, not the size of the rank's set?

Why this exists: the bucket layout keeps one key per live request
(``<ns>.req.<w>.<r>.<slot>``, its prompt hashes packed as u64) and one small load key per rank,
so that booking or freeing a request costs that request, whatever else the rank holds. This
script checks that claim end to end on a real nats-server, and measures what a fleet of large
ranks costs: 8 workers (dp 0), and two sweeps:

- **active set**: 1,024, 16,384, 65,536 and 262,144 active prompt hashes per rank, at requests
  of 256 blocks (4, 64, 256 and 1,024 live requests per rank);
- **request size**: 16, 64, 256 and 1,024 blocks per request, at 65,536 active hashes per rank
  (the 65,536 x 256 point is shared by both sweeps and measured once).

Every block hash is a distinct pseudo-random u64 (a bijective mix of a counter), so no two
requests share a hash and a rank's set is exactly ``requests x blocks``.

Each point, each run (``--runs``, interleaved: run 1 of every point, then run 2, ...), on a
fresh embedded nats-server (``NatsServer``, temporary store, streams as ``ensure`` makes them):

1. **Processes.** ``seqstate writer`` and ``seqstate projector`` are started as subprocesses
   with ``NATS_URL`` and default settings (what compose runs; snapshots every 10,000 events or
   60 s, expiry 300 s). This process holds the ``RouterPublisher`` (its own connection) and a
   ``RegistryView`` (another connection), on one event loop.
2. **Fill** (timed, reported, not a target): 8 ``WorkerAdded``, then every rank filled round
   robin to its target with AddRequest + MarkPrefillCompleted pairs via ``publish_many`` in
   chunks of ``--chunk``; then ``view.wait_for(last seq)``.
3. **Saturated churn**: ``--churn-events`` events (rounded to whole steps), built beforehand:
   each step takes one rank (round robin), frees its oldest live request and adds a new one of
   the same size (Free, AddRequest, MarkPrefillCompleted), so every set keeps its size. They are
   published with ``publish_many`` in chunks of ``--chunk``, one call after another, as fast as
   the acks come back. Measured from the first publish to ``view.wait_for(last seq)``:
   events/s and hashes/s (hashes carried by the adds); bytes per event on SEQSTATE_EVENTS and
   SEQSTATE_DELTAS (stream info ``state.bytes`` and ``messages``, after minus before: these
   streams only grow); on the bucket's stream ``KV_<bucket>`` the messages written
   (``last_seq`` after minus before: the bucket keeps one value per key, so its ``state.bytes``
   stays flat and says nothing about writes) and the bytes they took, computed per value the
   view's watch delivers with the server's file-store record size (22 + subject + headers + 4
   if any + payload + 8 bytes, checked against ``state.bytes`` when this script was written); CPU
   per event of the writer, the projector and nats-server (``/proc/<pid>/stat`` utime + stime,
   after minus before) and of this process (``time.process_time()``: publisher + view + this
   script's own bookkeeping), and, inside it, the view's own folding of values (wall time
   inside ``RegistryView.receive``; not nats-py's receive path). Also the lag of every 50th
   event (``--sample-every``) from its call's return (all acks in) to the view reflecting it:
   under an open-loop burst that is mostly the backlog the burst builds, reported as such.
4. **Freshness under steady churn** (the target): churn paced at ``--paced-rate`` events/s
   for ``--paced-events`` events: each step (Free, AddRequest, MarkPrefillCompleted) is one
   ``publish_many`` call at its scheduled time; every AddRequest (a third of the events, and
   the ones that carry hashes) is sampled: the time from its call's return (its ack in) to
   ``view.wait_for(its seq)``, p50/p99; publish start to view as well. A step that falls behind
   schedule is sent at once (the achieved rate is reported). CPU and bytes per event are
   measured over this phase too.
5. **View cold start**: a NEW process (this script with ``--view-child``) imports, connects,
   records its RSS, then times ``RegistryView(...).start()`` (returns once every current value
   of the bucket is folded) and records RSS and peak RSS (``VmHWM``) again: the memory figure
   is the RSS growth of a process that runs only the view. It then answers ``loads()`` and 24
   ``potential_loads`` queries (prefixes of live requests, some extended by unknown hashes, and
   unknown ones) at one log time, folds the event log itself from scratch
   (``projector.write.log_fold.fold_stream`` into ``config.new_state()``, to the view's
   position) and compares: the view must equal the write model exactly. This process's live
   view (which followed every delta of the churn) is compared with the same answers. The cold
   start runs after the churn, so the bucket holds the steady state: slot keys reused many
   times.

Targets (PASS/FAIL lines): saturated churn events/s at 262,144 per rank >= 2/3 of that at
1,024 (medians of the same invocation); freshness p99 <= 50 ms at every point; a view of
8 x 262,144 active hashes (2M) ready and exact within 3 s. (The router batch target is
``benchmarks/router.py``'s.)

Everything runs on one machine: with 2 cores, nats-server, writer, projector and this process
share them, so CPU per event is the honest figure to compare; events/s says what this machine
did. A PNG (``--plot``, needs the optional ``bench`` extra: ``pip install -e '.[bench]'``)
shows CPU and bytes per event against the active set and the request size.

Diagnosis, never part of the default figures: ``--no-snapshots`` runs the writer without
snapshots (to tell their cost apart), ``--py-spy DIR`` samples the writer, the projector and
this process during each saturated churn (collapsed stacks; needs py-spy), ``--logs DIR``
keeps the consumers' logs at info level (snapshot times, to line up with ``worst`` samples).

Run from the repository root after ``make native``: ``.venv/bin/python benchmarks/scale.py
[--runs N] [--json] [--save FILE] [--plot PNG]`` (about 6-7 minutes with the defaults on the
2-core machine); ``--quick`` for a look in under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
from harness.cli import add_json, argument_parser, positive
from harness.measure import collect, rss_kb
from harness.report import REPO_ROOT, emit, machine
from harness.servers import connect, server_version, stop
from harness.workload import NS_PER_MS, WAIT_TIMEOUT_S
from scale_measure import (
    CountingView,
    Pipeline,
    paced_churn,
    publish_chunks,
    saturated_churn,
    start_consumers,
)
from scale_report import plot, print_report, summarize, targets
from scale_workload import WORKERS, Point, Workload

from projector.bucket.reader import RegistryView
from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.settings.config import Config
from projector.write.log_fold import fold_stream
from seqstate import WorkerAdded

SET_SIZES: Final = (1024, 16_384, 65_536, 262_144)
REQUEST_SIZES: Final = (16, 64, 256, 1024)
FIXED_BLOCKS: Final = 256
FIXED_SET: Final = 65_536


# ---- the cold start -----------------------------------------------------------------------


async def cold_start(url: str, queries: list[tuple[list[int], int]], work: Path) -> dict[str, Any]:
    path = work / "queries.json"
    path.write_bytes(msgspec.json.encode(queries))
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).resolve()),
        "--view-child",
        url,
        str(path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), WAIT_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"view child failed ({proc.returncode}): {err.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    result["process_wall_s"] = time.perf_counter() - t0
    return result


def same_answers(view: RegistryView, child: dict[str, Any]) -> bool:
    """This process's live view answers as the child's fold of the log did."""
    now = child["now_ns"]
    if msgspec.to_builtins(view.loads(now)) != child["fold_loads"]:
        return False
    queries = msgspec.json.decode(Path(child["queries_path"]).read_bytes())
    mine = [msgspec.to_builtins(view.potential_loads(h, isl, now)) for h, isl in queries]
    return bool(mine == child["fold_potential"])


# ---- one point, one run -------------------------------------------------------------------


async def one_point(args: argparse.Namespace, point: Point, run: int) -> dict[str, Any]:
    config = Config()
    workload = Workload(point)
    fill = workload.fill()
    steps = workload.steps(args.churn_events)
    paced = workload.steps(args.paced_events)
    queries = workload.queries()
    result: dict[str, Any] = {
        "point": {"set_per_rank": point.set_per_rank, "blocks": point.blocks, "run": run}
    }
    with tempfile.TemporaryDirectory(prefix="seqstate-scale-") as tmp:
        work = Path(tmp)
        async with NatsServer() as server:
            server_pid = server.pid
            assert server_pid is not None
            nc_pub = await connect(server.url, "bench-publisher")
            nc_view = await connect(server.url, "bench-view")
            await ensure(nc_pub, config)
            consumers = start_consumers(
                server.url, work, "info" if args.logs else "warning", not args.no_snapshots
            )
            consumers.set_per_rank = point.set_per_rank
            view: CountingView | None = None
            try:
                view = CountingView(nc_view, config=config, initial_timeout=60.0)
                await view.start()
                pub = RouterPublisher(
                    nc_pub,
                    router_id=f"scale-{os.getpid()}-{run}",
                    config=config,
                    max_pending=args.max_pending,
                )
                setup = await pub.publish_many([WorkerAdded(worker_id=w) for w in range(WORKERS)])
                try:
                    await view.wait_for(max(setup), timeout=60)
                except TimeoutError:
                    raise RuntimeError(f"the pipeline did not start: {consumers.tail()}") from None

                collect()
                t0 = time.perf_counter()
                last = await publish_chunks(pub, fill, args.chunk)
                await view.wait_for(last, timeout=WAIT_TIMEOUT_S)
                result["fill"] = {
                    "events": len(fill),
                    "seconds": time.perf_counter() - t0,
                    "requests": point.requests_per_rank * WORKERS,
                    "present_hashes": view.registry.membership_size(),
                }
                pipeline = Pipeline(nc_pub, config, pub, view, consumers, server_pid)
                result["churn"] = await saturated_churn(args, pipeline, steps, point.blocks)
                result["paced"] = await paced_churn(args, pipeline, paced)
                view_rss = rss_kb()["VmRSS"]
                child = await cold_start(server.url, queries, work)
                child["live_view_equals_fold"] = same_answers(view, child)
                child["live_view_present_hashes"] = view.registry.membership_size()
                for key in ("fold_loads", "fold_potential", "queries_path"):
                    child.pop(key)
                result["cold"] = child
                result["bench_rss_mb"] = view_rss / 1024
                for proc in (consumers.writer, consumers.projector):
                    if proc.poll() is not None:
                        raise RuntimeError(f"a consumer exited early: {consumers.tail()}")
            finally:
                if view is not None:
                    await view.stop()
                stop((consumers.writer, consumers.projector), timeout=10)
                if args.logs:
                    keep = Path(args.logs)
                    keep.mkdir(parents=True, exist_ok=True)
                    for name in ("writer", "projector"):
                        tag = f"{point.set_per_rank}x{point.blocks}-run{run + 1}-{name}.log"
                        shutil.copyfile(work / f"{name}.log", keep / tag)
                for nc in (nc_view, nc_pub):
                    with contextlib.suppress(Exception):
                        await nc.drain()
            result["nats_server"] = server_version(nc_pub)
    return result


# ---- the cold-start child (this script with --view-child) ---------------------------------


async def view_child(url: str, queries_path: str) -> dict[str, Any]:
    config = Config()
    queries = msgspec.json.decode(Path(queries_path).read_bytes())
    nc = await connect(url, "bench-cold-view")
    gc.collect()
    rss0 = rss_kb()["VmRSS"]
    c0, t0 = time.process_time(), time.perf_counter()
    view = RegistryView(nc, config=config, initial_timeout=WAIT_TIMEOUT_S)
    await view.start()
    ready_s = time.perf_counter() - t0
    cpu_s = time.process_time() - c0
    mem = rss_kb()
    rss1, hwm1 = mem["VmRSS"], mem["VmHWM"]
    await view.stop()
    now = view.as_of_ns + 50 * NS_PER_MS
    view_loads = view.loads(now)
    view_potential = [view.potential_loads(h, isl, now) for h, isl in queries]
    # Untimed: the write model, folded from the log, must answer the same.
    state = config.new_state()
    await fold_stream(nc, config, state, start_seq=1, end_seq=view.applied_seq)
    fold_loads = state.registry.loads(now)
    fold_potential = [state.registry.potential_loads(h, isl, now) for h, isl in queries]
    await nc.drain()
    return {
        "ready_s": ready_s,
        "cpu_s": cpu_s,
        "rss_before_mb": rss0 / 1024,
        "rss_growth_mb": (rss1 - rss0) / 1024,
        "peak_growth_mb": (hwm1 - rss0) / 1024,
        "applied_seq": view.applied_seq,
        "values_received": view.values_received,
        "present_hashes": view.registry.membership_size(),
        "live_requests": sum(row.active_requests for row in view_loads),
        "exact": view_loads == fold_loads and view_potential == fold_potential,
        "fold_counters": {k: v for k, v in state.counters.items() if v},
        "now_ns": now,
        "fold_loads": msgspec.to_builtins(fold_loads),
        "fold_potential": msgspec.to_builtins(fold_potential),
        "queries_path": queries_path,
    }


# ---- the points ---------------------------------------------------------------------------


def points_of(args: argparse.Namespace) -> list[Point]:
    points = [Point(s, args.fixed_blocks) for s in args.sets]
    points += [Point(args.fixed_set, b) for b in args.blocks]
    unique: list[Point] = []
    for p in points:
        if p not in unique:
            unique.append(p)
    return unique


# ---- main ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argument_parser(__doc__)
    p.add_argument("--runs", type=positive, default=3, help="runs per point (interleaved)")
    add_json(p)
    p.add_argument("--save", metavar="FILE", default="", help="also write the JSON to FILE")
    p.add_argument(
        "--sets",
        type=positive,
        nargs="+",
        default=list(SET_SIZES),
        help="active hashes per rank of the first sweep",
    )
    p.add_argument(
        "--blocks",
        type=positive,
        nargs="+",
        default=list(REQUEST_SIZES),
        help="blocks per request of the second sweep",
    )
    p.add_argument(
        "--fixed-blocks",
        type=positive,
        default=FIXED_BLOCKS,
        help="blocks per request in the first sweep",
    )
    p.add_argument(
        "--fixed-set",
        type=positive,
        default=FIXED_SET,
        help="active hashes per rank in the second sweep",
    )
    p.add_argument(
        "--churn-events",
        type=positive,
        default=20_000,
        help="saturated churn events per point and run",
    )
    p.add_argument(
        "--paced-events",
        type=positive,
        default=10_000,
        help="paced churn events per point and run (a third are sampled)",
    )
    p.add_argument(
        "--paced-rate", type=positive, default=1_000, help="events/s offered in the paced phase"
    )
    p.add_argument(
        "--sample-every",
        type=positive,
        default=50,
        help="saturated churn: sample the lag of every Nth event",
    )
    p.add_argument("--chunk", type=positive, default=256, help="events per publish_many call")
    p.add_argument("--max-pending", type=positive, default=256, help="publisher's max_pending")
    p.add_argument(
        "--plot",
        default=str(REPO_ROOT / "benchmarks" / "scale.png"),
        help="PNG to write (needs matplotlib); '' for none",
    )
    p.add_argument(
        "--no-snapshots",
        action="store_true",
        help="diagnosis: run the writer without snapshots (not the default)",
    )
    p.add_argument(
        "--logs",
        metavar="DIR",
        default="",
        help="keep the writer's and projector's logs (info level) in DIR",
    )
    p.add_argument(
        "--py-spy",
        metavar="DIR",
        default="",
        help="diagnosis: py-spy the writer, projector and this process during the saturated "
        "churn (collapsed stacks in DIR; the sampling perturbs the figures)",
    )
    p.add_argument(
        "--quick", action="store_true", help="a look: 1 run, smaller sets, 3,000 churn events"
    )
    p.add_argument("--view-child", nargs=2, metavar=("URL", "QUERIES"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.churn_events, args.paced_events = 1, 3_000, 900
        args.sets, args.blocks, args.fixed_set = [1024, 16_384], [64, 256], 16_384
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.view_child:
        result = asyncio.run(view_child(*args.view_child))
        print(json.dumps(result))
        return 0
    points = points_of(args)
    report: dict[str, Any] = {
        "machine": machine(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    started = time.perf_counter()
    results: dict[Point, list[dict[str, Any]]] = {p: [] for p in points}
    for run in range(args.runs):
        for point in points:
            if not args.json:
                print(f"run {run + 1}/{args.runs}: {point.label} ...", file=sys.stderr, flush=True)
            results[point].append(asyncio.run(one_point(args, point, run)))
    report["runs"] = [r for p in points for r in results[p]]
    report["nats_server"] = report["runs"][0]["nats_server"]
    report["summary"] = [summarize(p, results[p]) for p in points]
    report["targets"] = targets(args, report["summary"])
    if args.plot:
        report["plot"] = plot(report["summary"], args, Path(args.plot))
    report["wall_s"] = time.perf_counter() - started
    if args.save:
        Path(args.save).write_text(json.dumps(report, indent=2))
    emit(report, args.json, print_report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
