"""A Dynamo deployment's Core publishes, stored by JetStream into the namespace's log.

``--dynamo-endpoint NS.COMPONENT.ENDPOINT`` makes provisioning create the namespace's capture
stream on Dynamo's subject, and the writer's forwarder stores what it captures in the events
stream, each subject rewritten to ``seqstate.events.<ns>.dynamo.<NS>.<COMPONENT>.<ENDPOINT>``:
every reader that filters the namespace's events (the writer, replay, verify, status) then
reads Dynamo's too, flag or not.
"""

from __future__ import annotations

import itertools

import pytest
from eventually import eventually
from nats.aio.client import Client
from pipeline_kit import forwarding

from projector.nats.resources import ProvisioningError, dynamo_capture, ensure
from projector.nats.stream import last_seq_of
from projector.settings.config import Config, ConfigError
from projector.wire.capture import captured_subject, dynamo_subject

_names = itertools.count()


def config_for(endpoints: str, events: str | None = None) -> Config:
    n = next(_names)
    return Config(
        namespace=f"dy{n}",
        events_stream=events or f"DYEV{n}",
        deltas_stream=f"DYDL{n}",
        registry_bucket=f"dyreg{n}",
        dynamo_endpoint=endpoints,
    )


async def stored(nc: Client, config: Config, count: int) -> list[tuple[str, bytes]]:
    """The namespace's events once ``count`` are there, as (subject, data)."""
    js = nc.jetstream()
    await eventually(
        lambda: last_seq_of(js, config.events_stream, config.events_subjects),
        lambda last: last > 0,
        what="the first event stored",
    )
    psub = await js.pull_subscribe(config.events_subjects, stream=config.events_stream)
    got: list[tuple[str, bytes]] = []
    try:
        while len(got) < count:
            for msg in await psub.fetch(count - len(got), timeout=10):
                got.append((msg.subject, msg.data))
    finally:
        await psub.unsubscribe()
    return got


async def test_a_core_publish_on_the_endpoint_is_stored_under_the_namespace(nc: Client) -> None:
    config = config_for("dyn.backend.generate, dyn.prefill.generate")
    await ensure(nc, config)
    await ensure(nc, config)  # idempotent: no error
    js = nc.jetstream()
    info = await js.stream_info(config.events_stream)
    assert not info.config.sources  # the writer's forwarder stores what is captured
    capture = await js.stream_info(dynamo_capture(config))
    assert capture.config.subjects == [
        dynamo_subject("dyn.backend.generate"),
        dynamo_subject("dyn.prefill.generate"),
    ]
    # Dynamo publishes on NATS Core: no ack, no headers. Then one of seqstate's own events.
    await nc.publish(dynamo_subject("dyn.backend.generate"), b"\x01first")
    await nc.publish(dynamo_subject("dyn.prefill.generate"), b"\x02second")
    await nc.flush()
    async with forwarding(nc, config):
        got = await stored(nc, config, 2)
    assert got == [
        (captured_subject(config.namespace, "dyn.backend.generate"), b"\x01first"),
        (captured_subject(config.namespace, "dyn.prefill.generate"), b"\x02second"),
    ]


async def test_two_namespaces_capture_their_own_endpoints_into_one_events_stream(
    nc: Client,
) -> None:
    a = config_for("one.backend.generate", events="DYSHARED")
    b = config_for("two.backend.generate", events="DYSHARED")
    await ensure(nc, a)
    await ensure(nc, b)
    await nc.publish(dynamo_subject("two.backend.generate"), b"to b")
    await nc.publish(dynamo_subject("one.backend.generate"), b"to a")
    async with forwarding(nc, a), forwarding(nc, b):
        assert await stored(nc, a, 1) == [
            (captured_subject(a.namespace, "one.backend.generate"), b"to a")
        ]
        assert await stored(nc, b, 1) == [
            (captured_subject(b.namespace, "two.backend.generate"), b"to b")
        ]


async def test_an_endpoint_another_namespace_captures_is_refused_in_words(nc: Client) -> None:
    await ensure(nc, config_for("same.backend.generate"))
    with pytest.raises(ProvisioningError, match="overlap"):
        await ensure(nc, config_for("same.backend.generate"))


@pytest.mark.parametrize(
    "endpoints", ["dynamo.backend", "a.b.c.d", "a..c", "a.b.c,", "a.b.*", "a.b.c, x y.b.c"]
)
def test_a_malformed_endpoint_is_one_line(endpoints: str) -> None:
    with pytest.raises(ConfigError, match=r"is not a Dynamo endpoint: NAMESPACE\.COMPONENT"):
        Config(dynamo_endpoint=endpoints)


async def test_a_forged_msg_id_on_a_dynamo_subject_takes_no_routers_id(nc: Client) -> None:
    """A client that knows a router's next msg-id (here: the test computes one of ``seqstate
    publish``'s from the stream's key) and puts it on a Dynamo message takes nothing: the
    forwarder stores Dynamo's bytes under a msg-id of its own, never a header Dynamo's side
    chose, so the router's event is stored."""
    from projector.nats.resources import msg_id_key
    from projector.route.publisher import RouterPublisher

    config = config_for(f"sq{next(_names)}.backend.generate")
    key = msg_id_key((await ensure(nc, config)).events)
    assert key is not None and len(key) == 32
    pub = RouterPublisher(nc, router_id="p9", config=config, msg_id_key=key)
    await nc.publish(
        dynamo_subject(config.dynamo_endpoints[0]),
        b"forged",
        headers={"Nats-Msg-Id": pub.msg_id(1)},
    )
    async with forwarding(nc, config):
        await stored(nc, config, 1)
    await pub.add("r1", 1)
    got = await stored(nc, config, 2)
    assert got[0][1] == b"forged"
    assert got[1][0] == config.event_subject(1)
