"""The shipped role config (deploy/nats-roles.conf) on a real nats-server: every command
runs signed in as the role that docs/operations.md gives it.

Every command the role table gives a role runs, as a subprocess, signed in as that role, and
exits 0 with no permissions violation; the admin runs the commands that do several roles' work
(``run``, ``rebuild``, ``snapshot save``, ``serve-http``); ``seqstate writer`` and ``seqstate
projector`` run as compose runs them and the writer's idle Tick expires a request.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import nats
import nats.errors
from eventually import eventually
from http_kit import exchange, rows
from permissions_kit import VIOLATION, _clean, as_cli, as_role, role_env, started_roles_server
from pipeline_kit import REPO

from projector.bucket.projection import Projector
from projector.route.publisher import RouterPublisher
from projector.settings.config import Config
from projector.write.writer import Writer

# The fixtures roles_server and pipeline, which the tests here take (a plugin: not imported).
pytest_plugins = ("permissions_fixtures",)


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
