"""``http_servers.py``'s load generator: requests formatted per call, raw connections, and one
run of every (mode, endpoint) on every server in turn.

Modes: ``seq`` (one connection, one request at a time), ``c16`` (16 connections, one request
in flight on each) and ``pipe`` (one connection, ``--depth`` in flight, HTTP/1.1 pipelining).
Every answer's status is checked; the CPU of the server (from /proc) and of this generator
(``time.process_time``) is taken per call.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any, Final

from harness.http import RawClient
from harness.measure import process_cpu_s

MODEL: Final = b"bench"
WORKERS: Final = 16
HASHES_PER_REQUEST: Final = 24
PREFILL_TOKENS: Final = 384
_rng = random.Random(12)
HASH_LISTS: Final = [
    (
        "["
        + ",".join(str(_rng.randrange(-(2**63), 2**63)) for _ in range(HASHES_PER_REQUEST))
        + "]"
    ).encode()
    for _ in range(1024)
]
POST_HEAD: Final = (
    b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n"
)
JSON_CT_BYTES: Final = b"application/json"
LOADS_REQUEST: Final = b"GET /loads HTTP/1.1\r\nHost: bench\r\n\r\n"


def post_request(path: bytes, body: bytes, content_type: bytes | None = JSON_CT_BYTES) -> bytes:
    ct = b"Content-Type: %s\r\n" % content_type if content_type is not None else b""
    return (
        b"POST %s HTTP/1.1\r\nHost: bench\r\n%sContent-Length: %d\r\n\r\n" % (path, ct, len(body))
        + body
    )


def add_maker(tag: bytes) -> Callable[[int], bytes]:
    tmpl = (
        b'{"model_name":"bench","request_id":"%s-%d","worker_id":%d,"dp_rank":0,'
        b'"sequence_hashes":%s,"new_isl_tokens":%d}'
    )
    head = b"POST /add HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"

    def make(i: int) -> bytes:
        body = tmpl % (tag, i, i % WORKERS, HASH_LISTS[i % 1024], PREFILL_TOKENS)
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body

    return make


def by_request_maker(path: bytes, tag: bytes, start: int = 0) -> Callable[[int], bytes]:
    head = POST_HEAD.split(b"Content-Length")[0] % path
    tmpl = b'{"model_name":"bench","request_id":"%s-%d"}'

    def make(i: int) -> bytes:
        body = tmpl % (tag, start + i)
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body

    return make


class Phase:
    """One measurement: requests from ``make(0..limit-1)`` until ``deadline``, statuses checked."""

    def __init__(
        self, make: Callable[[int], bytes], expect: int, limit: int | None, seconds: float | None
    ) -> None:
        self.make = make
        self.expect = b"%d" % expect
        self.limit = limit if limit is not None else 1 << 62
        self.seconds = seconds
        self.deadline = float("inf")
        self.issued = 0
        self.done = 0
        self.bad = 0
        self.first_bad = b""
        self.inflight = 0
        self.started = 0.0
        self.ended = 0.0
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def take(self, n: int) -> list[bytes]:
        out = []
        now = time.perf_counter()
        while n and self.issued < self.limit and now < self.deadline:
            out.append(self.make(self.issued))
            self.issued += 1
            n -= 1
        self.inflight += len(out)
        return out

    def settle(self, n: int) -> None:
        self.done += n
        self.inflight -= n
        if self.inflight == 0 and not self.finished.done():
            self.ended = time.perf_counter()
            self.finished.set_result(None)

    def fail(self, exc: BaseException) -> None:
        if not self.finished.done():
            self.finished.set_exception(exc)


class ClientConnection(RawClient):
    def __init__(self) -> None:
        super().__init__()
        self.phase: Phase | None = None

    def start(self, phase: Phase, depth: int) -> None:
        self.phase = phase
        out = phase.take(depth)
        if out:
            self.transport.write(b"".join(out))

    def data_received(self, data: bytes) -> None:
        phase = self.phase
        assert phase is not None
        buf, spans = self.answers(data)
        for start, end in spans:
            if buf[start + 9 : start + 12] != phase.expect:
                phase.bad += 1
                if not phase.first_bad:
                    phase.first_bad = buf[start:end]
        if n := len(spans):
            out = phase.take(n)
            if out:
                self.transport.write(b"".join(out))
            phase.settle(n)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.phase is not None:
            self.phase.fail(ConnectionError(f"server closed the connection ({exc})"))
        super().connection_lost(exc)


async def connect(port: int, n: int) -> list[ClientConnection]:
    loop = asyncio.get_running_loop()
    conns = []
    for _ in range(n):
        _, proto = await loop.create_connection(ClientConnection, "127.0.0.1", port)
        conns.append(proto)
    return conns


async def close(conns: list[ClientConnection]) -> None:
    for c in conns:
        c.phase = None
        c.transport.close()
    await asyncio.gather(*(c.closed for c in conns))


MODES: Final = {"seq": (1, 1), "c16": (16, 1), "pipe": (1, None)}  # (connections, depth)


async def measure(
    port: int, pid: int | None, mode: str, depth: int, phase: Phase, timeout: float
) -> dict[str, Any]:
    n_conns, per_conn = MODES[mode]
    conns = await connect(port, n_conns)
    try:
        cpu0 = process_cpu_s(pid) if pid else 0.0
        gen0 = time.process_time()
        phase.started = time.perf_counter()
        if phase.seconds is not None:
            phase.deadline = phase.started + phase.seconds
        for c in conns:
            c.start(phase, per_conn or depth)
        if phase.inflight == 0:
            phase.ended = phase.started
        else:
            await asyncio.wait_for(phase.finished, timeout)
        gen = time.process_time() - gen0
        cpu = process_cpu_s(pid) - cpu0 if pid else float("nan")
    finally:
        await close(conns)
    elapsed = max(phase.ended - phase.started, 1e-9)
    calls = max(phase.done, 1)
    if phase.bad:
        raise RuntimeError(
            f"{phase.bad} of {phase.done} answers were not {phase.expect.decode()};"
            f" first: {phase.first_bad[:300]!r}"
        )
    return {
        "calls": phase.done,
        "seconds": elapsed,
        "rate": phase.done / elapsed,
        "server_cpu_us": 1e6 * cpu / calls,
        "gen_cpu_us": 1e6 * gen / calls,
    }


ORDER: Final = ("add", "loads", "prefill_complete", "free")  # frees what add booked


async def measure_run(
    targets: dict[str, tuple[int, int | None]],
    tag: str,
    modes: list[str],
    endpoints: list[str],
    seconds: float,
    depth: int,
) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """One run: per mode, each endpoint on every server in turn (so all share a phase of the
    machine), in the order add, loads, prefill_complete, free; prefill_complete and free use
    the ids that server's add booked, and what free did not reach is freed untimed."""
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {s: {} for s in targets}
    timeout = 10 * seconds + 30
    for mode in modes:
        t = f"{tag}{mode}".encode()
        booked: dict[str, int] = {}
        for endpoint in ORDER:
            if endpoint not in endpoints and endpoint not in ("add", "free"):
                continue
            for s, (port, pid) in targets.items():
                if endpoint == "add":
                    phase = Phase(add_maker(t), 201, None, seconds)
                elif endpoint == "loads":
                    phase = Phase(lambda i: LOADS_REQUEST, 200, None, seconds)
                else:
                    phase = Phase(
                        by_request_maker(f"/{endpoint}".encode(), t), 200, booked[s], seconds
                    )
                res = await measure(port, pid, mode, depth, phase, timeout)
                if endpoint == "add":
                    booked[s] = phase.done
                if endpoint == "free" and phase.done < booked[s]:  # untimed: leave no booking
                    rest = Phase(
                        by_request_maker(b"/free", t, phase.done), 200, booked[s] - phase.done, None
                    )
                    await measure(port, None, "pipe", 64, rest, timeout)
                if endpoint in endpoints:
                    out[s].setdefault(mode, {})[endpoint] = res
    return out


WRK_FREE_LUA: Final = """wrk.method = "POST"
wrk.body = '{"model_name":"bench","request_id":"never-added"}'
wrk.headers["Content-Type"] = "application/json"
"""


async def wrk_check(port: int, seconds: float, lua: str) -> dict[str, float]:
    """The c16 cross-check with a C client: GET /loads and POST /free (an id never added)."""
    out = {}
    for name, path, extra in (("loads", "/loads", []), ("free", "/free", ["-s", lua])):
        proc = await asyncio.create_subprocess_exec(
            "wrk",
            "-t1",
            "-c16",
            f"-d{max(1, round(seconds))}s",
            *extra,
            f"http://127.0.0.1:{port}{path}",
            stdout=asyncio.subprocess.PIPE,
        )
        text = (await proc.communicate())[0].decode()
        if "Non-2xx" in text or "Socket errors" in text or proc.returncode:
            raise RuntimeError(f"wrk {path} on port {port}: {text}")
        rate = next(line for line in text.splitlines() if line.startswith("Requests/sec:"))
        out[name] = float(rate.split()[1])
    return out
