"""How fast a backlog can be read, and what each way of reading it holds: the runner's choice.

Why this exists: a consumer far behind must catch up at its fold's rate with memory
bounded by configuration. The candidates, each reading the same backlog of ``--events`` small
events (a Free, ~150 bytes stored) into a processor that only counts, on a fresh nats-server:

- ``ordered push (nats-py)``: the old runner, ``js.subscribe(ordered_consumer=True, cb=...)``;
  nothing bounds what the client queues (its flow control is answered on receipt);
- ``windowed push, window N``: :class:`~projector.nats.consumer.OrderedConsumer` as it is now,
  acknowledgement ``all`` with ``max_ack_pending = N``;
- ``pull fetch(N)``: a pull consumer read with nats-py's ``fetch(batch=N)``.

For each: events/s, and the most messages held received and not yet handled (``held``: the
client's queue, sampled as the processor runs). Medians of ``--runs`` runs.

Run from the repository root: ``.venv/bin/python benchmarks/consume.py [--events N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import nats
from harness.cli import argument_parser
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api

from projector.nats.consumer import OrderedConsumer
from projector.nats.server import NatsServer
from projector.nats.stream import Refused
from seqstate import Free, encode_event

STREAM, SUBJECTS = "BENCH", "bench.>"


async def fill(nc: Client, n: int) -> int:
    js = nc.jetstream()
    await js.add_stream(name=STREAM, subjects=[SUBJECTS])
    payload = encode_event(Free(request_id="r-123456789", worker_id=3, router_id="router-1"))
    last = 0
    for start in range(0, n, 10_000):
        acks = [
            await js.publish_async(f"bench.{i % 16}", payload)
            for i in range(start, min(n, start + 10_000))
        ]
        last = max(a.seq for a in await asyncio.gather(*acks))
    return last


async def ordered_push(nc: Client, last: int, held: list[int]) -> None:
    done = asyncio.Event()
    sub = None

    async def take(msg: Msg) -> None:
        if sub is not None and msg.metadata.sequence.stream % 1000 == 0:
            held.append(sub.pending_msgs)
        if msg.metadata.sequence.stream >= last:
            done.set()

    sub = await nc.jetstream().subscribe(SUBJECTS, stream=STREAM, ordered_consumer=True, cb=take)
    await done.wait()
    await sub.unsubscribe()


def windowed(window: int) -> Callable[[Client, int, list[int]], Awaitable[None]]:
    async def run(nc: Client, last: int, held: list[int]) -> None:
        runner: OrderedConsumer | None = None

        class Count:
            async def handle(self, msg: Msg) -> Refused | None:
                if runner is not None and int(msg.reply.split(".")[-4]) % 1000 == 0:
                    held.append(runner.held)
                return None

        runner = OrderedConsumer(
            nc.jetstream(), STREAM, SUBJECTS, Count(), on_failure=print, window=window
        )
        await runner.start()
        await runner.position.wait(last)
        await runner.stop()

    return run


def pull(batch: int) -> Callable[[Client, int, list[int]], Awaitable[None]]:
    async def run(nc: Client, last: int, held: list[int]) -> None:
        js = nc.jetstream()
        sub = await js.pull_subscribe(
            SUBJECTS, stream=STREAM, config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE)
        )
        seen = 0
        while seen < last:
            msgs = await sub.fetch(batch, timeout=5)
            held.append(len(msgs))
            seen = msgs[-1].metadata.sequence.stream
        await sub.unsubscribe()

    return run


async def main(opts: argparse.Namespace) -> None:
    readers: list[tuple[str, Callable[[Client, int, list[int]], Awaitable[None]]]] = [
        ("ordered push (nats-py)", ordered_push),
        *((f"windowed push, window {w}", windowed(w)) for w in opts.windows),
        *((f"pull fetch({b})", pull(b)) for b in (256, 1024)),
    ]
    with NatsServer() as server:
        nc = await nats.connect(server.url, pending_size=64 * 1024 * 1024)
        last = await fill(nc, opts.events)
        print(f"{opts.events:,} events stored; medians of {opts.runs} runs")
        for name, reader in readers:
            rates, peaks = [], []
            for _ in range(opts.runs):
                held: list[int] = []
                started = time.perf_counter()
                await reader(nc, last, held)
                rates.append(opts.events / (time.perf_counter() - started))
                peaks.append(max(held, default=0))
            print(
                f"{name:>28}: {statistics.median(rates):>9,.0f} events/s, "
                f"held at most {max(peaks):,} (sampled)"
            )
        await nc.close()


if __name__ == "__main__":
    parser = argument_parser(__doc__)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--windows", type=int, nargs="*", default=[256, 1024, 4096, 16384])
    asyncio.run(main(parser.parse_args()))
