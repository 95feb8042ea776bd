"""The ``seqstate`` command line as an operator runs it: subprocesses against real servers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from nats.aio.client import Client
from pipeline_kit import fresh_config

from projector.bucket import read_bucket
from projector.config import Config
from projector.pipeline import Pipeline
from projector.server import NatsServer
from seqstate import decode_deltas

REPO = Path(__file__).resolve().parents[2]


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k != "NATS_URL" and not k.startswith("SEQSTATE_")}  # fmt: skip
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def seqstate(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "projector", *args], capture_output=True,
                          text=True, timeout=timeout, env=cli_env(**env), cwd=REPO)  # fmt: skip


async def aseqstate(*args: str, stdin: bytes = b"", **env: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "projector", *args, env=cli_env(**env), cwd=REPO,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    return proc.returncode or 0, out.decode(), err.decode()


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("seqstate: error: ")
    return lines[0]


def test_run_demo_for_ten_seconds_fills_the_bucket(tmp_path: Path) -> None:
    store = tmp_path / "store"
    result = seqstate("run", "--demo", "--duration", "10", "--no-live", "--workers", "4",
                      "--store-dir", str(store), "--log-level", "warning", timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = [line for line in result.stdout.splitlines() if line.startswith("demo: routed")]
    assert summary, result.stdout
    routed = int(summary[0].split()[2])
    assert routed > 10

    async def inspect() -> tuple[set[tuple[int, int]], dict[int, int], int, int]:
        import nats

        async with NatsServer(store) as server:
            nc = await nats.connect(server.url)
            try:
                js = nc.jetstream()
                # nats-py's kv.keys() can miss values right after a server start: its end
                # marker may overtake them. read_bucket waits for the last pending one.
                bucket = await read_bucket(nc, Config())
                ranks = set(bucket.loads)
                position = bucket.position
                assert position is not None
                events = await js.stream_info("SEQSTATE_EVENTS")
                deltas = await js.stream_info("SEQSTATE_DELTAS")
                peak: dict[int, int] = {}
                for seq in range(deltas.state.first_seq, deltas.state.last_seq + 1):
                    raw = (await js.get_msg("SEQSTATE_DELTAS", seq)).data or b""
                    for change in (c for d in decode_deltas(raw) for c in d.changes):
                        w = change.rank[0]
                        peak[w] = max(peak.get(w, 0), change.load.active_requests)
                return ranks, peak, position.applied_seq, events.state.last_seq
            finally:
                await nc.close()

    ranks, peak, applied, last = asyncio.run(inspect())
    assert ranks == {(w, 0) for w in range(4)}
    assert all(peak.get(w, 0) > 0 for w in range(4)), peak  # every demo worker carried load
    assert applied == last  # the bucket reflects the whole log, the drain's frees included


def test_bad_flag_is_one_line_and_exit_2() -> None:
    result = seqstate("run", "--no-such-flag")
    assert result.returncode == 2
    assert "--no-such-flag" in one_line_error(result)


def test_missing_trace_is_one_line() -> None:
    line = one_line_error(seqstate("run", "--demo", "--trace", "/nonexistent/trace.jsonl"))
    assert "/nonexistent/trace.jsonl" in line


def test_unreachable_nats_is_one_line() -> None:
    line = one_line_error(seqstate("loads", NATS_URL="nats://127.0.0.1:1"))
    assert "cannot reach NATS at nats://127.0.0.1:1" in line


def test_bad_setting_is_one_line() -> None:
    line = one_line_error(seqstate("writer", "--flush-interval-s", "soon"))
    assert "SEQSTATE_FLUSH_INTERVAL_S" in line


def test_missing_publish_file_is_one_line(nats_server: NatsServer) -> None:
    line = one_line_error(seqstate("publish", "/nonexistent.jsonl", NATS_URL=nats_server.url))
    assert "/nonexistent.jsonl" in line


async def test_publish_then_loads_and_status(nc: Client, nats_server: NatsServer) -> None:
    config = fresh_config("c")
    flags = ["--namespace", config.namespace, "--events-stream", config.events_stream,
             "--deltas-stream", config.deltas_stream, "--registry-bucket",
             config.registry_bucket]  # fmt: skip
    lines = [
        {"type": "WorkerAdded", "worker_id": 3, "dp_size": 2},
        {"type": "AddRequest", "request_id": "a", "worker_id": 3, "dp_rank": 1,
         "block_hashes": [1, 2, 3], "prefill_tokens": 40},
        {"type": "AddRequest", "request_id": "b", "worker_id": 3, "block_hashes": [1, 2]},
        {"type": "Free", "request_id": "b", "worker_id": 3},
    ]  # fmt: skip
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
        assert [(r["worker_id"], r["dp_rank"], r["active_requests"], r["active_blocks"])
                for r in rows] == [(3, 0, 0, 0), (3, 1, 1, 3)]  # fmt: skip
        rc, out, err = await aseqstate("status", "--json", *flags, NATS_URL=nats_server.url)
        assert rc == 0, err
        status = json.loads(out)
        assert status["applied_seq"] == 4 and status["lag_events"] == 0 and status["ranks"] == 2
        assert status["streams"][0]["last_seq"] == 4
        rc, out, err = await aseqstate("status", *flags, NATS_URL=nats_server.url)
        assert rc == 0 and "lag: 0 events behind the log" in out


async def test_publish_rejects_an_invalid_line_naming_it(nats_server: NatsServer) -> None:
    stdin = b'{"type": "Free", "request_id": "x", "worker_id": 1}\n{"type": "Nope"}\n'
    rc, _, err = await aseqstate("publish", stdin=stdin, NATS_URL=nats_server.url)
    assert rc == 1 and err.startswith("seqstate: error: stdin:2: not an event")


@pytest.mark.parametrize("command", ["loads", "status"])
async def test_reads_of_a_missing_bucket_fail_clearly(
    nats_server: NatsServer, command: str
) -> None:
    rc, out, err = await aseqstate(command, "--registry-bucket", "never-made",
                                   NATS_URL=nats_server.url)  # fmt: skip
    if command == "loads":
        assert rc == 1 and "never-made" in err and "Traceback" not in err
    else:
        assert rc == 0 and "never-made: missing" in out


def test_run_demo_replays_a_mooncake_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [{"timestamp": t, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2 + i]}
             for i, t in enumerate([0, 10, 20, 30])]  # fmt: skip
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    result = seqstate("run", "--demo", "--trace", str(trace), "--speedup", "1", "--no-live",
                      "--workers", "2", "--store-dir", str(tmp_path / "store"), "--duration",
                      "30", "--log-level", "warning", timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    # The trace ends: the demo stops by itself, every request routed and completed.
    assert "demo: routed 4 requests (4 completed" in result.stdout, result.stdout
