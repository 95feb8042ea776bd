"""``seqstate serve-http`` side by side with Dynamo's own slot tracker.

Why this exists: ``seqstate serve-http`` is a drop-in for Dynamo's standalone slot-tracker HTTP
API (``python -m dynamo.slot_tracker``, contract in ``docs/slot-tracker-api.md``),
and there are throughput and latency targets for it relative to Dynamo's tracker on the same
machine. This script measures both, with one load generator, in one run:

- it starts everything itself, on free ports, in a temporary directory: a ``nats-server -js``
  (the one in this venv), ``seqstate serve-http`` on it, and Dynamo's tracker
  (``--dynamo-python``, the interpreter of a benchmark-only venv with ai-dynamo-runtime 1.6.1;
  default ``~/.cache/seqstate/dynamo-1.6.1/bin/python``; if it is missing, Dynamo is skipped and
  seqstate is still measured), and stops all of them at the end, on Ctrl-C and on errors;
  ``--seqstate-url`` / ``--dynamo-url`` measure servers already running instead;
- a correctness pass first: the same short sequence of calls (16 registrations of model
  ``bench``, adds, a duplicate add (409), an add on an unknown worker, a prefill_complete of an
  unknown id (404), frees, ``/loads``, ``/workers``, ``/potential_loads``) to both servers, the
  status codes and JSON bodies compared; a difference is printed, the timing still runs, and the
  exit status is 1 (rows of ``/potential_loads`` in another order are only noted: Dynamo's come
  in a hash map's order);
- the workloads, each measured on both servers, interleaved (per round every workload on one
  server then the other, the order alternating between rounds), ``--rounds`` rounds of
  ``--seconds`` each:

  - ``pairs``: POST /add of a fresh request id (one of the 16 workers, 24 sequence hashes from a
    pool of 1,024 lists, new_isl_tokens 384), then, on the same connection, POST /free of that
    id; an add and a free are two calls; at 1 connection (with each call's latency), 16 and 64
    connections (one request in flight on each), and pipelined (one connection, ``--depth``
    requests in flight, a free right behind its add);
  - ``loads``: GET /loads?model_name=bench (what a scheduler asks) at 16 connections and
    pipelined.

  Every status is checked (add 201, free 200, loads 200); any other is an error, reported, and
  makes the exit status 1. A measurement stops issuing at its deadline, at a pair's boundary
  (every add is freed).

The generator is this process: raw ``asyncio.Protocol`` connections (on uvloop when it is
importable), requests formatted from byte templates, responses split by ``Content-Length``.
The report gives per workload the median calls/s of each server over the rounds, the median of
the per-round ratios seqstate/dynamo, the CPU µs per call of each serving process (utime + stime
of the process and its children, from /proc, over the measurement; for seqstate also its
nats-server's), the latency of a call at 1 connection, and the targets, met or not.
The machine has few cores: the generator, the servers and NATS share them, so run nothing else.

Run from the repository root:

    .venv/bin/python benchmarks/slot_vs_dynamo.py
    .venv/bin/python benchmarks/slot_vs_dynamo.py --rounds 1 --seconds 1 --json /tmp/r.json
    .venv/bin/python benchmarks/slot_vs_dynamo.py --dynamo-python ../bench-dynamo/.venv/bin/python
    .venv/bin/python benchmarks/slot_vs_dynamo.py --seqstate-url http://127.0.0.1:8091
    mkdir /tmp/old && git archive HEAD~3 | tar -x -C /tmp/old && \
        .venv/bin/python benchmarks/slot_vs_dynamo.py --seqstate-src /tmp/old

The exit status is 0, or 1 when the correctness pass found a difference or a call failed
(``--fail-on-targets``: 2 when a target is missed).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any, Final

from harness.cli import argument_parser
from harness.http import one_shot
from harness.measure import alternated, median
from harness.report import cpu_model, git_revision
from harness.trackers import REPO, Processes, StartError, Target, add_server_args, start_servers
from slot_load import MODEL, WORKERS, Workload, failed_measurement, get, measure, post, workloads

SERVERS: Final = ("seqstate", "dynamo")


ONE_SHOT_S: Final = 10.0  # a call of the correctness pass, at most

# The targets: seqstate's calls/s as a share of Dynamo's (same round), per workload
TARGETS: Final = {"pairs-c16": 0.25, "pairs-c64": 0.30, "loads-c16": 0.75, "loads-pipe": 0.75}
# p50 latency of a call at 1 connection: at most this times Dynamo's, or this floor if higher
# (a round trip through one loopback socket and a JetStream store is tens of µs on its own)
P50_TARGET: Final = 3.0
P50_FLOOR_MS: Final = 0.080


def target_of(name: str) -> float | None:
    kind, _, mode = name.partition("-")
    return TARGETS.get(f"{kind}-pipe" if mode.startswith("pipe") else name)


# ---------------------------------------------------------------------------------------------
# The correctness pass.


def register_body(worker: int) -> bytes:
    return (
        b'{"worker_id":%d,"model_name":"bench","block_size":16,"dp_start":0,"dp_size":1}' % worker
    )


def add_body(rid: str, worker: int, hashes: list[int], isl: int, model: str = MODEL) -> bytes:
    return json.dumps(
        {
            "model_name": model,
            "request_id": rid,
            "worker_id": worker,
            "dp_rank": 0,
            "sequence_hashes": hashes,
            "new_isl_tokens": isl,
        }
    ).encode()


def by_id(rid: str, model: str = MODEL) -> bytes:
    return json.dumps({"model_name": model, "request_id": rid}).encode()


def correctness_calls(tag: str) -> Iterator[tuple[str, bytes]]:
    """The correctness pass: (label, raw request); ``tag`` keeps the ids of a run unique."""
    for w in range(WORKERS):
        yield f"register worker {w}", post("/register", register_body(w))
    yield "register worker 0 again (409)", post("/register", register_body(0))
    yield "workers", get(f"/workers?model_name={MODEL}")
    yield "loads, idle", get(f"/loads?model_name={MODEL}")
    a, b, c, ghost = (f"{tag}-{x}" for x in ("a", "b", "c", "ghost"))
    yield "add a on worker 0", post("/add", add_body(a, 0, [11, 12, 13], 100))
    yield "add b on worker 1", post("/add", add_body(b, 1, [11, 12, 13, 14], 50))
    yield "add c on worker 0 (shares 2 blocks)", post("/add", add_body(c, 0, [11, 12, 17], 0))
    yield "add a again, worker 2 (409)", post("/add", add_body(a, 2, [11], 10))
    yield "add on unknown worker 99 (404)", post("/add", add_body(f"{tag}-w", 99, [1], 10))
    yield "add, model never registered (404)", post("/add", add_body(f"{tag}-m", 0, [1], 1, "nm"))
    yield "prefill_complete of unknown id (404)", post("/prefill_complete", by_id(ghost))
    yield "loads with a, b, c", get(f"/loads?model_name={MODEL}")
    yield "prefill_complete a", post("/prefill_complete", by_id(a))
    yield "prefill_complete a again", post("/prefill_complete", by_id(a))
    yield (
        "potential_loads",
        post(
            "/potential_loads",
            json.dumps(
                {"model_name": MODEL, "sequence_hashes": [11, 12, 99], "new_isl_tokens": 7}
            ).encode(),
        ),
    )
    yield "free a", post("/free", by_id(a))
    yield "free a again", post("/free", by_id(a))
    yield "loads after free a", get(f"/loads?model_name={MODEL}")
    yield "free b", post("/free", by_id(b))
    yield "free c", post("/free", by_id(c))
    yield "loads, idle again", get(f"/loads?model_name={MODEL}")
    yield "prefill_complete of freed a (404)", post("/prefill_complete", by_id(a))


# Calls whose rows come in no stated order: Dynamo's /potential_loads walks a hash map, so its
# order changes from run to run; the same rows in another order are noted, not a difference.
UNORDERED: Final = frozenset({"potential_loads"})


def sorted_rows(body: Any) -> Any:
    if not isinstance(body, list):
        return body
    return sorted(body, key=lambda row: json.dumps(row, sort_keys=True))


def decoded(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")


async def correctness(targets: dict[str, Target], tag: str) -> list[dict[str, Any]]:
    """Every call to every server in turn; a row per call, with ``same`` when compared."""
    rows = []
    for label, raw in correctness_calls(tag):
        row: dict[str, Any] = {"call": label}
        for name, t in targets.items():
            try:
                status, _, body = await one_shot(t.port, raw, ONE_SHOT_S, t.host)
                row[name] = {"status": status, "body": decoded(body)}
            except Exception as e:  # a hang or a drop is a result too
                row[name] = {"status": 0, "body": f"<{type(e).__name__}: {e}>"}
        if len(targets) == 2:
            x, y = (row[n] for n in targets)
            row["same"] = x == y
            if not row["same"] and label in UNORDERED and x["status"] == y["status"]:
                row["same_rows_other_order"] = sorted_rows(x["body"]) == sorted_rows(y["body"])
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# The report.


def run_text(cmd: list[str], timeout: float = 30) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def header(args: argparse.Namespace, loop_name: str) -> dict[str, Any]:
    commit = git_revision()
    if args.seqstate_src:
        commit += f"; serve-http run from {os.path.abspath(args.seqstate_src)}"
    dynamo = ""
    if not args.no_dynamo and not args.dynamo_url and os.path.isfile(args.dynamo_python):
        dynamo = run_text(
            [
                args.dynamo_python,
                "-c",
                "from importlib.metadata import version;print(version('ai-dynamo-runtime'))",
            ]
        )
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "nproc": os.cpu_count(),
        "cpu": cpu_model(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "commit": commit,
        "python": sys.version.split()[0],
        "generator_loop": loop_name,
        "ai_dynamo_runtime": dynamo,
        "argv": sys.argv[1:],
    }


def fmt(x: float, spec: str) -> str:
    return "n/a" if math.isnan(x) else format(x, spec)


def summarize(
    rounds: list[dict[str, dict[str, dict[str, Any]]]], names: list[str], ws: list[Workload]
) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """The table, the targets' lines and their verdicts, from every round's numbers."""
    both = "seqstate" in names and "dynamo" in names
    lines = [
        "| workload | seqstate calls/s | dynamo calls/s | seqstate/dynamo | seqstate CPU µs/call"
        " | (its nats-server) | dynamo CPU µs/call | generator µs/call (s, d) | errors (s, d) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratio: dict[str, float] = {}
    for w in ws:
        rs = [r[w.name] for r in rounds]

        def col(server: str, key: str, rs: list[dict[str, dict[str, Any]]] = rs) -> float:
            return median([r[server][key] for r in rs if server in r])

        def errs(server: str, rs: list[dict[str, dict[str, Any]]] = rs) -> str:
            return str(sum(r[server]["errors"] for r in rs)) if server in names else "-"

        ratio[w.name] = (
            median([r["seqstate"]["rate"] / r["dynamo"]["rate"] for r in rs if r["dynamo"]["rate"]])
            if both
            else math.nan
        )
        lines.append(
            f"| {w.name} | {fmt(col('seqstate', 'rate'), ',.0f')} | "
            f"{fmt(col('dynamo', 'rate'), ',.0f')} | {fmt(ratio[w.name], '.1%')} | "
            f"{fmt(col('seqstate', 'server_cpu_us'), ',.0f')} | "
            f"{fmt(col('seqstate', 'nats_cpu_us'), ',.0f')} | "
            f"{fmt(col('dynamo', 'server_cpu_us'), ',.0f')} | "
            f"{fmt(col('seqstate', 'gen_cpu_us'), '.0f')}, "
            f"{fmt(col('dynamo', 'gen_cpu_us'), '.0f')}"
            f" | {errs('seqstate')}, {errs('dynamo')} |"
        )
    c1 = [r["pairs-c1"] for r in rounds]
    p50 = {s: median([r[s]["p50_ms"] for r in c1 if s in r]) for s in SERVERS}
    p99 = {s: median([r[s]["p99_ms"] for r in c1 if s in r]) for s in SERVERS}
    p50_ratio = (
        median(
            [r["seqstate"]["p50_ms"] / r["dynamo"]["p50_ms"] for r in c1 if r["dynamo"]["p50_ms"]]
        )
        if both
        else math.nan
    )
    p50_floor = max(p50["dynamo"], P50_FLOOR_MS) if both else math.nan
    lines += [
        "",
        "| latency of a call, pairs at 1 connection | seqstate | dynamo | seqstate/dynamo |",
        "|---|---:|---:|---:|",
        f"| p50 ms | {fmt(p50['seqstate'], '.3f')} | {fmt(p50['dynamo'], '.3f')} | "
        f"{fmt(p50_ratio, '.2f')}x |",
        f"| p99 ms | {fmt(p99['seqstate'], '.3f')} | {fmt(p99['dynamo'], '.3f')} | "
        f"{fmt(p99['seqstate'] / p99['dynamo'], '.2f')}x |",
    ]
    verdicts: list[dict[str, Any]] = []
    for w in ws:
        goal = target_of(w.name)
        if goal is not None:
            got = ratio[w.name]
            verdicts.append(
                {
                    "target": f"{w.name} >= {goal:.0%} of dynamo",
                    "value": f"{fmt(got, '.1%')}",
                    "met": None if math.isnan(got) else got >= goal,
                }
            )
    verdicts.append(
        {
            "target": f"p50 at 1 connection <= {P50_TARGET:g}x max(dynamo's, "
            f"{P50_FLOOR_MS * 1e3:g} us)",
            "value": f"{fmt(p50['seqstate'], '.3f')} ms",
            "met": None if math.isnan(p50_floor) else p50["seqstate"] <= P50_TARGET * p50_floor,
        }
    )
    met_text = {True: "MET", False: "not met", None: "n/a (no dynamo)"}
    target_lines = [f"  {v['target']:<36} {v['value']:>8}  {met_text[v['met']]}" for v in verdicts]
    return lines, target_lines, verdicts


async def run(args: argparse.Namespace, loop_name: str) -> int:
    info = header(args, loop_name)
    print(
        f"# seqstate serve-http vs Dynamo's slot tracker: {info['date']}, commit {info['commit']}\n"
        f"# machine: {info['nproc']} CPUs, {info['cpu']}; load average {info['loadavg']}\n"
        f"# python {info['python']}, generator loop {loop_name}, "
        f"ai-dynamo-runtime {info['ai_dynamo_runtime'] or '-'}; {args.rounds} rounds of "
        f"{args.seconds:g} s per measurement, pipelined depth {args.depth}",
        flush=True,
    )
    tmp = tempfile.mkdtemp(prefix="slot-vs-dynamo-")
    procs = Processes(tmp)
    failed = False
    try:
        targets = await start_servers(args, procs)
        names = list(targets)
        print(
            "# servers: "
            + ", ".join(f"{n} {t.host}:{t.port} (pid {t.pids or '?'})" for n, t in targets.items()),
            flush=True,
        )
        run_tag = f"{os.getpid() % 10000}{random.randrange(1 << 20):05x}"
        rows = await correctness(targets, f"chk{run_tag}")
        reordered = [r["call"] for r in rows if r.get("same_rows_other_order")]
        diffs = [r for r in rows if r.get("same") is False and r["call"] not in reordered]
        print(f"\ncorrectness pass: {len(rows)} calls", end="")
        if len(names) < 2:
            print(" (one server: nothing to compare)")
        else:
            print(f", {len(diffs)} differing")
        if reordered:
            print(f"  same rows, another order (Dynamo's order is a hash map's): {reordered}")
        for r in diffs:
            failed = True
            print(f"  DIFFERENT: {r['call']}")
            for n in names:
                print(f"    {n:>8}: {r[n]['status']} {json.dumps(r[n]['body'])[:400]}")
        for r in rows:
            if any(r[n]["status"] == 0 for n in names):
                failed = True
                print(f"  NO ANSWER: {r['call']}: " + ", ".join(str(r[n]) for n in names))

        ws = workloads(args.depth)
        if args.workloads:
            keep = set(args.workloads.split(","))
            ws = [w for w in ws if w.name in keep or w.name == "pairs-c1"]
        rounds: list[dict[str, dict[str, dict[str, Any]]]] = []
        print(flush=True)
        for rnd in range(args.rounds):
            order = alternated(names, rnd)
            res: dict[str, dict[str, dict[str, Any]]] = {}
            for w in ws:
                res[w.name] = {}
                for n in order:
                    tag = f"{run_tag}r{rnd}{w.name}{n[0]}".encode()
                    try:
                        r = await measure(targets[n], w, tag, args.seconds, args.timeout)
                    except (OSError, TimeoutError) as e:  # could not even connect
                        r = failed_measurement(f"{type(e).__name__}: {e}")
                    res[w.name][n] = r
                    lat = (
                        f" p50 {r['p50_ms']:.3f} ms p99 {r['p99_ms']:.3f} ms"
                        if w.depth == 1
                        else ""
                    )
                    print(
                        f"round {rnd + 1} {w.name:<12} {n:<8} {r['rate']:>10,.0f} calls/s "
                        f"({r['calls']} calls){lat}; cpu {r['server_cpu_us']:,.0f} µs/call"
                        + (
                            f"; ERRORS {r['errors']}: {'; '.join(r['notes'])}"
                            if r["errors"]
                            else ""
                        ),
                        file=sys.stderr,
                        flush=True,
                    )
                    if r["errors"]:
                        failed = True
                    await asyncio.sleep(args.settle)
            rounds.append(res)

        table, target_lines, verdicts = summarize(rounds, names, ws)
        print(
            f"\nmedian over {args.rounds} round(s) of {args.seconds:g} s; seqstate/dynamo is the "
            "median of the per-round ratios; CPU is utime+stime of the serving process per call\n"
        )
        print("\n".join(table))
        print("\nserve-http's targets:")
        print("\n".join(target_lines))
        if args.json:
            out = {
                "header": info,
                "servers": {n: vars(t) for n, t in targets.items()},
                "correctness": rows,
                "workloads": [vars(w) for w in ws],
                "rounds": rounds,
                "targets": verdicts,
            }
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1, default=str)
            print(f"\nraw numbers: {args.json}")
        if failed:
            print("\nFAILED: see the differences and errors above", file=sys.stderr)
        if args.fail_on_targets and any(v["met"] is False for v in verdicts):
            return 2
        return 1 if failed else 0
    finally:
        procs.stop()
        for name in procs.procs:
            if args.keep_logs:
                print(f"log of {name}: {os.path.join(tmp, name + '.log')}", file=sys.stderr)
        if not args.keep_logs:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    p.add_argument("--depth", type=int, default=32, help="requests in flight when pipelined")
    add_server_args(p)
    p.add_argument(
        "--seqstate-url",
        help="measure a serve-http already running (http://HOST:PORT): start neither it nor NATS",
    )
    p.add_argument("--dynamo-url", help="measure a Dynamo tracker already running")
    p.add_argument(
        "--workloads",
        help="comma-separated subset (pairs-c16,pairs-c64,pairs-pipe32,loads-c16,loads-pipe32);"
        " pairs-c1 always runs",
    )
    p.add_argument("--settle", type=float, default=0.5, help="seconds of rest after each one")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds past a deadline, at most")
    p.add_argument("--json", metavar="PATH", help="write every raw number there")
    p.add_argument("--keep-logs", action="store_true", help="keep the servers' logs")
    p.add_argument("--fail-on-targets", action="store_true", help="exit 2 if a target is missed")
    args = p.parse_args()

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    result: list[int] = []

    async def go(loop_name: str) -> None:
        result.append(await run(args, loop_name))

    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(go("asyncio (no uvloop)"))
        else:
            uvloop.run(go(f"uvloop {getattr(uvloop, '__version__', '?')}"))
    except KeyboardInterrupt:
        print("interrupted: servers stopped", file=sys.stderr)
        return 130
    except SystemExit:
        print("terminated: servers stopped", file=sys.stderr)
        raise
    except StartError as e:
        print(f"slot_vs_dynamo: {e}", file=sys.stderr)
        return 1
    return result[0]


if __name__ == "__main__":
    sys.exit(main())
