"""``slot_vs_dynamo.py``'s load generator: the workloads, their requests as bytes, and one
workload measured on one server.

The generator is this process: raw ``asyncio.Protocol`` connections, requests formatted from
byte templates, responses split by ``Content-Length``. A pair is an add of a fresh request id
and, on the same connection, the free of that id; a measurement stops issuing at its deadline,
at a pair's boundary, so every add is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Final

from harness.http import RawClient
from harness.measure import percentile, proc_tree_cpu
from harness.trackers import Target

MODEL: Final = "bench"
WORKERS: Final = 16
HASHES_PER_REQUEST: Final = 24
PREFILL_TOKENS: Final = 384
_rng = random.Random(23)
HASH_LISTS: Final = [
    ",".join(str(_rng.randrange(-(2**63), 2**63)) for _ in range(HASHES_PER_REQUEST)).encode()
    for _ in range(1024)
]


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "pairs" or "loads"
    conns: int
    depth: int  # requests in flight per connection


def workloads(depth: int) -> list[Workload]:
    return [
        Workload("pairs-c1", "pairs", 1, 1),
        Workload("pairs-c16", "pairs", 16, 1),
        Workload("pairs-c64", "pairs", 64, 1),
        Workload(f"pairs-pipe{depth}", "pairs", 1, depth),
        Workload("loads-c16", "loads", 16, 1),
        Workload(f"loads-pipe{depth}", "loads", 1, depth),
    ]


# ---------------------------------------------------------------------------------------------
# Requests, as bytes.


def post(path: str, body: bytes) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (path.encode(), len(body))
    ) + body


def get(path: str) -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: bench\r\n\r\n" % path.encode()


ADD_HEAD: Final = b"POST /add HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
ADD_BODY: Final = (
    b'{"model_name":"bench","request_id":"%s-%d","worker_id":%d,"dp_rank":0,'
    b'"sequence_hashes":[%s],"new_isl_tokens":%d}'
)
FREE_HEAD: Final = b"POST /free HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
FREE_BODY: Final = b'{"model_name":"bench","request_id":"%s-%d"}'
LOADS_REQUEST: Final = get(f"/loads?model_name={MODEL}")  # what a scheduler asks
CL: Final = b"Content-Length: %d\r\n\r\n"


def add_request(tag: bytes, i: int) -> bytes:
    body = ADD_BODY % (tag, i, i % WORKERS, HASH_LISTS[i % 1024], PREFILL_TOKENS)
    return ADD_HEAD + CL % len(body) + body


def free_request(tag: bytes, i: int) -> bytes:
    body = FREE_BODY % (tag, i)
    return FREE_HEAD + CL % len(body) + body


# ---------------------------------------------------------------------------------------------
# The load generator.


class Measurement:
    """One workload on one server: shared by its connections until every one is done."""

    def __init__(self, kind: str, tag: bytes, seconds: float) -> None:
        self.kind = kind
        self.tag = tag
        self.seconds = seconds
        self.deadline = math.inf
        self.next_id = 0
        self.calls = 0
        self.bad = 0
        self.bad_statuses: dict[str, int] = {}
        self.first_bad = b""
        self.latencies: list[float] = []
        self.started = 0.0
        self.ended = 0.0
        self.running = 0
        self.lost: list[str] = []
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def conn_done(self) -> None:
        self.running -= 1
        if self.running == 0 and not self.finished.done():
            self.finished.set_result(None)


class Client(RawClient):
    """One connection: requests in flight up to ``depth``, answers checked in order."""

    def __init__(self) -> None:
        super().__init__()
        self.m: Measurement | None = None
        self.depth = 1
        self.pending_free: int | None = None
        self.expect: deque[tuple[bytes, float]] = deque()
        self.done = True

    def next_request(self, now: float) -> bytes | None:
        m = self.m
        assert m is not None
        if m.kind == "loads":
            if now >= m.deadline:
                return None
            self.expect.append((b"200", now))
            return LOADS_REQUEST
        if self.pending_free is not None:  # a pair is finished even past the deadline
            i, self.pending_free = self.pending_free, None
            self.expect.append((b"200", now))
            return free_request(m.tag, i)
        if now >= m.deadline:
            return None
        i = m.next_id
        m.next_id += 1
        self.pending_free = i
        self.expect.append((b"201", now))
        return add_request(m.tag, i)

    def fill(self) -> None:
        now = time.perf_counter()
        out = []
        while len(self.expect) < self.depth:
            req = self.next_request(now)
            if req is None:
                break
            out.append(req)
        if out:
            self.transport.write(b"".join(out) if len(out) > 1 else out[0])
        elif not self.expect and not self.done:
            self.done = True
            assert self.m is not None
            self.m.conn_done()

    def start(self, m: Measurement, depth: int) -> None:
        self.m, self.depth, self.done, self.pending_free = m, depth, False, None
        self.fill()

    def data_received(self, data: bytes) -> None:
        m = self.m
        if m is None:
            return
        buf, spans = self.answers(data)
        now = time.perf_counter()
        lat = m.latencies
        expect = self.expect
        for start, end in spans:
            want, sent = expect.popleft() if expect else (b"???", now)
            lat.append(now - sent)
            status = buf[start + 9 : start + 12]
            if status != want:
                m.bad += 1
                key = f"{status.decode('latin-1')} (expected {want.decode()})"
                m.bad_statuses[key] = m.bad_statuses.get(key, 0) + 1
                if not m.first_bad:
                    m.first_bad = buf[start:end]
        n = len(spans)
        if n:
            m.calls += n
            m.ended = now
            self.fill()

    def connection_lost(self, exc: Exception | None) -> None:
        m = self.m
        if m is not None and not self.done:
            m.lost.append(f"connection closed by the server ({exc})")
            self.done = True
            m.conn_done()
        super().connection_lost(exc)


async def measure(
    target: Target, w: Workload, tag: bytes, seconds: float, timeout: float
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    m = Measurement(w.kind, tag, seconds)
    conns: list[Client] = []
    try:
        for _ in range(w.conns):
            _, c = await asyncio.wait_for(
                loop.create_connection(Client, target.host, target.port), 10
            )
            conns.append(c)
        cpu0 = proc_tree_cpu(target.pids) if target.pids else math.nan
        nats0 = proc_tree_cpu(target.nats_pids) if target.nats_pids else math.nan
        gen0 = time.process_time()
        m.started = m.ended = time.perf_counter()
        m.deadline = m.started + seconds
        m.running = len(conns)
        for c in conns:
            c.start(m, w.depth)
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(m.finished), seconds + timeout)
        except TimeoutError:
            timed_out = True
        gen = time.process_time() - gen0
        cpu = proc_tree_cpu(target.pids) - cpu0 if target.pids else math.nan
        nats = proc_tree_cpu(target.nats_pids) - nats0 if target.nats_pids else math.nan
    finally:
        for c in conns:
            c.m = None
            c.transport.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(c.closed for c in conns)), 5)
    errors = m.bad + len(m.lost) + (1 if timed_out else 0)
    notes = list(m.lost)
    if timed_out:
        inflight = sum(len(c.expect) for c in conns)
        notes.append(f"timed out {timeout:.0f} s after the deadline, {inflight} calls unanswered")
    if m.bad:
        notes.append(
            f"{m.bad} bad statuses {m.bad_statuses}; first: {m.first_bad[:300].decode('latin-1')!r}"
        )
    elapsed = max(m.ended - m.started, 1e-9)
    calls = max(m.calls, 1)
    lat = sorted(m.latencies)
    return {
        "calls": m.calls,
        "seconds": elapsed,
        "rate": m.calls / elapsed,
        "errors": errors,
        "notes": notes,
        "p50_ms": 1e3 * percentile(lat, 50),
        "p90_ms": 1e3 * percentile(lat, 90),
        "p99_ms": 1e3 * percentile(lat, 99),
        "max_ms": 1e3 * lat[-1] if lat else math.nan,
        "server_cpu_us": 1e6 * cpu / calls,
        "nats_cpu_us": 1e6 * nats / calls,
        "gen_cpu_us": 1e6 * gen / calls,
    }


def failed_measurement(note: str) -> dict[str, Any]:
    nan = math.nan
    keys = [
        "seconds",
        "rate",
        "p50_ms",
        "p90_ms",
        "p99_ms",
        "max_ms",
        "server_cpu_us",
        "nats_cpu_us",
        "gen_cpu_us",
    ]
    return {"calls": 0, "errors": 1, "notes": [note], **dict.fromkeys(keys, nan)}
