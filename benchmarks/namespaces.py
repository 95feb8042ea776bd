"""N namespaces, one pipeline each: events/s stored and folded as N grows, one server or three.

Why this exists: one writer folds one namespace; past its ceiling, a deployment splits its load
over several namespaces (docs/partitioning.md), each with its own writer and projector. This
measures what that buys on real processes: for N = 1, 2, 4, 8 namespaces on one embedded
nats-server and on a 3-node JetStream cluster (``NatsCluster``, every stream and the bucket
``--replicas 3``), the events/s the log stores and the events/s the N writers fold together.

One run of a point (a layout, N):

1. a fresh server (or cluster); every namespace provisioned (``ensure``). ``--streams shared``
   (the default: what N namespaces on the default names get) puts every namespace in one
   events stream, one deltas stream and one bucket; ``own`` gives each namespace streams and a
   bucket of its own (``--events-stream`` ...), so a cluster can lead them from different nodes;
2. N pipelines, each ``seqstate run --nats-url ... --namespace nsN`` in a process of its own (a
   writer and a projector, as a user runs them), started, waited for until ``/readyz`` says
   ready, then SIGSTOPped: their start-up is no part of what is timed;
3. **stored**: N publisher processes (this script, ``--publisher``), one per namespace, each
   holding its namespace's share of ``--events`` already encoded: the Mooncake trace's
   lifecycles (AddRequest with the trace's ``hash_ids``, MarkPrefillCompleted, Free; 16 workers
   round-robin, timeline order, pass after pass with distinct request ids, as
   ``benchmarks/replay.py`` builds them) behind 16 ``WorkerAdded``. On a signal they publish at
   once, pipelined (``publish_async``, ``--max-pending`` unacknowledged), every ack checked.
   Stored events/s: the events of all namespaces over the time from the first publish to the
   last ack;
4. **folded**: the N pipelines SIGCONTed at once; folded events/s: the events of all
   namespaces over the time from SIGCONT until every namespace's newest delta message covers
   its last event (polled every 50 ms). Then, untimed, until every bucket's position has
   reached it, and the CPU each pipeline process and each server spent meanwhile;
5. on the last run of a point, ``seqstate replay --verify`` per namespace: identical (exit 0)
   or diverged.

The runs are interleaved (run 1 of every point, then run 2, ...) so a phase of the machine
does not fall on one point; each figure is the median of ``--runs``.

Run from the repository root: ``.venv/bin/python benchmarks/namespaces.py [--json]``; ``--quick``
for a look in about a minute (one run, N = 1, 2, 4, 24,000 events).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
from catch_up import readyz
from harness.cli import argument_parser
from harness.measure import process_cpu_s
from harness.report import git_revision, machine_line
from harness.servers import free_port, replay_verify, seqstate_env, start_seqstate, stop
from harness.workload import DEFAULT_TRACE, base_events, encoded
from nats.aio.client import Client
from nats.js import api

from projector.nats.connection import connect
from projector.nats.resources import ensure
from projector.nats.server import NatsCluster, NatsServer
from projector.settings.config import Config
from projector.wire.chain import covered_source
from projector.wire.values import position_key

REPO: Final = Path(__file__).resolve().parents[1]
WORKERS: Final = 16  # per namespace, as the trace benchmarks route it
POLL_S: Final = 0.05
READY_TIMEOUT_S: Final = 120.0
FOLD_TIMEOUT_S: Final = 600.0


def names(index: int, streams: str) -> dict[str, str]:
    """The settings of namespace ``index``: streams shared by every namespace, or its own."""
    own = f"{index}" if streams == "own" else ""
    return {
        "namespace": f"ns{index}",
        "events_stream": f"NSB{own}_EVENTS",
        "deltas_stream": f"NSB{own}_DELTAS",
        "registry_bucket": f"nsb{own}-registry",
        "snapshot_bucket": f"nsb{own}-snapshots",
    }


def config_of(index: int, streams: str, replicas: int) -> Config:
    return Config(**names(index, streams), replicas=replicas)  # type: ignore[arg-type]


def flags(index: int, streams: str) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in names(index, streams).items()]


# ---- a publisher process ------------------------------------------------------------------


async def publisher(url: str, path: Path, max_pending: int) -> None:
    """Publish the (subject, payload) pairs in ``path`` once told to (a line on stdin);
    print ``{"first_ns", "last_ns", "acked", "last_seq"}`` (wall clock, shared by processes)."""
    messages: list[tuple[str, bytes]] = msgspec.msgpack.decode(path.read_bytes())
    async with connect(url, service=True) as nc:
        js = nc.jetstream(publish_async_max_pending=max_pending)
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        futures: list[asyncio.Future[api.PubAck]] = []
        first = time.time_ns()
        for subject, payload in messages:
            futures.append(await js.publish_async(subject, payload))
        acks = await asyncio.gather(*futures)
        last = time.time_ns()
    dupes = sum(1 for a in acks if a.duplicate)
    if dupes or len(acks) != len(messages):
        raise SystemExit(f"publisher: {len(acks)} acks of {len(messages)}, {dupes} duplicates")
    print(
        json.dumps(
            {
                "first_ns": first,
                "last_ns": last,
                "acked": len(acks),
                "last_seq": max(a.seq for a in acks),
            }
        ),
        flush=True,
    )


# ---- one run of a point -------------------------------------------------------------------


@dataclass
class Pipeline:
    index: int
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    last_seq: int = 0
    folded_s: float | None = None
    started_s: float | None = None  # SIGCONT to its first new delta
    covered_before: int = 0
    cpu_at_cont: float = 0.0


@dataclass
class Point:
    topology: str
    n: int
    runs: list[dict[str, Any]] = field(default_factory=list)


def server_for(topology: str, root: Path) -> AbstractAsyncContextManager[Any]:
    if topology == "cluster":
        return NatsCluster(root / "cluster", size=3, name="nsb")
    return NatsServer(root / "store")


def server_pids(server: Any) -> list[int]:
    nodes = server.nodes if isinstance(server, NatsCluster) else [server]
    return [node.pid for node in nodes if node.pid]


async def covered(nc: Client, config: Config) -> int:
    """The last event of ``config``'s namespace that its stored deltas cover (0: none)."""
    try:
        raw = await nc.jetstream().get_last_msg(config.deltas_stream, config.deltas_subject)
    except Exception:
        return 0
    return covered_source(raw.headers, raw.data) or 0


async def bucket_position(nc: Client, config: Config) -> int:
    try:
        kv = await nc.jetstream().key_value(config.registry_bucket)
        entry = await kv.get(position_key(config.namespace))
    except Exception:
        return 0
    return int(json.loads(entry.value or b"{}").get("applied_seq", 0))


async def wait_ready(pipes: Sequence[Pipeline]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    waiting = list(pipes)
    while waiting:
        for p in waiting:
            if p.proc.poll() is not None:
                raise RuntimeError(
                    f"pipeline ns{p.index} exited {p.proc.returncode}: {tail(p.log)}"
                )
        waiting = [p for p in waiting if await readyz(p.port) != 200]
        if time.monotonic() > deadline:
            raise RuntimeError(f"pipelines not ready within {READY_TIMEOUT_S:.0f} s: {waiting}")
        await asyncio.sleep(0.2)


def tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


async def one_run(
    topology: str, n: int, opts: argparse.Namespace, base: Sequence[Any], work: Path, verify: bool
) -> dict[str, Any]:
    replicas = 3 if topology == "cluster" else 1
    configs = [config_of(i, opts.streams, replicas) for i in range(n)]
    share = opts.events // n
    result: dict[str, Any] = {"topology": topology, "n": n, "events": share * n}
    async with server_for(topology, work) as server:
        url = server.url
        async with connect(url, service=True) as nc:
            for config in configs:
                await ensure(nc, config)
            files = []
            for i, config in enumerate(configs):
                path = work / f"ns{i}.msgpack"
                path.write_bytes(msgspec.msgpack.encode(encoded(config, base, share, WORKERS)))
                files.append(path)
            pipes = []
            for i in range(n):
                port, log = free_port(), work / f"run{i}.log"
                proc = start_seqstate(
                    [
                        "run",
                        *flags(i, opts.streams),
                        f"--replicas={replicas}",
                        f"--metrics-port={port}",
                        "--lag-check-s=0.5",
                        "--log-format=console",
                    ],
                    url,
                    log,
                )
                pipes.append(Pipeline(i, proc, port, log))
            publishers: list[Any] = []
            try:
                await wait_ready(pipes)
                for p in pipes:
                    os.kill(p.proc.pid, signal.SIGSTOP)
                publishers = [
                    subprocess.Popen(
                        [
                            sys.executable,
                            __file__,
                            "--publisher",
                            str(path),
                            "--url",
                            url,
                            "--max-pending",
                            str(opts.max_pending),
                        ],
                        env=seqstate_env(url),
                        cwd=REPO,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    for path in files
                ]
                for pub in publishers:
                    assert pub.stdout is not None
                    if pub.stdout.readline().strip() != "ready":
                        raise RuntimeError("a publisher did not start")
                servers_cpu0 = sum(process_cpu_s(pid) for pid in server_pids(server))
                for pub in publishers:
                    assert pub.stdin is not None
                    pub.stdin.write("go\n")
                    pub.stdin.flush()
                reports = []
                for pub in publishers:
                    out, _ = await asyncio.to_thread(pub.communicate, None, 300)
                    if pub.returncode != 0:
                        raise RuntimeError(f"a publisher exited {pub.returncode}")
                    reports.append(json.loads(out.strip().splitlines()[-1]))
                first = min(r["first_ns"] for r in reports)
                last = max(r["last_ns"] for r in reports)
                result["stored_per_s"] = share * n / ((last - first) / 1e9)
                for p, r in zip(pipes, reports, strict=True):
                    p.last_seq = r["last_seq"]
                servers_cpu1 = sum(process_cpu_s(pid) for pid in server_pids(server))
                result["server_cpu_us_per_event_stored"] = (
                    (servers_cpu1 - servers_cpu0) / (share * n) * 1e6
                )

                for p, config in zip(pipes, configs, strict=True):
                    p.cpu_at_cont = process_cpu_s(p.proc.pid)
                    p.covered_before = await covered(nc, config)
                servers_cpu0 = sum(process_cpu_s(pid) for pid in server_pids(server))
                resumed = time.perf_counter()
                for p in pipes:
                    os.kill(p.proc.pid, signal.SIGCONT)
                while any(p.folded_s is None for p in pipes):
                    for p, config in zip(pipes, configs, strict=True):
                        if p.folded_s is not None:
                            continue
                        now = await covered(nc, config)
                        if p.started_s is None and now > p.covered_before:
                            p.started_s = time.perf_counter() - resumed
                        if now >= p.last_seq:
                            p.folded_s = time.perf_counter() - resumed
                        if p.proc.poll() is not None:
                            raise RuntimeError(f"ns{p.index} exited: {tail(p.log)}")
                    if time.perf_counter() - resumed > FOLD_TIMEOUT_S:
                        raise RuntimeError("the writers did not fold the backlog in time")
                    await asyncio.sleep(POLL_S)
                folded_s = max(p.folded_s or 0.0 for p in pipes)
                result["folded_per_s"] = share * n / folded_s
                result["per_namespace_per_s"] = [share / (p.folded_s or 1) for p in pipes]
                pipe_cpu = sum(process_cpu_s(p.proc.pid) - p.cpu_at_cont for p in pipes)
                result["pipeline_cpu_us_per_event"] = pipe_cpu / (share * n) * 1e6
                result["pipeline_cpu_share"] = pipe_cpu / folded_s
                servers_cpu = sum(process_cpu_s(pid) for pid in server_pids(server)) - servers_cpu0
                result["server_cpu_share"] = servers_cpu / folded_s
                result["server_cpu_us_per_event"] = servers_cpu / (share * n) * 1e6
                result["first_delta_s"] = max(p.started_s or 0.0 for p in pipes)
                for p, config in zip(pipes, configs, strict=True):
                    deadline = time.monotonic() + 60
                    while await bucket_position(nc, config) < p.last_seq:
                        if time.monotonic() > deadline:
                            raise RuntimeError(
                                f"ns{p.index}: the bucket did not reach its last event"
                            )
                        await asyncio.sleep(POLL_S)
            finally:
                for pub in publishers:
                    if pub.poll() is None:
                        pub.kill()
                for p in pipes:
                    if p.proc.poll() is None:
                        os.kill(p.proc.pid, signal.SIGCONT)
                await asyncio.to_thread(stop, [p.proc for p in pipes])
            result["pipeline_exits"] = [p.proc.returncode for p in pipes]
            if verify:
                result["verify"] = [await verify_one(url, i, opts.streams) for i in range(n)]
    return result


async def verify_one(url: str, index: int, streams: str) -> str:
    """``seqstate replay --verify`` on namespace ``index``: 'identical' or 'diverged: ...'."""
    done = await asyncio.to_thread(replay_verify, url, *flags(index, streams))
    if done["exit"] == 0:
        return "identical"
    return f"diverged (exit {done['exit']}): {' / '.join(done['said'])}"


# ---- the sweep ----------------------------------------------------------------------------


def summarize(points: Sequence[Point]) -> list[dict[str, Any]]:
    rows = []
    base: dict[str, float] = {}
    for point in points:
        runs = point.runs
        if not runs:
            continue
        folded = statistics.median(r["folded_per_s"] for r in runs)
        base.setdefault(point.topology, folded)
        verdicts = [v for r in runs for v in r.get("verify", [])]
        rows.append(
            {
                "topology": point.topology,
                "n": point.n,
                "events": runs[0]["events"],
                "stored_per_s": statistics.median(r["stored_per_s"] for r in runs),
                "folded_per_s": folded,
                "vs_one": folded / base[point.topology],
                "folded_runs": [round(r["folded_per_s"]) for r in runs],
                "slowest_namespace_per_s": statistics.median(
                    min(r["per_namespace_per_s"]) for r in runs
                ),
                "pipeline_cpu_us_per_event": statistics.median(
                    r["pipeline_cpu_us_per_event"] for r in runs
                ),
                "pipeline_cpu_share": statistics.median(r["pipeline_cpu_share"] for r in runs),
                "server_cpu_us_per_event_stored": statistics.median(
                    r["server_cpu_us_per_event_stored"] for r in runs
                ),
                "server_cpu_share": statistics.median(r["server_cpu_share"] for r in runs),
                "server_cpu_us_per_event": statistics.median(
                    r["server_cpu_us_per_event"] for r in runs
                ),
                "first_delta_s": statistics.median(r["first_delta_s"] for r in runs),
                "verify": (
                    "identical"
                    if verdicts and all(v == "identical" for v in verdicts)
                    else ("; ".join(v for v in verdicts if v != "identical") or "not run")
                ),
            }
        )
    return rows


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    print(
        "| server | N | events | stored events/s | folded events/s (runs) | vs N=1 | slowest "
        "namespace | CPU µs/event: pipelines + server(s) | cores: pipelines + server(s) | verify |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---|---|---|")
    for r in rows:
        runs = ", ".join(f"{v:,}" for v in r["folded_runs"])
        print(
            f"| {r['topology']} | {r['n']} | {r['events']:,} | {r['stored_per_s']:,.0f} | "
            f"**{r['folded_per_s']:,.0f}** ({runs}) | {r['vs_one']:.2f} | "
            f"{r['slowest_namespace_per_s']:,.0f} | {r['pipeline_cpu_us_per_event']:.0f} + "
            f"{r['server_cpu_us_per_event']:.0f} | "
            f"{r['pipeline_cpu_share']:.2f} + {r['server_cpu_share']:.2f} | {r['verify']} |"
        )


async def sweep(opts: argparse.Namespace) -> dict[str, Any]:
    base = base_events(opts.trace, WORKERS)
    points = [Point(t, n) for t in opts.topology for n in opts.n]
    started = time.perf_counter()
    for run in range(opts.runs):
        for point in points:
            last = run == opts.runs - 1
            with tempfile.TemporaryDirectory(prefix="namespaces-", dir=opts.work) as tmp:
                result = await one_run(point.topology, point.n, opts, base, Path(tmp), last)
            point.runs.append(result)
            print(
                f"run {run + 1}/{opts.runs} {point.topology} N={point.n}: stored "
                f"{result['stored_per_s']:,.0f}/s, folded {result['folded_per_s']:,.0f}/s"
                + (f", verify {result['verify']}" if last else ""),
                file=sys.stderr,
                flush=True,
            )
    return {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.orig_argv),
        "machine": machine_line(),
        "loadavg_at_end": os.getloadavg(),
        "git": git_revision(),
        "streams": opts.streams,
        "wall_s": round(time.perf_counter() - started, 1),
        "rows": summarize(points),
        "runs": [r for p in points for r in p.runs],
    }


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--events", type=int, default=60_000, help="events in all namespaces")
    parser.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--topology", nargs="+", choices=["single", "cluster"], default=["single", "cluster"]
    )
    parser.add_argument("--streams", choices=["shared", "own"], default="shared")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-pending", type=int, default=256)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--quick", action="store_true", help="one run, N = 1 2 4, 24k events")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--work", type=Path, help="where each run's directory goes (logs)")
    parser.add_argument("--publisher", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.publisher is not None:
        asyncio.run(publisher(opts.url, opts.publisher, opts.max_pending))
        return
    if opts.quick:
        opts.runs, opts.n, opts.events = 1, [1, 2, 4], 24_000
    report = asyncio.run(sweep(opts))
    if opts.json:
        print(json.dumps(report))
        return
    print(f"{report['date_utc']}  {report['machine']}  commit {report['git']}")
    print(
        f"streams: {report['streams']}; wall {report['wall_s']} s; load {report['loadavg_at_end']}"
    )
    print_table(report["rows"])


if __name__ == "__main__":
    main()
