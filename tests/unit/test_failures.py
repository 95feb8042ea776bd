"""How a failed NATS request reads in a log line: a full disk is named, never
``ServiceUnavailableError()`` (no server: the errors are built as nats-py builds them)."""

from __future__ import annotations

import logging

import nats.errors
import nats.js.errors
import pytest

from projector.nats.connection import describe_refusal
from projector.nats.failures import describe, placing, retrying, storage_full


def from_server(code: int, err_code: int, description: str) -> nats.js.errors.APIError:
    """The error nats-py raises for a JetStream API error answer (its ``from_error``)."""
    try:
        nats.js.errors.APIError.from_error(
            {"code": code, "err_code": err_code, "description": description}
        )
    except nats.js.errors.APIError as exc:
        return exc
    raise AssertionError("nats-py raised nothing for an error answer")


FULL = from_server(503, 10023, "insufficient resources")


def test_a_full_disk_was_nameless() -> None:
    # What the writer logged for as long as it retried: no word of storage.
    assert isinstance(FULL, nats.js.errors.ServiceUnavailableError)
    assert repr(FULL) == "ServiceUnavailableError()"


ADVICE = (
    "; free disk space on the server, or raise its JetStream limit (max_file_store, "
    "max_memory_store, or the account's)"
)


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (FULL, f"JetStream storage full: insufficient resources (JetStream error 10023){ADVICE}"),
        (
            from_server(500, 10047, "insufficient storage resources available"),
            "JetStream storage full: insufficient storage resources available (JetStream "
            f"error 10047){ADVICE}",
        ),
        (
            from_server(400, 10002, "resource limits exceeded for account"),
            "JetStream storage full: resource limits exceeded for account (JetStream "
            f"error 10002){ADVICE}",
        ),
        (  # an object store's write on a full disk passes the disk's own words on
            from_server(500, 10051, "write /js/OBJ_s/msgs/1.blk: no space left on device"),
            "JetStream storage full: write /js/OBJ_s/msgs/1.blk: no space left on device "
            f"(JetStream error 10051){ADVICE}",
        ),
        (  # no responders on the JetStream API: nats-py's ServiceUnavailableError, no code
            nats.js.errors.ServiceUnavailableError(),
            "JetStream is off on this NATS server (nothing answers its API for this account): "
            "start nats-server with -js, or give its config a jetstream {} block (and the "
            "account jetstream: enabled); a server out of storage turns it off too, and says "
            "so in its log",
        ),
        (
            from_server(503, 10077, "maximum messages exceeded"),
            "the stream is full: maximum messages exceeded (JetStream error 10077)",
        ),
        (from_server(404, 10059, "stream not found"), "stream not found (JetStream error 10059)"),
        (nats.errors.TimeoutError(), "no answer in time"),
        (TimeoutError(), "no answer in time"),
        (
            nats.errors.NoRespondersError(),
            "NoRespondersError: nats: no responders available for request",
        ),
        (OSError("broken pipe"), "OSError: broken pipe"),
        (ValueError(), "ValueError"),
    ],
)
def test_describe_names_what_the_server_said(error: BaseException, said: str) -> None:
    assert describe(error) == said
    assert storage_full(error) == said.startswith("JetStream storage full")


async def test_a_retried_request_names_the_full_disk_in_its_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = 0

    async def refused() -> None:
        nonlocal calls
        calls += 1
        raise FULL

    with caplog.at_level(logging.WARNING, "seqstate"), pytest.raises(nats.js.errors.APIError):
        await retrying(refused, "a put", retry_for_s=0.05)
    said = [r.getMessage() for r in caplog.records]
    assert calls >= 2 and said, said
    assert said[0] == (
        "a put failed, retrying in 0.05s: JetStream storage full: insufficient resources "
        f"(JetStream error 10023){ADVICE}"
    )


NO_PEERS = from_server(500, 10005, "no suitable peers for placement, peer offline")


async def test_a_placement_waits_for_the_clusters_peers_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Right after a node of a cluster restarts, the cluster may refuse to place a replicated
    stream for a few seconds: a process starting then waits (one line), not fails at once."""
    answers: list[BaseException | str] = [NO_PEERS, NO_PEERS, NO_PEERS, "placed"]

    async def create() -> str:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    with caplog.at_level(logging.WARNING, "seqstate"):
        assert await placing(create, "placing stream EV") == "placed"
    assert [r.getMessage() for r in caplog.records] == [
        "placing stream EV: no suitable peers for placement, peer offline (JetStream error "
        "10005); waiting for the cluster's peers"
    ]


async def test_a_placement_refused_for_another_reason_is_not_retried() -> None:
    calls = 0

    async def create() -> None:
        nonlocal calls
        calls += 1
        raise FULL

    with pytest.raises(nats.js.errors.APIError):
        await placing(create, "placing stream EV")
    assert calls == 1


@pytest.mark.parametrize(
    ("violation", "said"),
    [
        (
            'nats: permissions violation for publish to "$js.api.stream.info.kv_seqstate-registry"',
            "user 'router' lacks the permission to read bucket seqstate-registry: NATS refused "
            'a publish to "$JS.API.STREAM.INFO.KV_seqstate-registry" (permissions violation)',
        ),
        (
            'nats: permissions violation for publish to "$js.api.stream.msg.get.seqstate_events"',
            "user 'router' lacks the permission to read stream SEQSTATE_EVENTS: NATS refused a "
            'publish to "$JS.API.STREAM.MSG.GET.SEQSTATE_EVENTS" (permissions violation)',
        ),
        (
            "nats: permissions violation for publish to "
            '"$js.api.consumer.create.seqstate_events.c1.seqstate.events.default.>"',
            "user 'router' lacks the permission to read stream SEQSTATE_EVENTS: NATS refused a "
            'publish to "$JS.API.CONSUMER.CREATE.SEQSTATE_EVENTS.c1.seqstate.events.default.>" '
            "(permissions violation)",
        ),
        (
            "nats: permissions violation for publish to "
            '"$js.api.stream.info.obj_seqstate-snapshots"',
            "user 'router' lacks the permission to read object store seqstate-snapshots: NATS "
            'refused a publish to "$JS.API.STREAM.INFO.OBJ_seqstate-snapshots" (permissions '
            "violation)",
        ),
        (
            'nats: permissions violation for publish to "$js.api.stream.update.seqstate_events"',
            "user 'router' lacks the permission to create or update stream SEQSTATE_EVENTS: NATS "
            'refused a publish to "$JS.API.STREAM.UPDATE.SEQSTATE_EVENTS" (permissions violation)',
        ),
        (
            'nats: permissions violation for publish to "$js.api.info"',
            "user 'router' lacks the permission to ask JetStream for the account's info: NATS "
            'refused a publish to "$JS.API.INFO" (permissions violation)',
        ),
        (
            'nats: permissions violation for publish to "$kv.seqstate-registry.default.load.1.0"',
            "user 'router' lacks the permission to write bucket seqstate-registry: NATS refused "
            'a publish to "$KV.seqstate-registry.default.load.1.0" (permissions violation)',
        ),
        (
            'nats: permissions violation for subscription to "seqstate.svc.default.writer.status"',
            "user 'router' lacks the permission to subscribe to "
            "seqstate.svc.default.writer.status: NATS refused a subscription to "
            '"seqstate.svc.default.writer.status" (permissions violation)',
        ),
    ],
)
def test_a_refused_command_says_what_the_user_lacks_the_permission_to_do(
    violation: str, said: str
) -> None:
    names = ["SEQSTATE_EVENTS", "KV_seqstate-registry", "OBJ_seqstate-snapshots"]
    assert describe_refusal(violation, user="router", names=names) == said


def test_a_client_between_servers_is_not_told_its_server_is_too_old() -> None:
    """A process provisioning while its client reconnects (a cluster node it was on just
    died) has no server version to read: it used to fail with "nats-server 0.0.0 is too old";
    its requests wait for the next server instead."""
    from nats.aio.client import Client

    from projector.nats.resources import check_server

    reconnecting = Client()  # no server yet: the version nats-py reports is 0.0.0
    version = reconnecting.connected_server_version
    assert (version.major, version.minor, version.patch) == (0, 0, 0)
    check_server(reconnecting)
