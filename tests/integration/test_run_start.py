"""``seqstate run``'s start, as a user types it: its port, and a signal while it catches up.

A port taken used to be one warning and a random port: the tour's ``NATS_URL`` then reached the
other server (Dynamo's listens on 4222 too), a publish there "succeeded" and ``loads`` stayed
empty. A Ctrl-C while ``run`` folded a backlog took tens of seconds and printed a hundred lines
of tracebacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from log_text import plain, plain_lines
from pipeline_kit import seqstate, spawned_run

from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.settings.config import Config
from seqstate import AddRequest, Event, Free

DEFAULT_PORT = 4222


@contextlib.contextmanager
def taken(port: int) -> Iterator[None]:
    """``port`` on 127.0.0.1 taken for the block: by this test if it is free, else it already
    is (another server listens there)."""
    with socket.socket() as squatter:
        try:
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
        except OSError:
            pass
        yield


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_run_refuses_a_taken_port_in_one_line_and_port_0_takes_any(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with taken(DEFAULT_PORT):
        refused = seqstate("run", "--store-dir", str(store), "--duration", "5")
        assert (refused.returncode, refused.stdout) == (1, ""), refused.stderr
        url = f"nats://127.0.0.1:{DEFAULT_PORT}"
        assert plain_lines(refused.stderr) == [
            f"seqstate: error: port {DEFAULT_PORT} on 127.0.0.1 is taken: another server listens "
            f"there (NATS_URL={url} would reach it, not this run); --port N (SEQSTATE_PORT=N) "
            "picks another port, --port 0 any free one"
        ]
        # Nothing was left running: the same store starts at once on any free port.
        anywhere = seqstate(
            "run", "--store-dir", str(store), "--port", "0", "--duration", "0.5",
            "--log-level", "info",
        )  # fmt: skip
    assert anywhere.returncode == 0, anywhere.stderr
    said = [line for line in plain_lines(anywhere.stderr) if "embedded nats-server at" in line]
    assert len(said) == 1, anywhere.stderr
    port = int(said[0].split("embedded nats-server at nats://127.0.0.1:", 1)[1].split()[0])
    assert port not in (0, DEFAULT_PORT)
    assert not any(line.startswith("WARNING") for line in plain_lines(anywhere.stderr))


def test_run_refuses_a_port_it_was_given_when_taken(tmp_path: Path) -> None:
    port = free_port()
    with taken(port):
        store = str(tmp_path / "store")
        refused = seqstate("run", "--store-dir", store, "--port", str(port), "--duration", "5")
    assert (refused.returncode, refused.stdout) == (1, ""), refused.stderr
    (line,) = plain_lines(refused.stderr)
    assert line.startswith(f"seqstate: error: port {port} on 127.0.0.1 is taken: "), line
    assert "Traceback" not in refused.stderr


# --- a signal while run catches up ----------------------------------------------------------

BACKLOG = 100_000  # events no writer has folded: seconds of start-up, past the 50,000 it warns at


@pytest.fixture(scope="module")
def backlog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store whose log holds ``BACKLOG`` events of the default namespace and nothing else:
    what a run finds after its routers went on publishing without it. Made once, copied."""
    store = tmp_path_factory.mktemp("backlog") / "store"

    async def publish() -> None:
        async with NatsServer(store) as server:
            nc = await nats.connect(server.url)
            try:
                await ensure(nc, Config())
                router = RouterPublisher(nc, router_id="backlog")
                batch: list[Event] = []
                for i in range(BACKLOG):
                    if i % 4 == 3:
                        batch.append(Free(request_id=f"r{i - 2}", worker_id=(i - 2) % 16))
                    else:
                        hashes = list(range(i % 64, i % 64 + 32))
                        add = AddRequest(f"r{i}", i % 16, block_hashes=hashes, prefill_tokens=500)
                        batch.append(add)
                    if len(batch) == 10_000:
                        await router.publish_many(batch)
                        batch = []
            finally:
                await nc.close()

    asyncio.run(publish())
    return store


def interrupted(store: Path, sig: signal.Signals, *waits: str) -> tuple[int, float, list[str]]:
    """``seqstate run`` on ``store``, sent ``sig`` once it has logged a line with each of
    ``waits`` in turn (it is folding the backlog: its first lag report, say); its exit code,
    the seconds from the signal to its exit, and the lines it logged from the signal on (those
    after the last awaited, by their time stamps: piped, it logs JSON records)."""
    proc, before = spawned_run(store, "--port", "0", until=waits)
    assert proc.stderr is not None
    signalled = time.time()
    started = time.monotonic()
    proc.send_signal(sig)
    watchdog = threading.Timer(60, proc.kill)  # a run that never stops fails, not hangs
    watchdog.start()
    try:
        rest = proc.stderr.read()
        proc.wait()
    finally:
        watchdog.cancel()
    took = time.monotonic() - started
    everything = "".join(before) + rest
    assert "Traceback" not in everything, everything
    assert "writer and projector running" not in everything  # the signal came while starting
    since = dt.datetime.fromtimestamp(int(signalled * 1000) / 1000, dt.UTC)
    after = [
        plain(line)
        for line in rest.splitlines()
        if dt.datetime.fromisoformat(json.loads(line)["ts"].replace("Z", "+00:00")) >= since
    ]
    return proc.returncode, took, after


STOPPED = re.compile(
    r"WARNING seqstate: stopped while starting, before the writer caught up \(event ([\d,]+) "
    rf"of {BACKLOG:,}\); nothing is lost, the next run catches up"
)


def test_a_signal_while_run_catches_up_stops_it_within_2s_in_one_line(
    backlog: Path, tmp_path: Path
) -> None:
    """Ctrl-C while the writer folds the backlog (once it has saved a first snapshot), then
    SIGTERM while the next run, started from that snapshot, folds the rest: each ends its run
    within 2 s of the signal, exit 0 (a signal stops a run cleanly), saying where the writer
    was in one line. Then a run catches up, and ``replay --verify`` finds the bucket equal to
    a fold of the log."""
    store = tmp_path / "store"
    shutil.copytree(backlog, store)
    first = interrupted(store, signal.SIGINT, "writer falling behind", "saved and verified")
    second = interrupted(
        store, signal.SIGTERM, "restored the write model from snapshot", "writer falling behind"
    )
    for rc, took, after in (first, second):
        assert rc == 0, after
        assert took < 2.0, (took, after)
        # The stop is one line, the last; before it, only the start's own progress that the
        # signal crossed (the projector saying where it resumed, say), never a warning.
        said = STOPPED.fullmatch(after[-1]) if after else None
        assert said is not None, after
        assert [line for line in after[:-1] if not line.startswith("INFO ")] == [], after
        assert 10_000 <= int(said.group(1).replace(",", "")) < BACKLOG
    done = seqstate("run", "--store-dir", str(store), "--port", "0", "--duration", "0.1")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr

    with NatsServer(store) as server:
        verified = seqstate("replay", "--verify", timeout=120, NATS_URL=server.url)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.splitlines()[-1] == "identical: 0 keys differ"


# Holds the import of the commands (what every command loads first) until a signal comes: the
# way to press Ctrl-C while a command loads, whatever the machine's speed.
LOADING_HOLD = """
import os, sys, time

class _Hold:
    def find_spec(self, name, path=None, target=None):
        if name == "projector.ops.commands":
            open(os.environ["HOLD_LOADING_MARK"], "w").close()
            for _ in range(6000):
                time.sleep(0.01)
        return None

sys.meta_path.insert(0, _Hold())
"""


def test_ctrl_c_while_a_command_loads_exits_130_without_a_traceback(tmp_path: Path) -> None:
    """A Ctrl-C in the first half second of ``seqstate run`` (its modules loading) printed
    a traceback of whichever module was loading, 15 to 35 lines, and died of the signal. It
    exits 130, saying nothing."""
    (tmp_path / "sitecustomize.py").write_text(LOADING_HOLD)
    loading = tmp_path / "loading"
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    env.update(PYTHONPATH=str(tmp_path), HOLD_LOADING_MARK=str(loading))
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "seqstate"), "run", "--store-dir", str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        while not loading.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # polls for the file the hold writes
        assert loading.exists(), proc.poll()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, out, err) == (130, b"", b"")
