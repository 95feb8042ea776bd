"""A Dynamo deployment's Core publishes, stored by JetStream into the namespace's log.

``--dynamo-endpoint NS.COMPONENT.ENDPOINT`` makes provisioning create the namespace's capture
stream on Dynamo's subject and source it into the events stream, each subject rewritten to
``seqstate.events.<ns>.dynamo.<NS>.<COMPONENT>.<ENDPOINT>``: every reader that filters the
namespace's events (the writer, replay, verify, status) then reads Dynamo's too, flag or not.
"""

from __future__ import annotations

import itertools

import pytest
from eventually import eventually
from nats.aio.client import Client

from projector.nats.resources import ProvisioningError, dynamo_capture, ensure
from projector.nats.stream import last_seq_of
from projector.wire.capture import captured_subject, dynamo_subject
from projector.wire.config import Config, ConfigError

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
    await ensure(nc, config)  # idempotent: no second source, no error
    js = nc.jetstream()
    info = await js.stream_info(config.events_stream)
    assert [s.name for s in info.config.sources or []] == [dynamo_capture(config)]
    capture = await js.stream_info(dynamo_capture(config))
    assert capture.config.subjects == [
        dynamo_subject("dyn.backend.generate"),
        dynamo_subject("dyn.prefill.generate"),
    ]
    # Dynamo publishes on NATS Core: no ack, no headers. Then one of seqstate's own events.
    await nc.publish(dynamo_subject("dyn.backend.generate"), b"\x01first")
    await nc.publish(dynamo_subject("dyn.prefill.generate"), b"\x02second")
    await nc.flush()
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
    info = await nc.jetstream().stream_info("DYSHARED")
    assert sorted(s.name for s in info.config.sources or []) == sorted(
        [dynamo_capture(a), dynamo_capture(b)]
    )
    await nc.publish(dynamo_subject("two.backend.generate"), b"to b")
    await nc.publish(dynamo_subject("one.backend.generate"), b"to a")
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


async def test_a_forged_msg_id_on_a_dynamo_subject_is_named_a_squat(nc: Client) -> None:
    """A client that knows a router's next msg-id (here: the test computes one of ``seqstate
    publish``'s from the stream's key) and puts it on a Dynamo message takes it first; the
    router's event is refused, and the error says by what: a message copied in from the
    capture, not an earlier run. (Without the key, or a random tag, no one else knows it.)"""
    from projector.nats.resources import msg_id_key
    from projector.route.publisher import PublishError, RouterPublisher

    config = config_for(f"sq{next(_names)}.backend.generate")
    key = msg_id_key((await ensure(nc, config)).events)
    assert key is not None and len(key) == 32
    pub = RouterPublisher(nc, router_id="p9", config=config, msg_id_key=key)
    await nc.publish(
        dynamo_subject(config.dynamo_endpoints[0]),
        b"forged",
        headers={"Nats-Msg-Id": pub.msg_id(1)},
    )
    await stored(nc, config, 1)
    with pytest.raises(PublishError) as raised:
        await pub.add("r1", 1)
    assert raised.value.squatted and raised.value.taken_at == 1
    assert str(raised.value) == (
        f"AddRequest for request 'r1': msg-id {pub.msg_id(1)} is taken by stream sequence 1, a "
        f"message copied in from {dynamo_capture(config)} (the Dynamo capture, subject "
        f"'{captured_subject(config.namespace, config.dynamo_endpoints[0])}') whose publisher "
        "forged this msg-id in its Nats-Msg-Id header, so the event was not stored"
    )
