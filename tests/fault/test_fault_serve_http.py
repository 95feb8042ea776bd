"""A ``serve-http`` process that runs a tracker's writer and projector is SIGKILLed in
the middle of a pipelined run while a second one serves on; the second takes the tracker over,
the first comes back, and in the end both answer ``/loads`` as one uninterrupted fold of the
log says, and the bucket holds exactly what that fold's deltas write.

And nats-server itself SIGKILLed under a serving process: /health and /readyz say not ready
while it is away, ready once it is back, and calls are answered again, with nothing lost. A
process whose credentials the server stops accepting cannot go on: it exits, in one line."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import signal
from pathlib import Path
from typing import Any

import pytest
from eventually import eventually
from fault_kit import BUSY, bucket_position, fault_config, fold_differences, fold_log
from http_kit import RUNNING, exchange, free_port, http_get, kill, request, rows, serve_http
from log_text import plain_lines
from nats.aio.client import Client
from pipeline_kit import bucket_values

from projector.http.tracker_names import namespace_for
from projector.nats.server import NatsServer
from projector.wire.values import position_key

M = "Qwen/Qwen3-8B"
WORKERS = 4


def calls(seed: int, n: int) -> list[tuple[str, str, dict[str, Any]]]:
    """Adds sharing prefixes, duplicate adds, marks and frees (some of ids never added)."""
    rng = random.Random(seed)
    prefixes = [[rng.getrandbits(63) for _ in range(rng.randint(1, 6))] for _ in range(5)]
    out: list[tuple[str, str, dict[str, Any]]] = []
    live: list[str] = []
    for i in range(n):
        roll = rng.random()
        if roll < 0.45 or not live:
            rid = rng.choice(live) if live and rng.random() < 0.1 else f"r{seed}-{i}"
            hashes = rng.choice(prefixes) + [rng.getrandbits(63) for _ in range(rng.randint(0, 3))]
            out.append(
                (
                    "POST",
                    "/add",
                    {
                        "model_name": M,
                        "request_id": rid,
                        "worker_id": rng.randrange(WORKERS),
                        "dp_rank": rng.randrange(2),
                        "sequence_hashes": hashes,
                        "new_isl_tokens": rng.choice([0, 16, 384]),
                    },
                )
            )
            live.append(rid)
        elif roll < 0.65:
            body = {"model_name": M, "request_id": rng.choice([*live, "never"])}
            out.append(("POST", "/prefill_complete", body))
        else:
            rid = live.pop(rng.randrange(len(live))) if rng.random() < 0.9 else "ghost"
            out.append(("POST", "/free", {"model_name": M, "request_id": rid}))
    return out


async def send_then_kill(port: int, chunk: list[tuple[str, str, dict[str, Any]]]) -> None:
    """Pipeline ``chunk`` to ``port`` and SIGKILL the process once its first answer is back:
    the rest are stored, half-done or never read, wherever the kill finds them."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"".join(request(*call) for call in chunk))
        await writer.drain()
        assert (await reader.readline()).startswith(b"HTTP/1.1 ")
        kill(port)
    finally:
        writer.close()


@pytest.mark.parametrize("seed", [1, 2])
async def test_a_killed_serving_process_leaves_the_ledger_a_replay_of_the_log(
    nc: Client, nats_server: NatsServer, seed: int
) -> None:
    config = fault_config("fh")
    tracker = dataclasses.replace(
        config.with_namespace(namespace_for(M, "default", config.namespace)),
        rules="slot-tracker",
        worker_grace_s=0.0,
    )
    work = calls(seed, 400)
    chunks = [work[i : i + 25] for i in range(0, len(work), 25)]
    url = nats_server.url
    async with serve_http(url, config) as first, serve_http(url, config) as second:
        registered = await exchange(
            first,
            [
                (
                    "POST",
                    "/register",
                    {
                        "model_name": M,
                        "worker_id": w,
                        "block_size": 16,
                        "dp_start": 0,
                        "dp_size": 2,
                    },
                )
                for w in range(WORKERS)
            ],
        )
        assert [r.status for r in registered] == [201] * WORKERS
        # The first registered the tracker, so it runs its writer and projector: kill it with
        # a chunk in flight, while the second goes on (and takes the tracker over).
        for n, chunk in enumerate(chunks[:4]):
            assert all(
                r.status in (200, 201, 404, 409)
                for r in await exchange((first, second)[n % 2], chunk)
            )
        await send_then_kill(first, chunks[4])
        for chunk in chunks[5:10]:
            assert all(r.status in (200, 201, 404, 409) for r in await exchange(second, chunk))
    async with serve_http(url, config) as again, serve_http(url, config) as other:
        for n, chunk in enumerate(chunks[10:]):
            assert all(
                r.status in (200, 201, 404, 409)
                for r in await exchange((again, other)[n % 2], chunk)
            )
        fold = await fold_log(nc, tracker)
        fold.state.sync_registry()
        want = [
            (M, r.worker_id, r.dp_rank, r.active_prefill_tokens, r.active_blocks)
            for r in fold.state.registry.loads(fold.last_ns)
        ]
        assert len(want) == 2 * WORKERS and any(row[4] for row in want)
        js = nc.jetstream()
        await eventually(
            lambda: bucket_position(js, tracker),
            lambda p: p.applied_seq == fold.last,
            what="the bucket at the log's last event",
            retry_on=BUSY,
        )
        for port in (again, other):

            async def loads_of(port: int = port) -> list[tuple[Any, ...]]:
                return rows((await exchange(port, [("GET", "/loads", None)]))[0])

            assert (
                await eventually(loads_of, lambda got: got == want, what=f"/loads on {port}")
                == want
            )
    values = await bucket_values(nc, tracker)
    values.pop(position_key(tracker.namespace))
    image = fold.image.everything()
    image.pop(position_key(tracker.namespace), None)
    assert fold_differences(image, values) == ""


async def test_serve_http_is_not_ready_while_nats_is_away_and_serves_again_after(
    tmp_path: Path,
) -> None:
    server = NatsServer(tmp_path / "store")
    server.start()  # its port is kept across restarts, so serve-http finds it again
    config = fault_config("fn")
    metrics = free_port()
    m = {"model_name": M}

    def add(rid: str) -> tuple[str, str, dict[str, Any]]:
        body = {**m, "request_id": rid, "worker_id": 0, "dp_rank": 0, "sequence_hashes": [1, 2]}
        return ("POST", "/add", body)

    async def health(port: int) -> Any:
        return (await exchange(port, [("GET", "/health", None)]))[0]

    async def ready() -> tuple[int, str]:
        status, _, why = await http_get(metrics, "/readyz")
        return status, why

    try:
        async with serve_http(server.url, config, "--metrics-port", str(metrics)) as port:
            register = {**m, "worker_id": 0, "block_size": 16, "dp_start": 0, "dp_size": 1}
            answers = await exchange(port, [("POST", "/register", register), add("before")])
            assert [a.status for a in answers] == [201, 201]
            await eventually(ready, lambda r: r[0] == 200, what="/readyz ready at first")

            server.kill()
            down = await eventually(
                lambda: health(port), lambda r: r.status == 503, what="/health while NATS is away"
            )
            assert down.body == {"error": "not ready: NATS is disconnected (reconnecting)"}
            assert await ready() == (503, "nats: disconnected\n")
            # A call that needs NATS is 503 naming it, never a 500 "internal error" (with a
            # traceback in the log): here the registration of a tracker not served yet.
            new = {**register, "model_name": f"{M}-new"}
            (refused,) = await exchange(port, [("POST", "/register", new)])
            assert refused.status == 503, refused
            assert refused.body == {
                "error": "NATS failed the call: nats: timeout (NATS is disconnected, reconnecting)"
            }, refused

            server.start()
            await eventually(
                lambda: health(port), lambda r: r == (200, None), what="/health once NATS is back"
            )
            await eventually(ready, lambda r: r == (200, "ready\n"), what="/readyz once back")
            answers = await exchange(
                port,
                [
                    add("after"),
                    ("POST", "/free", {**m, "request_id": "before"}),
                    ("GET", "/loads", None),
                ],
            )
            assert [a.status for a in answers] == [201, 200, 200], answers
            assert rows(answers[2]) == [(M, 0, 0, 0, 2)]
    finally:
        server.stop()


async def test_serve_http_exits_in_one_line_when_its_credentials_are_revoked(
    tmp_path: Path,
) -> None:
    """No reconnect can mend a refusal of the credentials: serve-http must not look alive
    without NATS (its /health answering 200 to nobody's benefit), it exits non-zero."""
    conf = tmp_path / "users.conf"
    users = (
        'server_name: seqstate\nauthorization {{ users = [ {{user: "svc", password: "{}"}} ] }}\n'
    )
    conf.write_text(users.format("first"))
    server = NatsServer(tmp_path / "store", extra_args=("-c", str(conf)))
    server.start()
    try:
        url = server.url.replace("nats://", "nats://svc:first@")
        async with serve_http(url, fault_config("fc")) as port:
            proc = RUNNING[port]
            conf.write_text(users.format("next"))
            assert server._proc is not None
            server._proc.send_signal(signal.SIGHUP)  # reload: the password has changed
            await eventually(lambda: proc.poll(), lambda rc: rc is not None, what="exited")
            assert proc.returncode == 1
            assert proc.stdout is not None
            lines = plain_lines(proc.stdout.read().decode())
            assert lines[-1] == (
                "seqstate: error: NATS closed the connection for good (nats: authorization "
                "failed): serve-http cannot go on"
            ), lines
    finally:
        server.stop()
