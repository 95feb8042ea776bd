"""A scheduler's read while routers write: ``/potential_loads`` latency at one connection while
another connection books and frees, seqstate serve-http and Dynamo's tracker side by side.

Why: a scheduler asks ``/potential_loads`` for every routing decision, right after the calls
that changed the load. serve-http answers it read-your-writes; this measures what that costs.

    .venv/bin/python benchmarks/potential_loads.py [--rounds 3] [--seconds 3] [--no-dynamo]
        [--seqstate-src DIR]

Servers are started as ``slot_vs_dynamo.py`` starts them (its own nats-server, serve-http,
Dynamo 1.6.1's tracker from the venv ``make test-dynamo`` caches), measured in turn each
round, the order alternating. Prints each round's p50 and p99 and the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from harness.cli import argument_parser
from harness.measure import alternated, percentile
from harness.report import git_revision
from harness.trackers import Processes, StartError, Target, add_server_args, start_servers

MODEL = "potential-bench"


def _request(path: str, body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (
        b"POST %b HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (path.encode(), len(data), data)
    )


async def _call(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes
) -> tuple[bytes, bytes]:
    writer.write(data)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head[9:12], await reader.readexactly(length)


async def measure(target: Target, seconds: float, tag: str) -> list[float]:
    """Latencies (s) of ``/potential_loads`` on one connection while another books and frees."""
    reader, writer = await asyncio.open_connection(target.host, target.port)
    register = {"model_name": MODEL, "worker_id": 1, "block_size": 16, "dp_start": 0}
    status, body = await _call(reader, writer, _request("/register", {**register, "dp_size": 1}))
    if status not in (b"200", b"201", b"409"):  # 409: registered by an earlier round
        raise StartError(f"{target.name}: /register answered {status!r} {body[:200]!r}")
    stop = asyncio.Event()

    async def book_and_free() -> int:
        r, w = await asyncio.open_connection(target.host, target.port)
        n = 0
        while not stop.is_set():
            n += 1
            rid = f"{tag}-{n}"
            add = {"model_name": MODEL, "request_id": rid, "worker_id": 1}
            add.update(sequence_hashes=[1, 2, n], new_isl_tokens=64)
            await _call(r, w, _request("/add", add))
            await _call(r, w, _request("/free", {"model_name": MODEL, "request_id": rid}))
        w.close()
        return n

    writes = asyncio.create_task(book_and_free())
    await asyncio.sleep(0.5)
    probe = _request(
        "/potential_loads", {"model_name": MODEL, "sequence_hashes": [1, 2], "new_isl_tokens": 10}
    )
    latencies = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        started = time.perf_counter()
        status, body = await _call(reader, writer, probe)
        latencies.append(time.perf_counter() - started)
        if status != b"200":
            raise StartError(f"{target.name}: /potential_loads answered {status!r} {body[:200]!r}")
    stop.set()
    await writes
    writer.close()
    return sorted(latencies)


def _ms(latencies: list[float], q: float) -> float:
    return 1000 * percentile(latencies, 100 * q)


async def run(args: argparse.Namespace) -> int:
    tmp = tempfile.mkdtemp(prefix="potential-bench-")
    procs = Processes(tmp)
    try:
        targets = await start_servers(args, procs)
        commit = git_revision()
        print(
            f"# /potential_loads under writes, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        )
        print(f"# commit {commit}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
        p50s: dict[str, list[float]] = {name: [] for name in targets}
        p99s: dict[str, list[float]] = {name: [] for name in targets}
        for round_ in range(1, args.rounds + 1):
            order = alternated(list(targets), round_ - 1)
            for name in order:
                got = await measure(targets[name], args.seconds, f"r{round_}")
                p50s[name].append(_ms(got, 0.5))
                p99s[name].append(_ms(got, 0.99))
                print(
                    f"round {round_} {name:9} {len(got):6} calls  p50 {_ms(got, 0.5):.3f} ms"
                    f"  p99 {_ms(got, 0.99):.3f} ms"
                )
        print("\n| server | p50 ms | p99 ms |\n|---|---:|---:|")
        for name in targets:
            print(
                f"| {name} | {statistics.median(p50s[name]):.3f} | "
                f"{statistics.median(p99s[name]):.3f} |"
            )
        return 0
    except StartError as e:
        print(f"potential_loads: {e}", file=sys.stderr)
        return 1
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    add_server_args(p)
    args = p.parse_args()
    args.seqstate_url = args.dynamo_url = None
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
