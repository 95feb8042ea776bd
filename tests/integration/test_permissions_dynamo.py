"""The shipped role config (deploy/nats-roles.conf) on a real nats-server: Dynamo's
processes, signed in as ``dynamo``, and seqstate's Dynamo capture.

The writer and the projector provision the namespace's capture as themselves; Dynamo's
replica-sync messages are captured and folded, and the admin resyncs, listens to Dynamo's
routers and uncaptures endpoints. A client of the dynamo role takes nothing from seqstate:
no reply on nats' default inbox, and no effect from the JetStream headers it forges.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import nats
import nats.errors
from dynamo_capture import CAPTURE
from eventually import eventually
from nats.aio.msg import Msg
from permissions_kit import PASSWORDS, _clean, as_cli, as_role, role_config, started_roles_server

from projector.bucket.projection import Projector
from projector.bucket.reader import RegistryView
from projector.nats.resources import dynamo_capture, ensure
from projector.route.publisher import RouterPublisher
from projector.settings.config import Config
from projector.wire.headers import MSG_ID
from projector.write.writer import Writer
from seqstate.batches import items_of
from seqstate.dynamo import decode_dynamo, dynamo_subject, encode_dynamo

# The fixtures roles_server and pipeline, which the tests here take (a plugin: not imported).
pytest_plugins = ("permissions_fixtures",)


async def test_the_writer_and_the_projector_provision_a_dynamo_capture_as_themselves(
    roles_server: str,
) -> None:
    """``--dynamo-endpoint`` on the writer or the projector, each signed in as its role:
    the capture stream is created (the writer's forwarder stores what it captures: no
    source), with no permissions violation (each may create and update the namespace's
    capture stream)."""
    for role in ("writer", "projector"):
        async with as_role(roles_server, role, dynamo_endpoint="dyn.backend.generate") as nc:
            config = role_config(roles_server, role, dynamo_endpoint="dyn.backend.generate")
            await ensure(nc, config)
            js = nc.jetstream()
            assert not (await js.stream_info(config.events_stream)).config.sources
            capture = await js.stream_info(dynamo_capture(config))
            assert dynamo_subject("dyn.backend.generate") in (capture.config.subjects or [])


async def test_dynamo_publishes_as_dynamo_and_the_admin_resyncs(
    roles_server: str, pipeline: tuple[Writer, Projector]
) -> None:
    """Dynamo's processes sign in as ``dynamo``: their replica-sync messages (a frontend's
    first six AddRequests of the shared capture) are stored by the namespace's capture and
    folded; ``seqstate dynamo resync`` as the admin republishes them on Dynamo's subject."""
    endpoint = "dynamo.backend.generate"
    async with as_role(roles_server, "writer", dynamo_endpoint=endpoint) as wnc:
        await ensure(wnc, role_config(roles_server, "writer", dynamo_endpoint=endpoint))
    async with as_role(roles_server, "dynamo") as dnc:
        for message in CAPTURE[:6]:
            await dnc.publish(dynamo_subject(endpoint), message.data)
        await dnc.flush()
    writer = pipeline[0]
    six = {decode_dynamo(message.data).request_id for message in CAPTURE[:6]}
    await eventually(
        lambda: six - set(writer.state.requests.owner),
        lambda missing: not missing,
        what="the six Dynamo requests folded",
    )
    await pipeline[1].wait_flushed(writer.applied.value)
    argv = ("dynamo", "resync", "--dynamo-endpoint", endpoint)
    rc, out, err = await as_cli(roles_server, "admin", *argv)
    _clean("admin", argv, rc, out, err)
    assert "resynced 6 requests in flight" in out, out


async def test_the_admins_run_listens_to_dynamos_routers(tmp_path: Path) -> None:
    """``run --dynamo-endpoint`` as the admin, with no discovery to follow: Dynamo's routers
    (signed in as ``dynamo``) publish, and the run hears a router publisher the log never
    heard (the last resort that resyncs a frontend started blind), refused nothing."""
    endpoint = "adm.backend.generate"
    with started_roles_server(tmp_path / "js") as url:
        argv = ("run", "--nats-url", url, "--dynamo-endpoint", endpoint)
        argv += ("--dynamo-discovery", "none", "--duration", "6")
        run = asyncio.ensure_future(as_cli(url, "admin", *argv))
        async with as_role(url, "dynamo") as dnc:
            for publisher in range(1, 60):  # a new router each time, until the run is over
                if run.done():
                    break
                data = encode_dynamo(
                    msgspec.structs.replace(
                        decode_dynamo(CAPTURE[0].data), publisher_id=publisher, sequence=0
                    )
                )
                await dnc.publish(dynamo_subject(endpoint), data)
                await dnc.flush()
                await asyncio.sleep(0.2)
        rc, out, err = await run
    _clean("admin", argv, rc, out, err)
    assert "a router publisher never seen before" in err, err


async def test_a_dynamo_client_on_the_default_inbox_sees_no_seqstate_reply(
    roles_server: str, pipeline: tuple[Writer, Projector]
) -> None:
    """The dynamo role may subscribe to nats' default ``_INBOX.>`` (Dynamo's processes take
    their replies there). A Dynamo-side client listening there (the server accepts the
    subscription: no error) while a router publishes (its acks), a scheduler reads the bucket,
    the replay role reads the log (a replay's and status's push deliveries carry every event,
    msg-ids included) and a router's ``seqstate publish`` runs, receives nothing."""
    seen: list[str] = []
    errors: list[Exception] = []

    async def listen(msg: Msg) -> None:
        seen.append(msg.subject)

    async def error(exc: Exception) -> None:
        errors.append(exc)

    spy = await nats.connect(
        roles_server,
        max_reconnect_attempts=0,
        user="dynamo",
        password=PASSWORDS["dynamo"],
        error_cb=error,
    )
    try:
        await spy.subscribe("_INBOX.>", cb=listen)
        await spy.flush()
        async with (
            as_role(roles_server, "router") as rnc,
            as_role(roles_server, "scheduler") as snc,
        ):
            pub = RouterPublisher(rnc, router_id="inbox-probe", config=Config())
            await pub.add("inbox-1", 7, 0, block_hashes=[1, 2])
            last = await pub.free("inbox-1", 7, 0)
            async with RegistryView(snc, config=Config()) as view:
                await view.wait_for(last, timeout=20)
        await pipeline[1].wait_flushed(last)
        for role, argv in (
            ("replay", ("replay", "--verify")),
            ("replay", ("status",)),
            ("router", ("publish", "--router-id", "inbox-cli")),
        ):
            stdin = b'{"type": "Free", "request_id": "inbox-2", "worker_id": 7}\n'
            rc, out, err = await as_cli(roles_server, role, *argv, stdin=stdin)
            _clean(role, argv, rc, out, err)
        await spy.flush()
    finally:
        await spy.close()
    assert errors == []
    assert seen == []


# What a client of the dynamo role may put on a Dynamo subject, beside its message: JetStream's
# publish headers. The capture stream refuses those asking for what it does not allow
# (rollups, per-message TTLs, atomic batches, schedules, counters); the rest are stored and
# copied into the events stream, the Nats-Expected-* checks dropped on the way (a source does
# not check them again), the msg-id kept: the one header that reaches seqstate's events.
FORGED: list[tuple[dict[str, str], bool]] = [  # (headers, reaches the events stream)
    *(({"Nats-Msg-Id": f"forger:{n}"}, True) for n in range(1, 6)),  # a router's ids, as were
    ({"Nats-Rollup": "all"}, False),
    ({"Nats-Rollup": "sub"}, False),
    ({"Nats-TTL": "1s"}, False),
    ({"Nats-Batch-Id": "b1", "Nats-Batch-Sequence": "1", "Nats-Batch-Commit": "1"}, False),
    (
        {"Nats-Schedule": "@every 1s", "Nats-Schedule-Target": "seqstate.events.default.control"},
        False,
    ),
    ({"Nats-Incr": "1"}, False),
    ({"Nats-Expected-Stream": "SEQSTATE_EVENTS_DYNAMO_default"}, True),
    ({"Nats-Expected-Last-Subject-Sequence-Subject": "seqstate.events.default.control"}, False),
    ({"Nats-Expected-Last-Sequence": "0"}, False),  # the capture holds messages: refused
    ({"Nats-Marker-Reason": "MaxAge"}, True),
]


async def test_a_dynamo_clients_forged_headers_take_nothing_from_seqstate(
    roles_server: str, pipeline: tuple[Writer, Projector]
) -> None:
    """A client of the dynamo role puts JetStream headers on Dynamo messages, among them the
    msg-ids a router's events had (``<router_id>:<n>``). Each is refused by the capture or
    reaches the events stream as a Dynamo message and nothing more: no purge, no stall (a
    message sent after them is folded), and the router's own events, published after, are
    stored and folded, none taken as a duplicate."""
    endpoint = "dynamo.backend.generate"
    async with as_role(roles_server, "writer", dynamo_endpoint=endpoint) as wnc:
        await ensure(wnc, role_config(roles_server, "writer", dynamo_endpoint=endpoint))
    writer = pipeline[0]
    async with as_role(roles_server, "replay") as onc:
        js = onc.jetstream()
        before = (await js.stream_info("SEQSTATE_EVENTS")).state
        forger = await nats.connect(
            roles_server, max_reconnect_attempts=0, user="dynamo", password=PASSWORDS["dynamo"]
        )
        try:
            for i, (headers, _) in enumerate(FORGED):
                free = _dynamo(i, f"forged-{i}", "Free")
                await forger.publish(dynamo_subject(endpoint), free, headers=headers)
            await forger.publish(dynamo_subject(endpoint), _dynamo(len(FORGED), "after", "Add"))
            await forger.flush()
        finally:
            await forger.close()
        await eventually(
            lambda: "after" in writer.state.requests.owner,
            what="the Dynamo message sent after the forged ones folded",
        )
        async with as_role(roles_server, "router") as rnc:
            pub = RouterPublisher(rnc, router_id="forger", config=Config())
            seqs = [await pub.add(f"forger-{n}", 3, 0, block_hashes=[n]) for n in range(1, 6)]
        assert len(set(seqs)) == 5
        await eventually(
            lambda: {f"forger-{n}" for n in range(1, 6)} - set(writer.state.requests.owner),
            lambda missing: not missing,
            what="the router's five events folded",
        )
        after = (await js.stream_info("SEQSTATE_EVENTS")).state
        # nothing purged or removed: every message stored since is still there
        assert after.messages - before.messages == after.last_seq - before.last_seq
        reached = []
        forged = {k for h, _ in FORGED for k in h}
        for seq in range(before.last_seq + 1, after.last_seq + 1):
            msg = await js.get_msg("SEQSTATE_EVENTS", seq)
            if msg.subject.endswith(".dynamo.dynamo.backend.generate"):
                # stored by the writer's forwarder: its own headers, none of the forger's
                headers = msg.headers or {}
                assert headers[MSG_ID].startswith("capture:"), headers
                assert not forged & set(headers) - {MSG_ID, "Nats-Expected-Last-Subject-Sequence"}
                reached += [decode_dynamo(item).request_id for item in items_of(msg.data)]
    assert reached == [*(f"forged-{i}" for i, (_, ok) in enumerate(FORGED) if ok), "after"]


def _dynamo(sequence: int, request_id: str, op: str) -> bytes:
    """A Dynamo replica-sync message of a forging publisher (its own id, sequences from 0)."""
    from seqstate.dynamo import ADD, FREE, DynamoMessage, encode_dynamo

    return encode_dynamo(
        DynamoMessage(
            publisher_id=4242,
            sequence=sequence,
            published_at_ms=1,
            request_id=request_id,
            worker_id=3,
            router_id=99,
            op=ADD if op == "Add" else FREE,
            token_sequence=[1, 2] if op == "Add" else None,
        )
    )


async def test_the_admin_uncaptures_a_typod_endpoint_then_every_endpoint(
    roles_server: str,
) -> None:
    """``seqstate dynamo uncapture`` as the admin, with no permissions violation: a typo'd
    endpoint taken out of the capture stream (an update, which the writer's grants allow),
    then the last one (the stream deleted: the one grant the admin has beyond its roles').
    The writer's next start provisions the capture again."""
    typo, endpoint = "dynamo.backend.generat", "dynamo.backend.generate"
    both = f"{endpoint},{typo}"
    async with as_role(roles_server, "writer", dynamo_endpoint=both) as nc:
        await ensure(nc, role_config(roles_server, "writer", dynamo_endpoint=both))
    said = []
    for argv in (("dynamo", "uncapture", "--dynamo-endpoint", typo), ("dynamo", "uncapture")):
        rc, out, err = await as_cli(roles_server, "admin", *argv)
        _clean("admin", argv, rc, out, err)
        said.append(out)
    config = role_config(roles_server, "writer", dynamo_endpoint=endpoint)
    assert said[0].startswith(f"uncaptured Dynamo endpoint {typo} of namespace 'default'")
    assert (
        f"stream {dynamo_capture(config)} deleted: namespace 'default' captures no Dynamo "
        "endpoint\n"
    ) in said[1]
    async with as_role(roles_server, "writer", dynamo_endpoint=endpoint) as nc:
        await ensure(nc, config)
        info = await nc.jetstream().stream_info(dynamo_capture(config))
        assert info.config.subjects == [dynamo_subject(endpoint)]
