"""Replay a real request trace through ``seqstate.SequenceState`` and measure the pure core.

Why this exists: the writer folds every lifecycle event of a router pool through
``SequenceState.apply`` on one Python thread, and a scheduler calls
``registry.potential_loads`` once per routing decision. Whether a pure-Python core is fast and
small enough is a question of numbers on real traffic, not on synthetic unit-test data, so this
script replays the Mooncake FAST'25 conversation trace (one hour, 12,031 requests) in process,
with no NATS and no I/O in the measured regions, and reports:

(a) fold throughput: events/s of ``state.apply`` over the whole trace, workers round-robin;
(b) routed throughput: requests/s when every AddRequest is first routed with
    ``potential_loads`` (least ``prefill_tokens / block_size + decode_blocks``) and then booked;
(c) ``potential_loads`` latency over 64 workers for a 128-block query (median, p90, p99);
(d) memory retained per live request (tracemalloc), hash lists and hash ints included.

Each request of the trace becomes an AddRequest at its timestamp, a MarkPrefillCompleted after
a modeled prefill (``input_length * 0.05 ms + 20 ms``; only even-indexed requests tell the
state that duration, odd ones are unmodeled, the mark time is the same formula for both) and a
Free after ``output_length * 20 ms`` of decode. Everything is deterministic: the same trace and
arguments give the same event log; only the timings vary from run to run.

Run from the repository root: ``.venv/bin/python benchmarks/fold.py [--runs N] [--json]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from harness.cli import add_json, add_trace, argument_parser, positive
from harness.measure import collect, percentile
from harness.report import emit, fmt_rates, machine, print_head, verdict
from harness.workload import (
    ADD,
    DECODE_NS_PER_TOKEN,
    MARK,
    NS_PER_MS,
    NS_PER_S,
    PREFILL_BASE_MS,
    PREFILL_MS_PER_TOKEN,
    Lifecycle,
    Step,
    add_event,
    lifecycles,
    read_trace,
    round_robin_events,
    timeline,
)

from seqstate import (
    Event,
    Free,
    MarkPrefillCompleted,
    SequenceState,
    WorkerAdded,
    decode_event,
    encode_event,
)

TARGET_FOLD_EVENTS_PER_S: Final = 150_000
TARGET_LATENCY_MEDIAN_US: Final = 100.0


# ---- the workload -------------------------------------------------------------------------


def new_state(workers: int, expiry_s: float | None = 300.0) -> SequenceState:
    """A fresh state with ``workers`` registered single-rank workers (setup, never timed)."""
    state = SequenceState(expiry_s=expiry_s)
    for worker_id in range(workers):
        state.apply(WorkerAdded(worker_id=worker_id), 0)
    return state


# ---- (a) fold throughput ------------------------------------------------------------------


def fold_once(events: Sequence[tuple[int, Event]], workers: int) -> tuple[float, SequenceState]:
    state = new_state(workers)
    apply = state.apply
    start = time.perf_counter()
    for at_ns, event in events:
        apply(event, at_ns)
    elapsed = time.perf_counter() - start
    return elapsed, state


def bench_fold(
    requests: Sequence[Lifecycle], steps: Sequence[Step], workers: int, runs: int
) -> dict[str, Any]:
    events = round_robin_events(requests, steps, workers)  # built before any timing
    times = []
    counters: dict[str, int] = {}
    live = -1
    for _ in range(runs):
        collect()
        elapsed, state = fold_once(events, workers)
        times.append(elapsed)
        counters = dict(state.counters)
        live = len(state.requests)
        del state
    rates = [len(events) / t for t in times]
    return {
        "events": len(events),
        "workers": workers,
        "seconds": times,
        "events_per_s": rates,
        "median_events_per_s": statistics.median(rates),
        "target_events_per_s": TARGET_FOLD_EVENTS_PER_S,
        "meets_target": statistics.median(rates) >= TARGET_FOLD_EVENTS_PER_S,
        "counters_last_run": {k: v for k, v in counters.items() if v},
        "live_requests_at_end": live,
    }


# ---- (b) routed and booked ----------------------------------------------------------------


def route_once(
    requests: Sequence[Lifecycle], steps: Sequence[Step], workers: int, block_tokens: int
) -> tuple[float, SequenceState, list[int]]:
    state = new_state(workers)
    apply = state.apply
    potential_loads = state.registry.potential_loads
    chosen = [0] * len(requests)
    start = time.perf_counter()
    for at_ns, kind, i in steps:
        lc = requests[i]
        if kind == ADD:
            best_worker = -1
            best_cost = math.inf
            # Rows come sorted by (worker_id, dp_rank): a strict < keeps the lowest id on ties.
            for row in potential_loads(lc.hashes, lc.isl, at_ns):
                cost = row.potential_prefill_tokens / block_tokens + row.potential_decode_blocks
                if cost < best_cost:
                    best_cost = cost
                    best_worker = row.worker_id
            chosen[i] = best_worker
            apply(add_event(lc, best_worker), at_ns)
        elif kind == MARK:
            apply(MarkPrefillCompleted(request_id=lc.request_id, worker_id=chosen[i]), at_ns)
        else:
            apply(Free(request_id=lc.request_id, worker_id=chosen[i]), at_ns)
    elapsed = time.perf_counter() - start
    return elapsed, state, chosen


def bench_route(
    requests: Sequence[Lifecycle],
    steps: Sequence[Step],
    workers: int,
    block_tokens: int,
    runs: int,
) -> dict[str, Any]:
    times = []
    chosen: list[int] = []
    counters: dict[str, int] = {}
    for _ in range(runs):
        collect()
        elapsed, state, chosen = route_once(requests, steps, workers, block_tokens)
        times.append(elapsed)
        counters = dict(state.counters)
        del state
    rates = [len(requests) / t for t in times]
    per_worker = [0] * workers
    for w in chosen:
        per_worker[w] += 1
    return {
        "requests": len(requests),
        "events": len(steps),
        "workers": workers,
        "block_tokens": block_tokens,
        "seconds": times,
        "requests_per_s": rates,
        "median_requests_per_s": statistics.median(rates),
        "median_events_per_s": statistics.median(len(steps) / t for t in times),
        "requests_per_worker_min_max": [min(per_worker), max(per_worker)],
        "counters_last_run": {k: v for k, v in counters.items() if v},
    }


# ---- (c) potential_loads latency ----------------------------------------------------------


def latency_queries(
    populated: Sequence[Lifecycle], count: int, length: int, shared: int, fresh_base: int
) -> list[list[int]]:
    """``count`` queries of ``length`` hashes: up to ``shared`` leading hashes of a live request
    (a continuing conversation), then hashes present nowhere (its new turn)."""
    sources = [lc for lc in populated if len(lc.hashes) >= 8] or list(populated)
    step = max(1, len(sources) // count)
    queries = []
    for q, lc in enumerate(sources[::step][:count]):
        head = lc.hashes[:shared]
        tail = [fresh_base + q * length + k for k in range(length - len(head))]
        queries.append(head + tail)
    return queries


def bench_latency(
    requests: Sequence[Lifecycle],
    workers: int,
    populate: int,
    query_blocks: int,
    shared_blocks: int,
    block_tokens: int,
    calls: int,
    runs: int,
) -> dict[str, Any]:
    populated = requests[:populate]
    state = new_state(workers, expiry_s=None)
    for lc in populated:  # adds only: every request still live and still prefilling
        state.apply(add_event(lc, lc.index % workers), lc.add_ns)
    now_ns = populated[-1].add_ns + NS_PER_S
    fresh_base = max(h for lc in requests for h in lc.hashes) + 1
    queries = latency_queries(populated, 32, query_blocks, shared_blocks, fresh_base)
    isl = query_blocks * block_tokens
    registry = state.registry
    potential_loads = registry.potential_loads
    best_depths = [max(registry.overlap_depths(q).values(), default=0) for q in queries]
    ranks_hit = [len(registry.overlap_depths(q)) for q in queries]
    loads = registry.loads(now_ns)
    modeled_ranks = sum(1 for row in loads if row.modeled_remaining_prefill_ms is not None)

    per_run: list[dict[str, float]] = []
    nq = len(queries)
    for _ in range(runs):
        collect()
        for k in range(500):  # warm-up
            potential_loads(queries[k % nq], isl, now_ns)
        samples: list[int] = []
        record = samples.append
        clock = time.perf_counter_ns
        for k in range(calls):
            query = queries[k % nq]
            t0 = clock()
            potential_loads(query, isl, now_ns)
            record(clock() - t0)
        samples.sort()
        per_run.append(
            {
                "median_us": statistics.median(samples) / 1000,
                "p90_us": percentile(samples, 90) / 1000,
                "p99_us": percentile(samples, 99) / 1000,
                "mean_us": statistics.fmean(samples) / 1000,
            }
        )
    summary = {
        key: statistics.median(run[key] for run in per_run)
        for key in ("median_us", "p90_us", "p99_us", "mean_us")
    }
    return {
        "workers": workers,
        "live_requests": len(state.requests),
        "present_hashes": registry.membership_size(),
        "ranks_all_modeled_prefill": modeled_ranks,
        "query_blocks": query_blocks,
        "query_shared_blocks_max": shared_blocks,
        "isl_tokens": isl,
        "distinct_queries": nq,
        "mean_best_overlap_depth": statistics.fmean(best_depths),
        "mean_ranks_with_overlap": statistics.fmean(ranks_hit),
        "calls_per_run": calls,
        "runs": per_run,
        **summary,
        "target_median_us": TARGET_LATENCY_MEDIAN_US,
        "meets_target": summary["median_us"] <= TARGET_LATENCY_MEDIAN_US,
    }


# ---- (d) memory per live request ----------------------------------------------------------


def bench_memory(requests: Sequence[Lifecycle], workers: int, top: int) -> dict[str, Any]:
    """Traced memory of a state holding every request live, minus an empty state.

    Events are pre-encoded (outside the measurement) and decoded inside it, as the writer
    does: the state keeps each decoded event's request id, hash list and hash ints, which are
    therefore counted; the event structs themselves are dropped after ``apply`` and are not.
    """
    payloads = [encode_event(add_event(lc, lc.index % workers)) for lc in requests]
    times = [lc.add_ns for lc in requests]
    collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    state = new_state(workers, expiry_s=None)
    collect()
    empty = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.reset_peak()
    apply = state.apply
    for data, at_ns in zip(payloads, times, strict=True):
        apply(decode_event(data), at_ns)
    collect()
    current, peak = tracemalloc.get_traced_memory()
    snapshot = tracemalloc.take_snapshot()
    tracemalloc.stop()
    live = len(state.requests)
    full = current - base
    sites = []
    for stat in snapshot.statistics("lineno")[:top]:
        frame = stat.traceback[0]
        name = Path(frame.filename)
        where = f"{name.parent.name}/{name.name}:{frame.lineno}"
        sites.append({"site": where, "bytes": stat.size, "blocks": stat.count})
    return {
        "live_requests": live,
        "workers": workers,
        "blocks_referenced": sum(len(lc.hashes) for lc in requests),
        "present_hashes": state.registry.membership_size(),
        "empty_state_bytes": empty,
        "full_state_bytes": full,
        "retained_bytes": full - empty,
        "bytes_per_live_request": (full - empty) / live,
        "peak_bytes_during_fold": peak - base - empty,
        "peak_bytes_per_live_request": (peak - base - empty) / live,
        "hash_lists_and_ints_counted": True,
        "event_structs_counted": False,
        "top_sites": sites,
    }


# ---- reporting ----------------------------------------------------------------------------


def print_report(report: dict[str, Any]) -> None:
    m = report["machine"]
    print_head("seqstate fold benchmark (benchmarks/fold.py)", m)
    print(f"  python     : {m['python']}; msgspec {m['msgspec']}; gc enabled {m['gc_enabled']}")
    print(f"  seqstate   : git {m['git']}; sources sha256 {m['seqstate_sha256']}")
    w = report["workload"]
    print(
        f"  trace      : {w['trace']} ({w['requests']:,} requests, {w['events']:,} events, "
        f"{w['blocks']:,} block refs, {w['runs']} runs)"
    )
    print(f"  model      : {w['model']}")

    if "fold" in report:
        a = report["fold"]
        print(
            f"\n(a) fold: state.apply over the whole trace, round-robin over {a['workers']} workers"
        )
        print(
            f"    median {a['median_events_per_s']:,.0f} events/s   target >= "
            f"{a['target_events_per_s']:,} events/s: {verdict(a['meets_target'])}"
        )
        print(f"    runs (events/s): {fmt_rates(a['events_per_s'])}")
        print("    timed: the apply loop only; events built before timing, fresh state per run")
        print(
            f"    outcomes (last run): {a['counters_last_run']}; live at end "
            f"{a['live_requests_at_end']}"
        )

    if "route" in report:
        b = report["route"]
        print(
            f"\n(b) routed + booked: potential_loads over {b['workers']} workers, least "
            f"prefill/{b['block_tokens']} + decode_blocks, then apply (mark/free too)"
        )
        print(
            f"    median {b['median_requests_per_s']:,.0f} requests/s booked "
            f"({b['median_events_per_s']:,.0f} events/s incl. marks and frees)"
        )
        print(f"    runs (requests/s): {fmt_rates(b['requests_per_s'])}")
        print(
            "    timed: the whole loop (route, build each event for the chosen worker, apply); "
            "requests/s = requests / loop time"
        )
        lo, hi = b["requests_per_worker_min_max"]
        print(f"    requests per worker: min {lo:,}, max {hi:,}; outcomes {b['counters_last_run']}")

    if "latency" in report:
        c = report["latency"]
        print(
            f"\n(c) potential_loads latency: {c['workers']} workers, {c['live_requests']:,} live "
            f"requests ({c['present_hashes']:,} present hashes, {c['ranks_all_modeled_prefill']}"
            f" ranks fully modeled), {c['query_blocks']}-block query, isl {c['isl_tokens']:,}"
        )
        print(
            f"    queries: {c['distinct_queries']} distinct, first <= "
            f"{c['query_shared_blocks_max']} blocks from a live request; mean best overlap "
            f"{c['mean_best_overlap_depth']:.1f} blocks on {c['mean_ranks_with_overlap']:.1f} "
            "ranks"
        )
        print(
            f"    median {c['median_us']:.1f} us, p90 {c['p90_us']:.1f} us, p99 "
            f"{c['p99_us']:.1f} us (mean {c['mean_us']:.1f} us; {c['calls_per_run']:,} calls/run)"
            f"   target median <= {c['target_median_us']:.0f} us: {verdict(c['meets_target'])}"
        )
        for i, run in enumerate(c["runs"], 1):
            print(
                f"    run {i}: median {run['median_us']:.1f}  p90 {run['p90_us']:.1f}  "
                f"p99 {run['p99_us']:.1f} us"
            )

    if "memory" in report:
        d = report["memory"]
        print(
            f"\n(d) memory: {d['live_requests']:,} live requests on {d['workers']} workers "
            f"({d['blocks_referenced']:,} block refs, {d['present_hashes']:,} present hashes), "
            "tracemalloc"
        )
        print(
            f"    {d['bytes_per_live_request']:,.0f} bytes per live request "
            f"(retained {d['retained_bytes'] / 2**20:.2f} MiB = full "
            f"{d['full_state_bytes']:,} - empty state {d['empty_state_bytes']:,} bytes)"
        )
        print(
            f"    peak during fold {d['peak_bytes_during_fold'] / 2**20:.2f} MiB "
            f"({d['peak_bytes_per_live_request']:,.0f} bytes per live request)"
        )
        print(
            "    counted: request ids, block-hash lists and hash ints (decoded inside the "
            "measured region, retained by the state); not counted: the transient event structs"
        )
        for site in d["top_sites"]:
            print(
                f"      {site['bytes'] / 2**20:7.2f} MiB  {site['blocks']:>8,} blocks  "
                f"{site['site']}"
            )


# ---- main ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argument_parser(__doc__)
    add_trace(p)
    p.add_argument("--runs", type=positive, default=5, help="timed runs per measurement")
    add_json(p)
    p.add_argument("--workers", type=positive, default=16, help="workers for (a), (b) and (d)")
    p.add_argument("--latency-workers", type=positive, default=64, help="workers for (c)")
    p.add_argument(
        "--latency-populate", type=positive, default=2000, help="requests live in the (c) state"
    )
    p.add_argument("--latency-calls", type=positive, default=20_000, help="calls per (c) run")
    p.add_argument("--query-blocks", type=positive, default=128, help="(c) query length")
    p.add_argument(
        "--shared-blocks",
        type=positive,
        default=64,
        help="(c) at most this many leading query blocks come from a live request",
    )
    p.add_argument("--block-tokens", type=positive, default=512, help="tokens per KV block")
    p.add_argument("--limit", type=positive, default=None, help="use only the first N requests")
    p.add_argument("--only", default="abcd", help="subset of sections to run, e.g. 'ac'")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    trace: Path = args.trace
    records = read_trace(trace, "fold.py")
    if records is None:
        return 2
    if args.limit is not None:
        records = records[: args.limit]
    requests = lifecycles(records)
    steps = timeline(requests)
    sections = set(args.only.lower())

    report: dict[str, Any] = {
        "machine": machine(),
        "workload": {
            "trace": str(trace),
            "requests": len(requests),
            "events": len(steps),
            "blocks": sum(len(lc.hashes) for lc in requests),
            "runs": args.runs,
            "model": (
                f"add at timestamp; mark after {PREFILL_MS_PER_TOKEN} ms/token + "
                f"{PREFILL_BASE_MS:.0f} ms (told to the state for even indexes only); free "
                f"{DECODE_NS_PER_TOKEN // NS_PER_MS} ms/output token after mark; expiry 300 s"
            ),
        },
    }
    if "a" in sections:
        report["fold"] = bench_fold(requests, steps, args.workers, args.runs)
    if "b" in sections:
        report["route"] = bench_route(requests, steps, args.workers, args.block_tokens, args.runs)
    if "c" in sections:
        report["latency"] = bench_latency(
            requests,
            args.latency_workers,
            min(args.latency_populate, len(requests)),
            args.query_blocks,
            args.shared_blocks,
            args.block_tokens,
            args.latency_calls,
            args.runs,
        )
    if "d" in sections:
        report["memory"] = bench_memory(requests, args.workers, top=6)

    emit(report, args.json, print_report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
