"""The shipped role config (deploy/nats-roles.conf) on a real nats-server: enough, and no more.

One server per module runs with the role config. The writer and the projector run with their
own credentials, a router publishes with its credential (heartbeat and goodbye included), the
control role registers the workers, a scheduler reads the bucket with its credential, and an
operator verifies with the replay credential: the loads equal an in-process fold of the log
exactly, and no client was refused anything. Every command the role table gives a role runs, as a
subprocess, signed in as that role; ``seqstate writer`` and ``seqstate projector`` run as
compose runs them and the writer's idle Tick expires a request; the admin runs the commands
that do several roles' work (``run``, ``rebuild``, ``snapshot save``, ``serve-http``). Then
each role tries what it may not do (a router the control subject and another namespace,
every role the others' subjects): each is refused by the server (a permission violation, no
ack) and nothing is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import nats
import nats.errors
import pytest
from dynamo_capture import CAPTURE
from eventually import eventually
from http_kit import exchange, rows
from log_text import plain_lines
from nats.aio.client import Client
from nats.aio.msg import Msg
from pipeline_kit import read_log

from projector.bucket.projection import Projector
from projector.bucket.reader import RegistryUnavailable, RegistryView
from projector.control.workers import WorkerControl
from projector.nats.connection import ConnectError, connect
from projector.nats.resources import dynamo_capture, ensure
from projector.route.publisher import PublishError, RouterPublisher
from projector.run.assemble import build_projector, build_writer
from projector.schedule.scheduler import Scheduler
from projector.settings.config import Config
from projector.wire.headers import MSG_ID
from projector.wire.values import load_key
from projector.write.writer import Writer
from seqstate import AddRequest, WorkerAdded, WorkerRemoved, decode_event, encode_event
from seqstate.batches import items_of
from seqstate.dynamo import decode_dynamo, dynamo_subject, encode_dynamo

REPO = Path(__file__).resolve().parents[2]
ROLES_CONF = REPO / "deploy" / "nats-roles.conf"
ROLES = (
    "router",
    "scheduler",
    "chooser",
    "control",
    "writer",
    "projector",
    "replay",
    "demo",
    "admin",
    "dynamo",
)
PASSWORDS = {role: f"pw-{role}-7Qx2" for role in ROLES}
VIOLATION = "permissions violation"
NO_ACK_S = 1.0  # how long a refused JetStream publish waits for the ack that never comes


@contextlib.contextmanager
def started_roles_server(store: Path) -> Iterator[str]:
    """A nats-server with the shipped role config; its URL (no credentials in it)."""
    from projector.nats.server import NatsServer

    env = {f"SEQSTATE_{role.upper()}_PASSWORD": pw for role, pw in PASSWORDS.items()}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the config reads the passwords from the server's environment
    try:
        server = NatsServer(store, extra_args=("-c", str(ROLES_CONF)))
        server.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def roles_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with started_roles_server(tmp_path_factory.mktemp("roles") / "js") as url:
        yield url


def role_config(url: str, role: str, **overrides: object) -> Config:
    """The default names (the role config is written for them) and this role's credential."""
    return Config(nats_url=url, nats_user=role, nats_password=PASSWORDS[role], **overrides)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def as_role(url: str, role: str, **overrides: object) -> AsyncIterator[Client]:
    config = role_config(url, role, **overrides)
    async with connect(url, service=False, config=config) as nc:
        yield nc


def violations(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if VIOLATION in r.getMessage().lower()]


@pytest.fixture
async def pipeline(roles_server: str) -> AsyncIterator[tuple[Writer, Projector]]:
    """The writer and the projector, each signed in as itself (a snapshot every 5 events);
    the writer forwards the namespace's Dynamo capture (``dynamo.backend.generate``)."""
    writer_config = role_config(
        roles_server, "writer", snapshot_every_events=5, dynamo_endpoint="dynamo.backend.generate"
    )
    projector_config = role_config(roles_server, "projector")
    async with (
        connect(roles_server, service=True, config=writer_config) as wnc,
        connect(roles_server, service=True, config=projector_config) as pnc,
    ):
        writer, projector = build_writer(wnc, writer_config), build_projector(pnc, projector_config)
        tasks = [asyncio.create_task(writer.run()), asyncio.create_task(projector.run())]
        started = asyncio.gather(writer.caught_up.wait(), projector.caught_up.wait())
        done, _ = await asyncio.wait(
            [started, *tasks], timeout=30, return_when=asyncio.FIRST_COMPLETED
        )
        assert started in done, [t.exception() for t in tasks if t.done()]
        try:
            yield writer, projector
        finally:
            writer.stop()
            projector.stop()
            await asyncio.wait(tasks, timeout=10)
            for task in tasks:
                task.cancel()


async def test_each_role_does_its_job_with_its_own_credential(
    roles_server: str, pipeline: tuple[Writer, Projector], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with (
        as_role(roles_server, "router") as rnc,
        as_role(roles_server, "scheduler") as snc,
        as_role(roles_server, "replay") as onc,
    ):
        async with as_role(roles_server, "control") as cnc:  # topology is the operator's
            added = await WorkerControl(cnc, config=Config()).add(1, dp_size=2)
            assert added.applied
        # RouterPublisher with its defaults: a heartbeat at start, a goodbye at close.
        pub = await RouterPublisher(rnc, router_id="perm-r", config=Config()).start()
        for i in range(12):
            await pub.add(
                f"r{i}", 1, i % 2, block_hashes=[100, 101, 200 + i], prefill_tokens=100 + i
            )
        last = await pub.free("r3", 1, 1)
        async with RegistryView(snc, config=Config()) as view:
            await view.wait_for(last, timeout=20)
            state = Config().new_state()
            last_ns = 0
            for _, at_ns, data in await read_log(onc, Config()):
                state.apply(decode_event(data), at_ns)
                last_ns = at_ns
            assert view.applied_seq >= last
            for offset_ns in (0, 10**6, 10**9):
                now = last_ns + offset_ns
                assert view.loads(now) == state.registry.loads(now)
                query = [100, 101, 205]
                assert view.potential_loads(query, 64, now) == state.registry.potential_loads(
                    query, 64, now
                )
        # An operator finds the writer and the projector as NATS services (nats micro).
        for kind in ("writer", "projector"):
            info = json.loads((await onc.request(f"$SRV.INFO.seqstate-{kind}", b"", 10)).data)
            assert info["metadata"]["namespace"] == "default"
            status = await onc.request(f"seqstate.svc.default.{kind}.status", b"", 10)
            assert json.loads(status.data)["kind"] == kind
        await pub.close()  # its goodbye, on the routers subject
        assert pub.heartbeat_failures == 0
    assert violations(caplog) == []


async def test_a_scheduler_books_and_follows_its_peers_with_the_chooser_credential(
    roles_server: str, pipeline: tuple[Writer, Projector], caplog: pytest.LogCaptureFixture
) -> None:
    """A Scheduler is a router that chooses: the chooser role lets it publish, read the bucket
    and follow the namespace's worker events through a consumer (its peers' bookings), and
    still not read the events stream's info, whose metadata holds the key of the Ticks."""
    caplog.set_level(logging.WARNING)
    async with as_role(roles_server, "chooser") as a_nc, as_role(roles_server, "chooser") as b_nc:
        async with (
            Scheduler(a_nc, config=Config(), router_id="perm-a", block_size=16) as a,
            Scheduler(b_nc, config=Config(), router_id="perm-b", block_size=16) as b,
        ):
            assert a.following and b.following
            await a.add("perm-s1", worker_id=9, block_hashes=[1, 2, 3], prefill_tokens=48)
            await eventually(
                lambda: [r.active_requests for r in b.costs([1, 2, 3], 48, [(9, 0)])],
                lambda n: n == [1],
                what="b counts a's booking",
            )
            last = await a.free("perm-s1")
            await b.view.wait_for(last, timeout=20)
        assert violations(caplog) == []
        with pytest.raises(nats.errors.TimeoutError):
            await a_nc.jetstream(timeout=NO_ACK_S).stream_info("SEQSTATE_EVENTS")


def test_replay_verify_runs_with_the_replay_credential(
    roles_server: str, pipeline: tuple[Writer, Projector]
) -> None:
    clean = {
        k: v for k, v in os.environ.items() if k != "NATS_URL" and not k.startswith("SEQSTATE_")
    }
    env = {
        **clean,
        "NATS_URL": roles_server,
        "SEQSTATE_NATS_USER": "replay",
        "SEQSTATE_NATS_PASSWORD": PASSWORDS["replay"],
        "COLUMNS": "400",
    }
    for argv in (["replay", "--verify", "--no-progress"], ["status"]):
        result = subprocess.run(
            [sys.executable, "-m", "projector", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=REPO,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert PASSWORDS["replay"] not in result.stdout + result.stderr
        assert VIOLATION not in (result.stdout + result.stderr).lower()


async def _refused_publish(nc: Client, subject: str, payload: bytes) -> None:
    """A JetStream publish the server refuses: no ack comes."""
    with pytest.raises(nats.errors.TimeoutError):
        await nc.jetstream(timeout=NO_ACK_S).publish(subject, payload)
    await nc.flush()  # the server's -ERR came before this PONG: the error callback has run


async def _stored_since(nc: Client, stream: str, after: int) -> list[bytes]:
    """The payloads ``stream`` stored after sequence ``after`` (the pipeline keeps writing)."""
    js = nc.jetstream()
    last = (await js.stream_info(stream)).state.last_seq
    return [(await js.get_msg(stream, seq)).data or b"" for seq in range(after + 1, last + 1)]


async def _last_seq(nc: Client, stream: str) -> int:
    return (await nc.jetstream().stream_info(stream)).state.last_seq


def _refused(caplog: pytest.LogCaptureFixture, subject: str) -> bool:
    """The server said it refused a publish to ``subject`` (nats-py lower-cases its -ERR)."""
    return any(f'publish to "{subject.lower()}"' in line.lower() for line in violations(caplog))


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


async def test_a_scheduler_hears_the_projectors_heartbeat_from_the_bucket_alone(
    roles_server: str, pipeline: tuple[Writer, Projector], caplog: pytest.LogCaptureFixture
) -> None:
    """The scheduler may read the bucket and nothing else (the events stream's info holds a
    key): the projector's lease renewals bring its view the log's head and what it lacks of
    it, under the scheduler's own credential."""
    caplog.set_level(logging.WARNING)
    async with (
        as_role(roles_server, "control") as cnc,
        as_role(roles_server, "router") as rnc,
        as_role(roles_server, "scheduler") as snc,
    ):
        assert (await WorkerControl(cnc, config=Config()).add(41)).applied
        pub = RouterPublisher(rnc, router_id="perm-hb", config=Config())
        last = await pub.add("hb1", 41, block_hashes=[7, 8], prefill_tokens=32)
        async with RegistryView(snc, config=Config()) as view:
            s = await eventually(
                view.staleness,
                lambda s: s.head >= last and s.behind_events == 0 and s.applied_seq >= last,
                what="a heartbeat of the log at the add or later, the view lacking none of it",
            )
            assert view.renewals > 0 and not s.silent and s.within(0, 0.0)
        assert not violations(caplog), violations(caplog)
        with pytest.raises(nats.errors.TimeoutError):  # and still no read of the log
            await snc.jetstream(timeout=NO_ACK_S).stream_info("SEQSTATE_EVENTS")
        await snc.flush()
    assert _refused(caplog, "$JS.API.STREAM.INFO.SEQSTATE_EVENTS"), caplog.text


async def test_the_control_role_manages_workers_and_a_scheduler_cannot(
    roles_server: str, pipeline: tuple[Writer, Projector], caplog: pytest.LogCaptureFixture
) -> None:
    """``seqstate worker`` as "control": add, list and remove go through, confirmed by the
    bucket. A scheduler's credential cannot register a worker: refused, nothing stored."""
    caplog.set_level(logging.WARNING)
    async with as_role(roles_server, "control") as cnc:
        control = WorkerControl(cnc, config=role_config(roles_server, "control"))
        added = await control.add(31, dp_size=2)
        assert (added.applied, added.dp_ranks) == (True, [0, 1])
        assert 31 in [w.worker_id for w in await control.workers()]
        removed = await control.remove(31)
        assert removed.applied and removed.dp_ranks == []
    assert not violations(caplog), violations(caplog)
    async with as_role(roles_server, "scheduler") as snc, as_role(roles_server, "replay") as onc:
        before = await _last_seq(onc, "SEQSTATE_EVENTS")
        forged = encode_event(WorkerAdded(worker_id=32))
        await _refused_publish(snc, Config().control_subject, forged)
        assert forged not in await _stored_since(onc, "SEQSTATE_EVENTS", before)


async def test_a_wrong_role_password_is_refused_in_one_line(roles_server: str) -> None:
    config = Config(nats_url=roles_server, nats_user="writer", nats_password="not-it-55")
    with pytest.raises(ConnectError) as refused:
        async with connect(roles_server, service=False, config=config):
            pass
    message = str(refused.value)
    assert "refused the credentials" in message and "not-it-55" not in message


# --- every documented command, as the role docs/operations.md gives it -----------------------


def role_env(url: str, role: str) -> dict[str, str]:
    """A clean environment signed in as ``role`` (no other SEQSTATE_* setting leaks in)."""
    clean = {
        k: v for k, v in os.environ.items() if k != "NATS_URL" and not k.startswith("SEQSTATE_")
    }
    return {
        **clean,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{clean.get('PATH', '')}",
        "NATS_URL": url,
        "SEQSTATE_NATS_USER": role,
        "SEQSTATE_NATS_PASSWORD": PASSWORDS[role],
        "COLUMNS": "400",
    }


async def as_cli(
    url: str, role: str, *argv: str, stdin: bytes = b"", timeout: float = 60
) -> tuple[int, str, str]:
    """``seqstate ARGV`` as ``role``, a subprocess (the loop keeps running the pipeline)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "projector",
        *argv,
        env=role_env(url, role),
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
    return proc.returncode or 0, out.decode(), err.decode()


def _clean(role: str, argv: tuple[str, ...], rc: int, out: str, err: str) -> None:
    said = f"{role}: seqstate {' '.join(argv)}: rc={rc}\n{out}\n{err}"
    assert rc == 0, said
    assert VIOLATION not in (out + err).lower(), said
    assert "Traceback" not in err, said
    assert PASSWORDS[role] not in out + err, said


# The role table "role | may publish to | for" (docs/operations.md), command by command. Each
# runs against the pipeline (a snapshot every 5 events), after a router's events and a worker
# registration.
DOCUMENTED: list[tuple[str, tuple[str, ...]]] = [
    ("control", ("worker", "add", "41", "--dp-size", "2")),
    ("control", ("worker", "list", "--json")),
    ("control", ("worker", "remove", "41")),
    ("scheduler", ("top", "--once", "--interval", "0.2")),
    ("scheduler", ("inspect", "worker", "5")),
    ("replay", ("replay", "--verify", "--no-progress")),
    ("replay", ("status",)),
    ("replay", ("loads", "--json")),
    ("replay", ("watch", "--json", "--duration", "1")),
    ("replay", ("top", "--once", "--interval", "0.2")),
    ("replay", ("inspect", "request", "cli-a", "--json", "--no-progress")),
    ("replay", ("inspect", "worker", "5", "--json")),
    ("demo", ("demo", "--duration", "2", "--no-live", "--workers", "1")),
    ("replay", ("snapshot", "list")),
    ("replay", ("snapshot", "show")),
    ("replay", ("loads", "--at", "-0s", "--json")),
    ("replay", ("loads", "--at", "seq:1")),
]


async def test_every_documented_command_runs_as_its_role(
    roles_server: str, pipeline: tuple[Writer, Projector]
) -> None:
    """``seqstate publish`` as the router (it needs no JetStream API: the stream is there),
    then each command of the role table (docs/operations.md) signed in as its role: exit 0, no
    permissions violation anywhere in its output."""
    lines = [
        {"type": "AddRequest", "request_id": "cli-a", "worker_id": 5, "block_hashes": [1, 2]},
        {"type": "AddRequest", "request_id": "cli-b", "worker_id": 5, "dp_rank": 1},
        {"type": "Free", "request_id": "cli-b", "worker_id": 5, "dp_rank": 1},
    ]
    stdin = "\n".join(json.dumps(line) for line in lines).encode()
    rc, out, err = await as_cli(roles_server, "router", "publish", stdin=stdin)
    _clean("router", ("publish",), rc, out, err)
    last = int(out.strip().rsplit(" ", 1)[1])  # "published 3 events, last sequence N"
    await pipeline[1].wait_flushed(last)
    for role, argv in DOCUMENTED:
        if argv == ("snapshot", "show"):  # the writer saves one every 5 events: wait for it
            await eventually(
                lambda: pipeline[0].stats.snapshots_saved,
                what="a snapshot saved",
                interval=0.1,
            )
        rc, out, err = await as_cli(roles_server, role, *argv)
        _clean(role, argv, rc, out, err)
        if argv[:2] == ("inspect", "request"):
            assert json.loads(out)["state"] == "active", out
        if argv[:2] == ("worker", "add"):
            assert "ranks 0-1 in the registry" in out, out


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


# The role table's "admin" row: the commands that do several roles' work. Not in DOCUMENTED: a
# run and a rebuild each take the namespace's lease, which the pipeline fixture's projector
# holds, and a snapshot save beside a running writer could save under the same name.
async def test_the_admin_runs_the_commands_of_several_roles(tmp_path: Path) -> None:
    """On a server of its own, signed in as "admin": ``run --nats-url`` (the writer, the
    projector and the demo router in one process, on that server: no embedded one), then,
    after a router's events, ``rebuild`` (the bucket is the log's fold, to the last event),
    ``snapshot save`` (at that event) and ``serve-http`` (a worker registered and a request
    booked, in a tracker namespace of its own). Each exits 0 and no client is refused
    anything."""
    with started_roles_server(tmp_path / "js") as url:
        argv: tuple[str, ...] = ("run", "--nats-url", url, "--demo", "--no-live")
        argv += ("--workers", "1", "--duration", "2")
        rc, out, err = await as_cli(url, "admin", *argv)
        _clean("admin", argv, rc, out, err)
        assert f"writer and projector running for namespace 'default' at {url}" in err, err
        assert "embedded nats-server" not in out + err, err
        assert "demo: routed" in out, out

        line = {"type": "AddRequest", "request_id": "adm-a", "worker_id": 5, "block_hashes": [1]}
        rc, out, err = await as_cli(url, "router", "publish", stdin=json.dumps(line).encode())
        _clean("router", ("publish",), rc, out, err)
        last = int(out.strip().rsplit(" ", 1)[1])  # "published 1 event, last sequence N"

        argv = ("rebuild", "--no-progress")
        rc, out, err = await as_cli(url, "admin", *argv)
        _clean("admin", argv, rc, out, err)
        assert out.startswith(f"rebuilt the bucket of 'default' at event {last}: "), out
        argv = ("replay", "--verify", "--no-progress")
        rc, out, err = await as_cli(url, "replay", *argv)
        _clean("replay", argv, rc, out, err)
        assert out.strip().endswith("identical: 0 keys differ"), out

        argv = ("snapshot", "save", "--no-progress")
        rc, out, err = await as_cli(url, "admin", *argv)
        _clean("admin", argv, rc, out, err)
        assert out.startswith(f"saved and verified default.{last:020d} "), out

        await _serve_http_as_admin(url, tmp_path / "serve-http.log")


async def _serve_http_as_admin(url: str, log_path: Path) -> None:
    """``seqstate serve-http`` signed in as "admin" on any free port (the one it logs): one
    model's worker registered, a request booked and the loads read back; SIGTERM ends it."""
    with log_path.open("wb") as log_file:  # a file: a pipe could fill
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "projector",
            "serve-http",
            "--port",
            "0",
            env=role_env(url, "admin"),
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:

        def exited() -> None:
            if proc.returncode is not None:
                raise AssertionError(f"serve-http exited: {log_path.read_text()}")

        said = await eventually(
            lambda: re.search(r"slot-tracker API on http://[\d.]+:(\d+)", log_path.read_text()),
            what="serve-http says which port it listens on",
            interval=0.05,
            check=exited,
        )
        m = {"model_name": "llama"}
        register = {**m, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
        add = {**m, "request_id": "k", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [1, 2]}
        answers = await exchange(
            int(said.group(1)),
            [
                ("POST", "/register", register),
                ("POST", "/add", {**add, "new_isl_tokens": 64}),
                ("GET", "/loads", None),
            ],
        )
        assert [status for status, _ in answers] == [201, 201, 200], answers
        assert rows(answers[2]) == [("llama", 1, 0, 64, 2)]
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 30)
    text = log_path.read_text()
    _clean("admin", ("serve-http",), rc, text, text)


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


# --- what each role may not do ----------------------------------------------------------------

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


# --- compose: the writer and the projector as compose runs them --------------------------------


async def test_under_the_compose_roles_an_idle_request_expires(tmp_path: Path) -> None:
    """``seqstate writer`` and ``seqstate projector`` signed in as compose signs them in
    (tests/unit/test_compose.py: this role file, these users), the writer with a 1 s expiry:
    a router's request that nobody frees is expired by the writer's idle Tick (which it may
    now log on the control subject), and the writer logs no refusal. A server of its own, as
    a fresh compose volume: a log folded from its start takes the writer's expiry (a
    snapshot keeps the rules it was folded by). A rank's expiry check runs every 30 s of log
    time, so the request ends about 30 s after its add, whatever the expiry."""
    with started_roles_server(tmp_path / "js") as url:
        await _idle_request_expires(url, tmp_path)


async def _idle_request_expires(roles_server: str, tmp_path: Path) -> None:
    procs, logs = {}, {}
    for role, argv in (
        ("writer", ("writer", "--expiry-s", "1", "--idle-tick-s", "0.2")),
        ("projector", ("projector",)),
    ):
        procs[role] = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "projector",
            *argv,
            env={**role_env(roles_server, role), "SEQSTATE_NAMESPACE": "default"},
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / f"{role}.log").open("wb"),  # a file: a pipe could fill
        )
    try:
        async with as_role(roles_server, "replay") as onc:  # both up: the streams are there
            for kind in ("writer", "projector"):
                await eventually(
                    lambda kind=kind: onc.request(f"seqstate.svc.default.{kind}.status", b"", 1),
                    what=f"the {kind} answers its status",
                    interval=0.2,
                    retry_on=(nats.errors.NoRespondersError, nats.errors.TimeoutError),
                    check=lambda: _all_running(procs, tmp_path),
                )
        async with as_role(roles_server, "router") as rnc:
            pub = RouterPublisher(rnc, router_id="compose-idle", config=Config())
            await pub.add("idle-1", 6, block_hashes=[7, 8], prefill_tokens=10)

        async def request_state() -> dict[str, object]:
            rc, out, err = await as_cli(
                roles_server, "replay", "inspect", "request", "idle-1", "--json", "--no-progress"
            )
            assert rc == 0, err
            report: dict[str, object] = json.loads(out)
            return report

        ended = await eventually(
            request_state,
            lambda r: r["state"] == "ended",
            what="the idle request expired by the writer's Tick",
            timeout=90,
            interval=1.0,  # each look is a subprocess
            retry_on=(AssertionError,),
            check=lambda: _all_running(procs, tmp_path),
        )
        assert "expired" in str(ended["detail"]), ended
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.terminate()
        for role, proc in procs.items():
            await asyncio.wait_for(proc.wait(), 30)
            logs[role] = (tmp_path / f"{role}.log").read_text()
    for role, text in logs.items():
        assert VIOLATION not in text.lower(), (role, text)
        assert "Tick not logged" not in text, (role, text)


def _all_running(procs: dict[str, asyncio.subprocess.Process], logs: Path) -> None:
    for role, proc in procs.items():
        if proc.returncode is not None:
            raise AssertionError(f"{role} exited: {(logs / f'{role}.log').read_text()}")


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
