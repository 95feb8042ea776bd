"""The namespace's lease: one writer of the bucket at a time.

A rebuild refuses while a projector runs and proceeds once it is gone; a second projector waits
for the first; a holder whose lease was taken stops; readers never see the lease key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from eventually import eventually
from log_text import plain_lines
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from pipeline_kit import fresh_config, read_log, run_cli

from projector.bucket.contents import read_bucket
from projector.bucket.projection import Projector
from projector.bucket.reader import RegistryView
from projector.nats.lease import PID_SPACE, Holder, Lease, LeaseHeld, LeaseLost
from projector.nats.resources import ensure
from projector.ops.replay import rebuild, verify
from projector.route.publisher import RouterPublisher
from projector.run.assemble import build_projector, build_writer
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from projector.wire.values import lease_key, parse_key, position_key
from seqstate import WorkerAdded, decode_event

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 30.0  # a deadline only a hang reaches
HERE = f"pid {os.getpid()} on host {socket.gethostname()}"


async def publish_some(nc: Client, config: Config, tag: str, n: int = 6) -> int:
    pub = RouterPublisher(nc, namespace=config.namespace, router_id=f"lease-{tag}", config=config)
    last = await pub.publish(WorkerAdded(worker_id=0, dp_size=2))
    for i in range(n):
        last = await pub.add(
            f"{tag}{i}", 0, i % 2, block_hashes=[1, 2, 10 + i], prefill_tokens=40 + i
        )
        if i % 3 == 2:
            last = await pub.free(f"{tag}{i}", 0, i % 2)
    return last


async def filled(nc: Client) -> tuple[Config, int]:
    """A namespace whose bucket reflects a few events; its projector stopped cleanly."""
    config = fresh_config("l")
    async with Pipeline(nc, config) as pipeline:
        last = await publish_some(nc, config, "a")
        await pipeline.wait_applied(last)
    return config, last


@contextlib.asynccontextmanager
async def projecting(nc: Client, config: Config, **lease: float) -> AsyncIterator[Projector]:
    """A projector that holds the lease (it is caught up) until the block ends."""
    projector = build_projector(nc, config, **lease)
    task = asyncio.create_task(projector.run())
    ready = asyncio.ensure_future(projector.caught_up.wait())
    await asyncio.wait([ready, task], timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
    try:
        assert ready.done(), "the projector did not catch up"
        yield projector
    finally:
        ready.cancel()
        projector.stop()
        await asyncio.wait_for(task, WAIT_S)


async def registry(nc: Client, config: Config) -> KeyValue:
    return await nc.jetstream().key_value(config.registry_bucket)


async def lease_value(nc: Client, config: Config) -> Holder | None:
    """The lease's holder, or None once released."""
    try:
        entry = await (await registry(nc, config)).get(lease_key(config.namespace))
    except KeyNotFoundError:
        return None
    return msgspec.json.decode(entry.value or b"", type=Holder)


def stranger(pid: int = 1, ttl_s: float = 0.5, pid_space: str = "") -> bytes:
    """A holder's value as another machine's projector would write it."""
    return msgspec.json.encode(
        Holder(
            "projector", "stranger", "elsewhere", pid, "2000-01-01T00:00:00+00:00", ttl_s, pid_space
        )
    )


# ---- rebuild ------------------------------------------------------------------------------------


async def test_rebuild_refuses_while_a_projector_runs_and_names_the_namespace(nc: Client) -> None:
    config, _ = await filled(nc)
    async with projecting(nc, config) as projector:
        with pytest.raises(LeaseHeld) as refused:
            await rebuild(nc, config)
        assert str(refused.value) == (
            f"a projector of namespace {config.namespace!r} is running ({HERE}); stop it (or "
            "the 'seqstate run' that holds it), then rebuild"
        )
        holder, lease = await lease_value(nc, config), projector.lease
        assert lease is not None and lease.lost is None  # the projector goes on, unharmed
        assert holder is not None and holder.id == lease.holder.id


async def test_the_cli_rebuild_refuses_in_one_line(nc: Client, nats_server: object) -> None:
    url = nats_server.url  # type: ignore[attr-defined]
    config, _ = await filled(nc)
    async with projecting(nc, config):
        out = await run_cli(config, url, "rebuild", "--no-progress")
    assert out.returncode == 1, out.stdout
    lines = plain_lines(out.stderr)
    assert lines == [
        f"seqstate: error: a projector of namespace {config.namespace!r} is running "
        f"({HERE}); stop it (or the 'seqstate run' that holds it), then rebuild"
    ]


async def test_rebuild_proceeds_at_once_after_a_clean_stop(nc: Client) -> None:
    config, last = await filled(nc)
    # A holder that never released would keep the rebuild waiting an hour, not a few seconds.
    async with projecting(nc, config, lease_ttl_s=3600.0, lease_renew_s=1.0):
        assert await lease_value(nc, config) is not None
    assert await lease_value(nc, config) is None  # released: deleted
    done = await asyncio.wait_for(rebuild(nc, config), WAIT_S)
    assert done.last_seq == last
    assert await verify(nc, config) == []
    assert await lease_value(nc, config) is None  # the rebuild released it too


async def test_rebuild_takes_over_a_dead_holder_after_its_ttl(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="seqstate.lease")
    config, last = await filled(nc)
    kv = await registry(nc, config)
    await kv.create(lease_key(config.namespace), stranger(ttl_s=0.5))  # SIGKILLed elsewhere
    loop = asyncio.get_running_loop()
    started = loop.time()
    done = await rebuild(nc, config)
    assert loop.time() - started >= 0.5  # the holder's TTL, waited out on our clock
    assert done.last_seq == last and await verify(nc, config) == []
    assert (
        f"took over the lease of namespace {config.namespace!r} from a projector (pid 1 on "
        "host elsewhere): not renewed for its TTL"
    ) in caplog.text
    assert await lease_value(nc, config) is None


async def test_a_holder_on_this_machine_whose_process_is_gone_is_taken_over_at_once(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="seqstate.lease")
    config, _ = await filled(nc)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    kv = await registry(nc, config)
    await kv.create(
        lease_key(config.namespace), stranger(gone.pid, ttl_s=3600.0, pid_space=PID_SPACE)
    )
    await asyncio.wait_for(rebuild(nc, config), WAIT_S)  # an hour's TTL: not waited out
    assert "its process is gone" in caplog.text


async def test_a_rebuild_refuses_another_rebuild_and_a_projector_waits_for_it(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="seqstate.lease")
    config, _ = await filled(nc)
    held = Lease(nc, config, "rebuild")  # a rebuild in progress
    await held.acquire(wait=False)
    projector = build_projector(nc, config)
    task: asyncio.Task[None] | None = None
    try:
        with pytest.raises(LeaseHeld, match=r"a rebuild of .* is running .*; wait for it to end"):
            await rebuild(nc, config)
        task = asyncio.create_task(projector.run())
        await eventually(
            lambda: "a rebuild of namespace" in caplog.text,
            what="the projector waits",
            watch=lambda: caplog.text,
        )
        assert not projector.caught_up.is_set() and projector.lease is None
        await held.release()
        await asyncio.wait_for(projector.caught_up.wait(), WAIT_S)
    finally:
        await held.release()
        projector.stop()
        if task is not None:
            await asyncio.wait_for(task, WAIT_S)


# ---- projectors ---------------------------------------------------------------------------------


async def test_a_second_projector_waits_then_takes_over_and_the_bucket_equals_a_replay(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="seqstate.lease")
    config = fresh_config("l")
    await ensure(nc, config)
    writer = build_writer(nc, config)
    writing = asyncio.create_task(writer.run())
    try:
        async with projecting(nc, config) as first:
            second = build_projector(nc, config)
            waiting = asyncio.create_task(second.run())
            await eventually(
                lambda: "waiting for it to stop" in caplog.text,
                what="the second one waits",
                watch=lambda: caplog.text,
            )
            assert f"a projector of namespace {config.namespace!r} is running ({HERE})" in (
                caplog.text
            )
            last = await publish_some(nc, config, "first")
            await writer.wait_applied(last)
            await writer.flush()
            await first.wait_flushed(last)
            # Never two writers: the second has not even read the bucket back.
            assert second.lease is None and second.stats.flushes == 0
            assert not second.caught_up.is_set()
        await asyncio.wait_for(second.caught_up.wait(), WAIT_S)
        assert second.lease is not None
        holder = await lease_value(nc, config)
        assert holder is not None and holder.id == second.lease.holder.id
        last = await publish_some(nc, config, "second")
        await writer.wait_applied(last)
        await writer.flush()
        await second.wait_flushed(last)
        second.stop()
        await asyncio.wait_for(waiting, WAIT_S)
    finally:
        writer.stop()
        await asyncio.wait_for(writing, WAIT_S)
    assert await verify(nc, config) == []


async def test_a_projector_whose_lease_is_taken_stops_and_its_run_raises(nc: Client) -> None:
    config, _ = await filled(nc)
    projector = build_projector(nc, config)
    task = asyncio.create_task(projector.run())
    try:
        await asyncio.wait_for(projector.caught_up.wait(), WAIT_S)
        kv = await registry(nc, config)
        await kv.put(lease_key(config.namespace), stranger())  # another holder took it
        with pytest.raises(
            LeaseLost,
            match=r"taken over: a projector of .* \(pid 1 on host "
            r"elsewhere\)",
        ):
            await asyncio.wait_for(task, WAIT_S)
    finally:
        projector.stop()
        with contextlib.suppress(LeaseLost):
            await asyncio.wait_for(task, WAIT_S)
    holder = await lease_value(nc, config)
    assert holder is not None and holder.id == "stranger"  # not deleted on the way out
    assert projector.lease is not None
    with pytest.raises(LeaseLost):  # what every write checks first
        projector.lease.check()


# ---- readers ------------------------------------------------------------------------------------


async def test_readers_ignore_the_lease_key(nc: Client) -> None:
    config, last = await filled(nc)
    ns = config.namespace
    assert parse_key(ns, lease_key(ns)).kind == "lease"
    kv = await registry(nc, config)
    await kv.put(lease_key(ns), b"not a lease")  # even a damaged one
    assert await verify(nc, config) == []
    bucket = await read_bucket(nc, config)
    assert not bucket.unreadable and bucket.position is not None
    state = config.new_state()
    for _, at_ns, data in await read_log(nc, config):
        state.apply(decode_event(data), at_ns)
    async with RegistryView(nc, config=config) as view:
        await view.wait_for(last, timeout=WAIT_S)
        received = view.values_received
        await kv.put(lease_key(ns), stranger())  # a renewal, as readers see one
        position = await kv.get(position_key(ns))
        await kv.put(position_key(ns), position.value or b"")  # delivered after it, in order
        await eventually(
            lambda: view.values_received, lambda n: n > received, what="the view saw the position"
        )
        assert view.values_received == received + 1  # the position only
        assert view.loads(state.now_ns) == state.registry.loads(state.now_ns)
        assert view.bad_values == 0
    # A running projector's lease, renewed meanwhile, changes nothing either.
    await kv.delete(lease_key(ns))
    async with projecting(nc, config, lease_ttl_s=0.6, lease_renew_s=0.05) as projector:
        lease = projector.lease
        assert lease is not None
        first = lease.revision
        await eventually(lambda: lease.revision, lambda r: r > first + 3, what="a few renewals")
        assert await verify(nc, config) == []
        assert not (await read_bucket(nc, config)).unreadable


async def test_renewals_carry_the_projectors_lag_and_no_reader_takes_it_for_data(
    nc: Client,
) -> None:
    """A projector's renewals say how far the bucket is behind the log (its heartbeat, for a
    scheduler that may read the bucket alone). Verify and read_bucket see no value, no stray
    in it; a dead projector's such lease is taken over by a rebuild, whose bucket verifies."""
    config, last = await filled(nc)
    ns = config.namespace
    kv = await registry(nc, config)
    async with projecting(nc, config, lease_ttl_s=0.6, lease_renew_s=0.05) as projector:
        holder = await eventually(
            lambda: lease_value(nc, config),
            lambda h: h is not None and h.heartbeat is not None,
            what="a renewal carrying the projector's lag",
        )
        assert projector.lease is not None and holder.id == projector.lease.holder.id
        beat = holder.heartbeat
        assert beat is not None and beat.ago_s >= 0
        # The log's head is the bucket's position: nothing lacking, nothing waiting.
        assert (beat.head, beat.behind, beat.captured, beat.oldest_ns) == (last, 0, 0, None)
        assert await verify(nc, config) == []
        bucket = await read_bucket(nc, config)
        assert not bucket.unreadable and bucket.strays == []
    # SIGKILLed on this machine: its last renewal stays, heartbeat and all.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = msgspec.structs.replace(holder, pid=gone.pid, pid_space=PID_SPACE, ttl_s=3600.0)
    await kv.put(lease_key(ns), msgspec.json.encode(dead))
    done = await asyncio.wait_for(rebuild(nc, config), WAIT_S)
    assert done.last_seq == last and await verify(nc, config) == []
    assert await lease_value(nc, config) is None  # the rebuild released it
