"""The CLI's logs as a pipeline collects them: stderr piped, so ``auto`` means JSON lines.

Each command is run as an operator types it (``python -m projector``, the ``seqstate`` entry
point's module) against the test nats-server, with no setting from this process's environment.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from pipeline_kit import fresh_config, name_flags

from projector.nats.server import NatsServer
from projector.settings.config import Config

REPO = Path(__file__).resolve().parents[2]
EVENTS = [
    {"type": "WorkerAdded", "worker_id": 0},
    {
        "type": "AddRequest",
        "request_id": "r1",
        "worker_id": 0,
        "block_hashes": [11, 12],
        "prefill_tokens": 100,
    },
    {
        "type": "AddRequest",
        "request_id": "r1",
        "worker_id": 0,
        "block_hashes": [11, 12],
        "prefill_tokens": 100,
    },  # a duplicate: the writer's DEBUG line names it
]
WAIT_S = 30.0


def env_for(url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL" and not k.startswith("SEQSTATE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["NATS_URL"] = url
    env.update(extra)
    return env


async def seqstate(*args: str, url: str, stdin: bytes = b"", **env: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "projector",
        *args,
        env=env_for(url, **env),
        cwd=REPO,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def logged_events(nc: Client, config: Config, url: str) -> int:
    """The events above, by ``seqstate publish``, then a message that is no event at all;
    returns the malformed one's stream sequence."""
    lines = "\n".join(json.dumps(e) for e in EVENTS).encode()
    code, _, err = await seqstate("publish", *name_flags(config), url=url, stdin=lines)
    assert code == 0, err
    ack = await nc.jetstream().publish(config.event_subject(0), b"\x00 not an event\nat all")
    return ack.seq


async def writer_stderr(config: Config, url: str, *flags: str, until: str, **env: str) -> str:
    """Run ``seqstate writer`` (at DEBUG) until its stderr has a line with ``until``, stop it
    with SIGTERM as an operator would, and return everything it wrote to stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "projector",
        "writer",
        *name_flags(config),
        "--log-level",
        "debug",
        *flags,
        env=env_for(url, **env),
        cwd=REPO,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        async with asyncio.timeout(WAIT_S):
            while not any(until in line for line in seen):
                line = await proc.stderr.readline()
                assert line, f"the writer exited early:\n{''.join(seen)}"
                seen.append(line.decode())
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        rest, _ = await asyncio.wait_for(proc.communicate(), WAIT_S)
    assert proc.returncode == 0, "".join(seen)
    return "".join(seen) + rest.decode()


def records(stderr: str) -> list[dict[str, Any]]:
    """Every line of ``stderr`` parsed: each one must be a JSON object."""
    out = []
    for line in stderr.splitlines():
        record = json.loads(line)
        assert isinstance(record, dict), line
        assert {"ts", "level", "logger", "msg"} <= record.keys(), line
        out.append(record)
    return out


async def test_a_piped_writer_logs_json_lines_with_their_context(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("lgj")
    bad_seq = await logged_events(nc, config, nats_server.url)
    stderr = await writer_stderr(config, nats_server.url, until="dead letter")
    found = records(stderr)
    dead = [r for r in found if r["msg"].startswith("dead letter")]
    assert len(dead) == 1, found
    assert dead[0]["level"] == "warning" and dead[0]["logger"] == "seqstate.dead"
    assert dead[0]["stream_seq"] == bad_seq and dead[0]["namespace"] == config.namespace
    assert "not an event" not in dead[0]["msg"]  # its size, never its payload
    duplicate = [r for r in found if "duplicate" in r["msg"]]
    assert len(duplicate) == 1, found
    assert duplicate[0]["level"] == "debug" and duplicate[0]["logger"] == "seqstate.writer"
    assert duplicate[0]["request_id"] == "r1" and duplicate[0]["worker"] == 0
    assert duplicate[0]["stream_seq"] == bad_seq - 1  # the second add, just before it
    assert duplicate[0]["router_id"].startswith("cli-")
    for record in found:  # never a block hash, never a payload
        assert "block_hashes" not in record and "11, 12" not in record["msg"]


async def test_console_logs_piped_are_plain_single_lines(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("lgc")
    await logged_events(nc, config, nats_server.url)
    stderr = await writer_stderr(
        config, nats_server.url, "--log-format", "console", until="dead letter"
    )
    lines = stderr.splitlines()
    assert lines
    for line in lines:
        assert not line.startswith("{"), line
        assert "\x1b" not in line, line  # no colour off a terminal
    duplicate = [line for line in lines if "duplicate" in line]
    assert len(duplicate) == 1, stderr
    assert " DEBUG   seqstate.writer: " in duplicate[0]
    assert "request_id=r1 worker=0" in duplicate[0]


async def test_the_final_error_is_a_json_record_under_json(nats_server: NatsServer) -> None:
    unreachable = "nats://127.0.0.1:1"
    for env in ({}, {"SEQSTATE_LOG_FORMAT": "json"}):
        code, out, err = await seqstate("status", url=unreachable, **env)
        assert code == 1 and out == ""
        lines = err.splitlines()
        assert len(lines) == 1, err
        record = json.loads(lines[0])
        assert record["level"] == "error" and record["logger"] == "seqstate"
        assert record["msg"].startswith("cannot reach NATS at nats://127.0.0.1:1")
    # The flag wins over the variable; console keeps the plain line.
    code, _, err = await seqstate(
        "status", "--log-format", "console", url=unreachable, SEQSTATE_LOG_FORMAT="json"
    )
    assert code == 1 and err.startswith("seqstate: error: cannot reach NATS"), err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (("--log-format", "xml"), {}, "'xml' is not a log format"),
        ((), {"SEQSTATE_LOG_FORMAT": "xml"}, "'xml' is not a log format"),
        (("--log-level", "loud"), {}, "'loud' is not a log level"),
        (
            (),
            {"SEQSTATE_LOG_LEVEL": "loud"},
            "'loud' is not a log level (one of debug, info, "
            "warning, error; from --log-level or SEQSTATE_LOG_LEVEL)",
        ),
    ],
)
async def test_a_bad_log_setting_is_one_usage_line(
    nats_server: NatsServer, args: tuple[str, ...], env: dict[str, str], said: str
) -> None:
    code, _, err = await seqstate("status", *args, url=nats_server.url, **env)
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and said in lines[0], err
