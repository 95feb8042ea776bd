"""``seqstate serve-http``'s door: every part of a request bounded as it arrives, a refusal
named for each, timeouts for clients that send too slowly, output bounded for clients that do
not read, and names checked before they become NATS subjects. Each against a real process on a
real nats-server, with another client served meanwhile.

The limits, as docs/http-api.md states them: URL 8 KiB (414), header lines 16 KiB (431), body 2 MiB
(413), a head within 10 s (408, then closed), a tracker's namespace 2,048 bytes (400).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from eventually import eventually
from http_kit import (
    RUNNING,
    WAIT_S,
    Reply,
    exchange,
    free_port,
    http_get,
    read_reply,
    refused,
    register,
    request,
    rows,
    serve_http,
)
from log_text import plain_lines
from nats.aio.client import Client
from pipeline_kit import cli, fresh_config

from projector.http.slot_routes import EMPTY_ID
from projector.http.tracker_names import namespace_for
from projector.nats.server import NatsServer

KiB, MiB = 1024, 1024 * 1024
RSS_LIMIT_MB = 150
MODEL = "Qwen/Qwen3-8B"


def add(request_id: str, hashes: list[int], model: str = MODEL) -> tuple[str, str, Any]:
    body = {
        "model_name": model,
        "request_id": request_id,
        "worker_id": 1,
        "dp_rank": 0,
        "sequence_hashes": hashes,
    }
    return ("POST", "/add", body)


def with_url(target: str) -> bytes:
    return f"GET {target} HTTP/1.1\r\nhost: x\r\n\r\n".encode()


def with_header_lines(total: int, target: str = "/health") -> bytes:
    """A GET whose header lines (``name: value\\r\\n`` each) take ``total`` bytes in all."""
    fixed = len(b"host: x\r\n") + len(b"x-pad: \r\n")
    return f"GET {target} HTTP/1.1\r\nhost: x\r\nx-pad: {'p' * (total - fixed)}\r\n\r\n".encode()


def rss_mb(port: int) -> float:
    """serve-http's resident memory, as the kernel counts it."""
    with open(f"/proc/{RUNNING[port].pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@contextlib.asynccontextmanager
async def rss_watch(port: int) -> AsyncIterator[Callable[[], float]]:
    """The peak of serve-http's RSS while inside, sampled every 10 ms (a measurement: the
    test waits on conditions, never on this)."""
    peak = [rss_mb(port)]

    async def sample() -> None:
        while True:
            peak[0] = max(peak[0], rss_mb(port))
            await asyncio.sleep(0.01)

    sampler = asyncio.create_task(sample())
    try:
        yield lambda: max(peak[0], rss_mb(port))
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler


async def served_meanwhile(port: int, n: int) -> None:
    """Another client's calls, answered while a flood is on another connection."""
    answers = await exchange(
        port,
        [
            add(f"meanwhile-{n}", [n, n + 1]),
            ("POST", "/free", {"model_name": MODEL, "request_id": f"meanwhile-{n}"}),
            ("GET", "/health", None),
        ],
    )
    assert [a.status for a in answers] == [201, 200, 200], answers


async def flood(port: int, head: bytes, filler: int) -> Reply:
    """``head`` then ``filler`` bytes of ``a`` in 1 MiB writes, as fast as the server reads
    them; the answer, read meanwhile. Sending stops once it is answered (or refused)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    chunk = b"a" * MiB

    async def send() -> None:
        writer.write(head)
        for _ in range(filler // MiB):
            writer.write(chunk)
            await writer.drain()

    sender = asyncio.create_task(send())
    try:
        reply = await read_reply(reader)
        assert await asyncio.wait_for(reader.read(), WAIT_S) == b"", "not closed after it"
        return reply
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await sender
        writer.close()


async def test_each_part_of_a_request_is_bounded_where_it_arrives(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("dl")
    async with serve_http(nats_server.url, config) as port:
        assert (await exchange(port, [register()]))[0].status == 201

        # The URL: 8 KiB served, a byte more 414.
        at = "/health?pad=" + "u" * (8 * KiB - len("/health?pad="))
        assert (await exchange(port, [with_url(at)]))[0] == (200, None)
        over = await refused(port, with_url(at + "u"))
        assert over == (414, {"error": "the request's URL is over 8192 bytes"})

        # The header lines: 16 KiB in all served, a byte more 431.
        assert (await exchange(port, [with_header_lines(16 * KiB)]))[0] == (200, None)
        over = await refused(port, with_header_lines(16 * KiB + 1))
        assert over == (431, {"error": "the request's headers are over 16384 bytes"})
        both = with_header_lines(16 * KiB, at)  # each at its limit at once
        assert (await exchange(port, [both]))[0] == (200, None)

        # The body: a 1M-token prompt's /add (62,500 i64 hashes) padded to 2 MiB is booked;
        # a body one byte over is 413 as soon as its Content-Length is read, unsent.
        rng = random.Random(7)
        hashes = [rng.randrange(-(2**63), 2**63) for _ in range(62_500)]
        body = json.dumps(add("long-prompt", hashes)[2]).encode()
        assert 1_000_000 < len(body) < 2 * MiB
        at_limit = request("POST", "/add", raw=body + b" " * (2 * MiB - len(body)))
        assert (await exchange(port, [at_limit]))[0] == (201, {"status": "ok"})
        # Calls pipelined behind a body far longer than a head may be are each read as a
        # request of their own: a body's bytes never count against the head's bound.
        long_body = json.dumps(add("pipelined", hashes[:50_000])[2]).encode()
        free = ("POST", "/free", {"model_name": MODEL, "request_id": "pipelined"})
        piped = [request("POST", "/add", raw=long_body), free, ("GET", "/health", None)]
        assert [a.status for a in await exchange(port, piped)] == [201, 200, 200]
        head = (
            b"POST /add HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (2 * MiB + 1)
        )
        over = await refused(port, head)
        assert over == (413, {"error": "Failed to buffer the request body: length limit exceeded"})

        # A malformed request is 400, then closed; the connections after it are served.
        assert (await refused(port, b"GET / HTTP/1.1\r\nho st: x\r\n\r\n")).status == 400
        loads = await exchange(port, [("GET", "/loads", None)])
        assert rows(loads[0]) == [(MODEL, 1, 0, 0, 62_500)]


async def test_a_slowloris_is_closed_within_10_s_while_others_are_served(
    nc: Client, nats_server: NatsServer
) -> None:
    """A client that sends its head a header at a time, one every 0.5 s, is answered 408 and
    closed within 10 s of connecting, however much it keeps sending; so is one that sends
    nothing at all. The bound is an upper one: the timer cannot fire late by much unless the
    server's loop is stuck, which is what the other client's answers show it is not."""
    config = fresh_config("ds")
    async with serve_http(nats_server.url, config) as port:
        assert (await exchange(port, [register()]))[0].status == 201
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        silent_reader, silent_writer = await asyncio.open_connection("127.0.0.1", port)
        opened = loop.time()
        dripped = 0

        async def drip() -> None:
            nonlocal dripped
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n")
            while True:
                await asyncio.sleep(0.5)  # the attack's pace, not a wait for anything
                writer.write(b"x-more: 1\r\n")
                await writer.drain()
                dripped += 1

        dripping = asyncio.create_task(drip())
        try:
            for n in range(3):
                await served_meanwhile(port, n)
            reply = await asyncio.wait_for(read_reply(reader), 10)
            assert await asyncio.wait_for(reader.read(), 10) == b""
            closed_after = loop.time() - opened
            assert await asyncio.wait_for(silent_reader.read(), 10) == b""
            silent_after = loop.time() - opened
        finally:
            dripping.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await dripping
            writer.close()
            silent_writer.close()
        assert reply.status == 408
        assert reply.body == {"error": "the request's head did not arrive within 5 s"}
        assert closed_after < 10 and silent_after < 10, (closed_after, silent_after)
        assert dripped >= 4  # it kept sending: a timeout per byte would never have fired
        await served_meanwhile(port, 9)


async def test_a_204_mb_url_and_a_128_mb_header_are_refused_unread_under_150_mb(
    nc: Client, nats_server: NatsServer
) -> None:
    """Refused at their limits, never read whole: serve-http's RSS stays under 150 MB, and
    another client is served between them."""
    config = fresh_config("du")
    async with serve_http(nats_server.url, config) as port:
        assert (await exchange(port, [register()]))[0].status == 201
        async with rss_watch(port) as peak:
            url = await flood(port, b"GET /", 204 * MiB)
            assert url == (414, {"error": "the request's URL is over 8192 bytes"})
            await served_meanwhile(port, 1)
            header = await flood(port, b"GET / HTTP/1.1\r\nx-big: ", 128 * MiB)
            assert header == (431, {"error": "the request's headers are over 16384 bytes"})
            await served_meanwhile(port, 2)
            assert peak() < RSS_LIMIT_MB, peak()


async def test_a_128_mb_trailer_or_chunk_size_line_is_refused_unread_under_150_mb(
    nc: Client, nats_server: NatsServer
) -> None:
    """A chunked body's framing is bounded as its head is: a trailer (header lines after the
    last chunk) or a chunk size line (its extensions) over 16 KiB is 431 as it arrives. A
    128 MB trailer was read for its 30 s, the server's loop busy growing it (its lease
    renewals and other clients waiting), then answered 408; an 8 KiB one is served."""
    config = fresh_config("dc")
    chunked = (
        b"POST /add HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    body = json.dumps(add("chunked", [1, 2])[2]).encode()
    data = b"%x\r\n%s\r\n" % (len(body), body)
    trailer = b"x-t: " + b"t" * 8 * KiB + b"\r\n"
    refusal = (
        431,
        {
            "error": "the request's chunked framing (a chunk's size line, or the trailer after "
            "the last chunk) is over 16384 bytes"
        },
    )
    async with serve_http(nats_server.url, config) as port:
        assert (await exchange(port, [register()]))[0].status == 201
        served = await exchange(port, [chunked + data + b"0\r\n" + trailer + b"\r\n"])
        assert served[0] == (201, {"status": "ok"})
        async with rss_watch(port) as peak:
            assert await flood(port, chunked + data + b"0\r\nx-big: ", 128 * MiB) == refusal
            await served_meanwhile(port, 1)
            assert await flood(port, chunked + b"1;ext=", 128 * MiB) == refusal
            await served_meanwhile(port, 2)
            assert peak() < RSS_LIMIT_MB, peak()


async def test_a_client_that_pipelines_20000_calls_and_reads_none_is_paused_under_150_mb(
    nc: Client, nats_server: NatsServer
) -> None:
    """20,000 pipelined /loads (17 KB each, 340 MB in all) never read: once its unread
    answers pass a high-water mark the client is no longer read (its requests wait in the
    kernel), serve-http's RSS stays under 150 MB, another client is served meanwhile, and the
    first gets every answer, in order, once it reads."""
    config = fresh_config("dp")
    async with serve_http(nats_server.url, config) as port:
        assert (await exchange(port, [register(dp_size=128)]))[0].status == 201
        n = 20_000
        async with rss_watch(port) as peak:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                client_port = writer.get_extra_info("sockname")[1]
                writer.write(b"GET /loads HTTP/1.1\r\nhost: x\r\n\r\n" * n)
                await eventually(
                    lambda: receive_queue(port, client_port),
                    lambda queued: queued > 0,
                    what="serve-http stopped reading the client that does not read",
                )
                for k in range(3):
                    await served_meanwhile(port, k)
                assert receive_queue(port, client_port) > 0
                assert peak() < RSS_LIMIT_MB, peak()
                first = await read_reply(reader)
                assert first.status == 200 and len(first.raw) > 16_000
                for _ in range(n - 1):
                    reply = await read_reply(reader)
                    assert reply.status == 200 and reply.raw == first.raw
            finally:
                writer.close()
            assert peak() < RSS_LIMIT_MB, peak()


async def test_bodies_queued_behind_a_waiting_call_are_bounded_under_150_mb(
    tmp_path: Path,
) -> None:
    """Calls pipelined behind a read that waits (the read waits for the add before it, whose
    event cannot be stored: nats-server is frozen) are read ahead, but their bodies are kept
    only up to a bound per connection and over all of them. Four clients each pipelining 60
    bodies of 2 MiB once took serve-http past 500 MB; every call is answered in order once
    the server is back."""
    with NatsServer(tmp_path / "nats") as server:
        config = fresh_config("dq")
        async with serve_http(server.url, config) as port:
            assert [a.status for a in await exchange(port, [register(), add("w", [1])])] == [
                201,
                201,
            ]
            body = json.dumps({"model_name": MODEL, "request_id": "nobody"}).encode()
            big = request("POST", "/free", raw=body + b" " * (2 * MiB - len(body)))
            clients = []
            assert server.pid is not None
            os.kill(server.pid, signal.SIGSTOP)
            try:
                async with rss_watch(port) as peak:
                    for i in range(4):
                        reader, writer = await asyncio.open_connection("127.0.0.1", port)
                        head = request("POST", "/add", add(f"held-{i}", [i + 2])[2])
                        writer.write(head + request("GET", "/loads") + big * 60)
                        clients.append((reader, writer, writer.get_extra_info("sockname")[1]))

                    def unread() -> list[int]:
                        return [receive_queue(port, client) for _, _, client in clients]

                    await eventually(
                        unread, lambda queues: all(queues), what="serve-http pausing each client"
                    )
                    await served_meanwhile_health(port)
                    assert peak() < RSS_LIMIT_MB, peak()
            finally:
                os.kill(server.pid, signal.SIGCONT)
            for reader, writer, _ in clients:
                try:
                    statuses = [(await read_reply(reader)).status for _ in range(62)]
                finally:
                    writer.close()
                assert statuses[0] in (201, 503) and statuses[1] == 200, statuses[:2]
                assert set(statuses[2:]) <= {200, 503}, statuses


async def served_meanwhile_health(port: int) -> None:
    """Another client is answered while the others wait."""
    assert (await exchange(port, [("GET", "/health", None)]))[0].status in (200, 503)


def receive_queue(server_port: int, client_port: int) -> int:
    """Bytes the kernel holds for serve-http on the connection from ``client_port``, not read
    by it yet (/proc/net/tcp's rx_queue)."""
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            local, remote = fields[1], fields[2]
            if int(local.split(":")[1], 16) == server_port and (
                int(remote.split(":")[1], 16) == client_port
            ):
                return int(fields[4].split(":")[1], 16)
    raise AssertionError(f"no connection from port {client_port}")


async def test_a_name_too_long_for_nats_is_400_and_serve_http_stays_connected(
    nc: Client, nats_server: NatsServer
) -> None:
    """A 5,000-character model_name once became a 5,000-byte NATS subject: the server ended
    the connection, the client never reconnected, /health stayed 200. Names are checked
    before they reach NATS: a namespace of 2,048 bytes is served, one more byte is 400."""
    config = fresh_config("dn")
    metrics = free_port()
    async with serve_http(nats_server.url, config, "--metrics-port", str(metrics)) as port:
        fixed = len(namespace_for("", "default", config.namespace))
        longest = "m" * (2048 - fixed)
        assert len(namespace_for(longest, "default", config.namespace)) == 2048
        answers = await exchange(
            port,
            [
                register("x" * 5000),
                add("r", [1], model="x" * 5000),
                ("GET", f"/loads?model_name={'x' * 5000}&routing_group=default", None),
                register(longest + "m"),
                register("/" * 700),  # each '/' takes 3 bytes: 2,100 in all
                register(longest),
                add("r", [1, 2], model=longest),
                ("GET", f"/loads?model_name={longest}&routing_group=default", None),
            ],
        )
        assert [a.status for a in answers] == [400, 400, 400, 400, 400, 201, 201, 200]
        assert answers[0].body == {
            "error": "model_name and routing_group too long: their tracker's namespace, a "
            f"token of NATS subjects and KV keys, would take {5000 + fixed:,} bytes, over the "
            "limit of 2,048 (an ASCII letter or digit takes 1 byte, any other byte of the "
            "UTF-8 names 3)"
        }
        assert rows(answers[7]) == [(longest, 1, 0, 0, 2)]
        assert (await exchange(port, [register(), ("GET", "/health", None)])) == [
            (201, {"status": "ok"}),
            (200, None),
        ]
        status, _, why = await http_get(metrics, "/readyz")
        assert (status, why) == (200, "ready\n")


async def test_an_empty_request_id_is_422_on_every_route_and_nothing_is_stored(
    nc: Client, nats_server: NatsServer
) -> None:
    """serde takes "" as a request id; the log keeps no request without one. It was a 500
    "internal error" and a traceback, through the lease holder and elsewhere alike."""
    config = fresh_config("de")
    empty = {"model_name": MODEL, "request_id": ""}
    refused = (422, {"error": EMPTY_ID})
    async with serve_http(nats_server.url, config) as port:
        calls = [
            register(),
            add("", [1, 2]),
            ("POST", "/prefill_complete", empty),
            ("POST", "/free", empty),
            add("named", [1, 2]),
        ]
        assert await exchange(port, calls) == [
            (201, {"status": "ok"}),
            refused,
            refused,
            refused,
            (201, {"status": "ok"}),
        ]
        assert await exchange(port, calls[1:4]) == [refused] * 3  # the holder's own door too
        loads = await exchange(port, [("GET", "/loads", None)])
        assert rows(loads[0]) == [(MODEL, 1, 0, 0, 2)]


def test_a_deployment_name_that_leaves_no_room_for_a_tracker_is_refused_in_one_line() -> None:
    """Its name is part of every tracker's namespace: serve-http refuses it before it starts."""
    config = dataclasses.replace(fresh_config("dd"), namespace="d-" * 700)
    result = cli(config, "nats://127.0.0.1:1", "serve-http")
    assert result.returncode == 1
    assert plain_lines(result.stderr) == [
        "seqstate: error: --namespace: 1400 characters leave no room for the names of a tracker "
        "in its namespace (a token of NATS subjects): use a shorter one"
    ]
