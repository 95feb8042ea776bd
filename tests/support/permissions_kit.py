"""A nats-server under the shipped role config, and clients signed in as each role.

What the permission suites (tests/integration/test_permissions_*.py) share: a server with
deploy/nats-roles.conf, a client or a ``seqstate`` subprocess signed in as a role, and the
checks that the server refused a publish and stored nothing of it. Their fixtures are in
permissions_fixtures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from pipeline_kit import REPO

from projector.nats.connection import connect
from projector.settings.config import Config

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
