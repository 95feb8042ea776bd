"""``seqstate loads --at WHEN`` at random points of a million events of history.

Why this exists: the target is an answer in at most 1 s at any point inside 1,000,000 events
of history. A look back restores the newest snapshot at or before the point and folds the log
from there (the writer keeps the first snapshot past every ``snapshot_history_every`` events,
50,000 by default), so its cost is a snapshot's restore and at most about that many events,
wherever the point is.

Setup (timed and reported, never part of the target): as ``benchmarks/restart.py`` builds its
history: a fresh embedded nats-server, ``ensure`` with the default ``Config``, 16
``WorkerAdded`` then the Mooncake trace's lifecycles pass after pass, ``--events`` messages
published pipelined, and one pipeline (writer and projector, default settings) that folds them
all, taking its snapshots as it goes, and stops.

``--pace EVENTS_PER_S`` builds the history as live traffic does instead: the pipeline runs
while the events arrive at that rate, so the writer snapshots as in service (by count and
size) rather than as a catch-up at full speed (spaced by its encodes' and saves' time).

Each point (``--points`` of them, seeded: ``--seed``) is asked ``--runs`` times, and each
answer timed two ways:

(c) the command as a user types it, ``seqstate loads --at seq:N --json`` (and the same point
    as an ISO 8601 time, ``--at <the event's log time>``), in a subprocess: wall time from
    spawn to exit, the interpreter's start and imports included;
(a) the same look back in this process (``projector.ops.loads_at.loads_at``), on a connection
    already open: the snapshot's fetch and restore and the fold.

The writer spaces its snapshots by their cost (every 10,000 events, or every ``size / 64``
events for a large state, and no sooner than 50 times an encode and save's time), and takes
one at the first event past each multiple of ``snapshot_history_every`` besides: the widest
gap between kept snapshots bounds the fold, and is reported with the snapshots' sizes.

Reported: the median per point over its runs, then the median and the maximum of those over the
points, and how many events each point folded (from the answer's own line). At the end one
point's answer is checked against a replay from the first event.

Run from the repository root: ``.venv/bin/python benchmarks/loads_at.py [--points N]
[--runs N] [--json]`` (``--events 100000`` for a quick look). One invocation builds its own
server; nothing cached.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
from harness.cli import positive
from harness.report import head_line
from harness.servers import connect
from harness.workload import DEFAULT_TRACE, WAIT_TIMEOUT_S, encoded, fill, trace_events
from nats.aio.client import Client
from replay import finish, new_report
from restart import catch_up

from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.nats.snapshots import SnapshotStore
from projector.ops.loads_at import loads_at
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from projector.write.log_fold import iso, replay

TARGET_S: Final = 1.0
PACE_SLICE: Final = 5_000
FOLDED = re.compile(r"; (\d+) events? folded from ")


def cli_once(url: str, config: Config, when: str) -> tuple[float, int, list[dict[str, Any]]]:
    """``seqstate loads --at WHEN --json``: wall seconds, events folded, rows printed."""
    exe = Path(sys.executable).parent / "seqstate"
    argv = [str(exe), "loads", "--at", when, "--json", "--namespace", config.namespace]
    t0 = time.perf_counter()
    done = subprocess.run(
        argv, env={**os.environ, "NATS_URL": url}, capture_output=True, text=True, check=False
    )
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"seqstate loads --at {when}: exit {done.returncode}: {done.stderr}")
    folded = FOLDED.search(done.stderr)
    rows = [msgspec.json.decode(line) for line in done.stdout.splitlines()]
    return seconds, int(folded.group(1)) if folded else -1, rows


async def paced(
    url: str, nc: Client, config: Config, messages: Sequence[Any], args: argparse.Namespace
) -> dict[str, Any]:
    """The history as live traffic makes it: a pipeline runs while the events arrive at
    ``--pace`` events/s in slices of ``PACE_SLICE``, so the writer keeps up and snapshots as it
    does in service, not as a catch-up at full speed does; it stops cleanly at the end."""
    pnc = await connect(url, "bench-paced")
    try:
        pipeline = await Pipeline(pnc, config, start_timeout=WAIT_TIMEOUT_S).start()
        t0 = time.perf_counter()
        sent = 0
        filled: dict[str, Any] = {}
        for start in range(0, len(messages), PACE_SLICE):
            part = messages[start : start + PACE_SLICE]
            filled = await fill(nc, config, part, args.max_pending, alone=False)
            sent += len(part)
            ahead = sent / args.pace - (time.perf_counter() - t0)
            if ahead > 0:
                await asyncio.sleep(ahead)
        await pipeline.wait_applied(filled["last_seq"])
        seconds = time.perf_counter() - t0
        await pipeline.stop(timeout=WAIT_TIMEOUT_S)
    finally:
        await pnc.drain()
    return {
        "events": sent,
        "seconds": seconds,
        "pace": args.pace,
        "last_seq": filled["last_seq"],
        "catch_up": {"seconds": 0.0, "events_folded": sent},
    }


async def bench(args: argparse.Namespace, base: Sequence[Any]) -> dict[str, Any]:
    config = Config()
    result: dict[str, Any] = {}
    async with NatsServer() as server:
        nc = await connect(server.url, "bench-loads-at")
        try:
            v = nc.connected_server_version
            result["nats_server"] = f"{v.major}.{v.minor}.{v.patch}"
            await ensure(nc, config)
            t0 = time.perf_counter()
            messages = encoded(config, base, args.events, args.workers)
            if args.pace:
                setup = await paced(server.url, nc, config, messages, args)
                setup["build_s"] = time.perf_counter() - t0
            else:
                setup = await fill(nc, config, messages, args.max_pending)
                setup["build_s"] = time.perf_counter() - t0
                setup["catch_up"] = await catch_up(server.url, config)
            del messages
            store = await SnapshotStore(nc, config).open(create=False)
            snapshots = await store.list()
            setup["snapshots"] = [info.applied_seq for info in snapshots]
            setup["snapshot_bytes"] = [info.size for info in snapshots]
            starts = [0, *setup["snapshots"]]
            setup["widest_gap_events"] = max(b - a for a, b in itertools.pairwise(starts))
            result["setup"] = setup
            last = setup["last_seq"]
            js = nc.jetstream()
            rng = random.Random(args.seed)
            points = sorted(rng.sample(range(args.workers + 1, last + 1), args.points))
            rows: list[dict[str, Any]] = []
            for seq in points:
                moment = (await js.get_msg(config.events_stream, seq)).time
                assert moment is not None
                by_seq, by_time, in_process = [], [], []
                folded = -1
                for _ in range(args.runs):
                    seconds, folded, _ = await asyncio.to_thread(
                        cli_once, server.url, config, f"seq:{seq}"
                    )
                    by_seq.append(seconds)
                    seconds, _, _ = await asyncio.to_thread(
                        cli_once, server.url, config, moment.isoformat()
                    )
                    by_time.append(seconds)
                    a0 = time.perf_counter()
                    await loads_at(nc, config, f"seq:{seq}")
                    in_process.append(time.perf_counter() - a0)
                rows.append(
                    {
                        "seq": seq,
                        "folded": folded,
                        "cli_seq_s": statistics.median(by_seq),
                        "cli_time_s": statistics.median(by_time),
                        "in_process_s": statistics.median(in_process),
                    }
                )
                print(f"  seq:{seq}: {rows[-1]}", file=sys.stderr, flush=True)
            result["points"] = rows
            for key in ("cli_seq_s", "cli_time_s", "in_process_s"):
                values = [row[key] for row in rows]
                result[key] = {"median": statistics.median(values), "max": max(values)}
            result["folded"] = {
                "median": statistics.median(row["folded"] for row in rows),
                "max": max(row["folded"] for row in rows),
            }
            result["meets_target"] = result["cli_seq_s"]["max"] <= TARGET_S
            check = points[len(points) // 2]
            _, _, printed = await asyncio.to_thread(cli_once, server.url, config, f"seq:{check}")
            fresh = await replay(nc, config, from_seq=1, to_seq=check)
            result["check"] = {
                "seq": check,
                "equals_replay_from_the_first_event": printed
                == [msgspec.to_builtins(row) for row in fresh.loads()],
                "log_time": iso(fresh.as_of_ns),
            }
        finally:
            await nc.drain()
    return result


def print_report(report: dict[str, Any]) -> None:
    m, w, r = report["machine"], report["workload"], report["result"]
    print(head_line("loads --at", m))
    print(
        f"history {w['events']:,} events, {len(r['points'])} points x {w['runs']} runs, "
        f"compiled core {w['compiled_core']}"
    )
    s = r["setup"]
    print(
        f"setup: publish {s['seconds']:.1f} s"
        + (f" at {s['pace']:,} events/s, the pipeline running" if "pace" in s else "")
        + f", catch-up {s['catch_up']['seconds']:.1f} s, "
        f"{len(s['snapshots'])} snapshots kept at {s['snapshots']} "
        f"({max(s['snapshot_bytes']) / 1e6:.1f} MB at most; widest gap "
        f"{s['widest_gap_events']:,} events)"
    )
    for key, label in (
        ("cli_seq_s", "seqstate loads --at seq:N --json (subprocess)"),
        ("cli_time_s", "seqstate loads --at ISO --json (subprocess)"),
        ("in_process_s", "loads_at() in process, connection open"),
    ):
        print(
            f"{label:<48} median {r[key]['median'] * 1000:6.0f} ms, worst point "
            f"{r[key]['max'] * 1000:6.0f} ms"
        )
    print(f"events folded per point: median {r['folded']['median']:,}, max {r['folded']['max']:,}")
    print(f"target {TARGET_S:.1f} s at every point: {'met' if r['meets_target'] else 'MISSED'}")
    print(f"check at seq:{r['check']['seq']}: equals a replay from the first event: "
          f"{r['check']['equals_replay_from_the_first_event']}")  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="JSONL trace (Mooncake)")
    p.add_argument("--events", type=positive, default=1_000_000, help="events of history")
    p.add_argument("--points", type=positive, default=20, help="random points asked")
    p.add_argument("--runs", type=positive, default=3, help="answers timed per point")
    p.add_argument(
        "--pace",
        type=positive,
        default=None,
        metavar="EVENTS_PER_S",
        help="build the history as live traffic, a pipeline running, at this rate (default: "
        "published first, then folded in one catch-up, as restart.py builds it)",
    )
    p.add_argument("--seed", type=int, default=20261205, help="which points")
    p.add_argument("--workers", type=positive, default=16, help="workers, round-robin")
    p.add_argument("--max-pending", type=positive, default=4_000, help="setup: unacked publishes")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    p.add_argument("--save", type=Path, default=None, help="also write the JSON document here")
    args = p.parse_args(argv)
    args.tail = 0  # the report's workload names it (restart.py's)
    if args.events <= args.workers + args.points:
        p.error("--events must exceed --workers + --points")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    base = trace_events(args.trace, args.workers, "loads_at.py")
    if base is None:
        return 2
    report = new_report(args, base)
    finish(report, args, bench(args, base), print_report)
    result = report["result"]
    return 0 if result["check"]["equals_replay_from_the_first_event"] else 1


if __name__ == "__main__":
    sys.exit(main())
