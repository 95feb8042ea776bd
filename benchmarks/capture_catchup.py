"""Writer catch-up over a backlog of captured Dynamo traffic: sourced (a message each) against
forwarded (the capture's forwarder's record batches), same run.

Why this exists: a Dynamo fleet sends about four replica-sync messages per request. Sourced
server-side into the events stream, each was one stored message, and the writer paid its
per-message cost for each; the forwarder stores a burst as one record batch. This measures
what that buys the writer, on the same traffic, in the same run.

Each run: a fresh nats-server, two namespaces of their own (their own events streams and
capture streams), the same ``--requests`` synthetic Dynamo requests (an AddRequest of 136
block hashes, the router's Mark, the worker's Mark, the Free; 64 in flight; two frontends
and 16 workers; Dynamo's own wire bytes) published on NATS Core on each namespace's endpoint:

- ``sourced``: its events stream sources the capture stream (as provisioned before the
  forwarder), one stored message per Dynamo message;
- ``batched``: the capture's forwarder stores the backlog (untimed), bursts as batches.

Then, timed, for each: a writer (``build_writer``, as ``seqstate run`` builds it) with the
projector beside it, from its start until the bucket has the last event; events/s (Dynamo
messages per second) and the process's CPU share. Then ``verify`` of each: identical.

Run from the repository root: ``.venv/bin/python benchmarks/capture_catchup.py [--runs 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from harness.cli import argument_parser
from harness.measure import fresh_stores
from harness.report import git_revision
from nats.js import api
from writer_catchup import writer_catchup

from projector.dynamo.forward import CaptureForwarder
from projector.nats.connection import connect
from projector.nats.resources import dynamo_capture, ensure
from projector.nats.server import NatsServer
from projector.ops.replay import verify
from projector.run.collector import tune_collector
from projector.settings.config import Config
from projector.wire.capture import RAW_PATTERN, rewrite
from seqstate.dynamo import ADD, FREE, MARK, DynamoMessage, dynamo_subject, encode_dynamo

FRONTENDS = (5396769825624678, 3443434125927359)  # publisher ids
WORKERS = 16
IN_FLIGHT = 64
HASHES = 136


def traffic(requests: int, seed: int) -> list[bytes]:
    """A fleet's replica-sync messages, in the order published: per request its frontend's
    Add and Mark, its worker's Mark, its frontend's Free (``IN_FLIGHT`` requests later)."""
    rng = random.Random(seed)
    seqs: dict[int, int] = {}
    out: list[bytes] = []

    def message(publisher: int, op: str, rid: str, worker: int, router: int, **add: Any) -> None:
        seqs[publisher] = seqs.get(publisher, -1) + 1
        out.append(
            encode_dynamo(
                DynamoMessage(
                    publisher_id=publisher,
                    sequence=seqs[publisher],
                    published_at_ms=1_700_000_000_000 + len(out),
                    request_id=rid,
                    worker_id=worker,
                    router_id=router,
                    op=op,  # type: ignore[arg-type]
                    **add,
                )
            )
        )

    live: list[tuple[str, int, int]] = []
    for i in range(requests):
        frontend, worker = FRONTENDS[i % 2], 1000 + i % WORKERS
        rid = f"req-{i}"
        hashes = [rng.getrandbits(64) for _ in range(HASHES)]
        message(frontend, ADD, rid, worker, frontend, token_sequence=hashes, prefill_tokens=2176)
        message(frontend, MARK, rid, worker, frontend)
        message(worker, MARK, rid, worker, worker)  # the worker's own publisher
        live.append((rid, worker, frontend))
        if len(live) > IN_FLIGHT:
            done, w, f = live.pop(0)
            message(f, FREE, done, w, f)
    for rid, w, f in live:
        message(f, FREE, rid, w, f)
    return out


def named(name: str) -> Config:
    return Config(
        namespace=name,
        events_stream=f"{name.upper()}_EVENTS",
        deltas_stream=f"{name.upper()}_DELTAS",
        registry_bucket=f"{name}-registry",
        snapshot_bucket=f"{name}-snapshots",
        dynamo_endpoint=f"{name}.backend.generate",
        idle_tick_s=3600.0,
    )


async def publish(nc: Any, config: Config, data: list[bytes]) -> None:
    subject = dynamo_subject(config.dynamo_endpoints[0])
    js = nc.jetstream()
    for start in range(0, len(data), 2000):  # NATS Core, paced by the capture's storing
        for each in data[start : start + 2000]:
            await nc.publish(subject, each)
        await nc.flush()
        while (await js.stream_info(dynamo_capture(config))).state.messages < start:
            await asyncio.sleep(0.01)


async def wait_count(js: Any, stream: str, count: int) -> int:
    while (info := await js.stream_info(stream)).state.messages < count:
        await asyncio.sleep(0.05)
    return info.state.last_seq


async def one_run(args: argparse.Namespace, store: Path) -> dict[str, Any]:
    data = traffic(args.requests, seed=1)
    sourced, batched = named("sourced"), named("batched")
    out: dict[str, Any] = {"messages": len(data)}
    with NatsServer(store) as server:
        async with connect(server.url, service=True, config=sourced) as nc:
            js = nc.jetstream()
            for config in (sourced, batched):
                await ensure(nc, config)
            events = (await js.stream_info(sourced.events_stream)).config
            events.sources = [  # as provisioned before the forwarder
                api.StreamSource(
                    name=dynamo_capture(sourced),
                    subject_transforms=[
                        api.SubjectTransform(src=RAW_PATTERN, dest=rewrite(sourced.namespace))
                    ],
                )
            ]
            await js.update_stream(events)
            await publish(nc, sourced, data)
            last = {sourced.namespace: await wait_count(js, sourced.events_stream, len(data))}
            await publish(nc, batched, data)
            await wait_count(js, dynamo_capture(batched), len(data))
            forwarder = CaptureForwarder(nc, batched)
            await forwarder.forward_waiting(600.0)
            info = await js.stream_info(batched.events_stream)
            last[batched.namespace] = info.state.last_seq
            out["batched_messages"] = info.state.messages
            for config in (sourced, batched):
                print(f"timing the writer of {config.namespace}", file=sys.stderr, flush=True)
                rate, cpu = await writer_catchup(
                    nc, config, last[config.namespace], server.url, False
                )
                rate *= len(data) / last[config.namespace]  # Dynamo messages, not stored ones
                diffs = await verify(nc, config)
                out[config.namespace] = {"per_s": rate, "cpu": cpu, "diffs": diffs}
    return out


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    tune_collector()
    runs = []
    for i, store in enumerate(fresh_stores(args.runs, "capture-catchup-")):
        run = asyncio.run(one_run(args, store))
        runs.append(run)
        s, b = run["sourced"], run["batched"]
        print(
            f"run {i + 1}: {run['messages']:,} Dynamo messages; sourced (a message each): "
            f"{s['per_s']:,.0f}/s, CPU {s['cpu']:.0%} ({s['cpu'] / s['per_s'] * 1e6:.1f} us each); "
            f"batched ({run['batched_messages']:,} messages): {b['per_s']:,.0f}/s, CPU "
            f"{b['cpu']:.0%} ({b['cpu'] / b['per_s'] * 1e6:.1f} us each); ratio "
            f"{b['per_s'] / s['per_s']:.2f}x; verify: "
            + ", ".join(
                "identical" if not r["diffs"] else f"{len(r['diffs'])} keys differ" for r in (s, b)
            ),
            flush=True,
        )
    med = {
        name: statistics.median(r[name]["per_s"] for r in runs) for name in ("sourced", "batched")
    }
    us = {
        name: statistics.median(r[name]["cpu"] / r[name]["per_s"] * 1e6 for r in runs)
        for name in ("sourced", "batched")
    }
    ratios = ", ".join(f"{r['batched']['per_s'] / r['sourced']['per_s']:.2f}x" for r in runs)
    print(
        f"{runs[0]['messages']:,} Dynamo messages, {args.runs} runs, commit {git_revision()}: "
        f"median writer+projector sourced {med['sourced']:,.0f}/s, batched "
        f"{med['batched']:,.0f}/s (ratios {ratios}); CPU per Dynamo message sourced "
        f"{us['sourced']:.1f} us, batched {us['batched']:.1f} us"
    )
    return 1 if any(r[n]["diffs"] for r in runs for n in ("sourced", "batched")) else 0


if __name__ == "__main__":
    raise SystemExit(main())
