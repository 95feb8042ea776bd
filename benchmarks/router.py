"""How fast one router can put events on SEQSTATE_EVENTS, against the client's own ceiling.

Why this exists: ``RouterPublisher.publish`` spends a task, a future, a ``wait_for`` and a
semaphore round per event, which capped one router at about 7.7k events/s (BENCHMARKS.md,
pipeline (e)) where bare pipelined ``js.publish_async`` reaches several times that on the same
machine. ``RouterPublisher.publish_many`` is the batch path; this script measures, in one run
against one embedded nats-server (``NatsServer``, a temporary JetStream store, the streams as
``ensure`` makes them):

(a) ceiling: raw pipelined ``js.publish_async`` of pre-encoded AddRequest payloads, each with
    its ``Nats-Msg-Id`` header (the msg-ids built beforehand too), at most ``--max-pending``
    unacknowledged, then every ack awaited and checked (not a duplicate);
(b) ``RouterPublisher.publish``, every event fired concurrently with ``asyncio.gather`` over
    chunks of ``--chunk`` (as ``benchmarks/pipeline.py`` (e) does);
(c) ``RouterPublisher.publish_many`` called one batch after another (each awaited), for every
    ``--batch`` size.

(b) and (c) get the events as AddRequest objects and so also pay what a router pays: encode,
validate (``check``), msg-id, subject. Every measurement publishes the same ``--events``
AddRequests (16 workers round-robin, 24 random 64-bit block hashes each, deterministic), with
a router id of its own, and is checked untimed afterwards: the stream holds exactly that many
messages, every sequence is distinct, and for (c) the sequences of every call increase (stored
in the given order). The stream is purged between measurements. Measurements are interleaved
(a, b, c..., a, b, c..., ``--runs`` times) so a slow phase of the machine hits all alike; the
report gives the median events/s of each and the ratio (c)/(a) of the medians.

Run from the repository root: ``.venv/bin/python benchmarks/router.py [--events N] [--runs R]
[--batch 64 256] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import itertools
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

from harness.cli import argument_parser, positive
from harness.report import emit, machine
from harness.servers import connect, server_version
from nats.aio.client import Client

from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.route.publisher import MSG_ID_HEADER, RouterPublisher
from projector.settings.config import Config
from seqstate import AddRequest, Event, encode_event

WORKERS: Final = 16
HASHES_PER_EVENT: Final = 24
TARGET_RATIO: Final = 0.5


def make_events(count: int, seed: int = 1) -> list[AddRequest]:
    rng = random.Random(seed)
    return [
        AddRequest(
            request_id=f"req-{n}",
            worker_id=n % WORKERS,
            block_hashes=[rng.getrandbits(64) for _ in range(HASHES_PER_EVENT)],
            prefill_tokens=rng.randrange(64, 8192),
            expected_prefill_ms=round(rng.uniform(5.0, 400.0), 2),
            expected_output_tokens=rng.randrange(16, 1024),
        )
        for n in range(count)
    ]


# ---- the three ways to publish ------------------------------------------------------------


async def raw_publish_async(
    nc: Client,
    subjects: Sequence[str],
    payloads: Sequence[bytes],
    msg_ids: Sequence[str],
    max_pending: int,
) -> list[list[int]]:
    """(a): pipelined ``publish_async``, at most ``max_pending`` unacknowledged."""
    js = nc.jetstream(publish_async_max_pending=max_pending)
    publish_async = js.publish_async
    futures = [
        await publish_async(subject, payload, headers={MSG_ID_HEADER: msg_id})
        for subject, payload, msg_id in zip(subjects, payloads, msg_ids, strict=True)
    ]
    acks = await asyncio.gather(*futures)
    if any(ack.duplicate for ack in acks):
        raise RuntimeError("a raw publish was acknowledged as a duplicate")
    return [[ack.seq for ack in acks]]


async def concurrent_publish(
    pub: RouterPublisher, events: Sequence[Event], chunk: int
) -> list[list[int]]:
    """(b): every event its own ``publish``, fired ``chunk`` at a time with ``gather``."""
    seqs: list[int] = []
    for start in range(0, len(events), chunk):
        seqs.extend(await asyncio.gather(*(pub.publish(e) for e in events[start : start + chunk])))
    return [seqs]


async def batched_publish(
    pub: RouterPublisher, events: Sequence[Event], batch: int
) -> list[list[int]]:
    """(c): ``publish_many`` one batch after another; the sequences of every call."""
    return [
        await pub.publish_many(events[start : start + batch])
        for start in range(0, len(events), batch)
    ]


# ---- one measurement ----------------------------------------------------------------------


async def measure(
    nc: Client,
    config: Config,
    label: str,
    count: int,
    run: Callable[[], Awaitable[list[list[int]]]],
    in_call_order: bool,
) -> float:
    """events/s of ``run``; checks the stream afterwards and purges it."""
    js = nc.jetstream()
    gc.collect()
    t0 = time.perf_counter()
    calls = await run()
    seconds = time.perf_counter() - t0
    seqs = [seq for call in calls for seq in call]
    stored = (await js.stream_info(config.events_stream)).state.messages
    if stored != count or len(set(seqs)) != count:
        raise RuntimeError(
            f"{label}: {stored} messages stored, {len(set(seqs))} distinct "
            f"sequences; expected {count}"
        )
    if in_call_order and any(b <= a for call in calls for a, b in itertools.pairwise(call)):
        raise RuntimeError(f"{label}: a call's events were not stored in the given order")
    await js.purge_stream(config.events_stream)
    return count / seconds


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    config = Config()
    events = make_events(args.events)
    subjects = [config.event_subject(e.worker_id, e.dp_rank) for e in events]
    labels = ["a", "b", *(f"c{size}" for size in args.batch)]
    rates: dict[str, list[float]] = {label: [] for label in labels}
    info = machine()  # the date and load at the start
    async with NatsServer() as server:
        nc = await connect(server.url, "bench-router")
        try:
            await ensure(nc, config)
            info["nats_server"] = server_version(nc)
            payloads = [encode_event(e) for e in events]  # (a)'s inputs, untimed: the ceiling
            for rep in range(args.runs):
                tag = f"{os.getpid()}-{rep}"
                msg_ids = [f"raw-{tag}:{n}" for n in range(1, len(events) + 1)]
                for label in labels:
                    if label == "a":
                        run = functools.partial(
                            raw_publish_async, nc, subjects, payloads, msg_ids, args.max_pending
                        )
                    else:
                        pub = RouterPublisher(
                            nc,
                            router_id=f"bench-{tag}-{label}",
                            config=config,
                            max_pending=args.max_pending,
                        )
                        if label == "b":
                            run = functools.partial(concurrent_publish, pub, events, args.chunk)
                        else:
                            run = functools.partial(batched_publish, pub, events, int(label[1:]))
                    rate = await measure(
                        nc, config, label, len(events), run, in_call_order=label != "b"
                    )
                    rates[label].append(rate)
                    print(
                        f"  run {rep + 1}: ({label[0]}) {describe(label, args)}: "
                        f"{rate:,.0f} events/s",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            await nc.drain()
    medians = {label: statistics.median(values) for label, values in rates.items()}
    return {
        "machine": info,
        "events": args.events,
        "runs": args.runs,
        "max_pending": args.max_pending,
        "chunk": args.chunk,
        "rates": rates,
        "medians": medians,
        "ratios_to_a": {label: medians[label] / medians["a"] for label in labels},
    }


def describe(label: str, args: argparse.Namespace) -> str:
    if label == "a":
        return f"raw js.publish_async, pre-encoded, max_pending {args.max_pending}"
    if label == "b":
        return f"RouterPublisher.publish, gather over chunks of {args.chunk}"
    return f"RouterPublisher.publish_many, batches of {label[1:]}"


def print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    m = report["machine"]
    print(
        f"{m['date_utc']}  {m['cpu']}, {m['nproc']} cores, load {m['loadavg_1m_at_start']:.2f}"
        f"  {m['python']}, nats-py {m['nats_py']}, nats-server {m['nats_server']}, "
        f"{m['core'].split(':')[0]} core"
    )
    print(f"{report['events']:,} AddRequests per measurement, {report['runs']} runs each, medians:")
    for label, median in report["medians"].items():
        runs = ", ".join(f"{r:,.0f}" for r in report["rates"][label])
        ratio = report["ratios_to_a"][label]
        print(
            f"  ({label[0]}) {describe(label, args):<62} {median:>9,.0f} events/s  "
            f"{ratio:5.0%} of (a)   ({runs})"
        )
    best = max((r for label, r in report["ratios_to_a"].items() if label[0] == "c"), default=0.0)
    verdict = "MEETS" if best >= TARGET_RATIO else "MISSES"
    print(f"target (c) >= {TARGET_RATIO:.0%} of (a): {verdict} (best batch size: {best:.0%})")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argument_parser(__doc__)
    parser.add_argument("--events", type=positive, default=50_000, help="events per measurement")
    parser.add_argument("--runs", type=positive, default=5, help="repetitions of every measurement")
    parser.add_argument(
        "--batch",
        type=positive,
        nargs="+",
        default=[64, 256],
        help="publish_many batch sizes for (c)",
    )
    parser.add_argument(
        "--max-pending",
        type=positive,
        default=256,
        help="unacknowledged publishes at most, for all three",
    )
    parser.add_argument("--chunk", type=positive, default=1024, help="(b)'s gather size")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(bench(args))
    emit(report, args.json, print_report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
