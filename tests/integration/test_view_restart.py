"""RegistryView across a nats-server SIGKILL and a restart on the same store.

No writer or projector here: the test writes the bucket itself, as a projector does (a
SequenceState folds events, a BucketImage turns its deltas into key writes), so what the view
must end with is known exactly and nothing but the server goes away. The server is the test's
own, since it is killed.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import nats
import nats.errors
from eventually import eventually
from nats.aio.client import Client
from nats.js.kv import KeyValue
from pipeline_kit import fresh_config

from projector.bucket.image import BucketImage
from projector.bucket.reader import RegistryView
from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from seqstate import AddRequest, Event, Free, MarkPrefillCompleted, SequenceState, WorkerRemoved

WAIT_S = 30.0  # any single wait: only a view that never resumes reaches it
T0_NS = 1_700_000_000_000_000_000
PROMPT = [7001, 7002, 7003]


async def reconnecting_client(url: str) -> Client:
    async def quiet(exc: Exception) -> None:  # the dead server is the point
        pass

    return await nats.connect(
        url, max_reconnect_attempts=-1, reconnect_time_wait=0.1, error_cb=quiet, connect_timeout=2
    )


class Projecting:
    """Events folded and written to the bucket as a projector writes them; counts the writes
    (each one a value the view must receive exactly once)."""

    def __init__(self, kv: KeyValue, state: SequenceState, image: BucketImage) -> None:
        self.kv, self.state, self.image = kv, state, image
        self.seq = 0
        self.writes = 0

    async def write(self, events: list[Event]) -> int:
        """One flush: every key the events touched, written once; then the position."""
        for event in events:
            self.seq += 1
            delta = self.state.apply(event, T0_NS + self.seq * 1_000_000)
            delta.seq = self.seq
            self.image.apply(delta)
        for key, value in self.image.take():
            if value is None:
                await self.kv.delete(key)
            else:
                await self.kv.put(key, value)
            self.writes += 1
        await self.kv.put(*self.image.position(self.seq))
        self.writes += 1
        return self.seq


async def test_a_view_resumes_on_its_own_after_its_server_restarts(tmp_path: Path) -> None:
    """Breaks: the server under a running RegistryView (SIGKILL, restart on the same store);
    writes then land in the bucket before the view can have noticed anything, among them a
    rank's removal (deletes). Expects: the view, never restarted and its client's callbacks
    not its own, re-creates its watch once, after the last revision it applied: it reaches
    the newest position, receives every write exactly once (a watch restarted from scratch or
    from a wrong revision would count some twice or miss some), follows later writes live, and
    its loads equal the state's. Before, the view waited on nats-py's ordered consumer, which
    re-creates itself only after two missed 5 s heartbeats: 10-20 s stale per restart."""
    config = fresh_config("vr")
    server = NatsServer(tmp_path / "store")
    server.start()
    writer_nc = await reconnecting_client(server.url)
    view_nc = await reconnecting_client(server.url)
    view: RegistryView | None = None
    try:
        await ensure(writer_nc, config)
        kv = await writer_nc.jetstream().key_value(config.registry_bucket)
        bucket = Projecting(kv, config.new_state(), BucketImage(config.namespace))
        view = await RegistryView(view_nc, config=config, stall_after_s=1.0).start()

        adds: list[Event] = [
            AddRequest(
                request_id=f"a{i}",
                worker_id=i % 3,
                block_hashes=[*PROMPT, i],
                prefill_tokens=100 + i,
            )
            for i in range(9)
        ]
        await caught_up(view, await bucket.write(adds))
        assert view.resumes == 0

        server.kill()
        server.start()
        # Until the restarted server answers JetStream requests: a write before that could
        # fail after the server stored it, and its retry would write the key twice.
        await eventually(
            writer_nc.jetstream(timeout=1.0).account_info,
            what="the restarted server answers JetStream requests",
            timeout=WAIT_S,
            interval=0.05,
            retry_on=(nats.errors.Error, TimeoutError),
        )
        after_restart = [
            MarkPrefillCompleted(request_id="a1", worker_id=1),
            Free(request_id="a3", worker_id=0),
            WorkerRemoved(worker_id=2),
            AddRequest(request_id="b1", worker_id=1, block_hashes=PROMPT, prefill_tokens=50),
        ]
        await caught_up(view, await bucket.write(after_restart))
        assert view.resumes == 1
        seq = await bucket.write([Free(request_id="a0", worker_id=0)])  # live again
        await caught_up(view, seq)

        assert (view.values_received, view.bad_values) == (bucket.writes, 0)
        registry = bucket.state.registry
        now = T0_NS + seq * 1_000_000
        assert [(r.worker_id, r.dp_rank) for r in view.loads(now)] == [(0, 0), (1, 0)]
        assert view.loads(now) == registry.loads(now)
        for query in ([*PROMPT, 4], PROMPT[:1], [1, 2]):
            assert view.potential_loads(query, 64, now) == registry.potential_loads(query, 64, now)
    finally:
        if view is not None:
            await view.stop()
        for client in (writer_nc, view_nc):
            with contextlib.suppress(Exception):
                await client.close()
        server.stop()


async def test_a_view_replaces_a_watch_that_holds_back_updates(tmp_path: Path) -> None:
    """Breaks: the view's delivery, not its consumer (the subscription dropped behind the
    view's back, as a lost flow-control reply or a lost delivery would leave it: the consumer
    lives on, holding the updates). Expects: two checks a silence apart that find updates
    held back make the view re-create its watch after its last revision, and every update
    arrives once. Only nats-py's heartbeat would notice otherwise, 30 s on."""
    config = fresh_config("vh")
    server = NatsServer(tmp_path / "store")
    server.start()
    nc = await reconnecting_client(server.url)
    view: RegistryView | None = None
    try:
        await ensure(nc, config)
        kv = await nc.jetstream().key_value(config.registry_bucket)
        bucket = Projecting(kv, config.new_state(), BucketImage(config.namespace))
        view = await RegistryView(nc, config=config, stall_after_s=0.5).start()
        await caught_up(view, await bucket.write([AddRequest(request_id="h1", worker_id=1)]))
        assert view._sub is not None
        await view._sub.unsubscribe()  # no interest: the consumer keeps what it would send
        seq = await bucket.write([AddRequest(request_id="h2", worker_id=1, block_hashes=PROMPT)])
        await caught_up(view, seq)
        assert view.resumes == 1
        assert (view.values_received, view.bad_values) == (bucket.writes, 0)
        now = T0_NS + seq * 1_000_000
        assert view.loads(now) == bucket.state.registry.loads(now)
    finally:
        if view is not None:
            await view.stop()
        with contextlib.suppress(Exception):
            await nc.close()
        server.stop()


async def caught_up(view: RegistryView, seq: int) -> None:
    try:
        await view.wait_for(seq, timeout=WAIT_S)
    except TimeoutError:
        raise AssertionError(
            f"the view stalled at position {view.applied_seq}, not {seq}; "
            f"{view.resumes} watches re-created"
        ) from None
