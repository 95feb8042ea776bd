"""``seqstate serve-http`` as a Dynamo client meets it: a real process on a port, HTTP/1.1 over
a socket (pipelined too), a restart that loses no booking, and two processes on one stream that
answer alike."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

from nats.aio.client import Client
from pipeline_kit import REPO, fresh_config, name_flags

from projector.config import Config
from projector.server import NatsServer

WAIT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def serve_http(url: str, config: Config) -> AsyncIterator[int]:
    """``seqstate serve-http`` with its defaults but the port; yields the port once /health
    answers."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEQSTATE_")}
    env["NATS_URL"] = url
    proc = subprocess.Popen([sys.executable, "-m", "projector", "serve-http", "--host",
                             "127.0.0.1", "--port", str(port), *name_flags(config)], env=env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while True:
            assert proc.poll() is None, (proc.stdout.read() if proc.stdout else b"").decode()
            with contextlib.suppress(OSError):
                status, _ = (await exchange(port, [("GET", "/health", None)]))[0]
                if status == 200:
                    break
            assert asyncio.get_running_loop().time() < deadline, "serve-http did not answer"
            await asyncio.sleep(0.05)
        yield port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 20)
            except subprocess.TimeoutExpired:
                proc.kill()
        if proc.stdout is not None:
            proc.stdout.close()


async def exchange(port: int, calls: list[tuple[str, str, Any]]) -> list[tuple[int, Any]]:
    """Send every call on one connection at once (pipelined), then read the answers in order."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        out = b""
        for method, path, body in calls:
            data = b"" if body is None else json.dumps(body).encode()
            out += (f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(data)}\r\n"
                    + ("content-type: application/json\r\n" if body is not None else "")
                    + "\r\n").encode() + data  # fmt: skip
        writer.write(out)
        answers = []
        for _ in calls:
            status_line = await asyncio.wait_for(reader.readline(), WAIT_S)
            status = int(status_line.split()[1])
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            payload = await reader.readexactly(length)
            answers.append((status, json.loads(payload) if payload else None))
        return answers
    finally:
        writer.close()


def rows(answer: tuple[int, Any]) -> list[tuple[Any, ...]]:
    assert answer[0] == 200, answer
    return [(r["model_name"], r["worker_id"], r["dp_rank"], r["active_prefill_tokens"],
             r["active_decode_blocks"]) for r in answer[1]]  # fmt: skip


async def test_a_dynamo_client_session_pipelined_over_one_connection(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("sh")
    m = {"model_name": "Qwen/Qwen3-8B"}
    where = "model=Qwen/Qwen3-8B routing_group=default"
    async with serve_http(nats_server.url, config) as port:
        answers = await exchange(port, [
            ("POST", "/register", {**m, "worker_id": 3, "block_size": 16, "dp_start": 0,
                                   "dp_size": 2}),
            ("POST", "/add", {**m, "request_id": "a", "worker_id": 3, "dp_rank": 1,
                              "sequence_hashes": [11, -12, 13], "new_isl_tokens": 200}),
            ("POST", "/add", {**m, "request_id": "a", "worker_id": 3, "dp_rank": 0,
                              "sequence_hashes": [11]}),
            ("POST", "/add", {**m, "request_id": "b", "worker_id": 3, "dp_rank": 0,
                              "sequence_hashes": [11, -12]}),
            ("POST", "/prefill_complete", {**m, "request_id": "a"}),
            ("GET", "/loads", None),
            ("POST", "/free", {**m, "request_id": "nobody"}),
            ("GET", "/nowhere", None),
            ("GET", "/add", None),
        ])  # fmt: skip
        assert [status for status, _ in answers] == [201, 201, 409, 201, 200, 200, 200, 404, 405]
        duplicate = ("Request ID already exists (assigned to worker WorkerWithDpRank { "
                     "worker_id: 3, dp_rank: 1 })")  # fmt: skip
        assert answers[2][1] == {"error": duplicate}
        assert rows(answers[5]) == [("Qwen/Qwen3-8B", 3, 0, 0, 2), ("Qwen/Qwen3-8B", 3, 1, 0, 3)]
        assert answers[7][1] == {"error": "route not found"}
        answers = await exchange(port, [
            ("POST", "/unregister", {**m, "worker_id": 3}),
            ("POST", "/add", {**m, "request_id": "c", "worker_id": 3, "dp_rank": 0,
                              "sequence_hashes": []}),
            ("GET", "/loads", None),
        ])  # fmt: skip
        assert answers == [(200, {"status": "ok"}),
                           (404, {"error": f"no slot tracker for {where}"}), (200, [])]  # fmt: skip


async def test_a_restart_loses_no_booking_and_two_processes_answer_alike(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("sr")
    m = {"model_name": "llama"}
    async with serve_http(nats_server.url, config) as port:
        await exchange(port, [
            ("POST", "/register", {**m, "worker_id": 1, "block_size": 16, "dp_start": 0,
                                   "dp_size": 1}),
            ("POST", "/add", {**m, "request_id": "k", "worker_id": 1, "dp_rank": 0,
                              "sequence_hashes": [1, 2], "new_isl_tokens": 64}),
        ])  # fmt: skip
        before = rows((await exchange(port, [("GET", "/loads", None)]))[0])
    assert before == [("llama", 1, 0, 64, 2)]
    url = nats_server.url
    async with serve_http(url, config) as one, serve_http(url, config) as two:
        assert rows((await exchange(one, [("GET", "/loads", None)]))[0]) == before
        assert (await exchange(two, [("POST", "/free", {**m, "request_id": "k"})]))[0][0] == 200
        after = [rows((await exchange(p, [("GET", "/loads", None)]))[0]) for p in (two, one)]
        assert after[0] == [("llama", 1, 0, 0, 0)]
        # The other process shows it once its view has it: read-your-writes is per process.
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while after[1] != after[0]:
            assert asyncio.get_running_loop().time() < deadline, after
            await asyncio.sleep(0.05)
            after[1] = rows((await exchange(one, [("GET", "/loads", None)]))[0])
