"""Forged Dynamo sequence numbers on a real server: counted, never fatal, never forgotten.

Anyone allowed on Dynamo's subjects can publish any publisher id and any u64 sequence. Two ids
sending sequence 0 and then 2^64 - 1 made hole totals no snapshot could encode: ``seqstate
snapshot save`` raised OverflowError, and ``seqstate run`` died at every restart. Here the
messages are published on NATS Core on Dynamo's own subject, as Dynamo publishes them, and a
real ``seqstate run`` captures and folds them; the counts then show in status, in the metrics
and in the snapshots, exact or saturated at 2^64 - 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats.errors
import pytest
from dynamo_capture import CAPTURE
from eventually import eventually
from nats.aio.client import Client
from pipeline_kit import REPO, clean_env, fresh_config, logged, name_flags, run_cli
from prometheus_client import generate_latest

from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.nats.services import status_subject
from projector.nats.snapshots import SnapshotStore
from projector.ops.metrics import Metrics
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from seqstate.dynamo import FREE, decode_dynamo, dynamo_subject, encode_dynamo

U64_MAX = 2**64 - 1  # the most a snapshot can hold

# A Free of a request no one added: what it names does not matter, its envelope does.
_FREE = next(m for m in map(decode_dynamo, (c.data for c in CAPTURE)) if m.op == FREE)


def forged(publisher_id: int, sequence: int) -> bytes:
    return encode_dynamo(
        msgspec.structs.replace(_FREE, publisher_id=publisher_id, sequence=sequence)
    )


async def publish(nc: Client, config: Config, messages: list[bytes]) -> None:
    """On NATS Core on the namespace's Dynamo endpoint, as Dynamo publishes (no ack)."""
    subject = dynamo_subject(config.dynamo_endpoints[0])
    for i, data in enumerate(messages, 1):
        await nc.publish(subject, data)
        if i % 500 == 0:
            await nc.flush()
    await nc.flush()


async def writer_status(nc: Client, config: Config) -> dict[str, object]:
    reply = await nc.request(status_subject(config, "writer"), b"", timeout=2)
    status: dict[str, object] = json.loads(reply.data)
    return status


def run_argv(config: Config, url: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "projector",
        "run",
        "--nats-url",
        url,
        "--dynamo-endpoint",
        config.dynamo_endpoints[0],
        "--dynamo-discovery",
        "none",  # no fleet's discovery here: its absence is not this test's
        "--idle-tick-s",
        "3600",
        "--snapshot-every-events",
        "2",
        *name_flags(config),
    ]


@contextlib.asynccontextmanager
async def started_run(
    nc: Client,
    config: Config,
    url: str,
    log: Path,
    argv: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> AsyncIterator[None]:
    """``seqstate run --nats-url`` as a user starts it (``argv``, by default this module's;
    ``env`` added to a clean environment), until its writer answers its status; SIGINT on
    leaving, exit 0 expected."""
    with log.open("ab") as out:
        proc = await asyncio.create_subprocess_exec(
            *(argv or run_argv(config, url)),
            env=clean_env() | (env or {}),
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def running() -> None:
        if proc.returncode is not None:
            raise AssertionError(f"seqstate run exited {proc.returncode}:\n{log.read_text()}")

    try:
        await eventually(
            lambda: writer_status(nc, config),
            what="the writer of seqstate run answers its status",
            retry_on=(nats.errors.NoRespondersError, nats.errors.TimeoutError),
            check=running,
            interval=0.1,
        )
        yield
        running()
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
        try:
            rc = await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()  # not left behind to hold the port and the lease
            await proc.wait()
            raise AssertionError(
                f"seqstate run did not exit within 30 s of SIGINT:\n{log.read_text()}"
            ) from None
    assert rc == 0, log.read_text()


async def applied(nc: Client, config: Config, seq: int) -> dict[str, object]:
    return await eventually(
        lambda: writer_status(nc, config),
        lambda status: int(status["applied_seq"]) >= seq,  # type: ignore[call-overload]
        what=f"the writer applied event {seq}",
        retry_on=(nats.errors.NoRespondersError, nats.errors.TimeoutError),
    )


async def test_forged_sequences_saturate_and_never_stop_run_or_a_snapshot(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """The probe's four messages: two ids, each sequence 0 then 2^64 - 1. ``seqstate run``
    folds them and snapshots every 2 events; ``seqstate snapshot save`` succeeds; ``run``
    stopped and started again restores the snapshot and goes on; every count says the total
    saturated, exact per publisher."""
    config = fresh_config("forge", dynamo_endpoint="forged.backend.generate")
    url = nats_server.url
    log = tmp_path / "run.log"
    await ensure(nc, config)
    probe = [forged(pid, seq) for pid in (71, 72) for seq in (0, U64_MAX)]
    async with started_run(nc, config, url, log):
        await publish(nc, config, probe)
        status = await applied(nc, config, await logged(nc, config, len(probe)))
        assert status["dynamo"] == {
            "publishers": 2,
            "lost": U64_MAX,
            "late": 0,
            "forgotten": 0,
            "lost_by_publisher": {"71": U64_MAX - 1, "72": U64_MAX - 1},
        }
        saved = await run_cli(config, url, "snapshot", "save", "--no-progress")
        assert saved.returncode == 0, saved.stderr
        assert saved.stdout.startswith(f"saved and verified {config.namespace}."), saved.stdout
    said = await run_cli(config, url, "status")  # no writer: the newest snapshot
    assert said.returncode == 0, said.stderr
    assert (
        f"dynamo: 2 publishers, at least {U64_MAX} messages lost, 0 late (the snapshot at event"
    ) in said.stdout, said.stdout
    assert f"publisher 71: {U64_MAX - 1} messages lost" in said.stdout, said.stdout

    async with started_run(nc, config, url, log):  # restarts from its snapshot
        await publish(nc, config, [forged(71, 0), forged(73, 5), forged(73, 9)])
        status = await applied(nc, config, await logged(nc, config, len(probe) + 3))
        assert status["dynamo"] == {
            "publishers": 3,
            "lost": U64_MAX,
            "late": 1,  # 71's sequence 0 again: late, no restart, no hole after it
            "forgotten": 0,
            "lost_by_publisher": {"71": U64_MAX - 1, "72": U64_MAX - 1, "73": 3},
        }
    text = log.read_text()
    assert "Traceback" not in text and "OverflowError" not in text, text
    assert "failed" not in text and "ERROR" not in text, text
    store = await SnapshotStore(nc, config).open(create=False)
    newest = (await store.list())[-1]
    restored = await store.load(newest)
    assert (restored.publishers.holes, restored.publishers.late) == (U64_MAX, 1)


HELD = (
    r"Dynamo publishers lost messages ([\d,]+) more times in the last [\d.]+s \(([\d,]+) "
    r"messages in all\); the last: publisher \d+, [\d,]+ before event \d+(#\d+)?"
)


async def test_hole_counts_survive_4096_publishers_in_status_metrics_and_snapshots(
    nc: Client, nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Three publishers lose 500, 400 and 300 messages; one sends 0-2, a late 0 and then 3;
    then 4,200 new ids each lose 1 to 7, which forgets the first ones from the table of
    4,096. The totals and the lossiest publishers are exact in the writer's status, the
    metrics, ``seqstate status`` (from the writer, then from a snapshot) and the snapshot.
    The writer's log says the first hole, then a line per interval counting the others (it
    said a line per hole: 4,203 here)."""
    config = fresh_config("many", dynamo_endpoint="many.backend.generate", idle_tick_s=3600.0)
    await ensure(nc, config)
    url = nats_server.url
    messages = [
        forged(pid, seq) for pid, lost in ((1, 500), (2, 400), (3, 300)) for seq in (0, lost + 1)
    ]
    messages += [forged(4, seq) for seq in (0, 1, 2, 0, 3)]
    flood = range(10, 4210)
    messages += [forged(pid, seq) for pid in flood for seq in (0, 2 + pid % 7)]
    lost = 1200 + sum(1 + pid % 7 for pid in flood)
    top = [(1, 500), (2, 400), (3, 300), *[(pid, 7) for pid in flood if pid % 7 == 6][:17]]
    caplog.set_level(logging.WARNING, logger="seqstate.writer")
    async with Pipeline(nc, config) as pipeline:
        await publish(nc, config, messages)
        last = await logged(nc, config, len(messages))
        await pipeline.wait_applied(last)
        want = {
            "publishers": 4096,
            "lost": lost,
            "late": 1,
            "forgotten": 4 + len(flood) - 4096,
            "lost_by_publisher": {str(pid): n for pid, n in top},
        }
        assert (await writer_status(nc, config))["dynamo"] == want
        metrics = Metrics()
        metrics.follow("writer", lambda: [pipeline.writer])
        scraped = generate_latest(metrics.registry).decode()
        ns = config.namespace
        assert f'seqstate_dynamo_publishers{{namespace="{ns}"}} 4096.0' in scraped
        for publisher, n in (("all", lost), ("1", 500), ("3", 300)):
            line = (
                f'seqstate_dynamo_messages_lost_total{{namespace="{ns}",publisher="{publisher}"}}'
            )
            assert f"{line} {float(n)}" in scraped, scraped
        said = await run_cli(config, url, "status")
        assert said.returncode == 0, said.stderr
        assert (
            f"dynamo: 4096 publishers, {lost} messages lost, 1 late (the running writer)"
            in said.stdout
        ), said.stdout
        saved = await run_cli(config, url, "snapshot", "save", "--no-progress")
        assert saved.returncode == 0, saved.stderr
    said_holes = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
    assert said_holes[0].startswith("Dynamo publisher 1 lost 500 messages (its sequence 1 on)")
    held = [re.fullmatch(HELD, line) for line in said_holes[1:]]
    assert all(held) and len(held) <= 3, said_holes  # a line per 10 s, and one at the stop
    counted = [(int(m[1].replace(",", "")), int(m[2].replace(",", ""))) for m in held if m]
    assert (1 + sum(n for n, _ in counted), 500 + sum(k for _, k in counted)) == (4203, lost)
    said = await run_cli(config, url, "status")  # the writer stopped: from the snapshot
    assert said.returncode == 0, said.stderr
    lines = said.stdout.splitlines()
    first = lines.index(next(line for line in lines if line.startswith("dynamo: ")))
    assert lines[first].startswith(f"dynamo: 4096 publishers, {lost} messages lost, 1 late ("), (
        said.stdout
    )
    assert lines[first + 1 : first + 4] == [
        "  publisher 1: 500 messages lost",
        "  publisher 2: 400 messages lost",
        "  publisher 3: 300 messages lost",
    ], said.stdout
    store = await SnapshotStore(nc, config).open(create=False)
    restored = await store.load((await store.list())[-1])
    assert restored.publishers.report() == want
