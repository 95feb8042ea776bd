"""``seqstate run`` beside a Dynamo fleet's discovery, with no command: real processes, a real
nats-server, discovery files written as Dynamo 1.6.1 writes them (and a real etcd).

The operator starts ``seqstate run --dynamo-endpoint`` with the fleet's environment
(``DYN_DISCOVERY_BACKEND``, ``DYN_FILE_KV``, ``ETCD_ENDPOINTS``), as Dynamo's processes have it.
From then on: workers in discovery show in ``loads`` idle; a worker that leaves discovery leaves
``loads`` and never comes back, late messages about it notwithstanding; a router replica that
registers its channel is sent every request in flight, in Dynamo's wire format, within 2 s;
``replay --verify`` finds the bucket equal to a replay (every change went through the log).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
from discovery_kit import channel, file_name, worker, write_files
from dynamo_capture import CAPTURE
from eventually import eventually
from nats.aio.client import Client
from nats.aio.msg import Msg
from pipeline_kit import REPO, clean_env, fresh_config, name_flags, run_cli
from test_dynamo_forged import started_run, writer_status

from projector.nats.server import NatsServer
from projector.settings.config import Config
from seqstate.dynamo import (
    ADD,
    FREE,
    MARK,
    decode_dynamo,
    dynamo_subject,
    encode_dynamo,
    resync_publisher_id,
)

ENDPOINT = "dynamo.backend.generate"
_ENDPOINTS = itertools.count()


def fresh_endpoint() -> str:
    """An endpoint of its own: one endpoint is captured by one namespace of the server."""
    return f"dyn{next(_ENDPOINTS)}.backend.generate"


def on(endpoint: str) -> dict[str, str]:
    """discovery_kit's keyword arguments that put a record on ``endpoint``."""
    ns, component, name = endpoint.split(".")
    return {"ns": ns, "component": component, "name": name}


_ADD = next(m for m in map(decode_dynamo, (c.data for c in CAPTURE)) if m.op == ADD)
W1, W2, W3 = 0xA1 << 56, 0xB2 << 56, 0xC3 << 56  # worker ids above 2^63, as Dynamo's often are
FRONT_A, FRONT_B = 5_000_001, 5_000_002  # the frontends' publisher ids (their channels)
ROUTER_A = 77_000_001


def dynamo(op: str, request_id: str, rank: tuple[int, int], sequence: int, **more: object) -> bytes:
    """A message of frontend A, as Dynamo publishes it."""
    message = msgspec.structs.replace(
        _ADD,
        op=op,
        publisher_id=FRONT_A,
        sequence=sequence,
        router_id=ROUTER_A,
        request_id=request_id,
        worker_id=rank[0],
        dp_rank=rank[1],
        token_sequence=[hash(request_id) & 0xFFFF_FFFF, sequence] if op == ADD else None,
        **more,
    )
    return encode_dynamo(message)


async def send(nc: Client, endpoint: str, *messages: bytes) -> None:
    for data in messages:
        await nc.publish(dynamo_subject(endpoint), data)
    await nc.flush()


@contextlib.asynccontextmanager
async def running(
    nc: Client, config: Config, url: str, log: Path, env: dict[str, str]
) -> AsyncIterator[Callable[[], str]]:
    """``seqstate run`` as an operator starts it beside the fleet, with the fleet's
    environment; yields a reader of its log."""
    argv = [sys.executable, "-m", "projector", "run", "--nats-url", url]
    argv += ["--dynamo-endpoint", config.dynamo_endpoints[0], *name_flags(config)]
    async with started_run(nc, config, url, log, argv, env):
        yield log.read_text


async def loads(config: Config, url: str) -> dict[tuple[int, int], int]:
    """Every rank ``loads`` shows, with its requests in flight."""
    done = await run_cli(config, url, "loads", "--json")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    return {(r["worker_id"], r["dp_rank"]): r["active_requests"] for r in rows}


async def outcomes(nc: Client, config: Config) -> dict[str, int]:
    status = await writer_status(nc, config)
    return dict(status["outcomes"])  # type: ignore[call-overload]


def file_env(root: Path) -> dict[str, str]:
    return {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(root)}


class Store:
    """Dynamo's discovery store, files or etcd, written as Dynamo writes it; ``env`` is the
    fleet's environment that names it."""

    def __init__(self, request: pytest.FixtureRequest, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.root = tmp_path / "kv"
        if kind == "etcd":
            self.etcd = request.getfixturevalue("etcd_server")
            self.env = {"DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": self.etcd.url}
        else:
            self.env = file_env(self.root)

    async def put(self, records: dict[str, bytes]) -> None:
        if self.kind == "etcd":
            for key, value in records.items():
                await self.etcd.put(key, value)
        else:
            write_files(self.root, records)

    async def remove(self, records: dict[str, bytes]) -> None:
        for key in records:
            if self.kind == "etcd":
                await self.etcd.delete(key)
            else:
                (self.root / file_name(key)).unlink()


@pytest.mark.parametrize("kind", ["file", "etcd"])
async def test_run_follows_workers_in_discovery_and_a_removed_one_stays_removed(
    nc: Client,
    nats_server: NatsServer,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    kind: str,
) -> None:
    """Two workers in discovery at start (one with dp 2): ``loads`` shows their three ranks
    idle. Requests on both; the first worker's files go (its process died): its rank leaves
    ``loads`` with its requests, and neither a late Add routed to it nor the Free of its cut
    request brings it back (outcome ``removed_worker``). A third worker that appears shows
    idle. ``replay --verify`` agrees: every change is in the log."""
    store = Store(request, kind, tmp_path)
    endpoint = fresh_endpoint()
    first, second = (
        worker(W1, base=1000, **on(endpoint)),
        worker(W2, dp=2, base=2000, **on(endpoint)),
    )
    await store.put(first | second | channel(FRONT_A, **on(endpoint)))
    config = fresh_config("follow", dynamo_endpoint=endpoint)
    url = nats_server.url
    async with running(nc, config, url, tmp_path / "run.log", store.env):
        await eventually(
            lambda: loads(config, url),
            lambda got: got == {(W1, 0): 0, (W2, 0): 0, (W2, 1): 0},
            what="both workers' three ranks, idle, from discovery alone",
        )
        await send(nc, endpoint, dynamo(ADD, "r1", (W1, 0), 0), dynamo(ADD, "r2", (W2, 1), 1))
        await eventually(
            lambda: loads(config, url),
            lambda got: got == {(W1, 0): 1, (W2, 0): 0, (W2, 1): 1},
            what="one request on each worker",
        )
        await store.remove(first)
        await eventually(
            lambda: loads(config, url),
            lambda got: got == {(W2, 0): 0, (W2, 1): 1},
            what="the dead worker gone from loads, with its request",
        )
        await send(nc, endpoint, dynamo(ADD, "r3", (W1, 0), 2), dynamo(FREE, "r1", (W1, 0), 3))
        await eventually(
            lambda: outcomes(nc, config),
            lambda got: got.get("removed_worker") == 1,
            what="the late Add refused as removed_worker",
        )
        assert await loads(config, url) == {(W2, 0): 0, (W2, 1): 1}
        await store.put(worker(W3, base=3000, **on(endpoint)))
        await eventually(
            lambda: loads(config, url),
            lambda got: got == {(W2, 0): 0, (W2, 1): 1, (W3, 0): 0},
            what="a new worker shows idle",
        )
    verify = await run_cli(config, url, "replay", "--verify", "--no-progress")
    assert verify.returncode == 0 and "identical: 0 keys differ" in verify.stdout, verify.stdout


async def republished(
    nc: Client, endpoint: str, count: int, namespace: str
) -> tuple[list[Msg], float]:
    """A late replica's view: the next ``count`` messages seqstate republishes on Dynamo's
    subject, and when the first came (monotonic)."""
    got: list[Msg] = []
    first: list[float] = []
    done = asyncio.get_running_loop().create_future()
    ours = resync_publisher_id(namespace)

    async def take(msg: Msg) -> None:
        if decode_dynamo(msg.data).publisher_id != ours or done.done():
            return
        first.append(time.monotonic())
        got.append(msg)
        if len(got) == count:
            done.set_result(None)

    sub = await nc.subscribe(dynamo_subject(endpoint), cb=take)
    try:
        await asyncio.wait_for(done, 30)
    finally:
        await sub.unsubscribe()
    return got, first[0]


async def test_a_new_router_replica_is_resynced_within_two_seconds(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """Requests in flight; a frontend starts (its ``active_sequences_events`` channel appears
    in discovery): within 2 s seqstate has sent it every request's AddRequest as routed, with
    no command run, and its own fold ignores what it sent."""
    root = tmp_path / "kv"
    endpoint = fresh_endpoint()
    write_files(root, worker(W1, base=1000, **on(endpoint)) | channel(FRONT_A, **on(endpoint)))
    config = fresh_config("resync", dynamo_endpoint=endpoint)
    url = nats_server.url
    async with running(nc, config, url, tmp_path / "run.log", file_env(root)) as log:
        await eventually(lambda: loads(config, url), bool, what="the worker in loads")
        await send(nc, endpoint, *(dynamo(ADD, f"q{i}", (W1, 0), i) for i in range(3)))
        await eventually(
            lambda: loads(config, url), lambda got: got == {(W1, 0): 3}, what="3 in flight"
        )
        late = asyncio.ensure_future(republished(nc, endpoint, 3, config.namespace))
        await asyncio.sleep(0.1)  # the late replica's subscription reaches the server
        registered = time.monotonic()
        write_files(root, channel(FRONT_B, **on(endpoint)))
        messages, first = await late
        assert sorted(decode_dynamo(m.data).request_id for m in messages) == ["q0", "q1", "q2"]
        assert first - registered < 2.0, (first - registered, log())
        assert (await loads(config, url)) == {(W1, 0): 3}  # the echo changed nothing
    assert "router replica channel 5000002 appeared" in log()


async def test_a_replica_that_started_and_routed_while_seqstate_was_down_is_resynced(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """seqstate stopped with three requests in flight; meanwhile a frontend starts (its
    channel appears) and routes one request, which JetStream captures. That frontend knows
    nothing of the three. When seqstate comes back, its publisher is in the log, yet it was
    never resynced: seqstate resyncs at start, all four requests in flight."""
    root = tmp_path / "kv"
    endpoint = fresh_endpoint()
    write_files(root, worker(W1, base=1000, **on(endpoint)) | channel(FRONT_A, **on(endpoint)))
    config = fresh_config("down", dynamo_endpoint=endpoint)
    url = nats_server.url
    async with running(nc, config, url, tmp_path / "run.log", file_env(root)):
        await eventually(lambda: loads(config, url), bool, what="the worker in loads")
        await send(nc, endpoint, *(dynamo(ADD, f"q{i}", (W1, 0), i) for i in range(3)))
        # The worker's own Mark, under its channel (base + 1), as a live worker sends it.
        mark = decode_dynamo(dynamo(MARK, "q0", (W1, 0), 0))
        mark = msgspec.structs.replace(mark, publisher_id=1001, router_id=W1)
        await send(nc, endpoint, encode_dynamo(mark))
        await eventually(
            lambda: writer_status(nc, config),
            lambda got: got.get("dynamo", {}).get("publishers") == 2,
            what="the log heard both publishers",
        )
        assert await loads(config, url) == {(W1, 0): 3}
    write_files(root, channel(FRONT_B, **on(endpoint)))
    routed = msgspec.structs.replace(
        decode_dynamo(dynamo(ADD, "q3", (W1, 0), 0)), publisher_id=FRONT_B
    )
    await send(nc, endpoint, encode_dynamo(routed))
    late = asyncio.ensure_future(republished(nc, endpoint, 5, config.namespace))
    await asyncio.sleep(0.1)  # the late replica's subscription reaches the server
    async with running(nc, config, url, tmp_path / "run.log", file_env(root)) as log:
        messages, _ = await late  # four Adds, and q0's Mark (its prefill is done)
        assert sorted(decode_dynamo(m.data).request_id for m in messages) == [
            "q0",
            "q0",
            "q1",
            "q2",
            "q3",
        ]
        assert (await loads(config, url)) == {(W1, 0): 4}
    assert "1 router replica(s) in discovery that the log had not heard before" in log()


async def test_an_endpoint_unknown_to_discovery_is_said(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """A typo in ``--dynamo-endpoint`` is said at start, with what discovery knows."""
    root = tmp_path / "kv"
    endpoint = fresh_endpoint()
    typo = endpoint[:-1]
    write_files(root, worker(W1, base=1000, **on(endpoint)))
    config = fresh_config("typo", dynamo_endpoint=typo)
    url = nats_server.url
    argv = [sys.executable, "-m", "projector", "run", "--nats-url", url]
    argv += ["--dynamo-endpoint", typo, *name_flags(config)]
    proc = subprocess.Popen(
        argv,
        env=clean_env() | file_env(root),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    try:
        said = ""
        for line in proc.stderr:
            if "unknown to discovery" in line:
                said = line
                break
        assert f"Dynamo endpoint {typo!r} is unknown to discovery (file discovery " in said, said
        assert f"discovery knows: {endpoint}" in said, said
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


@pytest.mark.parametrize("spec", ["etcd:ftp://x", "zookeeper"])
def test_a_discovery_spec_that_cannot_be_followed_is_one_line(spec: str, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "projector", "run", "--port", "0"]
    argv += ["--store-dir", str(tmp_path), "--dynamo-endpoint", ENDPOINT]
    done = subprocess.run(
        [*argv, "--dynamo-discovery", spec],
        env=clean_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--dynamo-discovery" in lines[0], done.stderr
