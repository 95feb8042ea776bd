"""How many NATS messages one slot-tracker call through ``seqstate serve-http`` moves.

Why this exists: a durable call's cost is mostly the Python NATS client's cost per message
(BENCHMARKS.md, "serve-http against Dynamo's slot tracker"), so the count per call is what
bounds the calls a second. Run against a nats-server started with a monitoring port (``-m``)
that only the serve-http under test talks to; the script reads the server's ``/varz`` message
counters before and after ``--calls`` calls of each kind, sent one at a time on one connection
and then 16 at a time on 16 connections:

    nats-server -js -sd /tmp/bench-ns -p 14222 -m 18222 &
    NATS_URL=nats://127.0.0.1:14222 .venv/bin/seqstate serve-http --port 18092 &
    .venv/bin/python benchmarks/http_messages.py --port 18092 --monitor http://127.0.0.1:18222
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

from harness.cli import argument_parser

Call = tuple[str, bytes]


def varz(monitor: str) -> tuple[int, int]:
    with urllib.request.urlopen(f"{monitor}/varz") as response:
        v = json.load(response)
    return int(v["in_msgs"]), int(v["out_msgs"])


async def call(port: int, path: str, body: dict[str, Any]) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        data = json.dumps(body).encode()
        writer.write(
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n".encode()
            + data
        )
        status = int((await reader.readline()).split()[1])
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        await reader.readexactly(length)
        return status
    finally:
        writer.close()


async def main() -> None:
    p = argument_parser(__doc__)
    p.add_argument("--port", type=int, default=8091)
    p.add_argument("--monitor", default="http://127.0.0.1:8222")
    p.add_argument("--calls", type=int, default=1600)
    args = p.parse_args()
    m = {"model_name": f"msgs-{uuid.uuid4().hex[:8]}"}
    for w in range(16):
        assert (
            await call(
                args.port,
                "/register",
                {**m, "worker_id": w, "block_size": 16, "dp_start": 0, "dp_size": 1},
            )
            == 201
        )
    kinds: list[tuple[str, Callable[[int], dict[str, Any]]]] = [
        (
            "/add",
            lambda i: {
                **m,
                "request_id": f"q{i}",
                "worker_id": i % 16,
                "dp_rank": 0,
                "sequence_hashes": [(i % 64) * 100 + j for j in range(24)],
                "new_isl_tokens": 384,
            },
        ),
        ("/prefill_complete", lambda i: {**m, "request_id": f"q{i}"}),
        ("/free", lambda i: {**m, "request_id": f"q{i}"}),
    ]
    print("| call | mode | in msgs/call | out msgs/call | calls/s |")
    print("|---|---|---|---|---|")
    for path, body in kinds:
        for mode, conns in (("one at a time", 1), ("16 at once", 16)):
            base = 0 if conns == 1 else args.calls
            per = args.calls // conns
            before, start = varz(args.monitor), time.perf_counter()

            async def run(
                c: int, path: str = path, body: Any = body, base: int = base, per: int = per
            ) -> None:
                for k in range(per):
                    await call(args.port, path, body(base + c * per + k))

            await asyncio.gather(*(run(c) for c in range(conns)))
            after, took = varz(args.monitor), time.perf_counter() - start
            n = per * conns
            print(
                f"| {path} | {mode} | {(after[0] - before[0]) / n:.1f} | "
                f"{(after[1] - before[1]) / n:.1f} | {n / took:,.0f} |"
            )


if __name__ == "__main__":
    asyncio.run(main())
