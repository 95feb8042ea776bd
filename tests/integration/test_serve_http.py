"""``seqstate serve-http`` as a Dynamo client meets it: a real process on a port, HTTP/1.1 over
a socket (pipelined too), a restart that loses no booking, and two processes on one stream that
answer alike."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from eventually import eventually
from http_kit import REPO, WAIT_S, exchange, free_port, request, rows, serve_http
from log_text import plain_lines
from nats.aio.client import Client
from pipeline_kit import fresh_config, name_flags, read_stream, run_cli, second_loopback

from projector.http.tracker_names import namespace_for
from projector.nats.server import NatsServer
from projector.write.log_fold import replay
from seqstate import Free, MarkPrefillCompleted, decode_event


async def test_a_dynamo_client_session_pipelined_over_one_connection(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("sh")
    m = {"model_name": "Qwen/Qwen3-8B"}
    where = "model=Qwen/Qwen3-8B routing_group=default"
    async with serve_http(nats_server.url, config) as port:
        answers = await exchange(
            port,
            [
                (
                    "POST",
                    "/register",
                    {**m, "worker_id": 3, "block_size": 16, "dp_start": 0, "dp_size": 2},
                ),
                (
                    "POST",
                    "/add",
                    {
                        **m,
                        "request_id": "a",
                        "worker_id": 3,
                        "dp_rank": 1,
                        "sequence_hashes": [11, -12, 13],
                        "new_isl_tokens": 200,
                    },
                ),
                (
                    "POST",
                    "/add",
                    {**m, "request_id": "a", "worker_id": 3, "dp_rank": 0, "sequence_hashes": [11]},
                ),
                (
                    "POST",
                    "/add",
                    {
                        **m,
                        "request_id": "b",
                        "worker_id": 3,
                        "dp_rank": 0,
                        "sequence_hashes": [11, -12],
                    },
                ),
                ("POST", "/prefill_complete", {**m, "request_id": "a"}),
                ("GET", "/loads", None),
                ("POST", "/free", {**m, "request_id": "nobody"}),
                ("GET", "/nowhere", None),
                ("GET", "/add", None),
            ],
        )
        assert [status for status, _ in answers] == [201, 201, 409, 201, 200, 200, 200, 404, 405]
        duplicate = (
            "Request a already exists (assigned to worker WorkerWithDpRank { "
            "worker_id: 3, dp_rank: 1 })"
        )
        assert answers[2][1] == {"error": duplicate}
        assert rows(answers[5]) == [("Qwen/Qwen3-8B", 3, 0, 0, 2), ("Qwen/Qwen3-8B", 3, 1, 0, 3)]
        assert answers[7][1] == {"error": "route not found"}
        answers = await exchange(
            port,
            [
                ("POST", "/unregister", {**m, "worker_id": 3}),
                (
                    "POST",
                    "/add",
                    {**m, "request_id": "c", "worker_id": 3, "dp_rank": 0, "sequence_hashes": []},
                ),
                ("GET", "/loads", None),
            ],
        )
        assert answers == [
            (200, {"status": "ok"}),
            (404, {"error": f"no slot tracker for {where}"}),
            (200, []),
        ]


async def test_a_restart_loses_no_booking_and_two_processes_answer_alike(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("sr")
    m = {"model_name": "llama"}
    async with serve_http(nats_server.url, config) as port:
        await exchange(
            port,
            [
                (
                    "POST",
                    "/register",
                    {**m, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1},
                ),
                (
                    "POST",
                    "/add",
                    {
                        **m,
                        "request_id": "k",
                        "worker_id": 1,
                        "dp_rank": 0,
                        "sequence_hashes": [1, 2],
                        "new_isl_tokens": 64,
                    },
                ),
            ],
        )
        before = rows((await exchange(port, [("GET", "/loads", None)]))[0])
    assert before == [("llama", 1, 0, 64, 2)]
    url = nats_server.url
    async with serve_http(url, config) as one, serve_http(url, config) as two:
        assert rows((await exchange(one, [("GET", "/loads", None)]))[0]) == before
        assert (await exchange(two, [("POST", "/free", {**m, "request_id": "k"})]))[0][0] == 200
        after = [rows((await exchange(p, [("GET", "/loads", None)]))[0]) for p in (two, one)]
        assert after == [[("llama", 1, 0, 0, 0)]] * 2


async def test_read_your_writes_holds_across_processes(nc: Client, nats_server: NatsServer) -> None:
    """A write answered by one process is in the next read of any other, at once: whichever
    of them holds the tracker's lease (answers from its fold) and whichever reads its view."""
    config = fresh_config("ry")
    m = {"model_name": "llama"}
    url = nats_server.url
    async with serve_http(url, config) as one, serve_http(url, config) as two:
        register = {**m, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
        assert (await exchange(one, [("POST", "/register", register)]))[0][0] == 201
        expected: list[tuple[Any, ...]] = []
        for n in range(20):
            writer, reader = (one, two) if n % 2 else (two, one)
            add = {
                **m,
                "request_id": f"r{n}",
                "worker_id": 1,
                "dp_rank": 0,
                "sequence_hashes": [n, n + 1],
                "new_isl_tokens": 16 * (n + 1),
            }
            assert (await exchange(writer, [("POST", "/add", add)]))[0][0] == 201
            loads = (await exchange(reader, [("GET", "/loads", None)]))[0]
            assert rows(loads)[0][3] == sum(16 * (k + 1) for k in range(n + 1)), (n, loads)
            potential = {**m, "sequence_hashes": [], "new_isl_tokens": 0}
            status, body = (await exchange(reader, [("POST", "/potential_loads", potential)]))[0]
            assert status == 200 and body[0]["active_requests"] == n + 1, (n, body)
            expected = rows(loads)
        assert rows((await exchange(one, [("GET", "/loads", None)]))[0]) == expected

        # A tracker registered through one process: a read naming it through the other sees
        # it at once; an unfiltered read, once the other's watch of the trackers has it.
        other = {
            "model_name": "qwen",
            "worker_id": 7,
            "block_size": 16,
            "dp_start": 0,
            "dp_size": 1,
        }
        assert (await exchange(one, [("POST", "/register", other)]))[0][0] == 201
        named = await exchange(two, [("GET", "/loads?model_name=qwen&routing_group=default", None)])
        assert rows(named[0]) == [("qwen", 7, 0, 0, 0)]
        fresh = [("qwen", 7, 0, 0, 0)]
        async with serve_http(url, config) as three:
            assert (await exchange(one, [("POST", "/register", {**other, "model_name": "q2"})]))[0][
                0
            ] == 201

            async def everything() -> list[tuple[Any, ...]]:
                return rows((await exchange(three, [("GET", "/loads", None)]))[0])

            await eventually(
                everything,
                lambda got: got == sorted([*expected, *fresh, ("q2", 7, 0, 0, 0)]),
                what="every tracker in an unfiltered /loads of a third process",
                timeout=WAIT_S,
                interval=0.05,
            )


async def _answers_on(address: str, port: int, token: str | None = None) -> bool:
    try:
        status, _ = (
            await exchange(port, [("GET", "/health", None)], address=address, token=token)
        )[0]
    except ConnectionRefusedError:
        return False
    return bool(status == 200)


@pytest.mark.skipif(not second_loopback(), reason="127.0.0.2 does not reach this host")
async def test_serve_http_listens_on_loopback_unless_asked(
    nc: Client, nats_server: NatsServer
) -> None:
    """serve-http listened on 0.0.0.0, so anyone who reached the host could book and
    free capacity. Now 127.0.0.1 by default; every address only on request, by flag or by
    variable."""
    config = fresh_config("sb")
    async with serve_http(nats_server.url, config, host=None) as port:
        assert await _answers_on("127.0.0.1", port)
        assert not await _answers_on("127.0.0.2", port)
    async with serve_http(nats_server.url, config, "--http-host", "0.0.0.0", host=None) as port:
        assert await _answers_on("127.0.0.2", port)
    env = {"SEQSTATE_HTTP_HOST": "0.0.0.0"}
    async with serve_http(nats_server.url, config, host=None, env=env) as port:
        assert await _answers_on("127.0.0.2", port)


async def test_with_a_token_a_call_without_it_is_401_and_changes_nothing(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """serve-http took no token. With one (variable, flag or file), every call that
    does not carry ``Authorization: Bearer <token>`` is 401 with a challenge, stores nothing,
    and does not disturb the calls pipelined around it; with the token, the contract is
    Dynamo's, unchanged."""
    config = fresh_config("st")
    m = {"model_name": "guarded"}
    secret = "tok-3f9a/+=~"
    reg = (
        "POST",
        "/register",
        {**m, "worker_id": 2, "block_size": 16, "dp_start": 0, "dp_size": 1},
    )
    add = {**m, "request_id": "a", "worker_id": 2, "dp_rank": 0, "sequence_hashes": [1, 2]}
    sneak = {**add, "request_id": "sneak", "sequence_hashes": [3, 4, 5]}
    env = {"SEQSTATE_HTTP_TOKEN": secret}
    async with serve_http(nats_server.url, config, env=env, token=secret) as port:
        refused = await exchange(port, [("GET", "/health", None), reg, ("GET", "/nowhere", None)])
        assert [r.status for r in refused] == [401, 401, 401]
        assert refused[0].headers["www-authenticate"].startswith("Bearer")
        assert "Bearer" in refused[0].body["error"]
        answers = await exchange(
            port,
            [
                request(*reg, token=secret),
                request("POST", "/add", sneak),  # no token
                request("POST", "/add", sneak, token="tok-3f9a/+=x"),  # a wrong one
                request("POST", "/add", sneak, authorization=f"Basic {secret}"),
                request("POST", "/add", sneak, authorization=f"Bearer  {secret} extra"),
                request("POST", "/add", add, token=secret),
                request("HEAD", "/loads"),  # no body in a 401 to HEAD: the stream stays in step
                request("GET", "/loads", authorization=f"bearer {secret}"),  # any case
            ],
        )
        assert [r.status for r in answers] == [201, 401, 401, 401, 401, 201, 401, 200]
        assert rows(answers[7]) == [("guarded", 2, 0, 0, 2)]  # the sneaked add is nowhere
        assert secret not in b"".join(r.raw for r in answers).decode()
    # The same token from a file (what a secret mount gives), and a token file that is no token.
    token_file = tmp_path / "token"
    token_file.write_text(f"{secret}\n")
    async with serve_http(
        nats_server.url, config, "--http-token-file", str(token_file), token=secret
    ) as port:
        assert (await exchange(port, [("GET", "/loads", None)]))[0].status == 401
        assert rows((await exchange(port, [("GET", "/loads", None)], token=secret))[0]) == [
            ("guarded", 2, 0, 0, 2)
        ]
    token_file.write_text("two words\n")
    done = await run_cli(
        config, nats_server.url, "serve-http", "--http-token-file", str(token_file)
    )
    assert done.returncode == 1 and "two words" not in done.stderr
    assert plain_lines(done.stderr) == [
        f"seqstate: error: --http-token-file/SEQSTATE_HTTP_TOKEN_FILE {token_file}: not a "
        "bearer token: use visible ASCII only, no spaces (it travels in an HTTP header)"
    ]


async def test_prefill_complete_and_free_are_logged_under_the_worker_that_holds_the_request(
    nc: Client, nats_server: NatsServer
) -> None:
    """/prefill_complete and /free name no worker, and serve-http published them
    under worker 0: the fold found the request by id but counted ``worker_mismatch``, and
    ``inspect``, which reads an active request's events on its rank's subject, never saw the
    Mark. Now each is published under the worker and rank that hold the request: one this
    process booked (pipelined right behind its add), and one another process booked (found
    in the bucket)."""
    config = fresh_config("sk")
    m = {"model_name": "holder"}
    ns = namespace_for("holder", "default", config.namespace)
    tracker = dataclasses.replace(config.with_namespace(ns), rules="slot-tracker")
    url = nats_server.url
    async with serve_http(url, config) as one:
        answers = await exchange(
            one,
            [
                (
                    "POST",
                    "/register",
                    {**m, "worker_id": 3, "block_size": 16, "dp_start": 0, "dp_size": 2},
                ),
                (
                    "POST",
                    "/add",
                    {
                        **m,
                        "request_id": "r",
                        "worker_id": 3,
                        "dp_rank": 1,
                        "sequence_hashes": [1, 2],
                        "new_isl_tokens": 100,
                    },
                ),
                ("POST", "/prefill_complete", {**m, "request_id": "r"}),
                (
                    "POST",
                    "/add",
                    {**m, "request_id": "s", "worker_id": 3, "dp_rank": 0, "sequence_hashes": [7]},
                ),
                ("GET", "/loads", None),
            ],
        )
        assert [a.status for a in answers] == [201, 201, 200, 201, 200], answers
        assert rows(answers[4]) == [("holder", 3, 0, 0, 1), ("holder", 3, 1, 0, 2)]
        done = await run_cli(tracker, url, "inspect", "request", "r", "--json")
        report = json.loads(done.stdout)
        assert (report["state"], report["detail"]) == ("active", "prefill done"), report
        assert (report["worker_id"], report["dp_rank"]) == (3, 1)
        assert [(e["type"], e["outcome"]) for e in report["events"]] == [
            ("AddRequest", "applied"),
            ("MarkPrefillCompleted", "applied"),
        ]
        assert (await exchange(one, [("POST", "/free", {**m, "request_id": "r"})]))[0].status == 200
        # Request s, booked by `one`, freed through another process: found in its bucket view.
        async with serve_http(url, config) as two:

            async def loads_of_two() -> list[tuple[Any, ...]]:
                return rows((await exchange(two, [("GET", "/loads", None)]))[0])

            await eventually(
                loads_of_two,
                lambda got: ("holder", 3, 0, 0, 1) in got,
                what="the other process's view with request s",
                timeout=WAIT_S,
                interval=0.05,
            )
            free = ("POST", "/free", {**m, "request_id": "s"})
            assert (await exchange(two, [free]))[0].status == 200
            assert rows((await exchange(two, [("GET", "/loads", None)]))[0]) == [
                ("holder", 3, 0, 0, 0),
                ("holder", 3, 1, 0, 0),
            ]
    logged = [
        (headers["subject"], decode_event(data))
        for _, headers, data in await read_stream(
            nc, config.events_stream, f"seqstate.events.{ns}.>"
        )
    ]
    ending = [(subject, e) for subject, e in logged if isinstance(e, (MarkPrefillCompleted, Free))]
    assert [(s, type(e).__name__, e.request_id, e.worker_id, e.dp_rank) for s, e in ending] == [
        (tracker.event_subject(3, 1), "MarkPrefillCompleted", "r", 3, 1),
        (tracker.event_subject(3, 1), "Free", "r", 3, 1),
        (tracker.event_subject(3, 0), "Free", "s", 3, 0),
    ]
    folded = await replay(nc, tracker)
    assert folded.state.counters["worker_mismatch"] == 0
    assert folded.state.counters["unknown_request"] == 0


async def test_a_worker_id_above_2_63_goes_through_serve_http_whole(
    nc: Client, nats_server: NatsServer
) -> None:
    """Dynamo's worker ids use all 64 bits: 2^64-1 is registered, booked on,
    loaded and freed through the HTTP API, and comes back exact in /loads and /workers,
    never through a float or a signed integer."""
    config = fresh_config("big")
    m = {"model_name": "wide"}
    top = 2**64 - 1
    async with serve_http(nats_server.url, config) as one:
        answers = await exchange(
            one,
            [
                (
                    "POST",
                    "/register",
                    {**m, "worker_id": top, "block_size": 16, "dp_start": 0, "dp_size": 1},
                ),
                (
                    "POST",
                    "/add",
                    {
                        **m,
                        "request_id": "q",
                        "worker_id": top,
                        "dp_rank": 0,
                        "sequence_hashes": [1, 2, 3],
                    },
                ),
                ("GET", "/loads", None),
                ("GET", "/workers", None),
                ("POST", "/free", {**m, "request_id": "q"}),
                ("GET", "/loads", None),
            ],
        )
    assert [a.status for a in answers] == [201, 201, 200, 200, 200, 200], answers
    assert rows(answers[2]) == [("wide", top, 0, 0, 3)]  # no prefill, 3 blocks
    assert str(top).encode() in answers[3].raw, answers[3]
    assert rows(answers[5]) == [("wide", top, 0, 0, 0)]


@pytest.mark.parametrize(
    ("flags", "loop"), [((), "uvloop"), (("--event-loop", "asyncio"), "asyncio")]
)
async def test_serve_http_runs_on_uvloop_unless_asked_for_asyncio(
    nats_server: NatsServer, flags: tuple[str, ...], loop: str
) -> None:
    """uvloop (the ``fast`` extra, which ``make`` installs) by default; stock asyncio
    on request, or where uvloop is not installed. Either serves the same pipelined session."""
    config = fresh_config("el")
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SEQSTATE_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "projector",
        "serve-http",
        "--port",
        str(port),
        *name_flags(config),
        *flags,
        env={**environ, "NATS_URL": nats_server.url},
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        assert proc.stdout is not None
        line = ""
        async with asyncio.timeout(WAIT_S):
            while "serving the slot-tracker API" not in line:
                raw = await proc.stdout.readline()
                assert raw, "serve-http exited before it served"
                line = raw.decode()
        assert f"{loop} event loop" in line, line
        m = {"model_name": "m/loop"}
        add = {**m, "request_id": "a", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [1, 2]}
        answers = await exchange(
            port,
            [
                (
                    "POST",
                    "/register",
                    {**m, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1},
                ),
                ("POST", "/add", add),
                ("POST", "/add", add),
                ("GET", "/loads", None),
                ("POST", "/free", {**m, "request_id": "a"}),
                ("GET", "/loads", None),
            ],
        )
        assert [a.status for a in answers] == [201, 201, 409, 200, 200, 200]
        assert rows(answers[3]) == [("m/loop", 1, 0, 0, 2)]
        assert rows(answers[5]) == [("m/loop", 1, 0, 0, 0)]
    finally:
        proc.terminate()
        assert await proc.wait() == 0
