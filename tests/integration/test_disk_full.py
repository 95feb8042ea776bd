"""A full disk under the ledger: every write that fails says "JetStream storage full".

Two ways a server runs out. Its JetStream limit (``max_file_store``, or by default 75% of the
disk free at its start) is reached: it answers each write with an error (insufficient
resources). Or the disk fills under it: it stores nothing and answers nothing, and says so only
in its own log ("no space left on device"); a write then times out like one lost on the wire,
and was reported as "ack timed out". Before, the projector's bucket writes met the first as
hundreds of nameless ``ServiceUnavailableError: code=503`` lines, then "no answer in time";
``seqstate snapshot save`` printed nats-py's repr.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import nats.js.errors
import pytest
from eventually import eventually
from http_kit import free_port
from log_text import plain_lines
from nats.aio.client import Client
from pipeline_kit import REPO, clean_env, fill, fresh_config, name_flags

from projector.bucket.projection import Projector
from projector.nats.server import NatsServer, find_binary
from projector.nats.snapshots import SnapshotStore
from projector.route.publisher import PublishError, RouterPublisher
from projector.run.assemble import build_lease, build_projector, build_writer
from projector.settings.config import Config

FULL = "JetStream storage full"
ADVICE = "free disk space on the server, or raise its JetStream limit"


@contextlib.asynccontextmanager
async def limited_server(tmp_path: Path, limit: str = "256KB") -> AsyncIterator[tuple[str, Client]]:
    """A server whose JetStream may store ``limit`` at most, and a client of it."""
    conf = tmp_path / "small.conf"
    conf.write_text(f"jetstream {{ max_file_store: {limit} }}\n")
    with NatsServer(tmp_path / "store", extra_args=("-c", str(conf))) as server:
        nc = await nats.connect(server.url)
        try:
            yield server.url, nc
        finally:
            await nc.close()


async def fill_the_disk(nc: Client) -> None:
    """Another stream takes what the server can still store, until it answers storage full."""
    js = nc.jetstream()
    await js.add_stream(name="FILLER", subjects=["filler"])
    with pytest.raises(nats.js.errors.APIError) as raised:
        for _ in range(1000):  # 4 MB: far more than the server will store
            await js.publish("filler", b"x" * 4096)
    assert raised.value.err_code == 10023, raised.value


async def logged_until(
    caplog: pytest.LogCaptureFixture, consumer: Projector, words: str
) -> list[str]:
    """What ``consumer`` logged (warnings and worse) by the time a line says ``words``."""
    caplog.set_level(logging.WARNING)
    running = asyncio.create_task(consumer.run())

    def lines() -> list[str]:
        if running.done():
            raise AssertionError(f"it stopped: {running.exception()!r}")
        return [r.getMessage() for r in caplog.records]

    try:
        return await eventually(lines, lambda said: any(words in x for x in said), what=words)
    finally:
        consumer.stop()
        running.cancel()
        await asyncio.wait([running], timeout=30)


def run_cli(url: str, config: Config, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "projector", *argv, *name_flags(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean_env(), "NATS_URL": url},
        cwd=REPO,
    )


async def test_a_projector_whose_bucket_writes_meet_a_full_disk_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Deltas stored and the projector's lease taken, then the disk filled: the projector's
    first write of the bucket fails at once, its line says JetStream storage full, and no
    line is nats-py's nameless ``ServiceUnavailableError``."""
    async with limited_server(tmp_path) as (_, nc):
        config = fresh_config("kvfull")
        last = await fill(nc, config, 40)
        writer = build_writer(nc, config, snapshots=False)
        task = asyncio.create_task(writer.run())
        await writer.wait_applied(last)
        await writer.flush()
        writer.stop()
        await asyncio.wait_for(task, 30)
        lease = build_lease(nc, config, "projector", ttl_s=600.0)
        await lease.acquire(wait=False)
        await fill_the_disk(nc)
        projector = build_projector(nc, config, held_lease=lease)
        said = await logged_until(caplog, projector, "flush failed")
    failed = [line for line in said if "flush failed" in line]
    assert failed[0].endswith(
        f": {FULL}: insufficient resources (JetStream error 10023); {ADVICE} "
        "(max_file_store, max_memory_store, or the account's)"
    ), failed
    assert not [line for line in said if "ServiceUnavailableError" in line], said


async def test_snapshot_save_on_a_full_disk_says_so_in_one_line(tmp_path: Path) -> None:
    async with limited_server(tmp_path) as (url, nc):
        config = fresh_config("snapfull")
        last = await fill(nc, config, 40)
        await fill_the_disk(nc)
        result = await asyncio.to_thread(run_cli, url, config, "snapshot", "save", "--no-progress")
    assert result.returncode == 1, result.stdout + result.stderr
    assert plain_lines(result.stderr) == [
        f"seqstate: error: snapshot {config.namespace}.{last:020d} not stored: {FULL}: "
        f"insufficient resources (JetStream error 10023); {ADVICE} (max_file_store, "
        "max_memory_store, or the account's)"
    ]


# --- a disk that fills under the server -------------------------------------------------------


@pytest.fixture
def full_disk_server(tmp_path: Path) -> Iterator[str]:
    """A server whose store is a 4 MB tmpfs while its JetStream limit is 1 GB: the disk fills
    first. The tmpfs is mounted in a user and mount namespace of the server's own (no root)."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-rm", "true"], check=False).returncode:
        pytest.skip("a disk that fills needs unshare -rm (user namespaces) to mount a tmpfs")
    store = tmp_path / "disk"
    store.mkdir()
    port = free_port()
    conf = tmp_path / "big.conf"
    conf.write_text(f"port: {port}\njetstream {{ store_dir: {store}, max_file_store: 1GB }}\n")
    script = f"mount -t tmpfs -o size=4m tmpfs {store} && exec {find_binary()} -c {conf}"
    proc = subprocess.Popen([unshare, "-rm", "sh", "-c", script], stderr=subprocess.DEVNULL)
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


async def test_a_disk_full_under_the_server_is_named_not_an_ack_timeout(
    full_disk_server: str,
) -> None:
    """The events fill the disk: the server answers nothing more. RouterPublisher's error
    names the likely full disk (the stream answers, stores nothing), not just "ack timed out";
    ``seqstate snapshot save`` passes on the server's "no space left on device" as storage
    full."""
    nc = await eventually(
        lambda: nats.connect(full_disk_server, allow_reconnect=False),
        what="the server on its small disk takes clients",
        retry_on=(OSError, nats.errors.Error),
    )
    try:
        config = fresh_config("enospc")
        await fill(nc, config, 10)
        await SnapshotStore(nc, config).open()  # created while there is room
        pub = RouterPublisher(nc, router_id="disk", config=config, retries=1, timeout=5.0)
        hashes = list(range(2000))  # 18 KB an event: the 4 MB disk fills within 250
        with pytest.raises(PublishError) as raised:
            for i in range(1000):
                await pub.add(f"big-{i}", 1, block_hashes=hashes)
        message = str(raised.value)
        assert "ack timed out, 2 times; " in message, message
        assert (
            f"stream {config.events_stream} answers but stored nothing: {FULL}? (a server whose "
            "disk is full says so only in its log: 'no space left on device'); " + ADVICE
        ) in message, message
        result = await asyncio.to_thread(
            run_cli, full_disk_server, config, "snapshot", "save", "--no-progress"
        )
    finally:
        await nc.close()
    assert result.returncode == 1, result.stdout + result.stderr
    [line] = plain_lines(result.stderr)
    assert line.startswith(f"seqstate: error: snapshot {config.namespace}.") and (
        f"not stored: {FULL}: write " in line and "no space left on device" in line
    ), line
