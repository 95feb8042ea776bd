"""Helpers shared by the integration tests: fresh names per test, a filled log, the log as the
writer saw it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from eventually import eventually
from nats.aio.client import Client
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE

from projector.aio.tasks import cancel
from projector.dynamo.forward import CaptureForwarder
from projector.nats.resources import ensure
from projector.nats.stream import last_seq_of, log_time_ns
from projector.settings.config import Config
from projector.wire.values import lease_key
from seqstate import AddRequest, Fold, Free, SequenceState, encode_event
from seqstate.batches import decode_batch, is_batch

_names = itertools.count()
REPO = Path(__file__).resolve().parents[2]


def fresh_config(prefix: str = "t", **overrides: object) -> Config:
    """A namespace, streams and bucket of their own, so tests sharing a server never meet."""
    n = next(_names)
    return Config(
        namespace=f"{prefix}{n}",
        events_stream=f"{prefix.upper()}EV{n}",
        deltas_stream=f"{prefix.upper()}DL{n}",
        registry_bucket=f"{prefix}reg{n}",
        **overrides,
    )  # type: ignore[arg-type]


def name_flags(config: Config) -> list[str]:
    """The flags that point a ``seqstate`` command at ``config``'s namespace, streams and
    buckets."""
    return [
        "--namespace",
        config.namespace,
        "--events-stream",
        config.events_stream,
        "--deltas-stream",
        config.deltas_stream,
        "--registry-bucket",
        config.registry_bucket,
        "--snapshot-bucket",
        config.snapshot_bucket,
    ]


def clean_env() -> dict[str, str]:
    """This process's environment without any seqstate setting (a command's defaults)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SEQSTATE_")}


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment without a NATS_URL or a SEQSTATE_* setting, the venv's
    ``bin`` (nats-server) first on the PATH, and ``extra``: what a user's shell gives."""
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL" and not k.startswith("SEQSTATE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def seqstate(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    """``seqstate ARGS`` as a user types it, with ``env`` beside :func:`cli_env`."""
    return subprocess.run(
        [sys.executable, "-m", "projector", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(**env),
        cwd=REPO,
    )


def spawned_run(
    store: Path, *args: str, until: tuple[str, ...] = ("writer and projector running",)
) -> tuple[subprocess.Popen[str], list[str]]:
    """``seqstate run`` on ``store`` in the background, once it has logged a line with each of
    ``until`` in turn; its log so far."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "projector", "run", "--store-dir", str(store), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        cwd=REPO,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    awaited = list(until)
    for line in proc.stderr:  # the pipe ends if the run dies: the loop cannot hang on it
        lines.append(line)
        if awaited[0] in line:
            awaited.pop(0)
            if not awaited:
                return proc, lines
    proc.wait()
    raise AssertionError(f"seqstate run never logged {awaited[0]!r}: {''.join(lines)}")


def cli(config: Config, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``seqstate ARGS`` against ``config`` on the server at ``url``, as an operator runs it:
    its defaults (progress bars included), no setting from this process's environment."""
    env = clean_env()
    env["NATS_URL"] = url
    command = [sys.executable, "-m", "projector", *args, *name_flags(config)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, cwd=REPO)


async def run_cli(config: Config, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """:func:`cli` without blocking the event loop (the pipeline under test runs on it)."""
    result = await asyncio.to_thread(cli, config, url, *args)
    assert "Traceback" not in result.stderr, result.stderr
    return result


async def read_events(nc: Client, config: Config) -> list[tuple[int, int, str, bytes]]:
    """Every message of the events stream as ``(seq, log_time_ns, subject, data)``, in stream
    order: what the writer's fold is handed (``seqstate.fold.Fold``).

    Read with an ordered consumer, as the writer reads, so the times are the nanosecond log
    times the writer applied (a stored message's parsed time keeps only microseconds).
    """
    js = nc.jetstream()
    last = (await js.stream_info(config.events_stream)).state.last_seq
    out: list[tuple[int, int, str, bytes]] = []
    done = asyncio.Event()

    async def take(msg) -> None:  # type: ignore[no-untyped-def]
        seq, at_ns = log_time_ns(msg)
        out.append((seq, at_ns, msg.subject, msg.data))
        if seq >= last:
            done.set()

    if last == 0:
        return out
    sub = await js.subscribe(
        config.events_subjects, stream=config.events_stream, ordered_consumer=True, cb=take
    )
    try:
        await asyncio.wait_for(done.wait(), 20)
    finally:
        await sub.unsubscribe()
    return [entry for entry in out if entry[0] <= last]


async def read_log(nc: Client, config: Config) -> list[tuple[int, int, bytes]]:
    """Every message of the events stream as ``(seq, log_time_ns, data)``, in stream order
    (:func:`read_events` without the subjects)."""
    return [(seq, at_ns, data) for seq, at_ns, _, data in await read_events(nc, config)]


def folded(config: Config, log: list[tuple[int, int, str, bytes]]) -> SequenceState:
    """The write model the writer folds ``log`` into (``read_events``): the one fold."""
    fold = Fold(config.new_state(), config.fold_rules)
    for message in log:
        fold(*message)
    return fold.state


@contextlib.asynccontextmanager
async def forwarding(nc: Client, config: Config) -> AsyncIterator[CaptureForwarder]:
    """The capture's forwarder (what every writer runs) while inside."""
    forwarder = CaptureForwarder(nc, config)
    task = asyncio.create_task(forwarder.run())
    try:
        yield forwarder
    finally:
        await cancel(task)


def events_in(log: list[tuple[int, int, str, bytes]]) -> int:
    """The events ``log`` (``read_events``) holds: a record batch's each (the capture's
    forwarder stores a burst of Dynamo messages as one)."""
    return sum(len(decode_batch(data)) if is_batch(data) else 1 for _, _, _, data in log)


def where(log: list[tuple[int, int, str, bytes]], data: bytes) -> str:
    """Where ``log`` (``read_events``) holds ``data`` first, as the writer names an event:
    ``<seq>``, or ``<seq>#<index>`` in a record batch."""
    for seq, _, _, stored in log:
        if not is_batch(stored):
            if stored == data:
                return str(seq)
        elif data in (items := decode_batch(stored)):
            return f"{seq}#{items.index(data)}"
    raise AssertionError("not in the log")


async def logged(nc: Client, config: Config, count: int) -> int:
    """The sequence of the namespace's newest message, once ``count`` events are stored
    (Dynamo's messages published on NATS Core, which the capture stores with no ack to wait
    for, and the writer's forwarder then stores in the log, a burst per message)."""

    async def newest() -> tuple[int, int]:
        log = await read_events(nc, config)
        return (events_in(log), log[-1][0] if log else 0)

    found = await eventually(
        newest, lambda got: got[0] >= count, what=f"{count} captured messages stored"
    )
    return found[1]


async def fill(nc: Client, config: Config, n: int) -> int:
    """``n`` events (enough for flow control at a few thousand) and one undecodable."""
    await ensure(nc, config)
    js = nc.jetstream()
    futures = []
    for i in range(n):
        event = (
            AddRequest(
                request_id=f"x{i}",
                worker_id=i % 8,
                block_hashes=list(range(i % 40)),
                prefill_tokens=i,
            )
            if i % 3
            else Free(request_id=f"x{i - 3}", worker_id=(i - 3) % 8)
        )
        futures.append(await js.publish_async(config.subject_of(event), encode_event(event)))
    futures.append(await js.publish_async(config.event_subject(1), b"\xc1 malformed"))
    await asyncio.gather(*futures)
    return await last_seq_of(js, config.events_stream, config.events_subjects)


READ_WAIT_S = 30.0  # what reading a stream back may take


async def bucket_values(nc: Client, config: Config) -> dict[str, bytes]:
    """Every live key of the namespace in ``config.registry_bucket``, with its bytes; not the
    lease, whose holder differs from run to run by design.

    Read from the bucket's stream (``KeyValue.keys`` filters by substring, not by subject).
    """
    bucket = config.registry_bucket
    prefix = f"$KV.{bucket}."
    out: dict[str, bytes] = {}
    for _, headers, data in await read_stream(nc, f"KV_{bucket}", f"{prefix}{config.namespace}.>"):
        key = headers["subject"][len(prefix) :]
        if key == lease_key(config.namespace):
            continue
        if headers.get(KV_OP) in (KV_DEL, KV_PURGE):
            out.pop(key, None)
        else:
            out[key] = data
    return out


async def read_stream(
    nc: Client, stream: str, subject: str
) -> list[tuple[int, dict[str, str], bytes]]:
    """Every message of ``stream`` on ``subject`` as ``(seq, headers, data)``, in order; the
    headers carry the message's subject too, under ``subject``."""
    js = nc.jetstream()
    last = await last_seq_of(js, stream, subject)
    out: list[tuple[int, dict[str, str], bytes]] = []
    if last == 0:
        return out
    done = asyncio.Event()

    async def take(msg) -> None:  # type: ignore[no-untyped-def]
        seq = msg.metadata.sequence.stream
        out.append((seq, {**(msg.headers or {}), "subject": msg.subject}, msg.data))
        if seq >= last:
            done.set()

    sub = await js.subscribe(subject, stream=stream, ordered_consumer=True, cb=take)
    try:
        await asyncio.wait_for(done.wait(), READ_WAIT_S)
    finally:
        await sub.unsubscribe()
    return [entry for entry in out if entry[0] <= last]


def second_loopback() -> bool:
    """Whether 127.0.0.2 reaches this host (Linux: the whole 127/8 is loopback): a port bound
    to 127.0.0.1 does not answer there, one bound to every address does."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.2", 0))
        except OSError:
            return False
    return True
