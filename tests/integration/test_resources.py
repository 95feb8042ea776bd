"""Provisioning against a real server: idempotent, additive across namespaces, never lossy."""

from __future__ import annotations

import asyncio
import itertools
import logging

import nats
import pytest
from eventually import eventually
from holding_proxy import HoldingProxy
from nats.aio.client import Client
from nats.js import api

from projector.nats.resources import ProvisioningError, dead_letter_stream, ensure
from projector.nats.server import NatsServer
from projector.run.assemble import build_projector, build_writer
from projector.settings.config import Config
from projector.wire.values import load_key

_names = itertools.count()


def fresh_config(**overrides: object) -> Config:
    n = next(_names)
    return Config(
        namespace=f"ns{n}",
        events_stream=f"EV{n}",
        deltas_stream=f"DL{n}",
        registry_bucket=f"reg{n}",
        **overrides,  # type: ignore[arg-type]
    )


async def test_ensure_creates_streams_and_bucket(nc: Client) -> None:
    config = fresh_config()
    res = await ensure(nc, config)
    assert res.events.config.subjects == [config.events_subjects]
    assert res.events.config.storage == api.StorageType.FILE
    assert res.events.config.duplicate_window == pytest.approx(120.0)
    assert res.deltas.config.subjects == [config.deltas_subject]
    assert res.dead_letters.config.name == dead_letter_stream(config)
    assert (await res.registry.status()).history == 1


async def test_ensure_is_idempotent_and_keeps_data(nc: Client) -> None:
    config = fresh_config()
    first = await ensure(nc, config)
    js = nc.jetstream()
    ack = await js.publish(config.event_subject(1, 0), b"event")
    await first.registry.put(load_key(config.namespace, (1, 0)), b"{}")
    second = await ensure(nc, config)
    info = await js.stream_info(config.events_stream)
    assert info.state.messages == 1 and info.state.last_seq == ack.seq
    assert info.state.first_seq == first.events.state.first_seq or first.events.state.messages == 0
    assert second.events.config == first.events.config
    entry = await second.registry.get(load_key(config.namespace, (1, 0)))
    assert entry.value == b"{}"


async def test_a_second_namespace_adds_its_subjects(nc: Client) -> None:
    a = fresh_config()
    b = Config(
        namespace=a.namespace + "b",
        events_stream=a.events_stream,
        deltas_stream=a.deltas_stream,
        registry_bucket=a.registry_bucket,
    )
    await ensure(nc, a)
    res = await ensure(nc, b)
    assert sorted(res.events.config.subjects or []) == sorted(
        [a.events_subjects, b.events_subjects]
    )
    assert sorted(res.deltas.config.subjects or []) == sorted([a.deltas_subject, b.deltas_subject])


async def test_a_mismatch_that_cannot_be_updated_is_reported(nc: Client) -> None:
    config = fresh_config()
    js = nc.jetstream()
    await js.add_stream(
        name=config.events_stream,
        subjects=[config.events_subjects],
        storage=api.StorageType.MEMORY,
    )
    with pytest.raises(ProvisioningError, match=r"uses .*memory.* storage"):
        await ensure(nc, config)
    info = await js.stream_info(config.events_stream)  # still there, untouched
    assert info.config.storage == api.StorageType.MEMORY


async def test_a_short_duplicate_window_is_widened(nc: Client) -> None:
    config = fresh_config()
    js = nc.jetstream()
    await js.add_stream(
        name=config.events_stream,
        subjects=[config.events_subjects],
        storage=api.StorageType.FILE,
        duplicate_window=10.0,
    )
    res = await ensure(nc, config)
    assert res.events.config.duplicate_window == pytest.approx(120.0)


async def test_a_request_left_unanswered_is_asked_again(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that restarts while a consumer provisions leaves a request unanswered: the
    consumer asks again and starts, where it used to exit on the timeout. The proxy holds every
    byte from the first stream-info request on until the first attempt has timed out."""
    port = int(nats_server.url.rsplit(":", 1)[1])
    proxy = await HoldingProxy(port, hold_at="$JS.API.STREAM.INFO.").start()
    nc = await nats.connect(proxy.url, max_reconnect_attempts=0)
    config = fresh_config()
    try:
        with caplog.at_level(logging.WARNING, logger="seqstate"):
            provisioning = asyncio.create_task(ensure(nc, config))
            said = "checking or provisioning the streams and the bucket failed, retrying in"
            await eventually(
                lambda: caplog.text, lambda text: said in text, what="the first attempt given up"
            )
            proxy.release.set()
            res = await asyncio.wait_for(provisioning, 30)
    finally:
        await nc.close()
        await proxy.stop()
    assert proxy.held.is_set()
    assert res.events.config.name == config.events_stream
    assert "no answer" in caplog.text


@pytest.mark.parametrize("build", [build_writer, build_projector], ids=["writer", "projector"])
async def test_a_stop_while_provisioning_ends_the_start(
    nats_server: NatsServer, build: object
) -> None:
    """A consumer whose server is silent while it provisions keeps asking; told to stop, it
    ends instead of asking on for a minute. The proxy holds every byte from the first
    stream-info request on (so the service registration's own stop waits out a flush: ~10 s)."""
    port = int(nats_server.url.rsplit(":", 1)[1])
    proxy = await HoldingProxy(port, hold_at="$JS.API.STREAM.INFO.").start()
    nc = await nats.connect(proxy.url, max_reconnect_attempts=0)
    try:
        consumer = build(nc, fresh_config())  # type: ignore[operator]
        running = asyncio.create_task(consumer.run())
        await asyncio.wait_for(proxy.held.wait(), 30)
        consumer.stop()
        await asyncio.wait_for(running, 30)  # unfixed: provisioning asks on for 60 s
    finally:
        await nc.close()
        await proxy.stop()
