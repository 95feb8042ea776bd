"""The HTTP layer's ceiling: candidate asyncio servers against Dynamo's own slot tracker.

Why this exists: ``seqstate serve-http`` is a drop-in for Dynamo's standalone
slot tracker (``python -m dynamo.slot_tracker``, contract in
``docs/slot-tracker-api.md``), on "a well-kept asyncio HTTP server library, chosen
for throughput (measure two before you pick)", and a target of at least 50% of Dynamo's calls/s
at 16 connections. This script measures, in one run and with one load generator:

- the candidates, each a minimal server of the tracker's shape with nothing behind it (no NATS,
  no state): ``POST /register``, ``/add`` (201), ``/prefill_complete`` and ``/free`` (200), each
  body checked for ``Content-Type: application/json`` and decoded and type-checked with msgspec
  into the contract's types (hashes i64, worker ids u64, ranks u32), and ``GET /loads`` (16 rows
  encoded with msgspec per call), ``GET /health``; unknown routes 404 ``route not found``, wrong
  methods 405 ``method not allowed`` with ``Allow``, extractor errors 415 / 400 / 422 with
  axum's prefixes, every error as ``{"error": "..."}``; all on uvloop:

  - ``aiohttp``: aiohttp's ``web`` server, its router, one middleware for the error bodies;
  - ``aiohttp-ll`` (not in the default set): aiohttp's low-level ``web.Server``, routing by hand;
  - ``starlette``: uvicorn (httptools parser) running a Starlette app (its router, exception
    handlers for the error bodies);
  - ``asgi``: uvicorn (httptools) running a bare ASGI callable that routes by a dict lookup:
    what uvicorn costs without a framework;
  - ``granian``: granian's embedded server (``granian.server.embed``: its Rust HTTP stack on one
    runtime thread, the app on this process's asyncio loop) with a bare RSGI callable;
  - ``httptools``: no server library: an ``asyncio.Protocol`` around httptools' request parser
    (the parser uvicorn uses), the contract written by hand;
- ``trivial``: an ``asyncio.Protocol`` on uvloop that only splits requests and writes canned
  responses, the fastest a Python server gets here: the check on the generator;
- ``dynamo``: Dynamo's own tracker from ``ai-dynamo-runtime`` (``--dynamo-python``, the
  interpreter of a benchmark-only venv; never a project dependency), with 16 workers registered
  and real bookings: every add is a new request id on one of the 16 workers (24 block hashes,
  1,024 distinct hash lists, 384 prefill tokens), every prefill_complete and free hits an id the
  add phase booked, and whatever the free phase did not reach is freed untimed afterwards;
- any server already running (``--target NAME=PORT``), e.g. ``seqstate serve-http`` later: it
  gets the same 16 registrations (201 or 409 accepted) and the same calls as Dynamo.

The generator (this process, uvloop, raw ``asyncio.Protocol`` connections, requests formatted
per call, responses split by ``Content-Length``) runs three modes per endpoint: ``seq`` (one
connection, one request at a time), ``c16`` (16 connections, one request in flight on each) and
``pipe`` (one connection, ``--depth`` requests in flight, HTTP/1.1 pipelining). Every response's
status is checked (add 201, the rest 200); a run with any other status is an error. Each
measurement lasts ``--seconds`` (prefill_complete and free stop earlier when they run out of the
ids the add phase booked). Within a run every (mode, endpoint) is measured on each server in
turn, so that all servers share a phase of this noisy machine; the server order rotates from run
to run. The table gives the median calls/s over ``--runs`` runs, and the CPU the server process
(utime + stime of all its threads, from /proc) and this generator (``time.process_time``) spent
per call. ``--wrk`` adds a cross-check with a C client (wrk, a Debian package): ``wrk -t1 -c16``
on ``GET /loads`` and on ``POST /free`` of an id never added, on every server, every run.

``--probe`` instead sends the contract's error cases to every server and prints status, body
and ``Allow`` header side by side with Dynamo's.

Run from the repository root (after ``pip install -e '.[bench]'``; Dynamo's venv as
BENCHMARKS.md says):

    .venv/bin/python benchmarks/http_servers.py --dynamo-python ../bench-dynamo/.venv/bin/python
    .venv/bin/python benchmarks/http_servers.py --probe --dynamo-python ...
    .venv/bin/python benchmarks/http_servers.py --servers aiohttp,asgi --runs 1 --seconds 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from typing import Any, Final

from harness.cli import argument_parser
from harness.http import listener_pid, one_shot
from harness.measure import rotated
from harness.report import machine
from harness.servers import free_port, stop
from http_candidates import CANDIDATES, run_loop
from http_load import WORKERS, WRK_FREE_LUA, measure_run, post_request, wrk_check

# ---------------------------------------------------------------------------------------------
# Servers as child processes, the probe, the report.


async def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    give_up = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
        try:
            status, _, _ = await one_shot(port, b"GET /health HTTP/1.1\r\nHost: b\r\n\r\n", 2.0)
            if status == 200:
                return
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            pass
        if time.monotonic() > give_up:
            raise RuntimeError(f"server on port {port} not ready after {timeout} s")
        await asyncio.sleep(0.2)


async def register_workers(port: int) -> None:
    for w in range(WORKERS):
        body = b'{"worker_id":%d,"model_name":"bench","block_size":16,"dp_start":0,"dp_size":1}' % w
        status, _, text = await one_shot(port, post_request(b"/register", body))
        if status not in (201, 409):
            raise RuntimeError(f"register {w} on port {port}: {status} {text!r}")


FREE_Z: Final = b'{"model_name":"bench","request_id":"z"}'
PROBES: Final = [
    ("add, no Content-Type", post_request(b"/add", b'{"model_name":"m"}', None)),
    ("add, text/plain", post_request(b"/add", b'{"model_name":"m"}', b"text/plain")),
    ("add, malformed JSON", post_request(b"/add", b'{"model_name":')),
    ("add, empty body", post_request(b"/add", b"")),
    (
        "add, request_id 5",
        post_request(
            b"/add",
            b'{"model_name":"m","request_id":5,"worker_id":1,"dp_rank":0,"sequence_hashes":[]}',
        ),
    ),
    (
        "add, no sequence_hashes",
        post_request(b"/add", b'{"model_name":"m","request_id":"a","worker_id":1,"dp_rank":0}'),
    ),
    (
        "add, hash 2^63",
        post_request(
            b"/add",
            b'{"model_name":"m","request_id":"a","worker_id":1,'
            b'"dp_rank":0,"sequence_hashes":[9223372036854775808]}',
        ),
    ),
    (
        "add, hash null",
        post_request(
            b"/add",
            b'{"model_name":"m","request_id":"a","worker_id":1,'
            b'"dp_rank":0,"sequence_hashes":[null]}',
        ),
    ),
    (
        "add, new_isl_tokens -1",
        post_request(
            b"/add",
            b'{"model_name":"m","request_id":"a",'
            b'"worker_id":1,"dp_rank":0,"sequence_hashes":[],'
            b'"new_isl_tokens":-1}',
        ),
    ),
    ("free, +json type", post_request(b"/free", FREE_Z, b"application/x+json")),
    ("free, charset param", post_request(b"/free", FREE_Z, b"application/json; charset=utf-8")),
    (
        "add, worker_id 2^64",
        post_request(
            b"/add",
            b'{"model_name":"m","request_id":"a",'
            b'"worker_id":18446744073709551616,"dp_rank":0,'
            b'"sequence_hashes":[]}',
        ),
    ),
    ("GET /nope", b"GET /nope HTTP/1.1\r\nHost: b\r\n\r\n"),
    ("GET /add", b"GET /add HTTP/1.1\r\nHost: b\r\n\r\n"),
    ("POST /loads", post_request(b"/loads", b"{}")),
    ("DELETE /health", b"DELETE /health HTTP/1.1\r\nHost: b\r\n\r\n"),
]


async def probe(ports: dict[str, int]) -> list[dict[str, Any]]:
    rows = []
    for name, raw in PROBES:
        row: dict[str, Any] = {"case": name}
        for server, port in ports.items():
            try:
                status, headers, body = await one_shot(port, raw)
                row[server] = {
                    "status": status,
                    "body": body.decode("utf-8", "replace"),
                    "allow": headers.get("allow", ""),
                }
            except Exception as e:  # a server that hangs or drops the case is a result too
                row[server] = {"status": 0, "body": f"<{type(e).__name__}: {e}>", "allow": ""}
        rows.append(row)
    return rows


def versions(dynamo_python: str | None) -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("msgspec", "aiohttp", "uvicorn", "starlette", "httptools", "granian", "uvloop"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    if dynamo_python:
        out["ai-dynamo-runtime"] = subprocess.run(
            [
                dynamo_python,
                "-c",
                "from importlib.metadata import version as v;print(v('ai-dynamo-runtime'))",
            ],
            capture_output=True,
            text=True,
        ).stdout.strip()
    return out


def table(
    results: dict[str, Any],
    servers: list[str],
    modes: list[str],
    endpoints: list[str],
    key: str,
    fmt: str,
) -> list[str]:
    lines = []
    head = f"| mode | endpoint | {' | '.join(servers)} |"
    if key == "rate" and "dynamo" in servers:
        others = [s for s in servers if s not in ("dynamo", "trivial")]
        head += "".join(f" {s}/dynamo |" for s in others)
    else:
        others = []
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for mode in modes:
        for e in endpoints:
            med = {}
            for s in servers:
                vals = [r[mode][e][key] for r in results[s] if e in r.get(mode, {})]
                med[s] = statistics.median(vals) if vals else float("nan")
            cells = [format(med[s], fmt) for s in servers]
            cells += [f"{med[s] / med['dynamo']:.0%}" for s in others]
            lines.append(f"| {mode} | {e} | {' | '.join(cells)} |")
    return lines


async def main_async(args: argparse.Namespace) -> int:
    servers = [s for s in args.servers.split(",") if s]
    for s in servers:
        if s not in CANDIDATES and s != "dynamo":
            raise SystemExit(f"unknown server {s!r}")
    if "dynamo" in servers and not args.dynamo_python:
        print("no --dynamo-python: Dynamo's tracker left out", file=sys.stderr)
        servers.remove("dynamo")
    if args.wrk and not shutil.which("wrk"):
        raise SystemExit("--wrk: no wrk on PATH (Debian: apt-get install wrk)")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    ports: dict[str, int] = {}
    tmp = tempfile.mkdtemp(prefix="http-bench-")
    try:
        for s in servers:
            port = free_port()
            if s == "dynamo":
                cmd = [args.dynamo_python, "-m", "dynamo.slot_tracker", "--port", str(port)]
            else:
                cmd = [sys.executable, os.path.abspath(__file__), "--serve", s, "--port", str(port)]
            procs[s] = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
            )
            ports[s] = port
        for target in args.target:
            name, _, port_text = target.partition("=")
            ports[name] = int(port_text)
            servers.append(name)
        for s in servers:
            if s in procs:
                await wait_ready(ports[s], procs[s])
            await register_workers(ports[s])

        if args.probe:
            ports = {s: p for s, p in ports.items() if s != "trivial"}
            servers = list(ports)
            rows = await probe(ports)
            if args.json:
                print(json.dumps(rows, indent=1))
                return 0
            ref = "dynamo" if "dynamo" in servers else servers[0]
            for row in rows:
                print(f"{row['case']}:")
                for s in servers:
                    r = row[s]
                    same = (
                        ""
                        if s == ref
                        else (
                            "  [same]"
                            if (r["status"], r["body"], r["allow"])
                            == (row[ref]["status"], row[ref]["body"], row[ref]["allow"])
                            else "  [same status]"
                            if r["status"] == row[ref]["status"]
                            else "  [DIFFERENT STATUS]"
                        )
                    )
                    allow = f" allow={r['allow']}" if r["allow"] else ""
                    print(f"  {s:>10} {r['status']}{allow} {r['body'][:150]}{same}")
            return 0

        modes = args.modes.split(",")
        endpoints = args.endpoints.split(",")
        info = {
            "machine": machine(),
            "versions": versions(args.dynamo_python),
            "argv": sys.argv[1:],
            "servers": servers,
            "ports": ports,
        }
        print(f"# {info['machine']} {info['versions']}", file=sys.stderr)
        results: dict[str, list[Any]] = {s: [] for s in servers}
        wrk: dict[str, list[dict[str, float]]] = {s: [] for s in servers}
        lua = os.path.join(tmp, "free.lua")
        with open(lua, "w") as f:
            f.write(WRK_FREE_LUA)
        for run in range(args.runs):
            order = rotated(servers, run)
            targets = {
                s: (ports[s], procs[s].pid if s in procs else listener_pid(ports[s])) for s in order
            }
            out = await measure_run(targets, f"r{run}", modes, endpoints, args.seconds, args.depth)
            for s in order:
                res = out[s]
                results[s].append(res)
                brief = ", ".join(
                    f"{m}:{e}={res[m][e]['rate']:,.0f}" for m in modes for e in endpoints
                )
                if args.wrk:
                    wrk[s].append(await wrk_check(ports[s], args.seconds, lua))
                    brief += f", wrk c16: {wrk[s][-1]}"
                print(f"run {run + 1} {s}: {brief}", file=sys.stderr)
        info["results"] = results
        if args.wrk:
            info["wrk_c16"] = wrk
        if args.save:
            with open(args.save, "w") as f:
                json.dump(info, f, indent=1)
        if args.json:
            print(json.dumps(info, indent=1))
            return 0
        print(f"machine: {info['machine']}\nversions: {info['versions']}")
        print(
            f"\nmedian calls/s over {args.runs} runs ({args.seconds} s each; "
            f"pipe = {args.depth} in flight)\n"
        )
        print("\n".join(table(results, servers, modes, endpoints, "rate", ",.0f")))
        print("\nserver CPU µs per call (all its threads; median)\n")
        print("\n".join(table(results, servers, modes, endpoints, "server_cpu_us", ".1f")))
        print("\ngenerator CPU µs per call (median)\n")
        print("\n".join(table(results, servers, modes, endpoints, "gen_cpu_us", ".1f")))
        if args.wrk:
            print(
                "\nc16 cross-check with wrk -t1 -c16 (median calls/s; free of an id never added)\n"
            )
            print(f"| endpoint | {' | '.join(servers)} |\n|---|" + "---|" * len(servers))
            for e in ("loads", "free"):
                cells = [f"{statistics.median(r[e] for r in wrk[s]):,.0f}" for s in servers]
                print(f"| {e} | {' | '.join(cells)} |")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        stop(procs.values(), timeout=10)


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument(
        "--servers",
        default="aiohttp,starlette,asgi,granian,httptools,trivial,dynamo",
        help="comma-separated: aiohttp, starlette, asgi, granian, httptools, trivial, dynamo",
    )
    p.add_argument(
        "--dynamo-python",
        default=os.environ.get("DYNAMO_PYTHON"),
        help="python of a venv with ai-dynamo-runtime==1.6.1 ($DYNAMO_PYTHON)",
    )
    p.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="NAME=PORT",
        help="also measure a server already listening on 127.0.0.1:PORT",
    )
    p.add_argument("--modes", default="seq,c16,pipe")
    p.add_argument("--endpoints", default="add,prefill_complete,free,loads")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.5, help="per measurement")
    p.add_argument("--depth", type=int, default=32, help="requests in flight when pipelined")
    p.add_argument("--probe", action="store_true", help="the contract's error cases, no load")
    p.add_argument(
        "--wrk",
        action="store_true",
        help="also measure c16 /loads and /free with wrk (a C client), if installed",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--save", metavar="FILE", help="also write the JSON with every run")
    p.add_argument("--serve", choices=sorted(CANDIDATES), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        run_loop(CANDIDATES[args.serve](args.port))
        return 0
    result: list[int] = []

    async def go() -> None:
        result.append(await main_async(args))

    run_loop(go())
    return result[0]


if __name__ == "__main__":
    sys.exit(main())
