"""The shipped role config (deploy/nats-roles.conf) on a real nats-server: each role is
refused what it may not do, and is told so.

Each role tries what it may not do (a router the control subject, the bucket, the deltas and
another namespace; every role the others' subjects): each is refused by the server (a
permission violation, no ack) and nothing is stored. A command or a library call that is
refused says so in one line, naming what the user lacks, at once; a wrong password is
refused, never echoed.
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import nats
import nats.errors
import pytest
from log_text import plain_lines
from permissions_kit import (
    NO_ACK_S,
    PASSWORDS,
    _last_seq,
    _refused,
    _refused_publish,
    _stored_since,
    as_cli,
    as_role,
    role_config,
    started_roles_server,
    violations,
)

from projector.bucket.projection import Projector
from projector.bucket.reader import RegistryUnavailable, RegistryView
from projector.nats.connection import ConnectError, connect
from projector.route.publisher import PublishError, RouterPublisher
from projector.settings.config import Config
from projector.wire.values import load_key
from projector.write.writer import Writer
from seqstate import AddRequest, WorkerAdded, WorkerRemoved, encode_event

# The fixtures roles_server and pipeline, which the tests here take (a plugin: not imported).
pytest_plugins = ("permissions_fixtures",)


async def test_a_router_cannot_write_the_bucket_or_the_deltas(
    roles_server: str, pipeline: tuple[Writer, Projector], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    forged_load, forged_delta = b'{"active_blocks": 999}', b"forged delta"
    async with (
        as_role(roles_server, "router") as rnc,
        as_role(roles_server, "replay") as onc,
        as_role(roles_server, "control") as cnc,  # registering a worker is the operator's
    ):
        last = await RouterPublisher(cnc, router_id="perm-w", config=Config()).publish(
            WorkerAdded(worker_id=9)
        )
        await pipeline[1].wait_flushed(last)
        kv = await onc.jetstream().key_value("seqstate-registry")
        key = load_key("default", (9, 0))
        before = await kv.get(key)
        deltas_before = await _last_seq(onc, "SEQSTATE_DELTAS")
        await _refused_publish(rnc, f"$KV.seqstate-registry.{key}", forged_load)
        await _refused_publish(rnc, "seqstate.deltas.default", forged_delta)
        with pytest.raises(nats.errors.TimeoutError):  # nor may it read the bucket's stream
            await rnc.jetstream(timeout=NO_ACK_S).stream_info("KV_seqstate-registry")
        await rnc.flush()
        after = await kv.get(key)
        assert (after.revision, after.value) == (before.revision, before.value)
        assert forged_delta not in await _stored_since(onc, "SEQSTATE_DELTAS", deltas_before)
    assert _refused(caplog, f"$KV.seqstate-registry.{key}"), caplog.text
    assert _refused(caplog, "seqstate.deltas.default"), caplog.text


async def test_a_scheduler_cannot_publish_events(
    roles_server: str, pipeline: tuple[Writer, Projector], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with as_role(roles_server, "scheduler") as snc, as_role(roles_server, "replay") as onc:
        before = await _last_seq(onc, "SEQSTATE_EVENTS")
        forged = encode_event(
            AddRequest(request_id="forged", worker_id=1, block_hashes=[1], prefill_tokens=1)
        )
        subject = Config().event_subject(1)
        await _refused_publish(snc, subject, forged)
        assert forged not in await _stored_since(onc, "SEQSTATE_EVENTS", before)
    assert _refused(caplog, subject), caplog.text


async def test_a_wrong_role_password_is_refused_in_one_line(roles_server: str) -> None:
    config = Config(nats_url=roles_server, nats_user="writer", nats_password="not-it-55")
    with pytest.raises(ConnectError) as refused:
        async with connect(roles_server, service=False, config=config):
            pass
    message = str(refused.value)
    assert "refused the credentials" in message and "not-it-55" not in message


async def test_an_unknown_namespace_is_told_with_a_readers_own_rights_never_for_a_refusal(
    roles_server: str, pipeline: tuple[Writer, Projector]
) -> None:
    """The scheduler may read only the bucket: that is where ``loads`` looks a namespace up,
    and a mistyped one is named with those the bucket knows. The replay role looks in the
    events stream too. A role that may not read the bucket at all (a router) is told that it
    lacks the permission, never that the namespace is unknown."""
    prefix = "seqstate: error: unknown namespace 'dynn': nothing of it in "
    rc, out, err = await as_cli(roles_server, "scheduler", "loads", "--namespace", "dynn")
    (line,) = plain_lines(err)
    assert (rc, out) == (1, "") and line.startswith(prefix + "bucket seqstate-registry; "), err
    assert "default" in line.split("known namespaces: ", 1)[1].split(", "), line
    rc, out, err = await as_cli(roles_server, "replay", "status", "--namespace", "dynn")
    (line,) = plain_lines(err)
    assert (rc, out) == (1, "") and line.startswith(
        prefix + "stream SEQSTATE_EVENTS or bucket seqstate-registry; known namespaces: "
    ), err
    rc, out, err = await as_cli(roles_server, "router", "loads")
    assert (rc, out) == (1, ""), err
    assert plain_lines(err) == _lacks("router", *BUCKET_READ)


async def test_publish_as_a_router_is_refused_the_control_subject_in_one_line(
    roles_server: str, pipeline: tuple[Writer, Projector]
) -> None:
    """A topology event through ``seqstate publish`` as the router: refused by the server,
    reported at once as a permissions violation naming the subject (not a timeout, not
    "JetStream is not available"), and not stored."""
    async with as_role(roles_server, "replay") as onc:
        before = await _last_seq(onc, "SEQSTATE_EVENTS")
        line = b'{"type": "WorkerRemoved", "worker_id": 1}\n'
        rc, out, err = await as_cli(roles_server, "router", "publish", stdin=line)
        assert (rc, out) == (1, ""), err
        assert plain_lines(err) == [
            'seqstate: error: NATS refused a publish to "seqstate.events.default.control" '
            "(permissions violation for user 'router') while publishing events"
        ]
        forged = encode_event(WorkerRemoved(worker_id=1))
        assert forged not in await _stored_since(onc, "SEQSTATE_EVENTS", before)


async def test_a_router_publisher_is_told_the_control_subject_is_refused(
    roles_server: str, pipeline: tuple[Writer, Projector], caplog: pytest.LogCaptureFixture
) -> None:
    """RouterPublisher (the library) as the router: a WorkerRemoved raises PublishError
    saying the server refused the subject, after its first attempt (no retry can help), and
    the server logged one refusal, not one per retry."""
    caplog.set_level(logging.WARNING)
    async with as_role(roles_server, "router") as rnc:
        pub = RouterPublisher(rnc, router_id="perm-lib", config=Config(), timeout=1.0)
        with pytest.raises(PublishError) as refused:
            await pub.publish(WorkerRemoved(worker_id=1))
    assert str(refused.value) == (
        f"WorkerRemoved: msg-id {pub.msg_id(1)} not stored: NATS refused a publish to "
        '"seqstate.events.default.control" (permissions violation: this user may not '
        "publish it)"
    )
    assert len([line for line in violations(caplog) if "control" in line]) == 1


async def test_a_role_that_may_not_provision_is_told_so_in_one_line(tmp_path: Path) -> None:
    """``seqstate publish`` as the router on a fresh server (no streams yet): it would have to
    provision them, which a router may not. One line naming the subject refused, at once (it
    used to be "JetStream is not available", after 10 s of polling)."""
    line = b'{"type": "Free", "request_id": "x", "worker_id": 1}\n'
    with started_roles_server(tmp_path / "js") as url:
        rc, out, err = await as_cli(url, "router", "publish", stdin=line, timeout=20)
    assert (rc, out) == (1, ""), err
    assert plain_lines(err) == [
        'seqstate: error: NATS refused a publish to "$JS.API.INFO" (permissions violation for '
        "user 'router') while checking or provisioning the streams and the bucket"
    ]


async def test_a_view_under_a_role_that_may_not_read_the_bucket_says_so_at_once(
    roles_server: str,
) -> None:
    """A RegistryView started by a router (a client of ``projector.connect``) raises
    RegistryUnavailable saying the role lacks the permission, as the commands say it; it was
    nats-py's "nats: timeout", 5 s later. No other error ends the start first (it fails at
    once, so ``wait_for``'s 4 s are a bound never reached)."""
    config = role_config(roles_server, "router")
    async with connect(roles_server, service=False, config=config) as rnc:
        with pytest.raises(RegistryUnavailable) as refused:
            await asyncio.wait_for(RegistryView(rnc, config=config).start(), 4)
    assert str(refused.value) == (
        "user 'router' lacks the permission to read bucket seqstate-registry: NATS refused a "
        'publish to "$JS.API.STREAM.INFO.KV_seqstate-registry" (permissions violation)'
    )


async def test_a_router_on_nats_default_inbox_is_told_why_no_ack_comes(
    roles_server: str,
) -> None:
    """The README tour's snippet connects with ``nats.connect``, whose inbox is nats' ``_INBOX``:
    under the router role the server refuses that subscription, and the acks never come. The
    PublishError said only "ack timed out"; it names the inbox refused and the way out."""
    nc = await nats.connect(roles_server, user="router", password=PASSWORDS["router"])
    try:
        pub = RouterPublisher(nc, config=Config(), router_id="plain", retries=1)
        with pytest.raises(PublishError) as failed:
            await pub.add("r1", 1, block_hashes=[1])
    finally:
        await nc.close()
    said = str(failed.value)
    assert "ack timed out, 2 times; NATS refused this client the subscription to its inbox " in (
        said
    ), said
    assert said.endswith(
        "(permissions violation), where the acks come: connect with "
        'inbox_prefix="_SEQSTATE_INBOX.<user>" (projector.connect does)'
    ), said


def _lacks(role: str, what: str, subject: str) -> list[str]:
    return [
        f"seqstate: error: user {role!r} lacks the permission to {what}: NATS refused a publish "
        f'to "{subject}" (permissions violation)'
    ]


BUCKET_READ = ("read bucket seqstate-registry", "$JS.API.STREAM.INFO.KV_seqstate-registry")
# Commands a router or Dynamo's processes may not run: each reads something the role may not.
UNREADABLE: list[tuple[str, tuple[str, ...], tuple[str, str]]] = [
    ("router", ("status",), BUCKET_READ),
    ("router", ("loads",), BUCKET_READ),
    ("router", ("top", "--once", "--interval", "0.2"), BUCKET_READ),
    ("router", ("watch", "--duration", "1"), BUCKET_READ),
    ("router", ("inspect", "worker", "5"), BUCKET_READ),
    ("router", ("worker", "list"), BUCKET_READ),
    # The namespace is looked up first (the bucket): the first thing refused is named.
    ("router", ("snapshot", "list"), BUCKET_READ),
    ("router", ("snapshot", "show"), BUCKET_READ),
    ("router", ("replay", "--no-progress"), BUCKET_READ),
    (
        "scheduler",
        ("replay", "--no-progress"),
        ("read stream SEQSTATE_EVENTS", "$JS.API.STREAM.MSG.GET.SEQSTATE_EVENTS"),
    ),
    (
        "scheduler",
        ("status",),
        ("read stream SEQSTATE_DELTAS", "$JS.API.STREAM.MSG.GET.SEQSTATE_DELTAS"),
    ),
]


async def test_a_role_that_may_not_read_is_told_it_lacks_the_permission_in_one_line(
    roles_server: str, pipeline: tuple[Writer, Projector]
) -> None:
    """Each command a role may not run: exit 1 and one line saying what the user lacks the
    permission to read, as soon as the server refuses it. It used to log the server's -ERR,
    then end, after the request's timeout, with "NATS: nats: timeout"."""
    for role, argv, (what, subject) in UNREADABLE:
        rc, out, err = await as_cli(roles_server, role, *argv)
        assert (rc, out) == (1, ""), (role, argv, out, err)
        assert plain_lines(err) == _lacks(role, what, subject), (role, argv, err)
    # Dynamo's own user may neither read the bucket nor take replies under the inbox a
    # seqstate client of that name uses (each role reads only its own). The server refuses
    # both at once; the line names the one reported first, and the way out of the inbox's.
    rc, out, err = await as_cli(roles_server, "dynamo", "loads", "--json")
    assert (rc, out) == (1, ""), err
    [line] = plain_lines(err)
    inbox = (
        r"seqstate: error: user 'dynamo' lacks the permission to take its replies under the "
        r"inbox prefix _SEQSTATE_INBOX\.dynamo \(--nats-inbox-prefix: give one this user may "
        r'subscribe to\): NATS refused a subscription to "_SEQSTATE_INBOX\.dynamo\.[a-z0-9]+\.\*" '
        r"\(permissions violation\)"
    )
    assert re.fullmatch(inbox, line) or [line] == _lacks("dynamo", *BUCKET_READ), line


KV_LOAD = f"$KV.seqstate-registry.{load_key('default', (1, 0))}"
CONTROL, ROUTERS = Config().control_subject, Config().router_subject
WORKER = Config().event_subject(1, 0)
OTHER_NAMESPACE = Config(namespace="other").event_subject(1, 0)
# Per role, subjects it must be refused. The API subjects get an empty body: harmless (an
# invalid request) should one ever be let through; none of them deletes or purges.
FORBIDDEN: dict[str, list[str]] = {
    "router": [
        CONTROL,
        f"{CONTROL}.1",
        f"{ROUTERS}.1",
        OTHER_NAMESPACE,
        Config(namespace="other").router_subject,
        KV_LOAD,
        "seqstate.deltas.default",
        "seqstate.dead.default",
        "$JS.API.INFO",
        "$JS.API.STREAM.UPDATE.SEQSTATE_EVENTS",
    ],
    "scheduler": [WORKER, CONTROL, ROUTERS, KV_LOAD, "seqstate.deltas.default"],
    "control": [WORKER, ROUTERS, KV_LOAD, "seqstate.deltas.default", OTHER_NAMESPACE],
    "writer": [WORKER, ROUTERS, KV_LOAD, OTHER_NAMESPACE],
    "projector": [WORKER, CONTROL, ROUTERS, "seqstate.deltas.default", "seqstate.dead.default"],
    "replay": [WORKER, CONTROL, ROUTERS, KV_LOAD, "seqstate.deltas.default"],
    "demo": [f"{CONTROL}.1", OTHER_NAMESPACE, KV_LOAD, "seqstate.deltas.default"],
    # Every namespace's subjects are the admin's (serve-http's trackers are namespaces of
    # their own), and the operator's control subject: refused what none of its commands
    # needs, a single event's removal from the log (an empty body: a bad request if it ever
    # went through), another bucket or stream, another application's subjects.
    "admin": [
        f"{CONTROL}.1",
        f"{ROUTERS}.1",
        "$JS.API.STREAM.MSG.DELETE.SEQSTATE_EVENTS",
        "$JS.API.CONSUMER.CREATE.NOT_SEQSTATE",
        "$KV.not-seqstate.k",
        "orders.created",
        "namespace.dynamo.component.backend.endpoint.generate.kv_metrics",
    ],
    # Dynamo's own processes: Dynamo's subjects, and nothing of seqstate's.
    "dynamo": [WORKER, CONTROL, ROUTERS, KV_LOAD, "seqstate.deltas.default", "$JS.API.INFO"],
}


async def test_each_role_is_refused_what_it_may_not_publish(
    roles_server: str, pipeline: tuple[Writer, Projector], caplog: pytest.LogCaptureFixture
) -> None:
    """Every role tries the subjects of the others: each publish is refused by the server
    (its -ERR names the subject), and none of the forged events is stored. For a router:
    never the control subject (a WorkerRemoved), nor another namespace's subjects."""
    caplog.set_level(logging.WARNING)
    async with as_role(roles_server, "replay") as onc:
        before = await _last_seq(onc, "SEQSTATE_EVENTS")
        forged: list[bytes] = []
        for n, (role, subjects) in enumerate(FORBIDDEN.items()):
            async with as_role(roles_server, role) as nc:
                for subject in subjects:
                    body = b""
                    if subject.startswith("seqstate.events."):
                        body = encode_event(WorkerRemoved(worker_id=9000 + n))
                        forged.append(body)
                    await nc.publish(subject, body)
                await nc.flush()  # the server's -ERRs came before this PONG
        missing = [
            (role, subject)
            for role, subjects in FORBIDDEN.items()
            for subject in subjects
            if not _refused(caplog, subject)
        ]
        assert missing == [], caplog.text
        stored = await _stored_since(onc, "SEQSTATE_EVENTS", before)
        assert not set(forged) & set(stored)
