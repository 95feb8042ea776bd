"""How well schedulers route a real trace over simulated workers, all in the same run.

Why this exists: a scheduler deciding on a view that lags its own bookings by 14-27 ms sends
a whole burst to one worker. ``projector.Scheduler`` counts its own events (and its peers')
at once; this script measures what that buys against round-robin and against an oracle whose
view is instant, for one scheduler replica and for two.

The trace: the first ``--requests`` requests of the Mooncake trace
(``data/mooncake_conversation_trace.jsonl``, shipped in the repo; one hash id per 512-token
block), their arrival
times divided by ``--speedup``. The workers (``--workers``, ranks ``(w, 0)``) are simulated in
this process on the same compressed clock: a request first waits for the worker's earlier
prefills (one at a time), prefills its uncached tokens at ``--prefill-tps`` tokens/s (its
prefix is cached when the worker holds it: active, or among the last ``--cache-blocks`` blocks
it held), then decodes ``output_length`` tokens at ``--decode-ms`` per token. The scheduler is
told the prefill's end (MarkPrefillCompleted) and the end (Free) as a router would be.

Schemes, each on a fresh namespace of one embedded nats-server with ``seqstate run`` (writer and
projector) as a separate process:

- ``round-robin``: ranks in turn; events published with RouterPublisher;
- ``view-only``: Dynamo's cost over ``RegistryView.costs`` alone (what a scheduler built on
  the view's documented reads got before the toolkit);
- ``toolkit``: ``Scheduler.choose`` / ``add`` / ``mark_prefill_completed`` / ``free``;
- ``toolkit-2``: two Schedulers (own connections, own router ids), requests alternating;
- ``oracle``: the same cost over a write model updated at the instant of each event;
- ``toolkit-indexed``: ``toolkit``, with each rank's cached prefix (what a KV indexer, Dynamo's
  own, would report of the simulated caches) passed as ``overlaps``: the ledger knows the
  blocks of the requests in flight, not what a worker kept after they ended.

Reported per scheme (medians over ``--runs`` rounds, schemes interleaved in each round):
balance (max/mean active blocks over the workers, sampled every ``--sample-ms`` of the
compressed clock while any block is active, averaged), prefill tokens saved against
round-robin (same round), decision latency p50/p99 of ``choose`` (toolkit), and the checks:
each booking visible where it was made (the scheduler's next costs count the prompt as active
on the rank it booked), and nothing left at the end (every view load zero, nothing pending).

Run from the repository root: ``.venv/bin/python benchmarks/routing.py [--runs 3] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import subprocess
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from harness.cli import argument_parser
from harness.measure import rotated
from harness.report import emit, machine_line
from harness.servers import connect
from harness.workload import DEFAULT_TRACE
from nats.aio.client import Client

from projector import RegistryView, RouterPublisher, Scheduler, WorkerControl
from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.settings.config import Config
from seqstate import AddRequest, Free, MarkPrefillCompleted, SequenceState, WorkerAdded
from seqstate.cost import CostWeights, select

NAME = "bench-routing"  # the client name the server lists
BLOCK_TOKENS = 512  # the Mooncake trace's block: one hash id per 512 tokens
Rank = tuple[int, int]


@dataclass(frozen=True)
class Req:
    request_id: str
    at_s: float  # compressed arrival time
    isl: int
    osl: int
    hashes: list[int]


def load_trace(path: Path, count: int, speedup: float) -> list[Req]:
    out = []
    with path.open() as f:
        for i, line in enumerate(f):
            if i >= count:
                break
            row = json.loads(line)
            out.append(
                Req(
                    f"r{i}",
                    row["timestamp"] / 1000 / speedup,
                    row["input_length"],
                    row["output_length"],
                    list(row["hash_ids"]),
                )
            )
    return out


# ---- the simulated workers -------------------------------------------------------------------


@dataclass
class Worker:
    cache_blocks: int
    busy_until: float = 0.0  # when its last queued prefill ends
    active: Counter[int] = field(default_factory=Counter)  # block -> requests holding it
    recent: OrderedDict[int, None] = field(default_factory=OrderedDict)  # released, LRU

    def cached_prefix(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.active and h not in self.recent:
                break
            n += 1
        return n

    def take(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.active[h] += 1
            self.recent.pop(h, None)

    def release(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.active[h] -= 1
            if not self.active[h]:
                del self.active[h]
                self.recent[h] = None
        while len(self.recent) > self.cache_blocks:
            self.recent.popitem(last=False)


class Policy(Protocol):
    def prepare(self, req: Req) -> Any: ...
    def choose(self, req: Req, extra: Any) -> Rank: ...
    async def add(self, req: Req, rank: Rank, prefill_tokens: int) -> None: ...
    async def mark(self, req: Req) -> None: ...
    async def free(self, req: Req) -> None: ...


@dataclass
class Outcome:
    balance: float
    prefilled_tokens: int
    decisions_us: list[float]  # wall time of each ``choose``
    decisions_cpu_us: list[float]  # the thread's CPU time in it (no preemption by others)
    problems: list[str]


async def simulate(
    reqs: Sequence[Req], policy: Policy, args: argparse.Namespace, ranks: list[Rank]
) -> Outcome:
    loop = asyncio.get_running_loop()
    workers = {rank: Worker(args.cache_blocks) for rank in ranks}
    if isinstance(policy, Toolkit):
        policy.caches = workers
    decisions: list[float] = []
    cpu: list[float] = []
    ratios: list[float] = []
    prefilled = 0
    tasks: set[asyncio.Task[None]] = set()
    problems: list[str] = []
    start = loop.time() + 0.2

    def spawn(coro: Any) -> None:
        task = loop.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def lifecycle(req: Req) -> None:
        nonlocal prefilled
        extra = policy.prepare(req)  # what the scheduler is handed (a KV indexer's answer)
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        rank = policy.choose(req, extra)
        decisions.append((time.perf_counter_ns() - t0) / 1000)
        cpu.append((time.thread_time_ns() - c0) / 1000)
        worker = workers[rank]
        cached = worker.cached_prefix(req.hashes)
        uncached = max(0, req.isl - cached * BLOCK_TOKENS)
        prefilled += uncached
        worker.take(req.hashes)
        now = loop.time()
        worker.busy_until = max(worker.busy_until, now) + uncached / args.prefill_tps / args.speedup
        prefill_end = worker.busy_until
        done = prefill_end + req.osl * args.decode_ms / 1000 / args.speedup
        await policy.add(req, rank, uncached)
        await asyncio.sleep(max(0.0, prefill_end - loop.time()))
        await policy.mark(req)
        await asyncio.sleep(max(0.0, done - loop.time()))
        worker.release(req.hashes)
        await policy.free(req)

    async def sample() -> None:
        while True:
            loads = [len(w.active) for w in workers.values()]
            mean = sum(loads) / len(loads)
            if mean > 0:
                ratios.append(max(loads) / mean)
            await asyncio.sleep(args.sample_ms / 1000)

    sampler = loop.create_task(sample())
    try:
        for req in reqs:
            await asyncio.sleep(max(0.0, start + req.at_s - loop.time()))
            spawn(lifecycle(req))
        while tasks:
            done, _ = await asyncio.wait(set(tasks), return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    problems.append(repr(task.exception()))
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    balance = statistics.fmean(ratios) if ratios else 0.0
    return Outcome(balance, prefilled, decisions, cpu, problems)


# ---- the schemes -----------------------------------------------------------------------------


class RoundRobin:
    def __init__(self, publisher: RouterPublisher, ranks: list[Rank]) -> None:
        self.publisher, self.ranks, self.i = publisher, ranks, 0
        self.where: dict[str, Rank] = {}

    def prepare(self, req: Req) -> Any:
        return None

    def choose(self, req: Req, extra: Any) -> Rank:
        self.i += 1
        return self.ranks[self.i % len(self.ranks)]

    async def add(self, req: Req, rank: Rank, prefill_tokens: int) -> None:
        self.where[req.request_id] = rank
        await self.publisher.add(req.request_id, *rank, req.hashes, prefill_tokens)

    async def mark(self, req: Req) -> None:
        await self.publisher.mark_prefill_completed(req.request_id, *self.where[req.request_id])

    async def free(self, req: Req) -> None:
        await self.publisher.free(req.request_id, *self.where.pop(req.request_id))


class Toolkit:
    """One or more Schedulers, requests dealt in turn; ``view_only`` chooses on the view;
    ``indexed`` credits each rank's cached prefix as a KV indexer reports it (``overlaps=``)."""

    def __init__(
        self,
        scheds: list[Scheduler],
        view_only: bool = False,
        seed: int = 0,
        indexed: bool = False,
    ) -> None:
        self.scheds, self.view_only, self.indexed = scheds, view_only, indexed
        self.caches: dict[Rank, Worker] = {}  # the simulated workers (set by ``simulate``)
        self.owner: dict[str, Scheduler] = {}
        self.n = 0
        self.rng = random.Random(seed)
        self.unseen: list[str] = []

    def prepare(self, req: Req) -> Any:
        if not self.indexed:
            return None
        return {rank: w.cached_prefix(req.hashes) for rank, w in self.caches.items()}

    def choose(self, req: Req, extra: Any) -> Rank:
        sched = self.scheds[self.n % len(self.scheds)]
        self.n += 1
        self.owner[req.request_id] = sched
        if self.view_only:
            rows = sched.view.costs(req.hashes, req.isl, block_size=BLOCK_TOKENS)
            row = rows[select([r.cost for r in rows], 0.0, self.rng.random())]
            return row.worker_id, row.dp_rank
        return sched.choose(req.hashes, req.isl, overlaps=extra)

    async def add(self, req: Req, rank: Rank, prefill_tokens: int) -> None:
        sched = self.owner[req.request_id]
        await sched.add(
            req.request_id,
            worker_id=rank[0],
            dp_rank=rank[1],
            block_hashes=req.hashes,
            prefill_tokens=prefill_tokens,
        )
        if not self.view_only:  # visible where it was made: counted as active on its rank
            (row,) = sched.costs(req.hashes, req.isl, [rank])
            if row.active_overlap_blocks != len(req.hashes):
                self.unseen.append(
                    f"{req.request_id} on {rank}: {row.active_overlap_blocks} of "
                    f"{len(req.hashes)} blocks counted"
                )

    async def mark(self, req: Req) -> None:
        await self.owner[req.request_id].mark_prefill_completed(req.request_id)

    async def free(self, req: Req) -> None:
        await self.owner.pop(req.request_id).free(req.request_id)


class Oracle:
    """Dynamo's cost over a write model that holds every event at the instant it happens."""

    def __init__(self, ranks: list[Rank], seed: int) -> None:
        self.state = SequenceState(expiry_s=None)
        self.rng = random.Random(seed)
        self.weights = CostWeights()
        self.where: dict[str, Rank] = {}
        for worker_id, _ in ranks:  # registered from the start, as the others' are
            self.state.apply(WorkerAdded(worker_id=worker_id), 0)

    def prepare(self, req: Req) -> Any:
        return None

    def choose(self, req: Req, extra: Any) -> Rank:
        rows = self.state.registry.costs(
            req.hashes, req.isl, time.time_ns(), BLOCK_TOKENS, self.weights
        )
        row = rows[select([r.cost for r in rows], 0.0, self.rng.random())]
        return row.worker_id, row.dp_rank

    async def add(self, req: Req, rank: Rank, prefill_tokens: int) -> None:
        self.where[req.request_id] = rank
        event = AddRequest(
            request_id=req.request_id,
            worker_id=rank[0],
            dp_rank=rank[1],
            block_hashes=req.hashes,
            prefill_tokens=prefill_tokens,
        )
        self.state.apply(event, time.time_ns())

    async def mark(self, req: Req) -> None:
        rank = self.where[req.request_id]
        event = MarkPrefillCompleted(request_id=req.request_id, worker_id=rank[0], dp_rank=rank[1])
        self.state.apply(event, time.time_ns())

    async def free(self, req: Req) -> None:
        rank = self.where.pop(req.request_id)
        self.state.apply(
            Free(request_id=req.request_id, worker_id=rank[0], dp_rank=rank[1]), time.time_ns()
        )


# ---- one round -------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def pipeline(url: str, namespace: str) -> Any:
    """``seqstate run`` for one namespace, in a process of its own (as deployed)."""
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "seqstate"),
        "run",
        "--nats-url",
        url,
        "--namespace",
        namespace,
        "--log-level",
        "warning",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        proc.terminate()
        await proc.wait()


async def wait_bucket(nc: Client, config: Config, timeout: float = 30.0) -> None:
    """Until the pipeline's projector has made the bucket."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with RegistryView(nc, config=config, initial_timeout=5):
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def run_scheme(
    scheme: str, url: str, reqs: Sequence[Req], args: argparse.Namespace, round_no: int
) -> dict[str, Any]:
    ranks = [(w, 0) for w in range(1, args.workers + 1)]
    namespace = f"bench{round_no}{scheme.replace('-', '')}"
    config = Config().with_namespace(namespace)
    if scheme == "oracle":
        outcome = await simulate(reqs, Oracle(ranks, args.seed + round_no), args, ranks)
        return report(scheme, outcome, [], None)
    nc = await connect(url, NAME, max_reconnect_attempts=-1)
    await ensure(nc, config)
    async with pipeline(url, namespace):
        await wait_bucket(nc, config)
        control = WorkerControl(nc, config=config)
        for worker_id, _ in ranks:
            await control.add(worker_id)
        extra: list[Client] = []
        try:
            if scheme == "round-robin":
                async with RouterPublisher(nc, router_id="rr", config=config) as pub:
                    outcome = await simulate(reqs, RoundRobin(pub, ranks), args, ranks)
                    last = pub.last_sequence
                return await finish(scheme, outcome, nc, config, last, [])
            replicas = 2 if scheme == "toolkit-2" else 1
            indexed = scheme == "toolkit-indexed"
            scheds = []
            for i in range(replicas):
                conn = nc if i == 0 else await connect(url, NAME, max_reconnect_attempts=-1)
                if conn is not nc:
                    extra.append(conn)
                scheds.append(
                    await Scheduler(
                        conn,
                        router_id=f"sched-{i}",
                        config=config,
                        block_size=BLOCK_TOKENS,
                        seed=args.seed + i,
                    ).start()
                )
            policy = Toolkit(
                scheds, view_only=scheme == "view-only", seed=args.seed + round_no, indexed=indexed
            )
            try:
                outcome = await simulate(reqs, policy, args, ranks)
                last = max(s.publisher.last_sequence or 0 for s in scheds)
                result = await finish(scheme, outcome, nc, config, last, scheds)
                result["unseen_bookings"] = policy.unseen
                return result
            finally:
                for s in scheds:
                    await s.stop()
        finally:
            for conn in extra:
                await conn.close()
            await nc.close()


async def finish(
    scheme: str,
    outcome: Outcome,
    nc: Client,
    config: Config,
    last: int | None,
    scheds: list[Scheduler],
) -> dict[str, Any]:
    """Nothing left at the end: the view shows every event, every load is zero, and no
    scheduler holds anything pending."""
    left: list[str] = []
    async with RegistryView(nc, config=config) as view:
        await view.wait_for(last or 0, timeout=30)
        busy = [r for r in view.loads() if r.active_blocks or r.active_requests]
        if busy:
            left.append(f"{len(busy)} ranks still loaded")
    for s in scheds:
        await s.view.wait_for(last or 0, timeout=30)
        if s.pending or s.booked:
            left.append(f"{s.router_id}: {s.pending} pending, {s.booked} booked")
    return report(scheme, outcome, left, last)


def report(scheme: str, outcome: Outcome, left: list[str], last: int | None) -> dict[str, Any]:
    d = sorted(outcome.decisions_us)
    c = sorted(outcome.decisions_cpu_us)
    return {
        "scheme": scheme,
        "balance": round(outcome.balance, 4),
        "prefilled_tokens": outcome.prefilled_tokens,
        "decision_us_p50": round(d[len(d) // 2], 1) if d else None,
        "decision_us_p99": round(d[min(len(d) - 1, int(len(d) * 0.99))], 1) if d else None,
        "decision_cpu_us_p99": round(c[min(len(c) - 1, int(len(c) * 0.99))], 1) if c else None,
        "left_at_end": left,
        "errors": outcome.problems,
        "last_seq": last,
    }


SCHEMES = ("round-robin", "view-only", "toolkit", "toolkit-2", "oracle", "toolkit-indexed")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    reqs = load_trace(args.trace, args.requests, args.speedup)
    rounds: list[dict[str, dict[str, Any]]] = []
    async with NatsServer() as server:
        for r in range(args.runs):
            turn = rotated(SCHEMES, r)
            order = [s for s in turn if s in args.schemes or s == "round-robin"]
            results = {}
            for scheme in order:
                results[scheme] = await run_scheme(scheme, server.url, reqs, args, r)
                print(json.dumps(results[scheme]), file=sys.stderr, flush=True)
            rr = results["round-robin"]["prefilled_tokens"]
            for res in results.values():
                res["prefill_saved_vs_rr"] = round(1 - res["prefilled_tokens"] / rr, 4)
            rounds.append(results)
    summary = {}
    for scheme in rounds[0]:
        runs = [rd[scheme] for rd in rounds]
        oracle = [rd["oracle"]["balance"] if "oracle" in rd else 0.0 for rd in rounds]
        summary[scheme] = {
            "balance": statistics.median(x["balance"] for x in runs),
            "balance_vs_oracle": statistics.median(
                x["balance"] / o if o else 0.0 for x, o in zip(runs, oracle, strict=True)
            ),
            "prefill_saved_vs_rr": statistics.median(x["prefill_saved_vs_rr"] for x in runs),
            "decision_us_p50": median_or_none([x["decision_us_p50"] for x in runs]),
            "decision_us_p99": median_or_none([x["decision_us_p99"] for x in runs]),
            "decision_cpu_us_p99": median_or_none([x["decision_cpu_us_p99"] for x in runs]),
            "left_at_end": [x["left_at_end"] for x in runs if x["left_at_end"]],
            "unseen_bookings": [u for x in runs for u in x.get("unseen_bookings", [])],
            "errors": sum(len(x["errors"]) for x in runs),
        }
    return {
        "command": " ".join(sys.orig_argv),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_line(),
        "settings": {k: str(v) for k, v in vars(args).items() if k != "json"},
        "summary": summary,
        "rounds": rounds,
    }


def median_or_none(xs: list[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return statistics.median(known) if known else None


def print_summary(result: dict[str, Any]) -> None:
    print(f"{result['date_utc']}  {result['machine']}\n{result['command']}")
    print(
        f"{'scheme':12} {'balance':>8} {'vs oracle':>10} {'prefill saved':>14} "
        f"{'p50 us':>8} {'p99 us':>8} {'cpu p99':>8}  checks"
    )
    for scheme, s in result["summary"].items():
        checks = (
            "ok"
            if not (s["left_at_end"] or s["unseen_bookings"] or s["errors"])
            else (f"left {s['left_at_end']}, unseen {s['unseen_bookings']}, errors {s['errors']}")
        )
        p50 = "-" if s["decision_us_p50"] is None else f"{s['decision_us_p50']:.1f}"
        p99 = "-" if s["decision_us_p99"] is None else f"{s['decision_us_p99']:.1f}"
        cpu = "-" if s["decision_cpu_us_p99"] is None else f"{s['decision_cpu_us_p99']:.1f}"
        print(
            f"{scheme:12} {s['balance']:8.3f} {s['balance_vs_oracle']:10.3f} "
            f"{s['prefill_saved_vs_rr']:14.1%} {p50:>8} {p99:>8} {cpu:>8}  {checks}"
        )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argument_parser(__doc__)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--speedup", type=float, default=20.0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--prefill-tps", type=float, default=20_000.0, help="tokens/s per worker")
    p.add_argument("--decode-ms", type=float, default=25.0, help="ms per output token")
    p.add_argument("--cache-blocks", type=int, default=1024, help="released blocks kept")
    p.add_argument("--sample-ms", type=float, default=20.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument(
        "--schemes",
        nargs="+",
        choices=SCHEMES,
        default=list(SCHEMES),
        help="round-robin always runs: the prefill saved is measured against it",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(main_async(args))
    emit(result, args.json, print_summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
