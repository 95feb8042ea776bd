"""Restart to ready with a million events of history: the writer alone, and ``seqstate run``.

Why this exists: the target is a restart to ready in at most 0.5 s with 1,000,000 events in
the stream. "Ready" is what each command waits for: ``seqstate writer`` from
``build_writer(nc, config)`` to ``writer.caught_up``; ``seqstate run`` (and its ``/readyz``)
from ``Pipeline(nc, config)`` (which builds the writer and the projector) until both are caught
up, as ``Pipeline.start`` waits.

Setup (timed and reported, never part of the target): a fresh embedded nats-server, ``ensure``
with the default ``Config``, and the history as ``benchmarks/replay.py`` builds it: 16
``WorkerAdded``, then the Mooncake trace's lifecycles pass after pass with distinct request
ids, ``--events`` messages published pipelined. Then one untimed pipeline (writer and
projector) folds the whole history, publishes its deltas, fills the bucket, and stops; its
writer saves a final snapshot at the last event, as a writer stopped cleanly does.

Each run then appends a tail of ``--tail`` (5,000) new events of the same workload (untimed:
nothing runs meanwhile), and times a start from what the previous run (or the setup) left:
the newest snapshot is at the event before the tail, the deltas up to it are stored, so the
start restores it and folds the tail. The run stops cleanly (its writer saves a final snapshot
at the end of the tail), which is where the next run starts from: every run restores a
snapshot of the same size and folds a tail of the same length, and the history grows by the
tail each run (1,000,000 + 5,000 k events).

(w) the writer alone: ``build_writer`` -> ``create_task(writer.run())`` -> ``caught_up``, the
phases timed by wrapping the writer's own calls on the instance (as replay.py's (r2) does):
``start_before_restore`` (ensure, the newest delta, opening the store), ``snapshot_list_and_
decode`` (listing, the snapshot's digest check and ``SequenceState.restore``, off the loop),
``snapshot_fetch`` (reading the chunks from the object store), ``coverage_and_target``,
``subscribe`` (creating the events consumer) and ``tail_fold`` (folding the tail and
publishing its deltas, up to ``caught_up``). Then, before the pipeline runs, one untimed
pipeline lets the projector take in the writer runs' deltas.

(p) ``seqstate run``'s pipeline: ``Pipeline(nc, config)`` -> ``start()`` returns (both caught
up); when each of the two was ready is reported too, and when ``/readyz`` would first answer
200 (``Metrics.readiness`` over the two, looked at every 2 ms): caught up, and a lag
measurement within ``ready_lag_events``.

At the end ``seqstate replay --verify`` must say the bucket equals a replay of the whole log.

``--profile``: one more writer-alone start (another tail) under cProfile, the functions with
the most own time listed; cProfile inflates per-call costs of Python code: read shares.

Run from the repository root: ``.venv/bin/python benchmarks/restart.py [--runs N] [--json]``
(``--events 100000`` for a quick look). One invocation builds its own server; nothing cached.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from harness.cli import add_json, add_trace, argument_parser, positive
from harness.measure import collect, stamp
from harness.report import head_line
from harness.servers import connect, replay_verify, server_version
from harness.workload import encoded, fill, trace_events
from nats.aio.client import Client
from replay import PhaseClock, finish, new_report, ready_once

from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.nats.snapshots import SnapshotStore
from projector.ops.metrics import PROJECTOR, WRITER, Metrics
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from seqstate import Event

TARGET_READY_S: Final = 0.5
WAIT_TIMEOUT_S: Final = 900.0
READYZ_POLL_S: Final = 0.002


async def catch_up(url: str, config: Config) -> dict[str, Any]:
    """An untimed pipeline that folds whatever is new, fills the bucket, and stops cleanly."""
    nc = await connect(url, "bench-catch-up")
    try:
        t0 = time.perf_counter()
        pipeline = await Pipeline(nc, config, start_timeout=WAIT_TIMEOUT_S).start()
        ready_s = time.perf_counter() - t0
        await pipeline.stop(timeout=WAIT_TIMEOUT_S)
        return {"seconds": ready_s, "events_folded": pipeline.writer.stats.applied}
    finally:
        await nc.drain()


async def newest_snapshot(nc: Client, config: Config) -> dict[str, Any]:
    infos = await (await SnapshotStore(nc, config).open()).list()
    newest = infos[-1]
    return {"name": newest.name, "applied_seq": newest.applied_seq, "bytes": newest.size}


async def ready_by(metrics: Metrics) -> None:
    """Until ``/readyz`` would answer 200 (``Metrics.readiness``), looked at every 2 ms."""
    while not metrics.readiness()[0]:
        await asyncio.sleep(READYZ_POLL_S)


async def pipeline_ready_once(url: str, config: Config, last: int, snap_seq: int) -> dict[str, Any]:
    """``seqstate run``'s start: both consumers caught up, as ``Pipeline.start`` waits."""
    nc = await connect(url, "bench-run")
    try:
        collect()
        clock = PhaseClock()
        c0, t0 = time.process_time(), time.perf_counter()
        pipeline = Pipeline(nc, config, start_timeout=WAIT_TIMEOUT_S)
        writer = pipeline.writer
        assert writer.snapshots is not None
        clock.wrap(writer.snapshots, "newest_valid", "restore")
        clock.wrap(writer.snapshots, "fetch", "fetch")
        writer_ready = asyncio.create_task(stamp(writer.caught_up.wait()))
        projector_ready = asyncio.create_task(stamp(pipeline.projector.caught_up.wait()))
        metrics = Metrics(
            nc, ready_lag_events=config.ready_lag_events, ready_lag_s=config.ready_lag_s
        )
        metrics.follow(WRITER, lambda: [writer])
        metrics.follow(PROJECTOR, lambda: [pipeline.projector])
        readyz = asyncio.create_task(stamp(ready_by(metrics)))
        await pipeline.start()
        t_ready = time.perf_counter()
        cpu = time.process_time() - c0
        await asyncio.wait_for(readyz, WAIT_TIMEOUT_S)
        stats = writer.stats
        folded_at_ready = stats.applied
        await pipeline.stop(timeout=WAIT_TIMEOUT_S)
    finally:
        await nc.drain()
    if stats.restored_from != snap_seq or stats.last_seq != last:
        raise RuntimeError(
            f"the pipeline's writer restored from {stats.restored_from} (not {snap_seq}) and "
            f"folded up to {stats.last_seq} (not {last})"
        )
    r_start, r_end = clock.first("restore")
    f_start, f_end = clock.first("fetch")
    return {
        "seconds": t_ready - t0,
        "cpu_s": cpu,
        "restored_from": stats.restored_from,
        "tail_events": folded_at_ready,
        "writer_ready_s": writer_ready.result() - t0,
        "projector_ready_s": projector_ready.result() - t0,
        "readyz_s": readyz.result() - t0,
        "phases_s": {
            "snapshot_load": r_end - r_start,
            "snapshot_fetch": f_end - f_start,
        },
    }


async def publish_tail(
    nc: Client, config: Config, messages: Sequence[tuple[str, bytes]], max_pending: int
) -> int:
    """Append ``messages`` (untimed: nothing folds meanwhile); the stream's new last sequence."""
    return int((await fill(nc, config, messages, max_pending))["last_seq"])


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = [r["seconds"] for r in runs]
    phases: dict[str, float] = {}
    for name in runs[0]["phases_s"]:
        phases[name] = statistics.median(r["phases_s"][name] for r in runs)
    readyz = [r["readyz_s"] for r in runs if "readyz_s" in r]
    return {
        "runs": runs,
        "median_s": statistics.median(seconds),
        "median_readyz_s": statistics.median(readyz) if readyz else None,
        "median_phases_s": phases,
        "target_s": TARGET_READY_S,
        "meets_target": statistics.median(seconds) <= TARGET_READY_S,
    }


async def bench(args: argparse.Namespace, base: Sequence[Event]) -> dict[str, Any]:
    config = Config()
    result: dict[str, Any] = {}
    tails = 2 * args.runs + (1 if args.profile else 0)
    async with NatsServer() as server:
        nc = await connect(server.url, "bench-setup")
        try:
            result["nats_server"] = server_version(nc)
            await ensure(nc, config)
            t0 = time.perf_counter()
            messages = encoded(config, base, args.events + tails * args.tail, args.workers)
            build_s = time.perf_counter() - t0
            setup = await fill(nc, config, messages[: args.events], args.max_pending)
            setup["build_s"] = build_s
            setup["catch_up"] = await catch_up(server.url, config)
            result["setup"] = setup
            last = setup["last_seq"]
            pending = iter(
                [
                    messages[args.events + k * args.tail : args.events + (k + 1) * args.tail]
                    for k in range(tails)
                ]
            )
            del messages

            writer_runs = []
            for _ in range(args.runs):
                before = last
                last = await publish_tail(nc, config, next(pending), args.max_pending)
                run = await ready_once(server.url, config, last, before, None)
                run["snapshot"] = await newest_snapshot(nc, config)
                writer_runs.append(run)
            result["writer"] = summary(writer_runs)
            result["catch_up_between"] = await catch_up(server.url, config)

            pipeline_runs = []
            for _ in range(args.runs):
                before = last
                last = await publish_tail(nc, config, next(pending), args.max_pending)
                pipeline_runs.append(await pipeline_ready_once(server.url, config, last, before))
            result["run"] = summary(pipeline_runs)

            if args.profile:
                before = last
                last = await publish_tail(nc, config, next(pending), args.max_pending)
                profiler = cProfile.Profile()
                profiler.enable()
                run = await ready_once(server.url, config, last, before, None)
                profiler.disable()
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
                result["profile"] = {"run": run, "top_own_time": out.getvalue().splitlines()}
                result["catch_up_after_profile"] = await catch_up(server.url, config)
            result["history_events"] = last
            result["verify"] = await asyncio.to_thread(
                replay_verify, server.url, "--namespace", config.namespace
            )
        finally:
            await nc.drain()
    return result


def print_report(report: dict[str, Any]) -> None:
    m, w, r = report["machine"], report["workload"], report["result"]
    print(head_line("restart to ready", m))
    print(
        f"history {w['events']:,} events, tail {w['tail']:,}, runs {w['runs']}, "
        f"compiled core {w['compiled_core']}"
    )
    s = r["setup"]
    print(f"setup: publish {s['seconds']:.1f} s, first catch-up {s['catch_up']['seconds']:.1f} s")
    for label, key in (("writer alone", "writer"), ("seqstate run", "run")):
        part = r[key]
        runs = ", ".join(f"{x['seconds'] * 1000:.0f}" for x in part["runs"])
        print(
            f"{label}: median {part['median_s'] * 1000:.0f} ms ({runs}); target "
            f"{TARGET_READY_S * 1000:.0f} ms: {'met' if part['meets_target'] else 'MISSED'}"
        )
        if part["median_readyz_s"] is not None:
            readyz_ms = part["median_readyz_s"] * 1000
            print(f"    /readyz 200 (Metrics.readiness): median {readyz_ms:.0f} ms")
        for name, value in part["median_phases_s"].items():
            print(f"    {name:<28} {value * 1000:8.1f} ms")
        if key == "writer":
            print(f"    snapshot: {part['runs'][-1]['snapshot']}")
        else:
            for x in part["runs"]:
                print(
                    f"    writer ready {x['writer_ready_s'] * 1000:.0f} ms, projector ready "
                    f"{x['projector_ready_s'] * 1000:.0f} ms, /readyz 200 at "
                    f"{x['readyz_s'] * 1000:.0f} ms"
                )
    if "profile" in r:
        print("\n".join(r["profile"]["top_own_time"]))
    print(
        f"history at the end: {r['history_events']:,} events; verify: exit "
        f"{r['verify']['exit']}: {' / '.join(r['verify']['said'])}"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argument_parser(__doc__)
    add_trace(p)
    p.add_argument("--events", type=positive, default=1_000_000, help="events of history")
    p.add_argument("--runs", type=positive, default=3, help="runs of each start")
    p.add_argument("--tail", type=positive, default=5_000, help="events after the snapshot")
    p.add_argument("--workers", type=positive, default=16, help="workers, round-robin")
    p.add_argument("--max-pending", type=positive, default=4_000, help="setup: unacked publishes")
    p.add_argument("--profile", action="store_true", help="one more writer start, cProfiled")
    p.add_argument("--top", type=positive, default=25, help="profile: functions listed")
    add_json(p)
    p.add_argument("--save", type=Path, default=None, help="also write the JSON document here")
    args = p.parse_args(argv)
    if args.events <= args.workers:
        p.error("--events must exceed --workers")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    base = trace_events(args.trace, args.workers, "restart.py")
    if base is None:
        return 2
    report = new_report(args, base)
    finish(report, args, bench(args, base), print_report)
    return 0 if report["result"]["verify"]["exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
