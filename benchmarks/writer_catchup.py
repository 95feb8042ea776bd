"""Writer catch-up with the projector running, against a bare ordered consumer, same run.

Why this exists: a writer restarted (or paused) behind a backlog must catch up at the pace its
reading allows, not at the pace of its delta log. The yardstick is the reading itself: the
repo's :class:`~projector.nats.consumer.OrderedConsumer` with a processor that does nothing,
over the same stream, in the same run, so the ratio holds on a busy machine where absolute
rates do not.

Each run: a fresh nats-server (``NatsServer``, temporary store), ``ensure`` with the default
``Config``, then ``--events`` messages of realistic lifecycles filled pipelined
(``benchmarks/replay.py``'s ``encoded`` and ``fill``: 16 ``WorkerAdded``, then the Mooncake
conversation trace's AddRequest / MarkPrefillCompleted / Free, 16 workers round-robin, pass
after pass, each AddRequest given 16-256 u64 block hashes, 136 on average: ``realistic``),
one event per message.
Then, timed:

(a) bare: an ``OrderedConsumer`` with a no-op processor from the first message to the last;
(b) writer: the projector (``build_projector``) started and caught up on the empty deltas
    first, then from ``build_writer`` + ``writer.run()`` until the writer's stored deltas
    cover the last event (``writer.flush``) and the projector has flushed them to the bucket
    (``projector.wait_flushed``). Both run in this process on one event loop, as
    ``seqstate run`` runs them; ``--projector-process``: the projector is ``seqstate
    projector`` in a process of its own (as a deployment of separate processes runs it), and
    the run ends when the bucket's position says the last event.

``--batch N``: (b) reads a copy of the same events in a namespace of its own, stored as
record batches of ``N`` events (each rank's events in order, as ``publish_many`` groups
them), while (a) still reads the one-event stream: the ratio is the writer's events/s over
batches against the bare consumer's over single events.

The process's garbage collector is tuned as every ``seqstate`` command tunes its own
(:func:`projector.run.collector.tune_collector`), for both (a) and (b).

After the runs, ``verify`` (what ``seqstate verify`` runs) replays the log to the bucket's
position and compares: it must say identical.

Run from the repository root: ``.venv/bin/python benchmarks/writer_catchup.py [--runs 3]``.
Profile the writer with ``py-spy record -o out.svg -- .venv/bin/python
benchmarks/writer_catchup.py --runs 1``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from harness.cli import argument_parser
from harness.measure import collect, fresh_stores
from harness.report import git_revision
from harness.servers import start_seqstate
from harness.workload import DEFAULT_TRACE, base_events, encoded, fill
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError

from projector.nats.connection import connect
from projector.nats.consumer import OrderedConsumer
from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.nats.stream import Refused
from projector.ops.replay import verify
from projector.run.assemble import build_projector, build_writer
from projector.run.collector import tune_collector
from projector.settings.config import Config
from projector.wire.values import decode_position, lease_key, position_key
from seqstate import AddRequest, Event
from seqstate.batches import encode_batch_of

WORKERS = 16
MAX_PENDING = 4000  # unacknowledged publishes while filling
TIMEOUT_S = 600.0


def realistic(base: list[Event], seed: int) -> list[Event]:
    """The trace's lifecycles with 16-token blocks: each AddRequest gets 16-256 u64 block
    hashes (uniform, 136 on average), 32 per block of the trace (whose blocks are 512
    tokens), so requests that share a prefix in the trace share their first hashes."""
    rng = random.Random(seed)
    out: list[Event] = []
    for event in base:
        if isinstance(event, AddRequest):
            trace, n = event.block_hashes, rng.randint(16, 256)
            own = zlib.crc32(event.request_id.encode())
            hashes = [
                _mix(trace[i // 32] * 32 + i % 32 if i // 32 < len(trace) else (own << 20) + i)
                for i in range(n)
            ]
            event = AddRequest(
                request_id=event.request_id,
                worker_id=event.worker_id,
                block_hashes=hashes,
                prefill_tokens=16 * n,
                expected_prefill_ms=event.expected_prefill_ms,
            )
        out.append(event)
    return out


def _mix(x: int) -> int:
    """A 64-bit hash of ``x`` (Fibonacci hashing): a real block hash's size on the wire."""
    return ((x + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF


class Nothing:
    """A processor that takes every message and does nothing with it."""

    async def handle(self, msg: Msg) -> Refused | None:
        return None


async def bare(js: Any, config: Config, last: int) -> tuple[float, float]:
    """(a) events/s of the repo's ordered consumer alone, no-op processor."""
    failures: list[BaseException] = []
    consumer = OrderedConsumer(
        js, config.events_stream, config.events_subjects, Nothing(), on_failure=failures.append
    )
    collect()
    started, cpu = time.perf_counter(), time.process_time()
    await consumer.start()
    await consumer.position.wait(last, timeout=TIMEOUT_S)
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu
    await consumer.stop()
    if failures:
        raise RuntimeError(f"bare consumer failed: {failures[0]!r}")
    return last / seconds, cpu / seconds


async def writer_catchup(
    nc: Any, config: Config, last: int, url: str, own_process: bool
) -> tuple[float, float]:
    """(b) events/s of the writer, the projector beside it, until the bucket has the last."""
    if own_process:
        return await writer_beside_a_projector_process(nc, config, last, url)
    projector = build_projector(nc, config)
    projecting = asyncio.create_task(projector.run())
    await asyncio.wait_for(projector.caught_up.wait(), TIMEOUT_S)
    try:
        return await timed_writer(
            nc, config, last, lambda: asyncio.wait_for(projector.wait_flushed(last), TIMEOUT_S)
        )
    finally:
        projector.stop()
        await projecting  # a failure is raised here


async def timed_writer(
    nc: Any, config: Config, last: int, projected: Callable[[], Awaitable[object]]
) -> tuple[float, float]:
    """Events/s and CPU share of a writer started now, until its deltas cover event ``last``
    and ``projected()`` returns (the bucket has them)."""
    collect()
    started, cpu = time.perf_counter(), time.process_time()
    writer = build_writer(nc, config)
    writing = asyncio.create_task(writer.run())
    await writer.wait_applied(last, timeout=TIMEOUT_S)
    await writer.flush()
    await projected()
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu
    writer.stop()
    await writing  # a failure is raised here
    return last / seconds, cpu / seconds


async def writer_beside_a_projector_process(
    nc: Any, config: Config, last: int, url: str
) -> tuple[float, float]:
    """(b) with ``seqstate projector`` in a process of its own, as a deployment runs it:
    until the bucket's position says the last event."""
    proc = start_seqstate(["projector"], url)
    try:
        kv = await nc.jetstream().key_value(config.registry_bucket)

        async def key(name: str) -> bytes | None:
            try:
                return (await kv.get(name)).value
            except KeyNotFoundError:
                return None

        async def projected() -> None:
            while (
                decode_position(await key(position_key(config.namespace)) or b"").applied_seq < last
            ):
                await asyncio.sleep(0.01)

        while await key(lease_key(config.namespace)) is None:  # the projector is up
            await asyncio.sleep(0.05)
        return await timed_writer(nc, config, last, projected)
    finally:
        proc.terminate()
        proc.wait(30)


def batched(messages: list[tuple[str, bytes]], size: int, control: str) -> list[tuple[str, bytes]]:
    """``messages`` as record batches of ``size`` events: each subject's (rank's) events in
    their order, a batch sent once it is full (the rest at the end); the control subject's
    (the workers' registrations) as they come, before the requests that need them."""
    out: list[tuple[str, bytes]] = []
    pending: dict[str, list[bytes]] = {}
    for subject, payload in messages:
        if subject == control:
            out.append((subject, payload))
            continue
        group = pending.setdefault(subject, [])
        group.append(payload)
        if len(group) == size:
            out.append((subject, encode_batch_of(group)))
            pending[subject] = []
    out.extend((subject, encode_batch_of(group)) for subject, group in pending.items() if group)
    return out


async def one_run(args: argparse.Namespace, store: Path) -> dict[str, Any]:
    """One run on a fresh server. The messages are built for the run and dropped once
    stored: held while the writer runs, their objects would add to every full garbage
    collection of this process, which a writer's process does not have to walk."""
    config = Config()
    with NatsServer(store) as server:
        async with connect(server.url, service=True, config=config) as nc:
            await ensure(nc, config)
            base = realistic(base_events(args.trace, WORKERS), seed=1)
            messages = encoded(config, base, args.events, WORKERS)
            filled = await fill(nc, config, messages, MAX_PENDING)
            last = events = filled["last_seq"]
            writing = config
            if args.batch > 1:  # the same events, batched, in a namespace of their own
                writing = Config(
                    namespace="batched",
                    events_stream="BATCHED_EVENTS",
                    deltas_stream="BATCHED_DELTAS",
                    registry_bucket="batched-registry",
                )
                await ensure(nc, writing)
                again = encoded(writing, base, args.events, WORKERS)
                batches = batched(again, args.batch, writing.control_subject)
                last = (await fill(nc, writing, batches, MAX_PENDING))["last_seq"]
                del again
            del base, messages
            js = nc.jetstream()
            bare_rate, bare_cpu = await bare(js, config, events)
            print("timing the writer", file=sys.stderr, flush=True)  # a profiler's cue
            writer_rate, writer_cpu = await writer_catchup(
                nc, writing, last, server.url, args.projector_process
            )
            writer_rate *= events / last  # events, not messages, per second
            diffs = await verify(nc, writing) if args.verify else []
    return {
        "events": events,
        "fill_per_s": filled["events_per_s"],
        "bare_per_s": bare_rate,
        "writer_per_s": writer_rate,
        "ratio": writer_rate / bare_rate,
        "bare_cpu": bare_cpu,
        "writer_cpu": writer_cpu,
        "bare_us": bare_cpu / bare_rate * 1e6,
        "writer_us": writer_cpu / writer_rate * 1e6,
        "diffs": diffs,
    }


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--events", type=int, default=150_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument(
        "--projector-process",
        action="store_true",
        help="run the projector as `seqstate projector` in a process of its own",
    )
    parser.add_argument(
        "--batch", type=int, default=1, help="the writer reads record batches of N events"
    )
    parser.add_argument(
        "--no-verify", dest="verify", action="store_false", help="skip the verify of each run"
    )
    args = parser.parse_args()
    tune_collector()  # as a seqstate process runs
    runs = []
    for i, store in enumerate(fresh_stores(args.runs, "writer-catchup-")):
        run = asyncio.run(one_run(args, store))
        runs.append(run)
        print(
            f"run {i + 1}: bare {run['bare_per_s']:,.0f} events/s (this process on CPU "
            f"{run['bare_cpu']:.0%}: {run['bare_us']:.1f} us/event), writer+projector "
            f"{run['writer_per_s']:,.0f} events/s (on CPU {run['writer_cpu']:.0%}: "
            f"{run['writer_us']:.1f} us/event), ratio {run['ratio']:.1%}; verify: "
            + ("identical" if not run["diffs"] else f"{len(run['diffs'])} keys differ")
            + ("" if args.verify else " (skipped)"),
            flush=True,
        )
    ratios = ", ".join(f"{r['ratio']:.1%}" for r in runs)
    med = {
        k: statistics.median(r[k] for r in runs) for k in ("bare_per_s", "writer_per_s", "ratio")
    }
    print(
        f"{runs[0]['events']:,} one-event messages, {args.runs} runs, commit {git_revision()}: "
        f"median bare {med['bare_per_s']:,.0f} events/s, writer+projector "
        f"{med['writer_per_s']:,.0f} events/s, ratio {med['ratio']:.1%} "
        f"(ratios {ratios})"
    )
    differing = [d for r in runs for d in r["diffs"]]
    if differing:
        print("verify: NOT identical:", *differing[:10], sep="\n  ")
        return 1
    if args.verify:
        print("verify: identical after every run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
