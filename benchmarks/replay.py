"""Replay a million events from SEQSTATE_EVENTS and restart a writer from a snapshot.

Why this exists: there are two targets for the log as the source of truth, on this machine:

(r1) replay throughput: fold 1,000,000 events from the stream into a fresh ``SequenceState``
     with ``projector.write.log_fold.fold_stream`` (what ``seqstate replay`` uses: its fast path, a
     reader process speaking the NATS protocol, when it has one; otherwise nats-py's ordered
     push consumer), from sequence 1 to the last, no snapshot. Target: at least 100,000
     events/s;
(r2) start to ready: with 1,000,000 events in the stream and a snapshot within the last
     10,000, the time from ``build_writer(nc, config)`` to ``writer.caught_up``. Target: under 2 s.

Setup (timed and reported, never part of a target): a fresh embedded nats-server
(``NatsServer``, temporary store), ``ensure`` with the default ``Config``, 16 ``WorkerAdded``
on the control subject, then the Mooncake conversation trace's lifecycles (as
``benchmarks/fold.py`` builds them: AddRequest / MarkPrefillCompleted / Free, 16 workers
round-robin, timeline order) repeated pass after pass with distinct request ids (``req-<i>.<pass>``)
until the stream holds ``--events`` messages; the last pass is cut short, so a few requests
stay live. Each event is encoded with ``seqstate.encode_event`` and sent with
``js.publish_async`` on ``config.event_subject(worker, rank)``, pipelined (the JetStream
context bounds the unacknowledged publishes at ``--max-pending``), and every ack future is
checked. Log time is the publish time: the trace's hours are compressed into the ingest.

(r1) Each run opens a new connection and calls ``fold_stream(start_seq=1, end_seq=last)``;
the time covers starting the reader process (fast path), creating the consumer, folding every
message and cleaning up. Each run's final state is encoded with ``state.snapshot()``; all runs
must give the same bytes. CPU is reported for this process, the reader child (waited for, so
``RUSAGE_CHILDREN``) and the nats-server (``/proc/<pid>/stat``): with 2 vCPUs, three busy
processes share 2 CPU-seconds per second. When ``fold_stream`` has the fast path,
``--client-runs`` runs of ``fold_stream(fast=False)`` (nats-py) are measured for comparison,
and must fold the same state.

(r2) Untimed preparation: fold in process to ``last - --tail`` (5,000), save that state with
``SnapshotStore.save`` (stored, read back, compared). The writer restores only a snapshot
whose deltas are all on SEQSTATE_DELTAS (``Writer._restore``: ``newest_valid(at_most_seq=
<Seqstate-Source-Seq of the newest DELTAS message>)``), so the DELTAS stream gets one marker
message: an echo delta at ``last - tail``, stored by the writer's own delta log. This is the
position a writer that ran up to the snapshot would have left behind.

Each run then starts a writer on a new connection and times ``build_writer(nc, config)`` →
``create_task(writer.run())`` → ``writer.caught_up``: ``ensure``, reading the newest delta,
opening the snapshot store, loading and decoding the snapshot, the coverage check, creating the
consumer, and folding the 5,000-event tail while publishing its deltas. The phases are timed by
wrapping the writer's own calls on the instance (``snapshots.newest_valid``,
``snapshots.fetch``, ``_js.subscribe``; once per run, nothing per message). The run asserts
``writer.stats.restored_from == last - tail``.

Keeping the runs identical: a writer that ran publishes deltas for the tail (the newest delta
then says ``last``) and, when stopped, saves a final snapshot at ``last``; the next run would
restore from that one and fold nothing. So each run stops its writer cleanly (``stop()``, then
``run()`` returns after every delta is acknowledged and the final snapshot is saved: the run's
checks include that), and before the next run the script deletes every snapshot except the
prepared one and recreates SEQSTATE_DELTAS holding only the marker. The stream is deleted, not
purged, so the server's duplicate window (the writer's deltas carry ``Nats-Msg-Id``) starts
empty as well and every run publishes its deltas for real. The events stream must still end
at ``last`` after every run (no Tick slipped in). The writer's final state must equal (r1)'s
byte for byte: snapshot + tail == full replay.

Profile (when (r1) misses its target, or ``--profile``): (p1) nats-py alone: the ordered
consumer of the fallback path with a callback that only reads the sequence and log time (and
keeps the payload); (p1b) the fast path's reader process and pipe alone (``fast_fold`` with a
callback that folds nothing); (p2) the core alone: ``decode_event`` + ``apply`` over the
stream's own payloads in process, as ``fold_stream`` folds (registry deferred, GC off) and
with the registry kept current and GC on; (p3) ``cProfile`` over one ``fold_stream`` (this
process only, not the reader), grouped by where the time goes; a builtin's time goes to its
caller's group. cProfile inflates per-call costs of Python code; read shares, not seconds.

Run from the repository root: ``.venv/bin/python benchmarks/replay.py [--runs N] [--json]``
(``--events 100000`` for a quick look). One invocation builds its own server; nothing is cached.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import inspect
import json
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
from harness.cli import add_json, add_trace, argument_parser, positive
from harness.measure import children_cpu_s, collect, process_cpu_s
from harness.report import REPO_ROOT, emit, git_revision, machine
from harness.servers import connect, server_version
from harness.workload import WAIT_TIMEOUT_S, base_events, encoded, fill
from nats.aio.client import Client
from nats.js.errors import NotFoundError
from replay_profile import client_alone, core_alone, profiled_replay, reader_alone
from replay_report import print_report

import seqstate.state
from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.nats.snapshots import SnapshotStore
from projector.run.assemble import build_delta_log, build_writer
from projector.settings.config import Config
from projector.write.log_fold import fold_stream
from seqstate import Delta, Event, SequenceState

TARGET_REPLAY_EVENTS_PER_S: Final = 100_000
TARGET_READY_S: Final = 2.0
SNAPSHOT_WITHIN: Final = 10_000  # the writer's default --snapshot-every-events


# ---- the workload -------------------------------------------------------------------------


def digest(state: SequenceState) -> str:
    return hashlib.sha256(state.snapshot()).hexdigest()[:16]


# ---- (r1) replay throughput ---------------------------------------------------------------


class Warnings(logging.Handler):
    """Collects what ``projector.ops.replay`` logs (e.g. the fast path falling back)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def replay_once(
    url: str, config: Config, last: int, server_pid: int | None, **options: Any
) -> dict[str, Any]:
    nc = await connect(url, "bench-replay")
    warnings = Warnings()
    logger = logging.getLogger("seqstate.replay")
    logger.addHandler(warnings)
    try:
        state = config.new_state()
        collect()
        s0 = process_cpu_s(server_pid)
        c0, k0, t0 = time.process_time(), children_cpu_s(), time.perf_counter()
        first, last_folded, count, dead = await fold_stream(
            nc, config, state, start_seq=1, end_seq=last, **options
        )
        seconds = time.perf_counter() - t0
        cpu, child_cpu = time.process_time() - c0, children_cpu_s() - k0
        server_cpu = process_cpu_s(server_pid) - s0
    finally:
        logger.removeHandler(warnings)
        await nc.drain()
    if (first, last_folded, count, dead) != (1, last, last, 0):
        raise RuntimeError(f"replay folded {first}..{last_folded}, {count} events, {dead} dead")
    return {
        "options": options,
        "events": count,
        "seconds": seconds,
        "cpu_s": cpu,
        "child_cpu_s": child_cpu,
        "server_cpu_s": server_cpu,
        "events_per_s": count / seconds,
        "warnings": warnings.messages,
        "digest": digest(state),
        "live_requests": len(state.requests),
        "outcomes": {k: v for k, v in state.counters.items() if v},
    }


def has_fast_path() -> bool:
    return "fast" in inspect.signature(fold_stream).parameters


# ---- (r2) start to ready ------------------------------------------------------------------


async def prepare_snapshot(
    nc: Client, config: Config, snap_seq: int
) -> tuple[SnapshotStore, dict[str, Any]]:
    """Fold to ``snap_seq`` in process and store that state as a verified snapshot."""
    state = config.new_state()
    t0 = time.perf_counter()
    await fold_stream(nc, config, state, start_seq=1, end_seq=snap_seq)
    fold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    data = state.snapshot()
    encode_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    restored = SequenceState.restore(data)
    decode_s = time.perf_counter() - t0
    if restored.snapshot() != data:
        raise RuntimeError("the snapshot does not survive restore + snapshot")
    store = await SnapshotStore(nc, config).open()
    t0 = time.perf_counter()
    info = await store.save(data, snap_seq, state.now_ns)
    save_s = time.perf_counter() - t0
    return store, {
        "applied_seq": snap_seq,
        "name": info.name,
        "bytes": len(data),
        "live_requests": len(state.requests),
        "ended_ids": len(state.ended),
        "tombstones": len(state.tombstones),
        "fold_s": fold_s,
        "encode_s": encode_s,
        "decode_in_process_s": decode_s,
        "save_s": save_s,
    }


async def reset_for_run(
    nc: Client, config: Config, store: SnapshotStore, snap_seq: int
) -> list[str]:
    """Only the prepared snapshot, and a DELTAS stream holding only the marker at ``snap_seq``."""
    removed = []
    for info in await store.list():
        if info.applied_seq != snap_seq:
            await store.store.delete(info.name)
            removed.append(info.name)
    js = nc.jetstream()
    with contextlib.suppress(NotFoundError):
        await js.delete_stream(config.deltas_stream)
    await ensure(nc, config)
    # What a writer that ran up to the snapshot leaves: its delta log's message at snap_seq.
    log = build_delta_log(nc, config)
    await log.take_batches()
    await log.open()
    log.start(lambda exc: None)
    log.append(Delta("echo", 0, seq=snap_seq))
    await log.flush()
    await log.close()
    return removed


class PhaseClock:
    """Wraps awaited methods of one object (on the instance) to record when each call ran."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[float, float]]] = {}

    def wrap(self, obj: object, name: str, label: str) -> None:
        original: Callable[..., Awaitable[Any]] = getattr(obj, name)
        calls = self.calls.setdefault(label, [])

        async def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await original(*args, **kwargs)
            finally:
                calls.append((start, time.perf_counter()))

        setattr(obj, name, timed)

    def first(self, label: str) -> tuple[float, float]:
        """The first call's start and end (later calls, e.g. the stop's snapshot read-back,
        fall outside the timed start)."""
        calls = self.calls.get(label) or [(float("nan"), float("nan"))]
        return calls[0]


async def ready_once(
    url: str, config: Config, last: int, snap_seq: int, want_digest: str | None
) -> dict[str, Any]:
    t0 = time.perf_counter()
    nc = await connect(url, "bench-writer")
    connect_s = time.perf_counter() - t0
    try:
        collect()
        clock = PhaseClock()
        c0, t0 = time.process_time(), time.perf_counter()
        writer = build_writer(nc, config)
        assert writer.snapshots is not None
        clock.wrap(writer.snapshots, "newest_valid", "restore")
        clock.wrap(writer.snapshots, "fetch", "fetch")
        clock.wrap(writer._events, "start", "subscribe")
        task = asyncio.create_task(writer.run())
        ready = asyncio.create_task(writer.caught_up.wait())
        await asyncio.wait(
            {task, ready}, timeout=WAIT_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
        t_ready = time.perf_counter()
        cpu = time.process_time() - c0
        if not ready.done():
            ready.cancel()
            if task.done():
                task.result()  # the writer's own error
            raise RuntimeError(f"the writer was not ready within {WAIT_TIMEOUT_S:g} s")
        stats = writer.stats
        folded_at_ready = stats.applied
        writer.stop()
        await asyncio.wait_for(task, WAIT_TIMEOUT_S)  # clean stop: deltas acked, final snapshot
    finally:
        await nc.drain()
    if stats.restored_from != snap_seq:
        raise RuntimeError(f"the writer restored from {stats.restored_from}, not {snap_seq}")
    if stats.last_seq != last or stats.applied != last - snap_seq:
        raise RuntimeError(f"the writer folded {stats.applied} events up to {stats.last_seq}")
    if stats.deltas_published != last - snap_seq or stats.dead_letters:
        raise RuntimeError(
            f"the writer published {stats.deltas_published} deltas, "
            f"{stats.dead_letters} dead letters"
        )
    state_digest = digest(writer.state)
    if want_digest is not None and state_digest != want_digest:
        raise RuntimeError("snapshot + tail differs from the full replay")
    r_start, r_end = clock.first("restore")
    f_start, f_end = clock.first("fetch")
    s_start, s_end = clock.first("subscribe")
    return {
        "seconds": t_ready - t0,
        "cpu_s": cpu,
        "connect_s": connect_s,
        "restored_from": stats.restored_from,
        "tail_events": folded_at_ready,
        "phases_s": {
            "start_before_restore": r_start - t0,  # ensure, newest delta, open the store
            "snapshot_load": r_end - r_start,  # list, fetch, decode (SequenceState.restore)
            "snapshot_fetch": f_end - f_start,
            "snapshot_decode_and_list": (r_end - r_start) - (f_end - f_start),
            "coverage_and_target": s_start - r_end,  # the trimmed-log check
            "subscribe": s_end - s_start,  # the last event of the stream, the consumer
            "tail_fold": t_ready - s_end,  # 5,000 events folded, their deltas published
        },
        "tail_events_per_s": folded_at_ready / (t_ready - s_end),
        "batches_published": writer.deltas.messages,
        "snapshots_saved_on_stop": stats.snapshots_saved,
        "state_equals_full_replay": want_digest is not None and state_digest == want_digest,
    }


# ---- one invocation -----------------------------------------------------------------------


async def bench(args: argparse.Namespace, base: Sequence[Event]) -> dict[str, Any]:
    config = Config()
    result: dict[str, Any] = {}
    async with NatsServer() as server:
        nc = await connect(server.url, "bench-setup")
        try:
            result["nats_server"] = server_version(nc)
            await ensure(nc, config)
            t0 = time.perf_counter()
            messages = encoded(config, base, args.events, args.workers)
            build_s = time.perf_counter() - t0
            setup = await fill(nc, config, messages, args.max_pending)
            setup["build_s"] = build_s
            setup["worker_added"] = args.workers
            del messages
            result["setup"] = setup
            last = setup["last_seq"]

            pid = server.pid  # the server's CPU time, read from /proc
            runs = [await replay_once(server.url, config, last, pid) for _ in range(args.runs)]
            digests = {r["digest"] for r in runs}
            if len(digests) != 1:
                raise RuntimeError(f"the replays disagree: {digests}")
            rates = [r["events_per_s"] for r in runs]
            result["replay"] = {
                "runs": runs,
                "median_events_per_s": statistics.median(rates),
                "median_seconds": statistics.median(r["seconds"] for r in runs),
                "target_events_per_s": TARGET_REPLAY_EVENTS_PER_S,
                "meets_target": statistics.median(rates) >= TARGET_REPLAY_EVENTS_PER_S,
                "fast_path_available": has_fast_path(),
            }
            full_digest = runs[0]["digest"]
            if has_fast_path() and args.client_runs:
                client = [
                    await replay_once(server.url, config, last, pid, fast=False)
                    for _ in range(args.client_runs)
                ]
                if {r["digest"] for r in client} != {full_digest}:
                    raise RuntimeError("the nats-py path folds a different state")
                result["replay_client_path"] = {
                    "runs": client,
                    "median_events_per_s": statistics.median(r["events_per_s"] for r in client),
                }

            snap_seq = last - args.tail
            store, snapshot = await prepare_snapshot(nc, config, snap_seq)
            result["snapshot"] = snapshot
            ready_runs = []
            for _ in range(args.runs):
                removed = await reset_for_run(nc, config, store, snap_seq)
                run = await ready_once(server.url, config, last, snap_seq, full_digest)
                run["snapshots_removed_before"] = removed
                events_last = (await nc.jetstream().stream_info(config.events_stream)).state
                if events_last.last_seq != last:
                    raise RuntimeError(f"the events stream grew to {events_last.last_seq}")
                ready_runs.append(run)
            seconds = [r["seconds"] for r in ready_runs]
            result["ready"] = {
                "runs": ready_runs,
                "tail": args.tail,
                "median_s": statistics.median(seconds),
                "median_phases_s": {
                    k: statistics.median(r["phases_s"][k] for r in ready_runs)
                    for k in ready_runs[0]["phases_s"]
                },
                "median_connect_s": statistics.median(r["connect_s"] for r in ready_runs),
                "target_s": TARGET_READY_S,
                "meets_target": statistics.median(seconds) < TARGET_READY_S,
            }

            if args.profile or (not args.no_profile and not result["replay"]["meets_target"]):
                p1, kept = await client_alone(server.url, config, last)
                p2 = core_alone(kept, config)
                del kept
                p1b = await reader_alone(server.url, config, last)
                p3 = await profiled_replay(server.url, config, last, args.top)
                result["profile"] = {
                    "client_alone": p1,
                    "reader_alone": p1b,
                    "core_alone": p2,
                    "cprofile": p3,
                }
        finally:
            await nc.drain()
    return result


def import_time() -> float:
    """Seconds for a fresh interpreter to import what a writer process imports (once)."""
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import nats, projector.write.writer, projector.ops.cli"],
        check=True,
        cwd=REPO_ROOT,
    )
    return time.perf_counter() - t0


# ---- main ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argument_parser(__doc__)
    add_trace(p)
    p.add_argument("--events", type=positive, default=1_000_000, help="events in the stream")
    p.add_argument("--runs", type=positive, default=3, help="runs of (r1) and of (r2)")
    p.add_argument(
        "--client-runs",
        type=int,
        default=1,
        help="(r1) runs of fold_stream(fast=False), the nats-py path, for comparison (0: none)",
    )
    p.add_argument("--tail", type=positive, default=5_000, help="(r2) events after the snapshot")
    p.add_argument("--workers", type=positive, default=16, help="workers, round-robin")
    p.add_argument("--max-pending", type=positive, default=4_000, help="setup: unacked publishes")
    p.add_argument("--profile", action="store_true", help="profile even if (r1) meets its target")
    p.add_argument("--no-profile", action="store_true", help="never profile")
    p.add_argument("--top", type=positive, default=12, help="profile: functions listed")
    add_json(p)
    p.add_argument("--save", type=Path, default=None, help="also write the JSON document here")
    args = p.parse_args(argv)
    if args.tail >= SNAPSHOT_WITHIN:
        p.error(f"--tail must be below {SNAPSHOT_WITHIN:,} (the writer's snapshot spacing)")
    if args.events <= args.workers + args.tail:
        p.error("--events must exceed --workers + --tail")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.trace.is_file():
        print(f"replay.py: trace not found: {args.trace} (pass --trace PATH)", file=sys.stderr)
        return 2
    try:
        base = base_events(args.trace, args.workers)
    except (OSError, msgspec.DecodeError) as exc:
        print(f"replay.py: cannot read trace {args.trace}: {exc}", file=sys.stderr)
        return 2
    if not base:
        print(f"replay.py: trace has no requests: {args.trace}", file=sys.stderr)
        return 2
    finish(new_report(args, base), args, bench(args, base), print_report)
    return 0


def new_report(args: argparse.Namespace, base: Sequence[Event]) -> dict[str, Any]:
    """The machine and the workload, before the results."""
    return {
        "machine": machine(),
        "workload": {
            "trace": str(args.trace),
            "trace_events": len(base),
            "events": args.events,
            "workers": args.workers,
            "runs": args.runs,
            "tail": args.tail,
            "compiled_core": (seqstate.state.__file__ or "").endswith(".so"),
            "import_s": import_time(),
        },
    }


def finish(
    report: dict[str, Any],
    args: argparse.Namespace,
    bench: Coroutine[Any, Any, dict[str, Any]],
    show: Callable[[dict[str, Any]], None],
) -> None:
    """Run ``bench`` into ``report["result"]``, then save (``--save``) and print it."""
    started = time.perf_counter()
    report["result"] = asyncio.run(bench)
    report["wall_s"] = time.perf_counter() - started
    # Others may commit or rebuild while this runs: say so if the build changed under us.
    report["machine"]["git_at_end"] = git_revision()
    if args.save is not None:
        args.save.write_text(json.dumps(report, indent=2) + "\n")
    emit(report, args.json, show)


if __name__ == "__main__":
    sys.exit(main())
