"""A writer paused under load, then let go: how fast it catches up, and how much memory it takes.

Why this exists: four routers published flat out, the writer was SIGSTOPped for
20 s and SIGCONTed. nats-py's ordered push consumer queued about half a million events in the
writer (RSS 36 MB → 612 MB, never returned), dropped the rest with one "slow consumer" log
line per message (1.1 million lines), reset itself again and again, and took 133 s to catch up;
meanwhile its delta publishes failed for ~62 s, and the projector's ``/readyz`` said ready on
a bucket 30 s stale.

This script plays the same scenario on real processes: a fresh nats-server (``NatsServer``,
temporary store), ``seqstate writer`` and ``seqstate projector`` as the commands an operator
runs (each with ``--metrics-port``), and ``--routers`` router processes (this script with
``--router``) each publishing batches through ``RouterPublisher.publish_many`` as fast as it
can, or at ``--rate`` events/s in all (AddRequests with a few block hashes, each freed a batch
later, so the state stays small).
After ``--warmup`` seconds it SIGSTOPs the writer for ``--pause`` seconds, SIGCONTs it, and
measures, while the routers go on publishing:

- ``catch_up_s``: from SIGCONT until the writer's stored deltas are within ``--caught-up``
  events (1,000, /readyz's default) of the events stream's newest event;
- ``passed_head_s``: from SIGCONT until the writer has passed the newest event logged at
  SIGCONT (the backlog of the pause, folded);
- ``peak_rss_mb``: the writer's peak resident memory (``VmHWM`` in ``/proc/<pid>/status``),
  and its RSS before the pause and at the end;
- the writer log's size and how many "slow consumer" and "delta publish failed" lines it has;
- the projector's ``/readyz`` answers, sampled every 0.25 s: how long it said 503 during the
  catch-up, and whether it said 200 while the bucket was over ``--caught-up`` events behind.

Run from the repository root: ``.venv/bin/python benchmarks/catch_up.py [--json]``. It is
heavy (the routers take every core they are given); run it once on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.cli import argument_parser
from harness.measure import rss_kb
from harness.report import emit, machine_line, print_fields
from harness.servers import free_port, start_seqstate, stop
from nats.aio.client import Client

from projector.nats.connection import connect
from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.nats.stream import last_seq_of
from projector.route.publisher import RouterPublisher
from projector.settings.config import Config
from projector.wire.chain import covered_source
from seqstate import AddRequest, Event, Free

REPO = Path(__file__).resolve().parents[1]

NAMES = {
    "namespace": "cu",
    "events_stream": "CU_EVENTS",
    "deltas_stream": "CU_DELTAS",
    "registry_bucket": "cu-registry",
    "snapshot_bucket": "cu-snapshots",
}
BATCH = 200  # events per publish_many call: 100 adds and the frees of the previous 100


# ---- a router process ---------------------------------------------------------------------


async def router(url: str, index: int, rate: float, one_by_one: bool) -> None:
    """Publish until SIGTERM: batches of AddRequests and the Frees of the last batch, flat out
    (``rate`` 0) or at ``rate`` events/s; ``one_by_one``: each event awaited on its own, as a
    router publishes its decisions (``publish``), rather than a batch per ``publish_many``."""
    config = Config(**NAMES)  # type: ignore[arg-type]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    started = loop.time()
    sent = 0
    async with connect(url, service=True, config=config) as nc:
        pub = RouterPublisher(nc, router_id=f"bench-{index}-{os.getpid()}", config=config)
        n = 0
        previous: list[AddRequest] = []
        while not stop.is_set():
            adds = [
                AddRequest(
                    request_id=f"{index}-{n + i}",
                    worker_id=(n + i) % 16,
                    block_hashes=[(n + i) * 7 + k for k in range(8)],
                    prefill_tokens=512,
                )
                for i in range(BATCH // 2)
            ]
            frees: list[Event] = [
                Free(request_id=a.request_id, worker_id=a.worker_id) for a in previous
            ]
            if one_by_one:
                for event in [*adds, *frees]:
                    await pub.publish(event)
            else:
                await pub.publish_many([*adds, *frees])
            sent += len(adds) + len(frees)
            previous = adds
            n += len(adds)
            if rate:
                ahead = started + sent / rate - loop.time()
                if ahead > 0:
                    await asyncio.sleep(ahead)


# ---- the benchmark ------------------------------------------------------------------------


async def readyz(port: int) -> int | None:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return None
    try:
        writer.write(b"GET /readyz HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)
        return int(raw.split(b" ", 2)[1])
    except (OSError, TimeoutError, ValueError, IndexError):
        return None
    finally:
        writer.close()


async def positions(nc: Client, config: Config) -> tuple[int, int]:
    """``(newest event logged, newest event the writer's stored deltas cover)``."""
    js = nc.jetstream()
    logged = await last_seq_of(js, config.events_stream, config.events_subjects)
    try:
        raw = await js.get_last_msg(config.deltas_stream, config.deltas_subject)
        folded = covered_source(raw.headers, raw.data) or 0
    except Exception:
        folded = 0
    return logged, folded


def command(args: list[str], url: str, log: Path) -> subprocess.Popen[bytes]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in NAMES.items()]
    return start_seqstate([*args, *flags], url, log)


async def bench(opts: argparse.Namespace, work: Path) -> dict[str, Any]:
    config = Config(**NAMES)  # type: ignore[arg-type]
    result: dict[str, Any] = {}
    with NatsServer(work / "store") as server:
        async with connect(server.url, service=True, config=config) as nc:
            await ensure(nc, config)
            w_port, p_port = free_port(), free_port()
            w_log, p_log = work / "writer.log", work / "projector.log"
            extra = [f"--consumer-window={opts.window}"] if opts.window else []
            writer = command(
                [
                    "writer",
                    f"--metrics-port={w_port}",
                    "--lag-check-s=0.5",
                    *extra,
                    *opts.writer_flag,
                ],
                server.url,
                w_log,
            )
            projector = command(
                ["projector", f"--metrics-port={p_port}", "--lag-check-s=0.5", *extra],
                server.url,
                p_log,
            )
            routers = [
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--router",
                        str(i),
                        "--url",
                        server.url,
                        "--rate",
                        str(opts.rate / opts.routers),
                        *(["--one-by-one"] if opts.one_by_one else []),
                    ],
                    cwd=REPO,
                    stdout=subprocess.DEVNULL,
                    stderr=(work / f"router{i}.log").open("wb"),
                )
                for i in range(opts.routers)
            ]
            procs = [writer, projector, *routers]
            loop = asyncio.get_running_loop()
            samples: list[dict[str, Any]] = []
            try:
                started = loop.time()
                before: dict[str, int] = {}
                while loop.time() - started < opts.warmup:
                    await asyncio.sleep(0.5)
                    before = rss_kb(writer.pid)
                logged0, folded0 = await positions(nc, config)
                warm_rate = logged0 / (loop.time() - started)
                os.kill(writer.pid, signal.SIGSTOP)
                paused_at = loop.time()
                while loop.time() - paused_at < opts.pause:
                    await asyncio.sleep(0.25)
                    samples.append({"t": loop.time() - paused_at, "ready": await readyz(p_port)})
                head, folded_at_cont = await positions(nc, config)
                os.kill(writer.pid, signal.SIGCONT)
                resumed = loop.time()
                passed = caught = None
                peak_rss_seen = 0
                while loop.time() - resumed < opts.limit:
                    await asyncio.sleep(0.25)
                    logged, folded = await positions(nc, config)
                    now = loop.time() - resumed
                    rss = rss_kb(writer.pid)
                    peak_rss_seen = max(peak_rss_seen, rss["VmRSS"])
                    samples.append(
                        {
                            "t": opts.pause + now,
                            "behind": logged - folded,
                            "rss_mb": rss["VmRSS"] / 1024,
                            "ready": await readyz(p_port),
                        }
                    )
                    if passed is None and folded >= head:
                        passed = now
                    if logged - folded <= opts.caught_up:
                        caught = now
                        break
                end_logged, end_folded = await positions(nc, config)
                end = rss_kb(writer.pid)
                total_s = loop.time() - started
            finally:
                for proc in routers:
                    proc.send_signal(signal.SIGTERM)
                os.kill(writer.pid, signal.SIGCONT)
                stop(procs)
            text = w_log.read_text(errors="replace")
            readies = [s for s in samples if s["t"] >= opts.pause and "behind" in s]
            result = {
                "routers": opts.routers,
                "rate": opts.rate or "flat out",
                "publish": "one by one" if opts.one_by_one else f"publish_many of {BATCH}",
                "writer_flags": opts.writer_flag,
                "window": opts.window or "default",
                "warmup_s": opts.warmup,
                "pause_s": opts.pause,
                "publish_rate_before_pause": round(warm_rate),
                "backlog_at_sigcont": head - folded_at_cont,
                "folded_before_pause": folded0,
                "catch_up_s": None if caught is None else round(caught, 1),
                "passed_head_s": None if passed is None else round(passed, 1),
                "caught_up_within": opts.caught_up,
                "events_logged": end_logged,
                "events_folded": end_folded,
                "mean_fold_rate_after_sigcont": (
                    None if caught is None else round((end_folded - folded_at_cont) / caught)
                ),
                "writer_rss_mb_before_pause": round(before.get("VmRSS", 0) / 1024, 1),
                "writer_peak_rss_mb": round(end["VmHWM"] / 1024, 1),
                "writer_rss_mb_at_end": round(end["VmRSS"] / 1024, 1),
                "writer_log_bytes": len(text.encode()),
                "slow_consumer_lines": len(re.findall("slow consumer", text)),
                "delta_publish_failed_lines": len(re.findall("delta publish failed", text)),
                "writer_exit": writer.returncode,
                "projector_503_while_paused": sum(
                    1 for s in samples if s["t"] < opts.pause and s["ready"] == 503
                ),
                "projector_200_while_paused": sum(
                    1 for s in samples if s["t"] < opts.pause and s["ready"] == 200
                ),
                "projector_200_while_over_caught_up": sum(
                    1 for s in readies if s["ready"] == 200 and s["behind"] > opts.caught_up
                ),
                "total_s": round(total_s, 1),
            }
    return result


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--routers", type=int, default=4)
    parser.add_argument(
        "--rate", type=float, default=0.0, help="events/s of all routers together (0: flat out)"
    )
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before the pause")
    parser.add_argument("--pause", type=float, default=20.0, help="seconds the writer is stopped")
    parser.add_argument("--limit", type=float, default=300.0, help="give up after this long")
    parser.add_argument("--caught-up", type=int, default=1000, help="events behind: caught up")
    parser.add_argument("--window", type=int, default=0, help="--consumer-window (0: default)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--writer-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for `seqstate writer` (repeatable), e.g. --writer-flag=--max-ended=100000",
    )
    parser.add_argument(
        "--one-by-one",
        action="store_true",
        help="routers await each event's publish, as a router does (default: publish_many)",
    )
    parser.add_argument("--router", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.router is not None:
        asyncio.run(router(opts.url, opts.router, opts.rate, opts.one_by_one))
        return
    with tempfile.TemporaryDirectory(prefix="catch-up-") as tmp:
        result = asyncio.run(bench(opts, Path(tmp)))
    result["machine"] = machine_line()
    result["date"] = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    emit(result, opts.json, print_fields, 36, indent=None)


if __name__ == "__main__":
    main()
