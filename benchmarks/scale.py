"""Fleet scale: does the cost of an event follow what it changed, not the size of the rank's set?

Why this exists: the bucket layout keeps one key per live request
(``<ns>.req.<w>.<r>.<slot>``, its prompt hashes packed as u64) and one small load key per rank,
so that booking or freeing a request costs that request, whatever else the rank holds. This
script checks that claim end to end on a real nats-server, and measures what a fleet of large
ranks costs: 8 workers (dp 0), and two sweeps:

- **active set**: 1,024, 16,384, 65,536 and 262,144 active prompt hashes per rank, at requests
  of 256 blocks (4, 64, 256 and 1,024 live requests per rank);
- **request size**: 16, 64, 256 and 1,024 blocks per request, at 65,536 active hashes per rank
  (the 65,536 x 256 point is shared by both sweeps and measured once).

Every block hash is a distinct pseudo-random u64 (a bijective mix of a counter), so no two
requests share a hash and a rank's set is exactly ``requests x blocks``.

Each point, each run (``--runs``, interleaved: run 1 of every point, then run 2, ...), on a
fresh embedded nats-server (``NatsServer``, temporary store, streams as ``ensure`` makes them):

1. **Processes.** ``seqstate writer`` and ``seqstate projector`` are started as subprocesses
   with ``NATS_URL`` and default settings (what compose runs; snapshots every 10,000 events or
   60 s, expiry 300 s). This process holds the ``RouterPublisher`` (its own connection) and a
   ``RegistryView`` (another connection), on one event loop.
2. **Fill** (timed, reported, not a target): 8 ``WorkerAdded``, then every rank filled round
   robin to its target with AddRequest + MarkPrefillCompleted pairs via ``publish_many`` in
   chunks of ``--chunk``; then ``view.wait_for(last seq)``.
3. **Saturated churn**: ``--churn-events`` events (rounded to whole steps), built beforehand:
   each step takes one rank (round robin), frees its oldest live request and adds a new one of
   the same size (Free, AddRequest, MarkPrefillCompleted), so every set keeps its size. They are
   published with ``publish_many`` in chunks of ``--chunk``, one call after another, as fast as
   the acks come back. Measured from the first publish to ``view.wait_for(last seq)``:
   events/s and hashes/s (hashes carried by the adds); bytes per event on SEQSTATE_EVENTS and
   SEQSTATE_DELTAS (stream info ``state.bytes`` and ``messages``, after minus before: these
   streams only grow); on the bucket's stream ``KV_<bucket>`` the messages written
   (``last_seq`` after minus before: the bucket keeps one value per key, so its ``state.bytes``
   stays flat and says nothing about writes) and the bytes they took, computed per value the
   view's watch delivers with the server's file-store record size (22 + subject + headers + 4
   if any + payload + 8 bytes, checked against ``state.bytes`` when this script was written); CPU
   per event of the writer, the projector and nats-server (``/proc/<pid>/stat`` utime + stime,
   after minus before) and of this process (``time.process_time()``: publisher + view + this
   script's own bookkeeping), and, inside it, the view's own folding of values (wall time
   inside ``RegistryView.receive``; not nats-py's receive path). Also the lag of every 50th
   event (``--sample-every``) from its call's return (all acks in) to the view reflecting it:
   under an open-loop burst that is mostly the backlog the burst builds, reported as such.
4. **Freshness under steady churn** (the target): churn paced at ``--paced-rate`` events/s
   for ``--paced-events`` events: each step (Free, AddRequest, MarkPrefillCompleted) is one
   ``publish_many`` call at its scheduled time; every AddRequest (a third of the events, and
   the ones that carry hashes) is sampled: the time from its call's return (its ack in) to
   ``view.wait_for(its seq)``, p50/p99; publish start to view as well. A step that falls behind
   schedule is sent at once (the achieved rate is reported). CPU and bytes per event are
   measured over this phase too.
5. **View cold start**: a NEW process (this script with ``--view-child``) imports, connects,
   records its RSS, then times ``RegistryView(...).start()`` (returns once every current value
   of the bucket is folded) and records RSS and peak RSS (``VmHWM``) again: the memory figure
   is the RSS growth of a process that runs only the view. It then answers ``loads()`` and 24
   ``potential_loads`` queries (prefixes of live requests, some extended by unknown hashes,
   and unknown ones) at one log time, folds the event log itself from scratch
   (``projector.ops.replay.fold_stream`` into ``config.new_state()``, to the view's position) and
   compares: the view must equal the write model exactly. This process's live view (which
   followed every delta of the churn) is compared with the same answers. The cold start runs
   after the churn, so the bucket holds the steady state: slot keys reused many times.

Targets (PASS/FAIL lines): saturated churn events/s at 262,144 per rank >= 2/3 of that at
1,024 (medians of the same invocation); freshness p99 <= 50 ms at every point; a view of
8 x 262,144 active hashes (2M) ready and exact within 3 s. (The router batch target is
``benchmarks/router.py``'s.)

Everything runs on one machine: with 2 cores, nats-server, writer, projector and this process
share them, so CPU per event is the honest figure to compare; events/s says what this machine
did. A PNG (``--plot``, needs the optional ``bench`` extra: ``pip install -e '.[bench]'``)
shows CPU and bytes per event against the active set and the request size.

Diagnosis, never part of the default figures: ``--no-snapshots`` runs the writer without
snapshots (to tell their cost apart), ``--py-spy DIR`` samples the writer, the projector and
this process during each saturated churn (collapsed stacks; needs py-spy), ``--logs DIR``
keeps the consumers' logs at info level (snapshot times, to line up with ``worst`` samples).

Run from the repository root after ``make native``: ``.venv/bin/python benchmarks/scale.py
[--runs N] [--json] [--save FILE] [--plot PNG]`` (about 6-7 minutes with the defaults on the
2-core machine); ``--quick`` for a look in under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec
from harness.cli import add_json, argument_parser, positive
from harness.measure import collect, median, percentile, process_cpu_s, rss_kb
from harness.report import (
    PASS_FAIL,
    REPO_ROOT,
    emit,
    machine,
    print_head,
    print_software,
    verdict,
)
from harness.servers import connect, server_version, start_seqstate, stop
from nats.aio.client import Client

from projector.bucket.reader import RegistryView
from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.settings.config import Config
from projector.write.log_fold import fold_stream
from seqstate import AddRequest, Event, Free, MarkPrefillCompleted, WorkerAdded

WORKERS: Final = 8
SET_SIZES: Final = (1024, 16_384, 65_536, 262_144)
REQUEST_SIZES: Final = (16, 64, 256, 1024)
FIXED_BLOCKS: Final = 256
FIXED_SET: Final = 65_536
TOKENS_PER_BLOCK: Final = 16
NS_PER_MS: Final = 1_000_000
WAIT_TIMEOUT_S: Final = 600.0
TARGET_CHURN_RATIO: Final = 2 / 3
TARGET_FRESH_P99_MS: Final = 50.0
TARGET_COLD_START_S: Final = 3.0
TARGET_COLD_SET: Final = 262_144
MASK64: Final = (1 << 64) - 1
GOLDEN: Final = 0x9E3779B97F4A7C15  # odd: n -> n * GOLDEN mod 2**64 is a bijection
DEL_HEADER: Final = len(b"NATS/1.0\r\nKV-Operation: DEL\r\n\r\n")
QUERIES: Final = 24


# ---- the workload -------------------------------------------------------------------------


def unique_hashes(first: int, count: int) -> list[int]:
    """``count`` distinct pseudo-random u64s: counter values ``first..`` through a bijection
    (multiply by an odd constant, then xor-shift), so no two calls ever overlap."""
    out = []
    for n in range(first, first + count):
        x = (n * GOLDEN) & MASK64
        out.append(x ^ (x >> 29))
    return out


@dataclass(frozen=True)
class Point:
    set_per_rank: int  # active prompt hashes per rank
    blocks: int  # blocks (hashes) per request

    @property
    def requests_per_rank(self) -> int:
        return max(1, self.set_per_rank // self.blocks)

    @property
    def label(self) -> str:
        return f"{self.set_per_rank:,}/rank x {self.blocks} blocks"


class Workload:
    """Live requests per rank (oldest first) and the events that fill and churn them."""

    def __init__(self, point: Point) -> None:
        self.point = point
        self.ranks = [(w, 0) for w in range(WORKERS)]
        self.live: list[deque[tuple[str, list[int]]]] = [deque() for _ in self.ranks]
        self._next_hash = 1
        self._next_request = 0
        self._next_rank = 0

    def _add(self, index: int) -> list[Event]:
        worker, rank = self.ranks[index]
        blocks = self.point.blocks
        hashes = unique_hashes(self._next_hash, blocks)
        self._next_hash += blocks
        request_id = f"r{self._next_request}"
        self._next_request += 1
        self.live[index].append((request_id, hashes))
        tokens = blocks * TOKENS_PER_BLOCK
        return [
            AddRequest(
                request_id=request_id,
                worker_id=worker,
                dp_rank=rank,
                block_hashes=hashes,
                prefill_tokens=tokens,
                expected_prefill_ms=round(20 + 0.05 * tokens, 2),
                expected_output_tokens=256,
            ),
            MarkPrefillCompleted(request_id=request_id, worker_id=worker, dp_rank=rank),
        ]

    def fill(self) -> list[Event]:
        events: list[Event] = []
        for _ in range(self.point.requests_per_rank):
            for index in range(len(self.ranks)):
                events.extend(self._add(index))
        return events

    def step(self) -> list[Event]:
        """Free the oldest live request of the next rank; add one of the same size there."""
        index = self._next_rank
        self._next_rank = (index + 1) % len(self.ranks)
        worker, rank = self.ranks[index]
        old, _ = self.live[index].popleft()
        return [Free(request_id=old, worker_id=worker, dp_rank=rank), *self._add(index)]

    def steps(self, events: int) -> list[list[Event]]:
        return [self.step() for _ in range(max(1, round(events / 3)))]

    def queries(self) -> list[tuple[list[int], int]]:
        """Queries with known answers of every kind: a live request's whole prompt, its first
        half, its first half then unknown hashes, and hashes no rank holds."""
        out: list[tuple[list[int], int]] = []
        fresh = 1 << 62  # counter values far beyond any the workload uses
        for k in range(QUERIES):
            queue = self.live[k % len(self.live)]
            _, hashes = queue[(k * 7) % len(queue)]
            half = hashes[: max(1, len(hashes) // 2)]
            kind = k % 4
            if kind == 0:
                query = hashes
            elif kind == 1:
                query = half
            elif kind == 2:
                query = half + unique_hashes(fresh + k * 4096, len(hashes) - len(half))
            else:
                query = unique_hashes(fresh + k * 4096, len(hashes))
            out.append((query, len(query) * TOKENS_PER_BLOCK))
        return out


# ---- measuring ----------------------------------------------------------------------------


class CountingView(RegistryView):
    """A RegistryView that counts what its watch delivers and the CPU time its fold takes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.delivered = 0
        self.stored_bytes = 0  # file-store record size of every delivered value
        self.fold_ns = 0
        self._subject_prefix = len(f"$KV.{self.config.registry_bucket}.")

    def receive(self, key: str, value: bytes | None, *, deleted: bool = False) -> None:
        t0 = time.thread_time_ns()
        super().receive(key, value, deleted=deleted)
        self.fold_ns += time.thread_time_ns() - t0
        self.delivered += 1
        size = 22 + self._subject_prefix + len(key) + len(value or b"") + 8
        self.stored_bytes += size + (4 + DEL_HEADER if deleted else 0)


@dataclass
class Consumers:
    writer: subprocess.Popen[bytes]
    projector: subprocess.Popen[bytes]
    logs: Path
    set_per_rank: int = 0

    def tail(self) -> str:
        parts = []
        for name in ("writer", "projector"):
            path = self.logs / f"{name}.log"
            with contextlib.suppress(OSError):
                lines = path.read_text(errors="replace").splitlines()[-5:]
                parts.append(f"{name}: " + " | ".join(lines))
        return "; ".join(parts)


def start_consumers(url: str, logs: Path, level: str, snapshots: bool) -> Consumers:
    settings = {"SEQSTATE_LOG_LEVEL": level}
    if not snapshots:  # a diagnosis: what the writer's snapshots cost
        settings.update(SEQSTATE_SNAPSHOT_EVERY_EVENTS="0", SEQSTATE_SNAPSHOT_EVERY_S="0")
    procs = {
        name: start_seqstate([name], url, logs / f"{name}.log", **settings)
        for name in ("writer", "projector")
    }
    return Consumers(procs["writer"], procs["projector"], logs)


def start_spies(
    args: argparse.Namespace, consumers: Consumers, blocks: int
) -> list[subprocess.Popen[bytes]]:
    """Diagnosis (``--py-spy DIR``): sample the writer, the projector and this process during
    the saturated churn, as collapsed stacks (flamegraph input) in DIR."""
    if not args.py_spy:
        return []
    exe = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if exe is None:
        raise RuntimeError("--py-spy: py-spy is not installed (pip install py-spy)")
    out = Path(args.py_spy)
    out.mkdir(parents=True, exist_ok=True)
    spies = []
    for name, pid in (
        ("writer", consumers.writer.pid),
        ("projector", consumers.projector.pid),
        ("bench", os.getpid()),
    ):
        path = out / f"{consumers.set_per_rank}x{blocks}-{name}.txt"
        spies.append(
            subprocess.Popen(
                [
                    exe,
                    "record",
                    "--pid",
                    str(pid),
                    "--format",
                    "raw",
                    "--rate",
                    "250",
                    "--nonblocking",
                    "--output",
                    str(path),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    time.sleep(0.5)  # let them attach
    return spies


def cpu_now(consumers: Consumers, server_pid: int) -> dict[str, float]:
    return {
        "writer": process_cpu_s(consumers.writer.pid),
        "projector": process_cpu_s(consumers.projector.pid),
        "nats_server": process_cpu_s(server_pid),
        "bench": time.process_time(),
    }


async def streams_now(nc: Client, config: Config, view: CountingView) -> dict[str, Any]:
    js = nc.jetstream()
    out: dict[str, Any] = {}
    for key, name in (
        ("events", config.events_stream),
        ("deltas", config.deltas_stream),
        ("kv", f"KV_{config.registry_bucket}"),
    ):
        state = (await js.stream_info(name)).state
        out[key] = {"messages": state.messages, "bytes": state.bytes, "last_seq": state.last_seq}
    out["view"] = {
        "delivered": view.delivered,
        "stored_bytes": view.stored_bytes,
        "fold_ns": view.fold_ns,
    }
    return out


def costs(
    events: int,
    cpu0: dict[str, float],
    cpu1: dict[str, float],
    s0: dict[str, Any],
    s1: dict[str, Any],
) -> dict[str, Any]:
    """CPU µs and stored bytes per event between two observations."""
    cpu_us = {k: (cpu1[k] - cpu0[k]) * 1e6 / events for k in cpu0}
    cpu_us["view_fold"] = (s1["view"]["fold_ns"] - s0["view"]["fold_ns"]) / 1e3 / events
    kv_written = s1["kv"]["last_seq"] - s0["kv"]["last_seq"]
    delivered = s1["view"]["delivered"] - s0["view"]["delivered"]
    return {
        "cpu_us_per_event": cpu_us,
        "bytes_per_event": {
            "events": (s1["events"]["bytes"] - s0["events"]["bytes"]) / events,
            "deltas": (s1["deltas"]["bytes"] - s0["deltas"]["bytes"]) / events,
            "kv": (s1["view"]["stored_bytes"] - s0["view"]["stored_bytes"]) / events,
        },
        "messages_per_event": {
            "events": (s1["events"]["messages"] - s0["events"]["messages"]) / events,
            "deltas": (s1["deltas"]["messages"] - s0["deltas"]["messages"]) / events,
            "kv": kv_written / events,
        },
        "kv_written": kv_written,
        "kv_delivered_to_view": delivered,
        "kv_state_bytes_change": s1["kv"]["bytes"] - s0["kv"]["bytes"],
    }


def latency_summary(samples_s: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    if not ordered:
        return {"n": 0, "p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan")}
    return {
        "n": len(ordered),
        "p50_ms": statistics.median(ordered) * 1e3,
        "p99_ms": percentile(ordered, 99) * 1e3,
        "max_ms": ordered[-1] * 1e3,
    }


async def reflected_after(view: RegistryView, seq: int, since: float) -> float:
    """Seconds from ``since`` until the view reflects ``seq``."""
    await view.wait_for(seq, timeout=WAIT_TIMEOUT_S)
    return time.perf_counter() - since


async def publish_chunks(pub: RouterPublisher, events: Sequence[Event], chunk: int) -> int:
    last = 0
    for start in range(0, len(events), chunk):
        seqs = await pub.publish_many(events[start : start + chunk])
        last = max(last, *seqs)
    return last


# ---- the phases ---------------------------------------------------------------------------


async def saturated_churn(
    args: argparse.Namespace,
    nc: Client,
    config: Config,
    pub: RouterPublisher,
    view: CountingView,
    consumers: Consumers,
    server_pid: int,
    steps: list[list[Event]],
    blocks: int,
) -> dict[str, Any]:
    events = [event for step in steps for event in step]
    collect()
    spies = start_spies(args, consumers, blocks)
    s0 = await streams_now(nc, config, view)
    cpu0 = cpu_now(consumers, server_pid)
    samplers: list[asyncio.Task[float]] = []
    t0 = time.perf_counter()
    last = 0
    for start in range(0, len(events), args.chunk):
        seqs = await pub.publish_many(events[start : start + args.chunk])
        acked = time.perf_counter()
        last = max(last, *seqs)
        for i in range(start, start + len(seqs)):
            if i % args.sample_every == args.sample_every - 1:
                samplers.append(asyncio.create_task(reflected_after(view, seqs[i - start], acked)))
    published = time.perf_counter() - t0
    await view.wait_for(last, timeout=WAIT_TIMEOUT_S)
    seconds = time.perf_counter() - t0
    cpu1 = cpu_now(consumers, server_pid)
    stop(spies, signal.SIGINT)
    lags = await asyncio.gather(*samplers)
    s1 = await streams_now(nc, config, view)
    adds = sum(isinstance(e, AddRequest) for e in events)
    return {
        "events": len(events),
        "seconds": seconds,
        "publish_seconds": published,
        "events_per_s": len(events) / seconds,
        "hashes_per_s": adds * blocks / seconds,
        "lag_at_saturation": latency_summary(lags),
        **costs(len(events), cpu0, cpu1, s0, s1),
    }


async def paced_churn(
    args: argparse.Namespace,
    nc: Client,
    config: Config,
    pub: RouterPublisher,
    view: CountingView,
    consumers: Consumers,
    server_pid: int,
    steps: list[list[Event]],
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    interval = 3 / args.paced_rate
    events = sum(len(step) for step in steps)
    collect()
    s0 = await streams_now(nc, config, view)
    cpu0 = cpu_now(consumers, server_pid)
    from_ack: list[asyncio.Task[float]] = []
    from_start: list[asyncio.Task[float]] = []
    late = 0
    began_unix = time.time()
    begin = loop.time()
    t0 = time.perf_counter()
    last = 0
    for k, step in enumerate(steps):
        due = begin + k * interval
        wait = due - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        elif wait < -interval:
            late += 1
        started = time.perf_counter()
        seqs = await pub.publish_many(step)
        acked = time.perf_counter()
        last = max(last, *seqs)
        add_seq = seqs[1]  # Free, AddRequest, MarkPrefillCompleted
        from_ack.append(asyncio.create_task(reflected_after(view, add_seq, acked)))
        from_start.append(asyncio.create_task(reflected_after(view, add_seq, started)))
    sent = time.perf_counter() - t0
    await view.wait_for(last, timeout=WAIT_TIMEOUT_S)
    cpu1 = cpu_now(consumers, server_pid)
    ack_lat = await asyncio.gather(*from_ack)
    # The slowest samples, with when they were sent (s after the phase began): a stall
    # shows as a run of neighbours; ``began_unix`` lines them up with the consumers' logs.
    worst = sorted(range(len(ack_lat)), key=ack_lat.__getitem__)[-5:]
    start_lat = await asyncio.gather(*from_start)
    s1 = await streams_now(nc, config, view)
    return {
        "events": events,
        "offered_rate": args.paced_rate,
        "achieved_rate": events / sent,
        "steps_late": late,
        "began_unix": began_unix,
        "worst": [(round(k * interval, 3), round(ack_lat[k] * 1e3, 1)) for k in worst],
        "ack_to_view": latency_summary(ack_lat),
        "start_to_view": latency_summary(start_lat),
        **costs(events, cpu0, cpu1, s0, s1),
    }


async def cold_start(url: str, queries: list[tuple[list[int], int]], work: Path) -> dict[str, Any]:
    path = work / "queries.json"
    path.write_bytes(msgspec.json.encode(queries))
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).resolve()),
        "--view-child",
        url,
        str(path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), WAIT_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"view child failed ({proc.returncode}): {err.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    result["process_wall_s"] = time.perf_counter() - t0
    return result


def same_answers(view: RegistryView, child: dict[str, Any]) -> bool:
    """This process's live view answers as the child's fold of the log did."""
    now = child["now_ns"]
    if msgspec.to_builtins(view.loads(now)) != child["fold_loads"]:
        return False
    queries = msgspec.json.decode(Path(child["queries_path"]).read_bytes())
    mine = [msgspec.to_builtins(view.potential_loads(h, isl, now)) for h, isl in queries]
    return bool(mine == child["fold_potential"])


# ---- one point, one run -------------------------------------------------------------------


async def one_point(args: argparse.Namespace, point: Point, run: int) -> dict[str, Any]:
    config = Config()
    workload = Workload(point)
    fill = workload.fill()
    steps = workload.steps(args.churn_events)
    paced = workload.steps(args.paced_events)
    queries = workload.queries()
    result: dict[str, Any] = {
        "point": {"set_per_rank": point.set_per_rank, "blocks": point.blocks, "run": run}
    }
    with tempfile.TemporaryDirectory(prefix="seqstate-scale-") as tmp:
        work = Path(tmp)
        async with NatsServer() as server:
            server_pid = server.pid
            assert server_pid is not None
            nc_pub = await connect(server.url, "bench-publisher")
            nc_view = await connect(server.url, "bench-view")
            await ensure(nc_pub, config)
            consumers = start_consumers(
                server.url, work, "info" if args.logs else "warning", not args.no_snapshots
            )
            consumers.set_per_rank = point.set_per_rank
            view: CountingView | None = None
            try:
                view = CountingView(nc_view, config=config, initial_timeout=60.0)
                await view.start()
                pub = RouterPublisher(
                    nc_pub,
                    router_id=f"scale-{os.getpid()}-{run}",
                    config=config,
                    max_pending=args.max_pending,
                )
                setup = await pub.publish_many([WorkerAdded(worker_id=w) for w in range(WORKERS)])
                try:
                    await view.wait_for(max(setup), timeout=60)
                except TimeoutError:
                    raise RuntimeError(f"the pipeline did not start: {consumers.tail()}") from None

                collect()
                t0 = time.perf_counter()
                last = await publish_chunks(pub, fill, args.chunk)
                await view.wait_for(last, timeout=WAIT_TIMEOUT_S)
                result["fill"] = {
                    "events": len(fill),
                    "seconds": time.perf_counter() - t0,
                    "requests": point.requests_per_rank * WORKERS,
                    "present_hashes": view.registry.membership_size(),
                }
                result["churn"] = await saturated_churn(
                    args, nc_pub, config, pub, view, consumers, server_pid, steps, point.blocks
                )
                result["paced"] = await paced_churn(
                    args, nc_pub, config, pub, view, consumers, server_pid, paced
                )
                view_rss = rss_kb()["VmRSS"]
                child = await cold_start(server.url, queries, work)
                child["live_view_equals_fold"] = same_answers(view, child)
                child["live_view_present_hashes"] = view.registry.membership_size()
                for key in ("fold_loads", "fold_potential", "queries_path"):
                    child.pop(key)
                result["cold"] = child
                result["bench_rss_mb"] = view_rss / 1024
                for proc in (consumers.writer, consumers.projector):
                    if proc.poll() is not None:
                        raise RuntimeError(f"a consumer exited early: {consumers.tail()}")
            finally:
                if view is not None:
                    await view.stop()
                stop((consumers.writer, consumers.projector), timeout=10)
                if args.logs:
                    keep = Path(args.logs)
                    keep.mkdir(parents=True, exist_ok=True)
                    for name in ("writer", "projector"):
                        tag = f"{point.set_per_rank}x{point.blocks}-run{run + 1}-{name}.log"
                        shutil.copyfile(work / f"{name}.log", keep / tag)
                for nc in (nc_view, nc_pub):
                    with contextlib.suppress(Exception):
                        await nc.drain()
            result["nats_server"] = server_version(nc_pub)
    return result


# ---- the cold-start child -----------------------------------------------------------------


async def view_child(url: str, queries_path: str) -> dict[str, Any]:
    config = Config()
    queries = msgspec.json.decode(Path(queries_path).read_bytes())
    nc = await connect(url, "bench-cold-view")
    gc.collect()
    rss0 = rss_kb()["VmRSS"]
    c0, t0 = time.process_time(), time.perf_counter()
    view = RegistryView(nc, config=config, initial_timeout=WAIT_TIMEOUT_S)
    await view.start()
    ready_s = time.perf_counter() - t0
    cpu_s = time.process_time() - c0
    mem = rss_kb()
    rss1, hwm1 = mem["VmRSS"], mem["VmHWM"]
    await view.stop()
    now = view.as_of_ns + 50 * NS_PER_MS
    view_loads = view.loads(now)
    view_potential = [view.potential_loads(h, isl, now) for h, isl in queries]
    # Untimed: the write model, folded from the log, must answer the same.
    state = config.new_state()
    await fold_stream(nc, config, state, start_seq=1, end_seq=view.applied_seq)
    fold_loads = state.registry.loads(now)
    fold_potential = [state.registry.potential_loads(h, isl, now) for h, isl in queries]
    await nc.drain()
    return {
        "ready_s": ready_s,
        "cpu_s": cpu_s,
        "rss_before_mb": rss0 / 1024,
        "rss_growth_mb": (rss1 - rss0) / 1024,
        "peak_growth_mb": (hwm1 - rss0) / 1024,
        "applied_seq": view.applied_seq,
        "values_received": view.values_received,
        "present_hashes": view.registry.membership_size(),
        "live_requests": sum(row.active_requests for row in view_loads),
        "exact": view_loads == fold_loads and view_potential == fold_potential,
        "fold_counters": {k: v for k, v in state.counters.items() if v},
        "now_ns": now,
        "fold_loads": msgspec.to_builtins(fold_loads),
        "fold_potential": msgspec.to_builtins(fold_potential),
        "queries_path": queries_path,
    }


# ---- summary, report, plot ----------------------------------------------------------------


def points_of(args: argparse.Namespace) -> list[Point]:
    points = [Point(s, args.fixed_blocks) for s in args.sets]
    points += [Point(args.fixed_set, b) for b in args.blocks]
    unique: list[Point] = []
    for p in points:
        if p not in unique:
            unique.append(p)
    return unique


def summarize(point: Point, runs: list[dict[str, Any]]) -> dict[str, Any]:
    c = [r["churn"] for r in runs]
    p = [r["paced"] for r in runs]
    k = [r["cold"] for r in runs]
    out: dict[str, Any] = {
        "set_per_rank": point.set_per_rank,
        "blocks": point.blocks,
        "requests_per_rank": point.requests_per_rank,
        "runs": len(runs),
        "fill_events_per_s": median([r["fill"]["events"] / r["fill"]["seconds"] for r in runs]),
        "churn_events_per_s": median([x["events_per_s"] for x in c]),
        "churn_events_per_s_runs": [x["events_per_s"] for x in c],
        "churn_hashes_per_s": median([x["hashes_per_s"] for x in c]),
        "churn_lag_p50_ms": median([x["lag_at_saturation"]["p50_ms"] for x in c]),
        "churn_lag_p99_ms": median([x["lag_at_saturation"]["p99_ms"] for x in c]),
        "fresh_p50_ms": median([x["ack_to_view"]["p50_ms"] for x in p]),
        "fresh_p99_ms": median([x["ack_to_view"]["p99_ms"] for x in p]),
        "fresh_p99_ms_runs": [x["ack_to_view"]["p99_ms"] for x in p],
        "fresh_max_ms": max(x["ack_to_view"]["max_ms"] for x in p),
        "fresh_start_p99_ms": median([x["start_to_view"]["p99_ms"] for x in p]),
        "paced_achieved_rate": median([x["achieved_rate"] for x in p]),
        "cold_ready_s": median([x["ready_s"] for x in k]),
        "cold_ready_s_runs": [x["ready_s"] for x in k],
        "cold_cpu_s": median([x["cpu_s"] for x in k]),
        "cold_rss_growth_mb": median([x["rss_growth_mb"] for x in k]),
        "cold_peak_growth_mb": median([x["peak_growth_mb"] for x in k]),
        "cold_present_hashes": k[-1]["present_hashes"],
        "cold_exact": all(x["exact"] for x in k),
        "live_view_exact": all(x["live_view_equals_fold"] for x in k),
    }
    for phase, xs in (("churn", c), ("paced", p)):
        for part in ("cpu_us_per_event", "bytes_per_event", "messages_per_event"):
            for name in xs[0][part]:
                out[f"{phase}_{part}_{name}"] = median([x[part][name] for x in xs])
    return out


def targets(args: argparse.Namespace, summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(s["set_per_rank"], s["blocks"]): s for s in summary}
    out: list[dict[str, Any]] = []
    small, large = (
        by.get((min(args.sets), args.fixed_blocks)),
        by.get((max(args.sets), args.fixed_blocks)),
    )
    if small and large and small is not large:
        ratio = large["churn_events_per_s"] / small["churn_events_per_s"]
        out.append(
            {
                "name": f"churn events/s at {large['set_per_rank']:,}/rank >= 2/3 of "
                f"{small['set_per_rank']:,}/rank",
                "ok": ratio >= TARGET_CHURN_RATIO,
                "detail": f"{large['churn_events_per_s']:,.0f} vs "
                f"{small['churn_events_per_s']:,.0f} events/s: {ratio:.2f} "
                f"(target >= {TARGET_CHURN_RATIO:.2f})",
            }
        )
    worst = max(summary, key=lambda s: s["fresh_p99_ms"])
    out.append(
        {
            "name": f"freshness p99 <= {TARGET_FRESH_P99_MS:g} ms at every point "
            f"(paced at {args.paced_rate:,} events/s)",
            "ok": all(s["fresh_p99_ms"] <= TARGET_FRESH_P99_MS for s in summary),
            "detail": f"worst median p99 {worst['fresh_p99_ms']:.1f} ms at "
            f"{worst['set_per_rank']:,}/rank x {worst['blocks']}; all: "
            + ", ".join(f"{s['fresh_p99_ms']:.1f}" for s in summary),
        }
    )
    cold = by.get((TARGET_COLD_SET, args.fixed_blocks))
    if cold:
        ok = cold["cold_ready_s"] <= TARGET_COLD_START_S and cold["cold_exact"]
        out.append(
            {
                "name": f"view cold start at {WORKERS} x {TARGET_COLD_SET:,} active hashes "
                f"<= {TARGET_COLD_START_S:g} s and exact",
                "ok": ok,
                "detail": f"ready in {cold['cold_ready_s']:.2f} s (runs "
                + ", ".join(f"{x:.2f}" for x in cold["cold_ready_s_runs"])
                + f"), {cold['cold_present_hashes']:,} hashes, exact: "
                f"{cold['cold_exact']}",
            }
        )
    return out


def table(rows: list[dict[str, Any]], key: str, title: str) -> list[str]:
    head = (
        f"| {title} | churn events/s | hashes/s | fresh p50 / p99 ms | lag at saturation "
        "p99 ms | CPU µs/event writer / projector / server / this | bytes/event events / "
        "deltas / KV | cold start s | view RSS MB | exact |"
    )
    lines = [head, "|" + "---|" * 10]
    for s in rows:
        cpu = "churn_cpu_us_per_event_"
        byt = "churn_bytes_per_event_"
        lines.append(
            f"| {s[key]:,} | {s['churn_events_per_s']:,.0f} | {s['churn_hashes_per_s']:,.0f} | "
            f"{s['fresh_p50_ms']:.1f} / {s['fresh_p99_ms']:.1f} | {s['churn_lag_p99_ms']:,.0f} | "
            f"{s[cpu + 'writer']:.0f} / {s[cpu + 'projector']:.0f} / "
            f"{s[cpu + 'nats_server']:.0f} / {s[cpu + 'bench']:.0f} | "
            f"{s[byt + 'events']:,.0f} / {s[byt + 'deltas']:,.0f} / {s[byt + 'kv']:,.0f} | "
            f"{s['cold_ready_s']:.3f} | {s['cold_rss_growth_mb']:.0f} | "
            f"{'yes' if s['cold_exact'] and s['live_view_exact'] else 'NO'} |"
        )
    return lines


def _runs_of(s: dict[str, Any], key: str, spec: str) -> str:
    return ", ".join(format(x, spec) for x in s[key])


def _cpu_of(s: dict[str, Any], phase: str) -> str:
    names = ("writer", "projector", "nats_server", "bench", "view_fold")
    return "/".join(f"{s[f'{phase}_cpu_us_per_event_{name}']:.0f}" for name in names)


def print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    m, summary = report["machine"], report["summary"]
    print_head("seqstate fleet-scale benchmark (benchmarks/scale.py)", m)
    print_software(m, report["nats_server"])
    print(
        f"  workload   : {WORKERS} workers (dp 0); churn {args.churn_events:,} events "
        f"(publish_many chunks of {args.chunk}, lag sampled every {args.sample_every}th); "
        f"paced {args.paced_events:,} events at {args.paced_rate:,}/s; {args.runs} runs per "
        "point, interleaved, fresh server per run"
    )
    print("  CPU 'this' = this process: publisher + live view (its fold alone in 'view fold')")
    sweep_a = [s for s in summary if s["blocks"] == args.fixed_blocks]
    sweep_b = [s for s in summary if s["set_per_rank"] == args.fixed_set]
    print(f"\nActive set sweep ({args.fixed_blocks} blocks per request), medians:")
    print(
        "\n".join(
            table(sorted(sweep_a, key=lambda s: s["set_per_rank"]), "set_per_rank", "hashes/rank")
        )
    )
    print(f"\nRequest size sweep ({args.fixed_set:,} hashes per rank), medians:")
    print("\n".join(table(sorted(sweep_b, key=lambda s: s["blocks"]), "blocks", "blocks")))
    print("\nPer point (medians over runs; each run's value in brackets):")
    for s in summary:
        runs_of = functools.partial(_runs_of, s)
        cpu = functools.partial(_cpu_of, s)
        print(
            f"  {s['set_per_rank']:,} hashes/rank x {s['blocks']} blocks "
            f"({s['requests_per_rank']:,} live requests per rank):"
        )
        print(
            f"    saturated churn [{runs_of('churn_events_per_s_runs', ',.0f')}] events/s; "
            f"CPU µs/event writer/projector/server/this/view-fold {cpu('churn')}; messages "
            f"per event: deltas {s['churn_messages_per_event_deltas']:.3f}, KV "
            f"{s['churn_messages_per_event_kv']:.2f}"
        )
        print(
            f"    paced at {s['paced_achieved_rate']:,.0f}/s: ack->view p99 "
            f"[{runs_of('fresh_p99_ms_runs', '.1f')}] ms (max {s['fresh_max_ms']:.1f}); "
            f"start->view p99 {s['fresh_start_p99_ms']:.1f} ms; CPU µs/event {cpu('paced')}; "
            f"bytes/event events/deltas/KV {s['paced_bytes_per_event_events']:,.0f}/"
            f"{s['paced_bytes_per_event_deltas']:,.0f}/{s['paced_bytes_per_event_kv']:,.0f}"
        )
        print(
            f"    cold start [{runs_of('cold_ready_s_runs', '.2f')}] s, CPU "
            f"{s['cold_cpu_s']:.2f} s, RSS +{s['cold_rss_growth_mb']:.0f} MB (peak "
            f"+{s['cold_peak_growth_mb']:.0f} MB), {s['cold_present_hashes']:,} hashes; fill "
            f"{s['fill_events_per_s']:,.0f} events/s"
        )
    print("\nTargets:")
    for t in report["targets"]:
        print(f"  {verdict(t['ok'], PASS_FAIL)}: {t['name']}: {t['detail']}")
    if report.get("plot"):
        print(f"\nplot: {report['plot']}")
    print(f"wall time: {report['wall_s']:.0f} s")


def plot(summary: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "scale.py: matplotlib is not installed, no plot written (pip install -e '.[bench]')",
            file=sys.stderr,
        )
        return None
    sweeps = (
        (
            "set_per_rank",
            f"active hashes per rank ({args.fixed_blocks} blocks per request)",
            sorted(
                (s for s in summary if s["blocks"] == args.fixed_blocks),
                key=lambda s: s["set_per_rank"],
            ),
        ),
        (
            "blocks",
            f"blocks per request ({args.fixed_set:,} hashes per rank)",
            sorted(
                (s for s in summary if s["set_per_rank"] == args.fixed_set),
                key=lambda s: s["blocks"],
            ),
        ),
    )
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    components = (
        ("writer", "writer"),
        ("projector", "projector"),
        ("nats_server", "nats-server"),
        ("bench", "publisher + view (bench)"),
        ("view_fold", "view fold alone"),
    )
    streams = (
        ("events", "SEQSTATE_EVENTS"),
        ("deltas", "SEQSTATE_DELTAS"),
        ("kv", "KV bucket stream"),
    )
    titles = {"set_per_rank": "active hashes per rank", "blocks": "blocks per request"}
    for col, (key, xlabel, rows) in enumerate(sweeps):
        xs = [s[key] for s in rows]
        for row, (part, items, ylabel) in enumerate(
            (
                ("cpu_us_per_event", components, "CPU µs per event"),
                ("bytes_per_event", streams, "stored bytes per event"),
            )
        ):
            ax = axes[row][col]
            for name, label in items:
                ax.plot(
                    xs,
                    [s[f"churn_{part}_{name}"] for s in rows],
                    marker="o",
                    label=label,
                    linestyle=":" if name == "view_fold" else "-",
                )
            ax.set_xscale("log", base=2 if key == "blocks" else 10)
            ax.set_xticks(xs, [f"{x:,}" for x in xs])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.set_ylabel(f"{ylabel} (saturated churn)")
            ax.set_title(f"{ylabel.split(' per')[0]} per event vs {titles[key]}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            if row == 1:
                ax.set_xlabel(xlabel)
    fig.suptitle(
        f"seqstate fleet scale: {WORKERS} ranks, Free+Add+MarkPrefillCompleted churn "
        f"(medians of {args.runs} runs)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# ---- main ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argument_parser(__doc__)
    p.add_argument("--runs", type=positive, default=3, help="runs per point (interleaved)")
    add_json(p)
    p.add_argument("--save", metavar="FILE", default="", help="also write the JSON to FILE")
    p.add_argument(
        "--sets",
        type=positive,
        nargs="+",
        default=list(SET_SIZES),
        help="active hashes per rank of the first sweep",
    )
    p.add_argument(
        "--blocks",
        type=positive,
        nargs="+",
        default=list(REQUEST_SIZES),
        help="blocks per request of the second sweep",
    )
    p.add_argument(
        "--fixed-blocks",
        type=positive,
        default=FIXED_BLOCKS,
        help="blocks per request in the first sweep",
    )
    p.add_argument(
        "--fixed-set",
        type=positive,
        default=FIXED_SET,
        help="active hashes per rank in the second sweep",
    )
    p.add_argument(
        "--churn-events",
        type=positive,
        default=20_000,
        help="saturated churn events per point and run",
    )
    p.add_argument(
        "--paced-events",
        type=positive,
        default=10_000,
        help="paced churn events per point and run (a third are sampled)",
    )
    p.add_argument(
        "--paced-rate", type=positive, default=1_000, help="events/s offered in the paced phase"
    )
    p.add_argument(
        "--sample-every",
        type=positive,
        default=50,
        help="saturated churn: sample the lag of every Nth event",
    )
    p.add_argument("--chunk", type=positive, default=256, help="events per publish_many call")
    p.add_argument("--max-pending", type=positive, default=256, help="publisher's max_pending")
    p.add_argument(
        "--plot",
        default=str(REPO_ROOT / "benchmarks" / "scale.png"),
        help="PNG to write (needs matplotlib); '' for none",
    )
    p.add_argument(
        "--no-snapshots",
        action="store_true",
        help="diagnosis: run the writer without snapshots (not the default)",
    )
    p.add_argument(
        "--logs",
        metavar="DIR",
        default="",
        help="keep the writer's and projector's logs (info level) in DIR",
    )
    p.add_argument(
        "--py-spy",
        metavar="DIR",
        default="",
        help="diagnosis: py-spy the writer, projector and this process during the saturated "
        "churn (collapsed stacks in DIR; the sampling perturbs the figures)",
    )
    p.add_argument(
        "--quick", action="store_true", help="a look: 1 run, smaller sets, 3,000 churn events"
    )
    p.add_argument("--view-child", nargs=2, metavar=("URL", "QUERIES"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.churn_events, args.paced_events = 1, 3_000, 900
        args.sets, args.blocks, args.fixed_set = [1024, 16_384], [64, 256], 16_384
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.view_child:
        result = asyncio.run(view_child(*args.view_child))
        print(json.dumps(result))
        return 0
    points = points_of(args)
    report: dict[str, Any] = {
        "machine": machine(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    started = time.perf_counter()
    results: dict[Point, list[dict[str, Any]]] = {p: [] for p in points}
    for run in range(args.runs):
        for point in points:
            if not args.json:
                print(f"run {run + 1}/{args.runs}: {point.label} ...", file=sys.stderr, flush=True)
            results[point].append(asyncio.run(one_point(args, point, run)))
    report["runs"] = [r for p in points for r in results[p]]
    report["nats_server"] = report["runs"][0]["nats_server"]
    report["summary"] = [summarize(p, results[p]) for p in points]
    report["targets"] = targets(args, report["summary"])
    if args.plot:
        report["plot"] = plot(report["summary"], args, Path(args.plot))
    report["wall_s"] = time.perf_counter() - started
    if args.save:
        Path(args.save).write_text(json.dumps(report, indent=2))
    emit(report, args.json, print_report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
