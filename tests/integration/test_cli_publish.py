"""``seqstate publish`` and the commands that read what it stored (``loads``, ``status``),
as an operator runs them: subprocesses against a real server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from cli_kit import one_line_error
from log_text import plain_lines
from nats.aio.client import Client
from nats.js.errors import NotFoundError
from pipeline_kit import REPO, cli_env, fresh_config, name_flags, seqstate

from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.wire.values import Position, encode_position, position_key


async def aseqstate(*args: str, stdin: bytes = b"", **env: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "projector",
        *args,
        env=cli_env(**env),
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    return proc.returncode or 0, out.decode(), err.decode()


def test_missing_publish_file_is_one_line(nats_server: NatsServer) -> None:
    line = one_line_error(seqstate("publish", "/nonexistent.jsonl", NATS_URL=nats_server.url))
    assert "/nonexistent.jsonl" in line


async def test_publish_then_loads_and_status(nc: Client, nats_server: NatsServer) -> None:
    config = fresh_config("c")
    flags = name_flags(config)
    lines = [
        {"type": "WorkerAdded", "worker_id": 3, "dp_size": 2},
        {
            "type": "AddRequest",
            "request_id": "a",
            "worker_id": 3,
            "dp_rank": 1,
            "block_hashes": [1, 2, 3],
            "prefill_tokens": 40,
        },
        {"type": "AddRequest", "request_id": "b", "worker_id": 3, "block_hashes": [1, 2]},
        {"type": "Free", "request_id": "b", "worker_id": 3},
    ]
    stdin = "\n".join(json.dumps(line) for line in lines).encode()
    async with Pipeline(nc, config) as pipeline:
        rc, out, err = await aseqstate(
            "publish", "-", *flags, stdin=stdin, NATS_URL=nats_server.url
        )
        assert rc == 0, err
        assert out.strip() == "published 4 events, last sequence 4"
        await pipeline.wait_applied(4)
        rc, out, err = await aseqstate("loads", "--json", *flags, NATS_URL=nats_server.url)
        assert rc == 0, err
        rows = [json.loads(line) for line in out.splitlines()]
        assert [
            (r["worker_id"], r["dp_rank"], r["active_requests"], r["active_blocks"]) for r in rows
        ] == [(3, 0, 0, 0), (3, 1, 1, 3)]
        rc, out, err = await aseqstate("status", "--json", *flags, NATS_URL=nats_server.url)
        assert rc == 0, err
        status = json.loads(out)
        assert status["applied_seq"] == 4 and status["lag_events"] == 0 and status["ranks"] == 2
        assert status["streams"][0]["last_seq"] == 4
        rc, out, err = await aseqstate("status", *flags, NATS_URL=nats_server.url)
        assert rc == 0 and "lag: 0 events behind the log" in out


@pytest.mark.parametrize(
    ("line", "said"),
    [
        (
            '{"type":"AddRequest","request_id":"t","worker_id":5,"block_hashes":[1],'
            '"prefil_tokens":500}',
            "stdin:1: not an event: Object contains unknown field `prefil_tokens`",
        ),
        (
            '{"type":"AddRequest","request_id":"t","worker_id":5,'
            '"block_hashes":[18446744073709551616]}',
            "stdin:1: not an event: invalid event: 18446744073709551616 does not fit in 64 bits - "
            "at `$.block_hashes[0]`",
        ),
    ],
)
async def test_publish_names_a_typo_or_an_overflow_and_publishes_nothing(
    nats_server: NatsServer, line: str, said: str
) -> None:
    config = fresh_config("t")
    rc, out, err = await aseqstate(
        "publish",
        "--namespace",
        config.namespace,
        "--events-stream",
        config.events_stream,
        stdin=line.encode(),
        NATS_URL=nats_server.url,
    )
    assert (rc, out) == (1, "")
    assert plain_lines(err) == [f"seqstate: error: {said}"]


async def test_publish_refuses_an_event_too_large_to_store_and_sends_nothing(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("t")
    small = '{"type": "Free", "request_id": "x", "worker_id": 1}'
    huge = json.dumps(
        {
            "type": "AddRequest",
            "request_id": "huge",
            "worker_id": 1,
            "block_hashes": list(range(2**62, 2**62 + 120_000)),
        }
    )
    rc, out, err = await aseqstate(
        "publish",
        "--namespace",
        config.namespace,
        "--events-stream",
        config.events_stream,
        "--router-id",
        "cli-test",
        NATS_URL=nats_server.url,
        stdin=f"{small}\n{huge}\n".encode(),
    )
    assert (rc, out) == (1, "")
    assert plain_lines(err) == [
        "seqstate: error: stdin:2: AddRequest for request 'huge': 1,080,083 bytes encoded, over "
        "the 1,043,456 bytes one event may take (the server's max_payload of 1,048,576 less 5,120 "
        "for its delta); it was not sent"
    ]
    with pytest.raises(NotFoundError):  # not even the stream was made: nothing was sent
        await nc.jetstream().stream_info(config.events_stream)


async def test_publish_counts_in_words(nats_server: NatsServer) -> None:
    config = fresh_config("w")
    line = b'{"type": "Free", "request_id": "x", "worker_id": 1}\n'
    rc, out, err = await aseqstate(
        "publish",
        "--namespace",
        config.namespace,
        "--events-stream",
        config.events_stream,
        NATS_URL=nats_server.url,
        stdin=line,
    )
    assert rc == 0, err
    assert out.strip() == "published 1 event, last sequence 1"


async def test_status_never_shows_a_negative_lag(nc: Client, nats_server: NatsServer) -> None:
    config = fresh_config("c")
    flags = name_flags(config)
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="lag", config=config)
        await pipeline.wait_applied(await pub.add("a", 1))
    # A position no fold of this log could have written (once shown as `lag: -999...`).
    kv = await nc.jetstream().key_value(config.registry_bucket)
    await kv.put(position_key(config.namespace), encode_position(Position(10**12, 0, 1)))
    rc, out, err = await aseqstate("status", "--json", *flags, NATS_URL=nats_server.url)
    assert rc == 0, err
    report = json.loads(out)
    assert (report["lag_events"], report["position_beyond_log"]) == (0, True)
    rc, out, err = await aseqstate("status", *flags, NATS_URL=nats_server.url)
    assert rc == 0 and "is beyond the log's newest event" in out and "lag: -" not in out


async def test_publish_rejects_an_invalid_line_naming_it(nats_server: NatsServer) -> None:
    stdin = b'{"type": "Free", "request_id": "x", "worker_id": 1}\n{"type": "Nope"}\n'
    rc, _, err = await aseqstate("publish", stdin=stdin, NATS_URL=nats_server.url)
    assert rc == 1 and plain_lines(err)[0].startswith("seqstate: error: stdin:2: not an event")


@pytest.mark.parametrize("command", ["loads", "status"])
async def test_reads_of_a_missing_bucket_fail_clearly(
    nats_server: NatsServer, command: str
) -> None:
    rc, out, err = await aseqstate(
        command, "--registry-bucket", "never-made", NATS_URL=nats_server.url
    )
    if command == "loads":
        assert rc == 1 and "never-made" in err and "Traceback" not in err
    else:
        assert rc == 0 and "never-made: missing" in out
