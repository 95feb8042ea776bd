"""A NATS server without JetStream: every command, the pipeline and the library say so.

Each used to print nats-py's ``ServiceUnavailableError: code=None err_code=None
description='None'`` (some after 10 s of polling), and RouterPublisher retried for 15 s before
"no response from stream". JetStream off is now named, with how to turn it on, in one line.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import nats
import nats.errors
import pytest
from eventually import eventually
from http_kit import free_port
from log_text import plain_lines
from pipeline_kit import REPO, clean_env

from projector.bucket.reader import RegistryUnavailable, RegistryView
from projector.nats.server import find_binary
from projector.route.publisher import PublishError, RouterPublisher
from projector.settings.config import Config

SAID = "JetStream is off on this NATS server"
HOW = "start nats-server with -js"


@pytest.fixture(scope="module")
def plain_url() -> Iterator[str]:
    """A nats-server started as its defaults have it: no ``-js``, so no JetStream."""
    port = free_port()
    proc = subprocess.Popen(
        [find_binary(), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
async def nc(plain_url: str) -> AsyncIterator[nats.NATS]:
    client = await eventually(
        lambda: nats.connect(plain_url, allow_reconnect=False),
        what="the server without JetStream takes clients",
        retry_on=(OSError, nats.errors.Error),
    )
    try:
        yield client
    finally:
        await client.close()


EVENT = b'{"type": "Free", "request_id": "x", "worker_id": 1}\n'
COMMANDS = [
    ("status",),
    ("loads",),
    ("top", "--once"),
    ("watch", "--duration", "1"),
    ("inspect", "worker", "1"),
    ("inspect", "request", "x", "--no-progress"),
    ("replay", "--no-progress"),
    ("replay", "--verify", "--no-progress"),
    ("rebuild", "--no-progress"),
    ("snapshot", "list"),
    ("snapshot", "show"),
    ("snapshot", "save", "--no-progress"),
    ("report", "--out", "report.html", "--no-progress"),
    ("worker", "list"),
    ("worker", "add", "1"),
    ("worker", "remove", "1"),
    ("publish",),
    ("dynamo", "resync", "--dynamo-endpoint", "dyn.backend.generate"),
    ("dynamo", "uncapture"),
    ("demo", "--duration", "1", "--no-live"),
    ("writer",),
    ("projector",),
    ("run",),  # with NATS_URL set: the pipeline on that server, no embedded one
    ("serve-http", "--port", "0"),
]


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
async def test_every_command_says_jetstream_is_off_in_one_line(
    plain_url: str, nc: nats.NATS, argv: tuple[str, ...]
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "projector", *argv],
        input=EVENT,
        capture_output=True,
        timeout=60,
        env={**clean_env(), "NATS_URL": plain_url},
        cwd=REPO,
    )
    err = result.stderr.decode()
    assert result.returncode == 1, err
    lines = plain_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"seqstate: error: {SAID}"), err
    assert HOW in lines[0], err


async def test_a_router_publisher_says_jetstream_is_off_without_retrying(nc: nats.NATS) -> None:
    """No retry can store an event while JetStream is off: the first attempt says so (it used
    to retry for 15 s, then say "no response from stream")."""
    pub = RouterPublisher(nc, router_id="off", config=Config())
    with pytest.raises(PublishError) as raised:
        await pub.add("req-off", 1, block_hashes=[1])
    message, msg_id = str(raised.value), raised.value.msg_id
    assert re.fullmatch(r"off:1:[0-9a-f]{16}", msg_id), msg_id
    said = f"AddRequest for request 'req-off': msg-id {msg_id} not stored: {SAID}"
    assert message.startswith(said), message
    assert HOW in message and "attempt" not in message


async def test_a_registry_view_says_jetstream_is_off(nc: nats.NATS) -> None:
    with pytest.raises(RegistryUnavailable) as raised:
        async with RegistryView(nc, config=Config()):
            pass
    assert str(raised.value).startswith(SAID) and HOW in str(raised.value)
