"""Talking to the servers a benchmark starts (``projector.nats.server.NatsServer`` and
``NatsCluster`` start them): free ports, a quiet client, and the end-of-run check that the
bucket equals a replay of the log."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def connect(url: str, name: str = "bench", max_reconnect_attempts: int = 0) -> Client:
    """A client that does not print a traceback per error, and by default gives up at once on
    a lost server: a benchmark does not ride out a fault."""

    async def quiet(exc: Exception) -> None:
        pass

    return await nats.connect(
        url, name=name, max_reconnect_attempts=max_reconnect_attempts, error_cb=quiet
    )


def stop(
    procs: Iterable[subprocess.Popen[bytes]], sig: int = signal.SIGTERM, timeout: float = 30.0
) -> None:
    """Signal every process still running, then wait for each; kill what outlives ``timeout``.
    All are signalled first so that they stop side by side, not one after another."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(sig)
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_version(nc: Client) -> str:
    """The version of the nats-server ``nc`` is connected to, as a report names it."""
    v = nc.connected_server_version
    return f"{v.major}.{v.minor}.{v.patch}"


def seqstate_command() -> list[str]:
    """``seqstate`` of this environment, as a user types it."""
    return [str(Path(sys.executable).parent / "seqstate")]


def replay_verify(url: str, *flags: str, cwd: Path | None = None) -> dict[str, Any]:
    """``seqstate replay --verify FLAGS`` against ``url``: exit 0 means the bucket equals a
    replay of the whole log; ``said`` is its last three lines."""
    done = subprocess.run(
        [*seqstate_command(), "replay", "--verify", "--no-progress", *flags],
        env={**os.environ, "NATS_URL": url},
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
    )
    said = (done.stdout + done.stderr).strip().splitlines()
    return {"exit": done.returncode, "said": said[-3:]}
