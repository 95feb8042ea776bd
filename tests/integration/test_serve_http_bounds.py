"""``seqstate serve-http``'s bounds on what many clients add up to, each against real processes
on a real nats-server: the connections it holds at once (one more is 503 and closed, and running
out of file descriptors never stops it), and the slot trackers it serves (one more is 400, an
ended one frees its room, a process with a lower bound leaves the rest to the others and says
so)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
from eventually import eventually
from http_kit import (
    WAIT_S,
    Reply,
    exchange,
    read_reply,
    refused,
    register,
    request,
    rows,
    serve_http,
)
from log_text import plain_lines
from nats.aio.client import Client
from pipeline_kit import bucket_values, fresh_config

from projector.http.tracker_names import namespace_for
from projector.nats.resources import dead_letter_stream
from projector.nats.server import NatsServer
from projector.nats.stream import last_seq_of
from projector.settings.config import Config

CONNECTIONS = 512  # serve-http's default bound (docs/http-api.md)
HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
FULL = {
    "error": "too many connections: this server holds at most 512 at once "
    "(--http-max-connections); try again once one closes"
}
OUT_OF_FDS = {"error": "this server is out of file descriptors: try again later"}


class Held:
    """A client connection kept open."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def health(self) -> Reply:
        self.writer.write(HEALTH)
        return await read_reply(self.reader)

    def close(self) -> None:
        self.writer.close()


async def closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server closed the connection (EOF, or a reset after its last answer)."""
    try:
        return await asyncio.wait_for(reader.read(), WAIT_S) == b""
    except ConnectionResetError:
        return True


async def attempt(port: int, refusals: list[Reply]) -> Held | None:
    """A connection and its /health: held if served; if refused, its answer is kept in
    ``refusals`` and the server must have closed it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    held = Held(reader, writer)
    reply = await held.health()
    if reply.status == 200:
        return held
    refusals.append(reply)
    assert await closed(reader), "not closed after its refusal"
    held.close()
    return None


async def served(port: int, refusals: list[Reply]) -> Held:
    """A connection that is served, trying again while the server is full (it may not have
    seen yet that another one closed)."""
    held = await eventually(
        lambda: attempt(port, refusals),
        lambda got: got is not None,
        what=f"a connection to port {port} served",
        timeout=WAIT_S,
    )
    assert held is not None
    return held


def said(output: Path, pattern: str) -> list[re.Match[str]]:
    """The lines of a stopped process's log that ``pattern`` matches (from their start)."""
    lines = plain_lines(output.read_text())
    return [m for m in (re.match(pattern, line) for line in lines) if m is not None]


def counted(first: list[re.Match[str]], more: list[re.Match[str]]) -> int:
    """How many refusals the log told of: one for its first line, then each later line's."""
    return len(first) + sum(int(m.group(1)) for m in more)


async def test_one_connection_over_the_default_bound_is_503_and_closed_while_others_are_served(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """serve-http holds 512 connections at once by default. The 513th is answered at once
    with a 503 naming the bound and closed, sent a request or not (nothing it sent is acted
    on); the 512 are served on, another call on one of them included; once some close, new
    connections are served again. The log says the refusals in a line or two, with counts."""
    config = fresh_config("cb")
    output = tmp_path / "serve-http.log"
    refusals: list[Reply] = []
    began = asyncio.get_running_loop().time()
    async with serve_http(nats_server.url, config, output=output) as port:
        held = [await served(port, refusals) for _ in range(CONNECTIONS)]
        try:
            # One more that sends nothing: answered at once, then closed.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            silent = await read_reply(reader)
            assert await closed(reader)
            writer.close()
            assert silent.headers["connection"] == "close"
            refusals.append(silent)
            # One more that sends a registration: the same, and nothing is stored.
            loud = await refused(port, request(*register("refused-model")))
            refusals.append(loud)
            assert [(r.status, r.body) for r in refusals] == [(503, FULL)] * len(refusals)

            # Those within the bound are served on, calls that book capacity included.
            answers = await exchange_on(
                held[0],
                [
                    register(),
                    ("POST", "/add", add_body("a", [1, 2, 3])),
                    ("GET", "/loads", None),
                ],
            )
            assert [a.status for a in answers] == [201, 201, 200]
            assert rows(answers[2]) == [("Qwen/Qwen3-8B", 1, 0, 0, 3)]
            for connection in held:
                assert (await connection.health()).status == 200

            # Once three close, new connections are served again (each as soon as the
            # server has seen a close).
            for connection in held[:3]:
                connection.close()
            held[:3] = [await served(port, refusals) for _ in range(3)]
            refusals.append(await refused(port, HEALTH))  # full again
            assert [(r.status, r.body) for r in refusals] == [(503, FULL)] * len(refusals)
        finally:
            for connection in held:
                connection.close()
        stored = await last_seq_of(
            nc.jetstream(),
            config.events_stream,
            f"seqstate.events.{namespace_for('refused-model', 'default', config.namespace)}.>",
        )
        assert stored == 0
    elapsed = asyncio.get_running_loop().time() - began
    first = said(output, r"WARNING seqstate\.http: refused a connection: 512 are open")
    more = said(output, r"WARNING seqstate\.http: refused (\d+) more connections over the bound")
    assert counted(first, more) == len(refusals)
    assert len(first) + len(more) <= 3 + elapsed / 10  # a line per 10 s at most, and a last
    assert said(output, "ERROR") == []


async def exchange_on(held: Held, calls: list[tuple[str, str, Any]]) -> list[Reply]:
    """``calls`` pipelined on a connection kept open, their answers in order."""
    held.writer.write(b"".join(request(*call) for call in calls))
    return [await read_reply(held.reader) for _ in calls]


def add_body(request_id: str, hashes: list[int], model: str = "Qwen/Qwen3-8B") -> dict[str, Any]:
    return {
        "model_name": model,
        "request_id": request_id,
        "worker_id": 1,
        "dp_rank": 0,
        "sequence_hashes": hashes,
    }


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_out_of_file_descriptors_refuses_with_a_503_and_never_stops_serve_http(
    nc: Client, nats_server: NatsServer, tmp_path: Path, loop: str
) -> None:
    """With 64 file descriptors (ulimit -n), fewer than its bound of connections needs,
    serve-http says so at start; once they are all taken, each new connection is answered 503
    (out of file descriptors) and closed, not dropped in silence (uvloop) nor left waiting
    (asyncio); the log says it in a line per ten seconds with counts, not a line per
    connection; and once connections close, new ones are served."""
    config = fresh_config("cf")
    output = tmp_path / "serve-http.log"
    refusals: list[Reply] = []
    began = asyncio.get_running_loop().time()
    async with serve_http(
        nats_server.url, config, "--event-loop", loop, output=output, descriptors=64
    ) as port:
        held: list[Held] = []
        try:
            while not refusals:
                connection = await attempt(port, refusals)
                if connection is not None:
                    held.append(connection)
            for _ in range(30):
                assert await attempt(port, refusals) is None
            assert len(held) >= 16  # what 64 descriptors leave for clients
            assert [r.body for r in refusals] == [OUT_OF_FDS] * 31
            for connection in held[:5]:
                connection.close()
            held[:5] = [await served(port, refusals) for _ in range(5)]
            for connection in held:
                assert (await connection.health()).status == 200
        finally:
            for connection in held:
                connection.close()
    elapsed = asyncio.get_running_loop().time() - began
    assert said(
        output,
        r"WARNING seqstate\.http: --http-max-connections 512 needs about \d+ file "
        r"descriptors, and this process may open 64 \(ulimit -n\)",
    )
    first = said(output, r"WARNING seqstate\.http: cannot accept connections: Too many open files")
    more = said(output, r"WARNING seqstate\.http: cannot accept connections: (\d+) more times")
    assert all(r.body == OUT_OF_FDS for r in refusals)
    assert counted(first, more) == len(refusals)
    assert len(first) + len(more) <= 3 + elapsed / 10  # a line per 10 s at most, and a last
    assert said(output, "ERROR") == []
    assert len(first) + len(more) < len(refusals)


async def tracker_rows(port: int, model: str) -> Reply:
    return (
        await exchange(port, [("GET", f"/loads?model_name={model}&routing_group=default", None)])
    )[0]


async def test_trackers_over_the_bound_are_400_and_an_ended_tracker_frees_its_room(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """``--max-trackers 3``: a fourth tracker's registration is 400 naming the bound, and
    nothing is stored; a worker more on a tracker served is no new tracker. Unregistering a
    tracker's last worker ends it: serve-http stops its pipeline, feed and view before
    answering, so the next new tracker is taken at once; registering and unregistering 20
    distinct trackers leaves the same consumers on the server as before."""
    config = fresh_config("ct")
    output = tmp_path / "serve-http.log"
    js = nc.jetstream()
    full = {
        "error": "no room for a new slot tracker for model=m3 routing_group=default: this "
        "server serves its bound of 3 trackers (--max-trackers); unregistering a tracker's "
        "last worker frees its room"
    }
    async with serve_http(nats_server.url, config, "--max-trackers", "3", output=output) as port:
        answers = await exchange(port, [register("m0"), register("m1"), register("m2")])
        assert [a.status for a in answers] == [201, 201, 201]
        answers = await exchange(
            port,
            [
                register("m3"),
                register("m0", worker=2),
                ("POST", "/add", add_body("r", [1], model="m3")),
            ],
        )
        assert answers == [
            (400, full),
            (201, {"status": "ok"}),
            (404, {"error": "no slot tracker for model=m3 routing_group=default"}),
        ]
        m3 = namespace_for("m3", "default", config.namespace)
        assert await last_seq_of(js, config.events_stream, f"seqstate.events.{m3}.>") == 0
        assert await bucket_values(nc, config.with_namespace(m3)) == {}

        # The last worker of m1 goes: its room is free once that is answered.
        assert await exchange(port, [unregister("m1")]) == [(200, {"status": "ok"})]
        assert await exchange(port, [register("m3")]) == [(201, {"status": "ok"})]
        assert rows(await tracker_rows(port, "m3")) == [("m3", 1, 0, 0, 0)]

        before = await consumers(nc, config)
        for n in range(20):
            model = f"churn{n}"
            # Each call once the one before it is answered: a pipelined call begins before
            # the one ahead of it has freed any room.
            answers = [
                *await exchange(port, [unregister("m3")]),
                *await exchange(
                    port,
                    [
                        register(model),
                        ("POST", "/add", add_body("c", [n], model=model)),
                        unregister(model),
                    ],
                ),
                *await exchange(port, [register("m3")]),
            ]
            assert [a.status for a in answers] == [200, 201, 201, 200, 201], (n, answers)
        await eventually(
            lambda: consumers(nc, config),
            lambda now: now <= before,
            what=f"the server's consumers back to the {before} there were before the churn",
            timeout=WAIT_S,
        )
        loads = (await exchange(port, [("GET", "/loads", None)]))[0]
        assert rows(loads) == [
            ("m0", 1, 0, 0, 0),
            ("m0", 2, 0, 0, 0),
            ("m2", 1, 0, 0, 0),
            ("m3", 1, 0, 0, 0),
        ]
    stopped = said(output, r"INFO seqstate\.slots: stopped serving tracker model=(\S+) ")
    assert sorted(m.group(1) for m in stopped) == sorted(
        ["m1", *(f"churn{n}" for n in range(20)), *["m3"] * 20]
    )


def unregister(model: str, worker: int = 1) -> tuple[str, str, Any]:
    return ("POST", "/unregister", {"model_name": model, "worker_id": worker})


async def consumers(nc: Client, config: Config) -> int:
    """Consumers on every stream a tracker is served from: the events, the deltas, the dead
    letters and the bucket's."""
    js = nc.jetstream()
    streams = (
        config.events_stream,
        config.deltas_stream,
        dead_letter_stream(config),
        f"KV_{config.registry_bucket}",
    )
    return sum([(await js.stream_info(stream)).state.consumer_count for stream in streams])


async def test_a_process_with_a_lower_bound_serves_up_to_it_and_answers_503_for_the_rest(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """Two processes of one deployment: A takes 4 trackers, B 2. Trackers registered through
    A beyond B's bound are left out by B, each said once in its log however often it is
    named; every call naming one, and an unfiltered read, is 503 from B (A answers them), a
    new tracker through B is 400. When a tracker B serves ends, B takes in the oldest one it
    left out. A third process with a bound of 1 says what it leaves out in one line."""
    config = fresh_config("cl")
    url = nats_server.url
    b_log, c_log = tmp_path / "b.log", tmp_path / "c.log"

    def not_served(model: str) -> tuple[int, dict[str, str]]:
        return 503, {
            "error": f"the slot tracker for model={model} routing_group=default is not served "
            "by this process: it serves its bound of 2 trackers (--max-trackers); call a "
            "serve-http with a higher bound"
        }

    async with (
        serve_http(url, config, "--max-trackers", "4") as a,
        serve_http(url, config, "--max-trackers", "2", output=b_log) as b,
    ):
        assert [r.status for r in await exchange(a, [register("m0"), register("m1")])] == [201] * 2
        for model in ("m0", "m1"):  # B serves these two (a read naming one opens it at once)
            assert rows(await tracker_rows(b, model)) == [(model, 1, 0, 0, 0)]
        assert [r.status for r in await exchange(a, [register("m2"), register("m3")])] == [201] * 2
        for _ in range(3):
            assert await tracker_rows(b, "m2") == not_served("m2")
        answers = await exchange(
            b,
            [
                ("POST", "/add", add_body("x", [1], model="m3")),
                ("POST", "/potential_loads", {"model_name": "m2", "sequence_hashes": [1]}),
                register("m2", worker=2),
                register("m9"),
                ("GET", "/loads", None),
                ("GET", "/workers?model_name=m3", None),
            ],
        )
        assert answers[:3] == [not_served("m3"), not_served("m2"), not_served("m2")]
        assert answers[3].status == 400 and "its bound of 2 trackers" in answers[3].body["error"]
        for read in answers[4:]:
            assert read.status == 503 and "(--max-trackers) and leaves out" in read.body["error"]
        assert rows((await exchange(a, [("GET", "/loads", None)]))[0]) == [
            (m, 1, 0, 0, 0) for m in ("m0", "m1", "m2", "m3")
        ]

        # m0 ends (through A): B stops it and takes in m2, the oldest it left out.
        unregister = ("POST", "/unregister", {"model_name": "m0", "worker_id": 1})
        assert (await exchange(a, [unregister]))[0] == (200, {"status": "ok"})
        await eventually(
            lambda: tracker_rows(b, "m2"),
            lambda reply: reply.status == 200,
            what="B serving m2 once m0 ended",
            timeout=WAIT_S,
        )
        assert rows(await tracker_rows(b, "m2")) == [("m2", 1, 0, 0, 0)]
        assert await tracker_rows(b, "m3") == not_served("m3")

        async with serve_http(url, config, "--max-trackers", "1", output=c_log) as c:
            assert (await exchange(c, [("GET", "/loads", None)]))[0].status == 503
    left_out = said(b_log, r"WARNING seqstate\.slots: not serving tracker model=(\S+) ")
    assert [m.group(1) for m in left_out] == ["m2", "m3"]
    assert [
        m.group(1)
        for m in said(b_log, r"INFO seqstate\.slots: stopped serving tracker model=(\S+) ")
    ] == ["m0"]
    summary = said(c_log, r"WARNING seqstate\.slots: not serving (\d+) trackers registered")
    assert [m.group(1) for m in summary] == ["2"]
