"""A writer folding a backlog: events/s from a filled events stream, and the writer's memory.

Why this exists: the catch-up of a paused writer is bounded by how fast the writer
folds a backlog when it has the machine to itself. This script fills a fresh nats-server's
events stream with ``--events`` events (AddRequests with 8 hashes on 16 workers, each freed
100 events later, as ``benchmarks/catch_up.py``'s routers publish them), then starts the
writer (``build_writer``, as ``seqstate writer`` builds it) in this process and times it until
its deltas cover the last event; ``--runs`` times, each on a fresh server. RSS is this
process's (the publisher's share included), so read it as an upper bound.

Run from the repository root: ``.venv/bin/python benchmarks/writer_backlog.py [--runs 3]``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from harness.cli import argument_parser
from harness.measure import fresh_stores, rss_kb

from projector.nats.connection import connect
from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.run.assemble import build_writer
from projector.settings.config import Config
from seqstate import AddRequest, Event, Free

NAMES = {
    "namespace": "wb",
    "events_stream": "WB_EVENTS",
    "deltas_stream": "WB_DELTAS",
    "registry_bucket": "wb-registry",
    "snapshot_bucket": "wb-snapshots",
}


async def one_run(events: int, store: Path) -> float:
    server = NatsServer(store)
    server.start()
    try:
        config = Config(**NAMES)  # type: ignore[arg-type]
        async with connect(server.url, service=True, config=config) as nc:
            await ensure(nc, config)
            pub = RouterPublisher(nc, router_id="backlog", config=config)
            previous: list[AddRequest] = []
            n = last = 0
            while n < events:
                adds = [
                    AddRequest(
                        request_id=f"r{n + i}",
                        worker_id=(n + i) % 16,
                        block_hashes=[(n + i) * 7 + k for k in range(8)],
                        prefill_tokens=512,
                    )
                    for i in range(100)
                ]
                frees: list[Event] = [Free(a.request_id, a.worker_id) for a in previous]
                last = max(await pub.publish_many([*adds, *frees]))
                previous, n = adds, n + len(adds) + len(frees)
            writer = build_writer(nc, config)
            started = time.perf_counter()
            task = asyncio.create_task(writer.run())
            await writer.wait_applied(last)
            await writer.flush()
            rate = last / (time.perf_counter() - started)
            writer.stop()
            await asyncio.gather(task, return_exceptions=True)
            return rate
    finally:
        server.stop()


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    opts = parser.parse_args()
    rates = [
        asyncio.run(one_run(opts.events, store))
        for store in fresh_stores(opts.runs, "writer-backlog-")
    ]
    shown = ", ".join(f"{r:,.0f}" for r in rates)
    peak_mb = rss_kb()["VmHWM"] / 1024
    print(
        f"writer over a backlog of ~{opts.events:,} events: median "
        f"{statistics.median(rates):,.0f} events/s ({shown}); peak RSS {peak_mb:.0f} MB"
    )


if __name__ == "__main__":
    main()
