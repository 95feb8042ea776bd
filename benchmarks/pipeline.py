"""Replay a real request trace through the whole pipeline on a real nats-server and time it.

Why this exists: ``benchmarks/fold.py`` measures the core alone; a router and a scheduler see
the pipeline: RouterPublisher → SEQSTATE_EVENTS → writer → SEQSTATE_DELTAS → projector → KV
bucket → RegistryView. This script starts a fresh embedded nats-server (``NatsServer``, a
temporary JetStream store) for every run, replays the Mooncake conversation trace through it
and reports, each as the median over ``--runs`` runs:

(e) ingest: events/s from one RouterPublisher into SEQSTATE_EVENTS, every lifecycle event of
    the trace (AddRequest, MarkPrefillCompleted, Free; 16 workers round-robin, timeline order)
    fired concurrently with ``asyncio.gather`` over chunks; the publisher bounds the
    unacknowledged publishes itself (``max_pending``);
(f) end-to-end catch-up: with those events already in the stream, start a ``Pipeline`` (writer
    + projector) and time until a ``RegistryView`` reports ``applied_seq`` == the last event's
    sequence: replay through writer → deltas → projector → bucket → view, as events/s; and how
    many KV writes the projector needed for it (coalescing);
(g) live latency: with the pipeline caught up, publish one AddRequest at a time and time the
    publish call's start → the view reflecting that event's sequence (``view.wait_for``);
    p50/p90/p99. Each probe is freed again (not timed) so the state keeps its size;
(h) read latency: ``view.potential_loads`` for 128 different queries taken from the trace,
    median/p99, and ``view.loads()``.

(g) and (h) are measured twice: on the state the trace leaves behind (every request freed: 16
ranks with no active blocks) and again after ``--live`` trace requests were added and left
live, where the bucket's block values and the view's hash index have a realistic size.

The view runs in this process, on the same event loop as the writer and the projector (three
NATS connections: publisher, pipeline, view). A scheduler in another process adds about the KV
watch latency (p50 0.73 ms, measured on this machine with nats-py) to (g).

Log time is the JetStream receive time, not the trace's timestamps: the trace's hour is
compressed into the seconds the ingest takes. The event log is deterministic; timings are not.

Run from the repository root: ``.venv/bin/python benchmarks/pipeline.py [--runs N] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
from harness.cli import add_json, add_trace, argument_parser, positive
from harness.measure import collect, median_of, percentile, stamp
from harness.report import emit, fmt_rates, machine, print_head, print_software
from harness.servers import connect, server_version
from harness.workload import (
    NS_PER_MS,
    Lifecycle,
    add_event,
    lifecycles,
    read_trace,
    round_robin_events,
    timeline,
)

from projector.bucket.reader import RegistryView
from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from seqstate import Event, SequenceState, WorkerAdded

NS_PER_US: Final = 1_000
WAIT_TIMEOUT_S: Final = 300.0


# ---- helpers ------------------------------------------------------------------------------


def spread(requests: Sequence[Lifecycle], count: int) -> list[Lifecycle]:
    """``count`` requests taken evenly over the trace (those with >= 8 blocks if enough)."""
    sources = [lc for lc in requests if len(lc.hashes) >= 8]
    if len(sources) < count:
        sources = list(requests)
    step = max(1, len(sources) // count)
    return sources[::step][:count]


def summary_ms(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    return {
        "p50_ms": statistics.median(ordered) / NS_PER_MS,
        "p90_ms": percentile(ordered, 90) / NS_PER_MS,
        "p99_ms": percentile(ordered, 99) / NS_PER_MS,
        "max_ms": ordered[-1] / NS_PER_MS,
    }


async def publish_all(pub: RouterPublisher, events: Sequence[Event], chunk: int) -> list[int]:
    """Fire every event, ``chunk`` at a time with ``asyncio.gather``; the stream sequences."""
    seqs: list[int] = []
    for start in range(0, len(events), chunk):
        batch = events[start : start + chunk]
        seqs.extend(await asyncio.gather(*(pub.publish(event) for event in batch)))
    return seqs


# ---- (g) live latency ---------------------------------------------------------------------


async def live_latency(
    pub: RouterPublisher,
    view: RegistryView,
    probes: Sequence[Lifecycle],
    workers: int,
    samples: int,
    gap_s: float,
    tag: str,
) -> dict[str, Any]:
    """One AddRequest at a time: publish-call start → ack, and → the view reflecting it."""
    clock = time.perf_counter_ns
    to_ack: list[int] = []
    to_view: list[int] = []
    collect()
    for k in range(samples):
        lc = probes[k % len(probes)]
        request_id = f"probe-{tag}-{k}"
        worker = k % workers
        t0 = clock()
        seq = await pub.add(
            request_id,
            worker,
            block_hashes=lc.hashes,
            prefill_tokens=lc.isl,
            expected_prefill_ms=lc.expected_prefill_ms,
        )
        t1 = clock()
        await view.wait_for(seq, timeout=10)
        t2 = clock()
        to_ack.append(t1 - t0)
        to_view.append(t2 - t0)
        # Untimed: free it again, so every sample sees the same state.
        await view.wait_for(await pub.free(request_id, worker), timeout=10)
        await asyncio.sleep(gap_s)
    return {"samples": samples, "ack": summary_ms(to_ack), "view": summary_ms(to_view)}


# ---- (h) read latency ---------------------------------------------------------------------


def read_latency(
    view: RegistryView, queries: Sequence[tuple[list[int], int]], calls: int, loads_calls: int
) -> dict[str, Any]:
    potential_loads = view.potential_loads
    loads = view.loads
    clock = time.perf_counter_ns
    nq = len(queries)
    collect()
    for k in range(500):  # warm-up
        hashes, isl = queries[k % nq]
        potential_loads(hashes, isl)
    samples: list[int] = []
    record = samples.append
    for k in range(calls):
        hashes, isl = queries[k % nq]
        t0 = clock()
        potential_loads(hashes, isl)
        record(clock() - t0)
    samples.sort()
    load_samples: list[int] = []
    for _ in range(loads_calls):
        t0 = clock()
        loads()
        load_samples.append(clock() - t0)
    load_samples.sort()
    depths = [max(view.overlap_depths(h).values(), default=0) for h, _ in queries]
    return {
        "ranks": len(view.loads()),
        "present_hashes": view.registry.membership_size(),
        "distinct_queries": nq,
        "mean_query_blocks": statistics.fmean(len(h) for h, _ in queries),
        "mean_best_overlap_depth": statistics.fmean(depths),
        "calls": calls,
        "potential_loads_median_us": statistics.median(samples) / NS_PER_US,
        "potential_loads_p99_us": percentile(samples, 99) / NS_PER_US,
        "loads_calls": loads_calls,
        "loads_median_us": statistics.median(load_samples) / NS_PER_US,
    }


def view_matches_writer(
    view: RegistryView, pipeline: Pipeline, queries: Sequence[tuple[list[int], int]]
) -> bool:
    """The view (built from bucket values) answers exactly as the writer's own registry."""
    # The writer defers its registry (it never reads it): rebuild one from its write model.
    registry = SequenceState.restore(pipeline.writer.state.snapshot()).registry
    now = view.as_of_ns + 50 * NS_PER_MS
    if view.loads(now) != registry.loads(now):
        return False
    return all(
        view.potential_loads(h, isl, now) == registry.potential_loads(h, isl, now)
        for h, isl in queries
    )


# ---- one run ------------------------------------------------------------------------------


async def one_run(
    args: argparse.Namespace,
    run: int,
    events: Sequence[Event],
    live: Sequence[Lifecycle],
    probes: Sequence[Lifecycle],
    queries: Sequence[tuple[list[int], int]],
) -> dict[str, Any]:
    config = Config()
    result: dict[str, Any] = {}
    async with NatsServer() as server:
        nc_pub = await connect(server.url, "bench-publisher")
        nc_pipe = await connect(server.url, "bench-pipeline")
        nc_view = await connect(server.url, "bench-view")
        result["nats_server"] = server_version(nc_pub)
        pipeline: Pipeline | None = None
        view: RegistryView | None = None
        try:
            await ensure(nc_pub, config)
            pub = RouterPublisher(
                nc_pub,
                router_id=f"bench-{os.getpid()}-{run}",
                config=config,
                max_pending=args.max_pending,
            )
            for worker_id in range(args.workers):  # setup, as fold.py's new_state
                await pub.publish(WorkerAdded(worker_id=worker_id))

            # (e) ingest
            collect()
            c0, t0 = time.process_time(), time.perf_counter()
            seqs = await publish_all(pub, events, args.chunk)
            ingest_s = time.perf_counter() - t0
            ingest_cpu_s = time.process_time() - c0
            last_seq = max(seqs)
            stored = (await nc_pub.jetstream().stream_info(config.events_stream)).state
            if stored.messages != len(events) + args.workers or len(set(seqs)) != len(seqs):
                raise RuntimeError(
                    f"stream holds {stored.messages} messages, expected "
                    f"{len(events) + args.workers}"
                )
            out_of_order = sum(1 for a, b in itertools.pairwise(seqs) if b < a)
            result["ingest"] = {
                "events": len(events),
                "seconds": ingest_s,
                "cpu_s": ingest_cpu_s,
                "events_per_s": len(events) / ingest_s,
                "stored_out_of_call_order": out_of_order,
            }

            # (f) catch-up
            view = await RegistryView(nc_view, config=config).start()  # empty bucket
            collect()
            pipeline = Pipeline(nc_pipe, config, start_timeout=WAIT_TIMEOUT_S)
            c0, t0 = time.process_time(), time.perf_counter()
            writer_done = asyncio.create_task(stamp(pipeline.writer.caught_up.wait()))
            projector_done = asyncio.create_task(stamp(pipeline.projector.wait_flushed(last_seq)))
            await pipeline.start()
            await view.wait_for(last_seq, timeout=WAIT_TIMEOUT_S)
            t_view = time.perf_counter()
            catchup_cpu_s = time.process_time() - c0
            t_writer, t_projector = await writer_done, await projector_done
            stats = pipeline.projector.stats
            replayed = last_seq  # every message of the stream: WorkerAdded included
            result["catchup"] = {
                "events": replayed,
                "seconds": t_view - t0,
                "cpu_s": catchup_cpu_s,
                "events_per_s": replayed / (t_view - t0),
                "writer_folded_s": t_writer - t0,
                "projector_flushed_s": t_projector - t0,
                "deltas_published": pipeline.writer.stats.deltas_published,
                "deltas_applied": stats.deltas,
                "flushes": stats.flushes,
                "keys_written": stats.keys_written,
                "keys_deleted": stats.keys_deleted,
                "flush_failures": stats.flush_failures,
                "view_values_received": view.values_received,
                "outcomes": {k: v for k, v in pipeline.writer.state.counters.items() if v},
                "live_requests_at_end": len(pipeline.writer.state.requests),
                "view_equals_writer": view_matches_writer(view, pipeline, queries),
            }

            # (h) and (g) on the state the trace leaves behind
            result["read_after_trace"] = read_latency(
                view, queries, args.read_calls, args.loads_calls
            )
            result["live_after_trace"] = await live_latency(
                pub, view, probes, args.workers, args.samples, args.gap_ms / 1000, "a"
            )

            # Populate: --live trace requests added and left live; then (g) and (h) again.
            if live:
                adds: list[Event] = [
                    msgspec.structs.replace(
                        add_event(lc, lc.index % args.workers), request_id=f"live-{lc.index}"
                    )
                    for lc in live
                ]
                populated = max(await publish_all(pub, adds, args.chunk))
                await view.wait_for(populated, timeout=WAIT_TIMEOUT_S)
                result["live_with_load"] = await live_latency(
                    pub, view, probes, args.workers, args.samples, args.gap_ms / 1000, "b"
                )
                result["read_with_load"] = read_latency(
                    view, queries, args.read_calls, args.loads_calls
                )
                result["read_with_load"]["live_requests"] = len(pipeline.writer.state.requests)
                result["read_with_load"]["view_equals_writer"] = view_matches_writer(
                    view, pipeline, queries
                )
            stats = pipeline.projector.stats
            result["projector_total"] = {
                "deltas_applied": stats.deltas,
                "flushes": stats.flushes,
                "keys_written": stats.keys_written,
                "flush_failures": stats.flush_failures,
            }
        finally:
            if view is not None:
                await view.stop()
            if pipeline is not None:
                await pipeline.stop()
            for nc in (nc_view, nc_pipe, nc_pub):
                await nc.drain()
    return result


# ---- reporting ----------------------------------------------------------------------------


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ingest_events_per_s": median_of([r["ingest"] for r in runs], "events_per_s"),
        "catchup_events_per_s": median_of([r["catchup"] for r in runs], "events_per_s"),
    }
    for key in ("live_after_trace", "live_with_load"):
        if key in runs[0]:
            for part in ("ack", "view"):
                for q in ("p50_ms", "p90_ms", "p99_ms"):
                    out[f"{key}_{part}_{q}"] = statistics.median(r[key][part][q] for r in runs)
    for key in ("read_after_trace", "read_with_load"):
        if key in runs[0]:
            for q in ("potential_loads_median_us", "potential_loads_p99_us", "loads_median_us"):
                out[f"{key}_{q}"] = median_of([r[key] for r in runs], q)
    return out


def print_report(report: dict[str, Any]) -> None:
    m, w, runs, s = report["machine"], report["workload"], report["runs"], report["summary"]
    print_head("seqstate pipeline benchmark over NATS (benchmarks/pipeline.py)", m)
    print_software(m, runs[0]["nats_server"])
    print(
        f"  trace      : {w['trace']} ({w['requests']:,} requests, {w['events']:,} events, "
        f"{w['workers']} workers round-robin, {w['runs']} runs, fresh server + store per run)"
    )
    print(
        f"  setup      : one process, one event loop; RouterPublisher max_pending "
        f"{w['max_pending']}, gather chunks of {w['chunk']}; flush interval "
        f"{w['flush_interval_ms']:g} ms; the view runs in this process"
    )

    e = [r["ingest"] for r in runs]
    print("\n(e) ingest: RouterPublisher → SEQSTATE_EVENTS, concurrent publishes, acks awaited")
    print(f"    median {s['ingest_events_per_s']:,.0f} events/s")
    print(f"    runs (events/s): {fmt_rates([x['events_per_s'] for x in e])}")
    print(
        "    this process's CPU / wall (per run): "
        + ", ".join(f"{x['cpu_s']:.2f}/{x['seconds']:.2f} s" for x in e)
    )
    print(f"    stored out of call order (per run): {[x['stored_out_of_call_order'] for x in e]}")

    f = [r["catchup"] for r in runs]
    print(
        f"\n(f) catch-up: Pipeline.start → view.applied_seq == last seq "
        f"({f[0]['events']:,} events in the stream)"
    )
    print(f"    median {s['catchup_events_per_s']:,.0f} events/s")
    print(f"    runs (events/s): {fmt_rates([x['events_per_s'] for x in f])}")
    print(
        "    this process's CPU / wall (per run): "
        + ", ".join(f"{x['cpu_s']:.2f}/{x['seconds']:.2f} s" for x in f)
    )
    for i, x in enumerate(f, 1):
        print(
            f"    run {i}: writer folded at {x['writer_folded_s']:.2f} s, projector flushed at "
            f"{x['projector_flushed_s']:.2f} s, view at {x['seconds']:.2f} s; "
            f"{x['deltas_applied']:,} deltas → {x['flushes']:,} flushes, "
            f"{x['keys_written']:,} keys written ({x['keys_written'] / x['deltas_applied']:.3f} "
            f"per delta); view == writer: {x['view_equals_writer']}"
        )
    print(
        f"    outcomes (last run): {f[-1]['outcomes']}; live at end {f[-1]['live_requests_at_end']}"
    )

    for key, label in (("live_after_trace", "after (f)"), ("live_with_load", "with load")):
        if key not in runs[0]:
            continue
        g = [r[key] for r in runs]
        state = (
            "the state the trace leaves (no live requests)"
            if key == "live_after_trace"
            else f"{w['live']:,} live trace requests"
        )
        print(
            f"\n(g) live latency {label}: {g[0]['samples']} AddRequests one at a time, "
            f"{w['gap_ms']:g} ms apart, on {state}"
        )
        print(
            f"    publish → view reflects it: p50 {s[key + '_view_p50_ms']:.2f} ms, p90 "
            f"{s[key + '_view_p90_ms']:.2f} ms, p99 {s[key + '_view_p99_ms']:.2f} ms"
        )
        print(
            f"    publish → ack alone:        p50 {s[key + '_ack_p50_ms']:.2f} ms, p90 "
            f"{s[key + '_ack_p90_ms']:.2f} ms, p99 {s[key + '_ack_p99_ms']:.2f} ms"
        )
        for i, x in enumerate(g, 1):
            v = x["view"]
            print(
                f"    run {i}: p50 {v['p50_ms']:.2f}  p90 {v['p90_ms']:.2f}  p99 "
                f"{v['p99_ms']:.2f}  max {v['max_ms']:.2f} ms"
            )
        print("    (view in this process; another process adds ~the KV watch latency)")

    for key, label in (("read_after_trace", "after (f)"), ("read_with_load", "with load")):
        if key not in runs[0]:
            continue
        h = [r[key] for r in runs]
        x = h[-1]
        live = f", {x['live_requests']:,} live requests" if "live_requests" in x else ""
        print(
            f"\n(h) read latency {label}: {x['ranks']} ranks{live}, {x['present_hashes']:,} "
            f"present hashes; {x['distinct_queries']} trace queries (mean "
            f"{x['mean_query_blocks']:.1f} blocks, best overlap {x['mean_best_overlap_depth']:.1f})"
        )
        print(
            f"    potential_loads: median {s[key + '_potential_loads_median_us']:.1f} us, p99 "
            f"{s[key + '_potential_loads_p99_us']:.1f} us ({x['calls']:,} calls/run); "
            f"loads(): median {s[key + '_loads_median_us']:.1f} us"
        )
        if "view_equals_writer" in x:
            print(f"    view == writer's registry: {[r['view_equals_writer'] for r in h]}")

    t = runs[-1]["projector_total"]
    print(
        f"\nprojector over the whole last run: {t['deltas_applied']:,} deltas → "
        f"{t['flushes']:,} flushes, {t['keys_written']:,} keys written, "
        f"{t['flush_failures']} flush failures"
    )
    print(f"wall time: {report['wall_s']:.1f} s")


# ---- main ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argument_parser(__doc__)
    add_trace(p)
    p.add_argument("--runs", type=positive, default=3, help="runs, each on a fresh server")
    add_json(p)
    p.add_argument("--requests", type=positive, default=None, help="use the first N requests")
    p.add_argument("--workers", type=positive, default=16, help="workers, round-robin")
    p.add_argument("--chunk", type=positive, default=1024, help="(e) events per gather")
    p.add_argument("--max-pending", type=positive, default=256, help="publisher's max_pending")
    p.add_argument("--samples", type=positive, default=300, help="(g) samples per state")
    p.add_argument("--gap-ms", type=float, default=5.0, help="(g) pause between samples")
    p.add_argument("--queries", type=positive, default=128, help="(h) distinct trace queries")
    p.add_argument("--read-calls", type=positive, default=10_000, help="(h) calls per run")
    p.add_argument("--loads-calls", type=positive, default=2_000, help="(h) loads() calls")
    p.add_argument(
        "--live", type=int, default=2000, help="trace requests left live for (g)/(h) with load"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    trace: Path = args.trace
    records = read_trace(trace, "pipeline.py")
    if records is None:
        return 2
    everything = lifecycles(records)
    requests = everything[: args.requests] if args.requests else everything
    steps = timeline(requests)
    events = [event for _, event in round_robin_events(requests, steps, args.workers)]
    live = everything[: max(0, args.live)]
    probes = spread(everything, 64)
    queries = [(lc.hashes, lc.isl) for lc in spread(everything, args.queries)]

    report: dict[str, Any] = {
        "machine": machine(),
        "workload": {
            "trace": str(trace),
            "requests": len(requests),
            "events": len(events),
            "workers": args.workers,
            "runs": args.runs,
            "chunk": args.chunk,
            "max_pending": args.max_pending,
            "flush_interval_ms": Config().flush_interval_s * 1000,
            "samples": args.samples,
            "gap_ms": args.gap_ms,
            "live": len(live),
        },
    }
    started = time.perf_counter()
    runs = []
    for run in range(args.runs):
        runs.append(asyncio.run(one_run(args, run, events, live, probes, queries)))
    report["runs"] = runs
    report["summary"] = summarize(runs)
    report["wall_s"] = time.perf_counter() - started
    emit(report, args.json, print_report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
