"""Backpressure. A publisher far faster than the writer (the writer frozen with
SIGSTOP, so that nothing here depends on the machine's speed) stays bounded and drops nothing,
the lag shows in ``seqstate status``, and the writer says that it fell behind and that it
caught up; afterwards the bucket is exactly one uninterrupted fold of the log.
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
from eventually import eventually
from fault_kit import (
    BUSY,
    Service,
    bucket_position,
    bucket_values,
    delta_source_seq,
    fault_config,
    fold_differences,
    read_stream,
    uninterrupted_fold,
)
from log_text import plain_lines
from nats.aio.client import Client
from pipeline_kit import name_flags

from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.nats.stream import last_seq_of
from projector.route.publisher import MSG_ID_HEADER, RouterPublisher
from projector.settings.config import Config
from projector.wire.values import position_key
from seqstate import AddRequest, Event, Free, MarkPrefillCompleted

BOUND = 64  # the publisher's max_pending
BATCH = 10_000  # events of the one publish_many call
SINGLES = 10_000  # events published by as many concurrent publish() calls
WARN_EVENTS = 1_000  # the consumers' behind_warn_events


def batch(n: int) -> list[Event]:
    """AddRequests of ``n`` requests on 8 workers x 2 ranks, sharing system-prompt prefixes."""
    prefixes = [[1000 * p + k for k in range(6)] for p in range(5)]
    return [
        AddRequest(
            request_id=f"bp{i}",
            worker_id=i % 8,
            dp_rank=i % 2,
            block_hashes=prefixes[i % 5] + [10**9 + i, 10**9 + i + 1],
            prefill_tokens=100 + i % 900,
        )
        for i in range(n)
    ]


def singles(n: int) -> list[Event]:
    """A MarkPrefillCompleted, then a Free, of the first ``n // 2`` requests of :func:`batch`:
    fired concurrently with it, some overtake their AddRequest (the fold tolerates that)."""
    out: list[Event] = []
    for i in range(n // 2):
        out.append(MarkPrefillCompleted(request_id=f"bp{i}", worker_id=i % 8, dp_rank=i % 2))
        out.append(Free(request_id=f"bp{i}", worker_id=i % 8, dp_rank=i % 2))
    return out


async def status(config: Config, url: str, *extra: str) -> str:
    """``seqstate status`` as an operator types it (the installed command), its stdout."""
    seqstate = Path(sys.executable).parent / "seqstate"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEQSTATE_")}
    env["NATS_URL"] = url
    proc = await asyncio.create_subprocess_exec(
        str(seqstate),
        "status",
        *name_flags(config),
        "--behind-warn-events",
        str(WARN_EVENTS),
        "--behind-warn-s",
        "off",
        *extra,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


def lines_of(service: Service, marker: str) -> list[str]:
    return [line for line in plain_lines(service.logs(tail=10**6)) if marker in line]


async def said(service: Service, marker: str) -> None:
    """Until the service's log has a line with ``marker``."""

    async def lines() -> list[str]:
        return lines_of(service, marker)

    await eventually(
        lines,
        what=f"{service.command} logged {marker!r}",
        watch=service.logs,
        check=service.check,
    )


async def test_a_publisher_faster_than_a_frozen_writer_is_bounded_loses_nothing_and_lag_shows(
    nc: Client, nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Broke: froze the writer and the projector (SIGSTOP), then published 20,000 events at
    once (one publish_many of 10,000 alongside 10,000 concurrent publish() calls) through a
    publisher bounded at 64 in flight; thawed the writer, then the projector.

    Expected: never more than 64 events in flight (nor more bytes buffered in the client than
    64 events take), the callers beyond waiting rather than failing; every acknowledged
    sequence in the stream; ``seqstate status`` (text and --json) showing the writer 20,000
    events behind while frozen, then the projector behind once the writer has caught up; the
    writer's log one "falling behind" line and then one "caught up" line (the projector's
    alike); and the bucket equal to one uninterrupted fold of the log."""
    config = fault_config(
        "bp",
        idle_tick_s=3600.0,
        tick_every_s=3600.0,
        snapshot_every_events=0,
        behind_warn_events=WARN_EVENTS,
        behind_warn_s=None,
        lag_check_s=0.1,
    )
    await ensure(nc, config)
    js = nc.jetstream()
    writer = Service("writer", config, nats_server.url, tmp_path)
    projector = Service("projector", config, nats_server.url, tmp_path)
    services = [writer, projector]
    frozen: list[Service] = []

    def freeze(service: Service) -> None:
        assert service.proc is not None
        os.kill(service.proc.pid, signal.SIGSTOP)
        frozen.append(service)

    def thaw(service: Service) -> None:
        assert service.proc is not None
        os.kill(service.proc.pid, signal.SIGCONT)
        frozen.remove(service)

    async def folded() -> int:
        return await delta_source_seq(js, config)

    async def in_bucket() -> int:
        return (await bucket_position(js, config)).applied_seq

    try:
        for service in services:
            await service.start(js, 0)
            await service.wait_ready(js)
        pub = RouterPublisher(
            nc, namespace=config.namespace, router_id="bp-router", config=config, max_pending=BOUND
        )
        warm = await pub.add("warm", 1, block_hashes=[1, 2])
        await eventually(
            in_bucket,
            lambda seq: seq >= warm,
            what="the pipeline works",
            retry_on=BUSY,
            watch=projector.logs,
            check=projector.check,
        )
        freeze(writer)
        freeze(projector)

        # Every message the publisher sends: what it holds in flight and what the client has
        # buffered for the socket at that moment.
        seen = {"in_flight": 0, "awaiting": 0, "buffered": 0, "waiting": 0, "sends": 0}
        real = nc.publish
        adds, others = batch(BATCH), singles(SINGLES)
        largest = max(len(pub.check(e)[1]) for e in [*adds, *others])

        async def watched(subject: str, payload: bytes = b"", **kw: Any) -> None:
            if MSG_ID_HEADER in (kw.get("headers") or {}):
                seen["sends"] += 1
                seen["in_flight"] = max(seen["in_flight"], pub.in_flight)
                seen["awaiting"] = max(seen["awaiting"], len(pub._awaiting))
                seen["buffered"] = max(seen["buffered"], nc.pending_data_size)
                seen["waiting"] = max(seen["waiting"], pub.waiting)
            await real(subject, payload, **kw)

        monkeypatch.setattr(nc, "publish", watched)
        many, *single = await asyncio.gather(
            pub.publish_many(adds), *(pub.publish(e) for e in others)
        )
        monkeypatch.undo()
        assert isinstance(many, list)
        acked = [warm, *many, *single]
        assert len(set(acked)) == 1 + BATCH + SINGLES, "a sequence acknowledged twice"
        assert seen["sends"] == BATCH + SINGLES, "an event sent more than once"
        assert 1 < pub.peak_in_flight <= BOUND and seen["in_flight"] <= BOUND
        assert seen["awaiting"] <= BOUND
        assert seen["buffered"] <= BOUND * (largest + 1024), seen  # headers, protocol line
        assert seen["waiting"] > BOUND, "no caller had to wait: the bound was never reached"
        assert (pub.in_flight, pub.waiting, pub.pending, len(pub._awaiting)) == (0, 0, 0, 0)
        last = max(acked)
        assert await last_seq_of(js, config.events_stream, config.events_subjects) == last

        # Frozen: the writer is every event behind, the projector nothing (no new deltas).
        text, raw = await asyncio.gather(
            status(config, nats_server.url), status(config, nats_server.url, "--json")
        )
        report = json.loads(raw)
        behind = last - warm
        assert report["writer"]["position"] == warm and report["writer"]["newest"] == last
        assert report["writer"]["events"] == behind and report["writer"]["behind"] is True
        assert report["writer"]["oldest_age_s"] > 0 and report["writer"]["oldest_log_time"]
        assert report["projector"]["events"] == 0 and report["projector"]["behind"] is False
        assert report["lag_events"] == behind
        assert (
            f"writer lag: {behind:,} events stored but not folded yet (folded up to event "
            f"{warm}, the log at {last})"
        ) in text, text
        assert "BEHIND (warns at 1,000 events)" in text, text

        thaw(writer)
        await eventually(
            folded,
            lambda seq: seq >= last,
            what="the writer caught up",
            retry_on=BUSY,
            watch=writer.logs,
            check=writer.check,
        )
        await said(writer, "writer caught up")
        falling = lines_of(writer, "writer falling behind")
        assert len(falling) == 1, writer.logs()
        assert "events stored but not folded yet" in falling[0]
        assert not lines_of(writer, "still behind"), writer.logs()
        log = writer.logs(tail=10**6)
        assert log.index("writer falling behind") < log.index("writer caught up")

        # The writer caught up, the projector frozen: its deltas wait.
        report = json.loads(await status(config, nats_server.url, "--json"))
        assert report["writer"]["events"] == 0 and report["writer"]["behind"] is False
        assert report["projector"]["position"] == warm
        assert report["projector"]["events"] == behind and report["projector"]["messages"] >= 1
        assert report["projector"]["behind"] is True, report

        thaw(projector)
        await eventually(
            in_bucket,
            lambda seq: seq >= last,
            what="the projector caught up",
            retry_on=BUSY,
            watch=projector.logs,
            check=projector.check,
        )
        await said(projector, "projector caught up")
        assert len(lines_of(projector, "projector falling behind")) == 1, projector.logs()
        for service in services:
            code = await service.stop()
            assert code == 0, f"{service.command} exited with {code}\n{service.logs()}"
    finally:
        for service in frozen:
            assert service.proc is not None
            os.kill(service.proc.pid, signal.SIGCONT)
        for service in services:
            service.close()

    # Nothing dropped: every acknowledged sequence is in the stream, and nothing else is.
    stored = {
        seq for seq, _, _ in await read_stream(nc, config.events_stream, config.events_subjects)
    }
    assert stored == set(acked)
    _, values, logged = await uninterrupted_fold(nc, config)
    assert logged == last
    got = await bucket_values(nc, config)
    assert got.pop(position_key(config.namespace)), "no position"
    assert not fold_differences(values, got), fold_differences(values, got)
