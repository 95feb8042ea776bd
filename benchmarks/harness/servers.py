"""Talking to the servers a benchmark starts (``projector.nats.server.NatsServer`` and
``NatsCluster`` start them): free ports, a quiet client, and the end-of-run check that the
bucket equals a replay of the log."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client

from harness.report import REPO_ROOT


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


def seqstate_env(url: str, **settings: str) -> dict[str, str]:
    """This environment for a ``seqstate`` process against ``url``, without the caller's own
    ``SEQSTATE_*`` settings: a figure depends only on what the benchmark sets (``settings``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEQSTATE_")}
    return {**env, "NATS_URL": url, **settings}


def start_seqstate(
    args: Sequence[str], url: str, log: Path | None = None, **settings: str
) -> subprocess.Popen[bytes]:
    """``seqstate ARGS`` against ``url`` in a process of its own, as deployed; what it writes
    goes to ``log`` (nowhere if None). Stop it with :func:`stop`."""
    out = log.open("wb") if log is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            [*seqstate_command(), *args],
            env=seqstate_env(url, **settings),
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )
    finally:
        if log is not None:
            out.close()  # type: ignore[union-attr]


def replay_verify(url: str, *flags: str) -> dict[str, Any]:
    """``seqstate replay --verify FLAGS`` against ``url``: exit 0 means the bucket equals a
    replay of the whole log; ``said`` is its last three lines."""
    done = subprocess.run(
        [*seqstate_command(), "replay", "--verify", "--no-progress", *flags],
        env=seqstate_env(url),
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO_ROOT,
    )
    said = (done.stdout + done.stderr).strip().splitlines()
    return {"exit": done.returncode, "said": said[-3:]}
