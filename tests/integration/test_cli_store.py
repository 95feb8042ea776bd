"""``seqstate run``'s store and its embedded nats-server: one run per store, and a run killed
(or a server left over from one) never keeps the next run from starting."""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path

from cli_kit import one_line_error, started_run, stopped
from eventually import eventually
from log_text import plain_lines
from pipeline_kit import REPO, cli_env, seqstate

from projector.nats.server import LOCK_FILE


def test_a_second_run_on_the_same_store_refuses_in_one_line(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first, _ = started_run(store, "--port", "0")
    try:
        second = seqstate("run", "--store-dir", str(store), "--duration", "5")
        line = one_line_error(second)
        assert f"the store {store} is in use by another nats-server" in line
    finally:
        stopped(first)
    # Released with the first run: the store starts again, and its snapshot is still there.
    again = seqstate("run", "--store-dir", str(store), "--port", "0", "--duration", "0.5")
    assert again.returncode == 0, again.stderr


def store_locked(store: Path) -> bool:
    """Does a process (a run, or its nats-server) hold the store's lock right now?"""
    fd = os.open(store / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases it, if it was taken
    return False


def server_pid(store: Path) -> int:
    return int((store / LOCK_FILE).read_text().split()[0])


def running(pid: int) -> bool:
    """Alive and not a zombie (a dead orphan may wait for a reaper that never comes)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


async def test_a_killed_run_takes_its_server_with_it_and_the_next_run_starts(
    tmp_path: Path,
) -> None:
    # Before the fix the server outlived a SIGKILLed run, holding the store: every later run
    # refused it ("in use by another nats-server") until someone found and killed the server.
    store = tmp_path / "store"
    first, _ = started_run(store, "--port", "0")
    pid = server_pid(store)
    first.kill()
    first.wait()
    try:
        await eventually(lambda: running(pid), lambda alive: not alive, what="the server died")
        await eventually(lambda: store_locked(store), lambda held: not held, what="store freed")
    finally:
        if running(pid):
            os.kill(pid, signal.SIGKILL)
    again = await asyncio.to_thread(
        seqstate, "run", "--store-dir", str(store), "--port", "0", "--duration", "0.5"
    )
    assert again.returncode == 0, again.stderr


ORPHAN_MAKER = """
import os, sys
from projector.nats.server import NatsServer
server = NatsServer(sys.argv[1]).start()  # as a run started it before the fix
print(server.url, flush=True)
os.kill(os.getpid(), 9)
"""


async def test_a_run_stops_a_server_left_over_from_a_killed_run(tmp_path: Path) -> None:
    # A server whose run is gone (killed before the fix, or its death signal lost): the next
    # run stops it and takes the store, instead of refusing the store for good.
    store = tmp_path / "store"
    maker = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", ORPHAN_MAKER, str(store)],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
        cwd=REPO,
    )
    assert maker.returncode == -signal.SIGKILL, maker.stderr
    pid = server_pid(store)
    try:
        assert running(pid) and store_locked(store)  # the orphan holds the store
        again = await asyncio.to_thread(
            seqstate,
            "run",
            "--store-dir",
            str(store),
            "--port",
            "0",
            "--duration",
            "0.5",
            "--log-level",
            "info",
        )
        assert again.returncode == 0, again.stderr
        said = plain_lines(again.stderr)
        stopping = f"stopping nats-server pid {pid}: it holds the store {store}, left over"
        assert any(stopping in line for line in said), said
        assert not running(pid)
    finally:
        if running(pid):
            os.kill(pid, signal.SIGKILL)
