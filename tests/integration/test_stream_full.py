"""A full events stream: a publish is refused out loud, quickly, and no stored event is dropped.

The events stream has no limits of its own, but an operator may give it some, and the server's
JetStream storage can run out. Once, the stream kept the default discard
policy ``old``, so a limit silently dropped the oldest events, unfolded ones included; and a
refused ``publish`` (nats-py's ``publish_async`` leaves its future pending on an error ack,
nats-io/nats.py#985) waited out every attempt's ack timeout and then said "ack timed out".
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path

import nats
import nats.js.errors
import pytest
from eventually import eventually
from nats.aio.client import Client
from nats.js import api
from pipeline_kit import fresh_config

from projector.nats.failures import retrying, storage_full
from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.route.publisher import PublishError, RouterPublisher
from projector.run.assemble import build_writer
from projector.settings.config import Config
from seqstate import Free

STORAGE_FULL_10023 = (
    "JetStream storage full: insufficient resources (JetStream error 10023); free disk space "
    "on the server, or raise its JetStream limit (max_file_store, max_memory_store, or the "
    "account's)"
)


def frees(n: int, start: int = 0) -> list[Free]:
    return [Free(request_id=f"f{i}", worker_id=i % 3) for i in range(start, start + n)]


async def limit(nc: Client, config: Config, **limits: object) -> None:
    """What an operator does with ``nats stream edit``: limits on the events stream."""
    js = nc.jetstream()
    wanted = (await js.stream_info(config.events_stream)).config
    for key, value in limits.items():
        setattr(wanted, key, value)
    await js.update_stream(wanted)


async def test_a_full_events_stream_makes_publish_raise_at_once_and_keeps_every_event(
    nc: Client,
) -> None:
    """Broke: gave the events stream max_msgs=5 and published a sixth event, with publish and
    with publish_many. Expected: PublishError in one line saying the stream is full (not an
    ack timeout), well within one ack timeout; the five stored events all still there."""
    config = fresh_config("full")
    await ensure(nc, config)
    await limit(nc, config, max_msgs=5)
    pub = RouterPublisher(
        nc, namespace=config.namespace, router_id="full", config=config, timeout=5.0
    )
    assert await pub.publish_many(frees(5)) == [1, 2, 3, 4, 5]
    started = time.monotonic()
    with pytest.raises(PublishError) as raised:
        await pub.publish(Free(request_id="sixth", worker_id=1))
    assert time.monotonic() - started < 2.0, "it waited for an ack timeout"
    message = str(raised.value)
    assert "\n" not in message and raised.value.sequences is None
    msg_id = raised.value.msg_id
    assert re.fullmatch(r"full:6:[0-9a-f]{16}", msg_id), msg_id
    assert message == (
        f"Free for request 'sixth': msg-id {msg_id} not stored after 4 attempt(s) to "
        f"{config.event_subject(1)}: the stream is full: maximum messages exceeded (JetStream "
        "error 10077), 4 times"
    )
    full = r"'f5'.*full:7:[0-9a-f]{16}.*the stream is full"
    with pytest.raises(PublishError, match=full) as raised:
        await pub.publish_many(frees(3, start=5))
    assert raised.value.sequences == [None, None, None]
    assert (pub.pending, pub.in_flight, pub.waiting) == (0, 0, 0)
    state = (await nc.jetstream().stream_info(config.events_stream)).state
    assert (state.first_seq, state.last_seq, state.messages) == (1, 5, 5), "an event was dropped"


async def test_ensure_keeps_the_events_stream_from_dropping_old_events(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """Broke: an operator's edit gave the events stream limits with the discard policy old
    (and a per-subject limit, and a max_age). Expected: ensure (every writer start) puts the
    policy back to new, per subject too, keeps the operator's limits, and warns of the
    max_age, which drops events whatever the policy."""
    config = fresh_config("keep")
    await ensure(nc, config)
    await limit(
        nc,
        config,
        max_msgs=100,
        max_msgs_per_subject=10,
        max_age=3600.0,
        discard=api.DiscardPolicy.OLD,
    )
    with caplog.at_level(logging.WARNING, "seqstate.resources"):
        events = (await ensure(nc, config)).events.config
    assert events.discard == api.DiscardPolicy.NEW and events.discard_new_per_subject
    assert (events.max_msgs, events.max_msgs_per_subject) == (100, 10)
    assert [r.getMessage() for r in caplog.records] == [
        f"stream {config.events_stream} has max_age 3600s: events older than that are dropped, "
        "folded or not (to trim, use --retain-events instead)"
    ]
    deltas = (await nc.jetstream().stream_info(config.deltas_stream)).config
    assert deltas.discard == api.DiscardPolicy.OLD  # the deltas are not the ledger's truth


async def test_a_server_out_of_storage_makes_publish_raise_saying_so(tmp_path: Path) -> None:
    """Broke: a server whose JetStream storage (max_file_store) fills up under publish_many.
    Expected: PublishError naming the storage, with the sequences of the events stored."""
    conf = tmp_path / "small.conf"
    conf.write_text("jetstream { max_file_store: 256KB }\n")
    with NatsServer(tmp_path / "store", extra_args=("-c", str(conf))) as server:
        nc = await nats.connect(server.url)
        try:
            config = fresh_config("store")
            await ensure(nc, config)
            pub = RouterPublisher(
                nc, namespace=config.namespace, router_id="st", config=config, retries=1
            )
            with pytest.raises(
                PublishError,
                match="JetStream storage full: insufficient "
                r"resources \(JetStream error 10023\); free disk space on the server",
            ) as raised:
                await pub.publish_many(frees(5000))
            sequences = raised.value.sequences
            assert sequences is not None and sequences[0] == 1 and sequences[-1] is None
            stored = [seq for seq in sequences if seq is not None]
            state = (await nc.jetstream().stream_info(config.events_stream)).state
            assert state.messages == len(stored) and state.first_seq == 1
        finally:
            await nc.close()


async def test_a_write_retried_on_a_full_disk_is_logged_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Broke: a server whose JetStream storage is full refused the writer's delta publishes,
    the projector's flushes, every retried write; each was logged as
    ``ServiceUnavailableError()``, the disk never named. Expected: every retry's line says
    "JetStream storage full", and the error given up on is one."""
    conf = tmp_path / "small.conf"
    conf.write_text("jetstream { max_file_store: 256KB }\n")
    with NatsServer(tmp_path / "store", extra_args=("-c", str(conf))) as server:
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            await js.add_stream(name="FILLER", subjects=["filler"])
            with (
                caplog.at_level(logging.WARNING, "seqstate"),
                pytest.raises(nats.js.errors.APIError) as raised,
            ):
                for _ in range(1000):  # 4 MB: far more than the server will store
                    await retrying(lambda: js.publish("filler", b"x" * 4096), "a filler write", 0.3)
            assert storage_full(raised.value)
            said = [r.getMessage() for r in caplog.records]
            assert said, "no retry was logged"
            for line in said:
                assert line.startswith("a filler write failed, retrying in "), line
                assert line.endswith(f": {STORAGE_FULL_10023}"), line
        finally:
            await nc.close()


async def test_a_writer_whose_deltas_meet_a_full_disk_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Broke: events logged, then the server's storage filled (here by another stream), then
    the writer started. Its delta publishes were refused and logged, for a minute, as
    ``ServiceUnavailableError()``. Expected: each line says JetStream storage full."""
    conf = tmp_path / "small.conf"
    conf.write_text("jetstream { max_file_store: 256KB }\n")
    with NatsServer(tmp_path / "store", extra_args=("-c", str(conf))) as server:
        nc = await nats.connect(server.url)
        try:
            config = fresh_config("disk")
            await ensure(nc, config)
            pub = RouterPublisher(nc, namespace=config.namespace, router_id="d", config=config)
            await pub.publish_many(frees(20))
            js = nc.jetstream()
            await js.add_stream(name="FILLER", subjects=["filler"])
            with pytest.raises(nats.js.errors.APIError) as raised:
                for _ in range(1000):  # 4 MB: far more than the server will store
                    await js.publish("filler", b"x" * 4096)
            assert storage_full(raised.value)
            writer = build_writer(nc, config, snapshots=False)
            with caplog.at_level(logging.WARNING, "seqstate"):
                task = asyncio.create_task(writer.run())
                try:
                    said = await eventually(
                        lambda: [r.getMessage() for r in caplog.records],
                        lambda lines: any("delta publish failed" in line for line in lines),
                        what="the writer's delta publish failed",
                    )
                finally:  # it would retry for a minute: no flush to wait for on a full disk
                    writer.stop()
                    task.cancel()
                    await asyncio.wait([task], timeout=30)
            failed = [line for line in said if "delta publish failed" in line]
            assert failed[0].endswith(f": {STORAGE_FULL_10023}"), failed
        finally:
            await nc.close()
