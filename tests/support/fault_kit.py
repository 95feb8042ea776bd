"""Helpers of the fault tests: restartable pipeline processes, a seeded workload, kill schedules.

A kill point is a number of events published, chosen by ``random.Random(seed)``, never a
moment in time. Before each kill the test waits until the process it is about to kill has
shown progress of its own (a delta or a bucket position newer than when it started), so every
SIGKILL hits a process that is connected and working, never one still importing Python.
Every wait is an ``eventually`` (tests/support/eventually.py): an observable condition with a
deadline; a process that dies on its own fails the test at once with its log
(``check=service.check``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import signal
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats.errors
from eventually import TIMEOUT_S, eventually
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NotFoundError
from pipeline_kit import bucket_values as bucket_values  # the fault tests import it from here
from pipeline_kit import read_events
from pipeline_kit import read_log as read_log  # the fault tests import it from here
from pipeline_kit import read_stream as read_stream

from projector.bucket.image import BucketImage
from projector.nats.snapshots import SnapshotStore
from projector.ops.flags import FOLD
from projector.route.publisher import RouterPublisher
from projector.settings.config import Config
from projector.wire.headers import SOURCE_SEQ
from projector.wire.values import Position, decode_position, position_key
from seqstate import (
    AddRequest,
    Event,
    Free,
    MarkPrefillCompleted,
    Refusal,
    SequenceState,
    WorkerAdded,
    WorkerRemoved,
)
from seqstate import Fold as CoreFold

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = TIMEOUT_S  # deadline of any single wait: generous, only a hang ever reaches it
# A busy server (a cluster electing a leader, a flood in flight) times a request out: the
# waits of the fault tests ask again, within their deadline.
BUSY: tuple[type[BaseException], ...] = (nats.errors.TimeoutError,)
TAIL = 50  # the last steps, published with the final run up and nothing else scheduled


def _off(value: float | None) -> str:
    return "off" if value is None else repr(value)


def fault_config(tag: str, **overrides: object) -> Config:
    """A namespace, streams and buckets of their own, so tests sharing a server never meet."""
    n = uuid.uuid4().hex[:8]
    return Config(
        namespace=f"{tag}{n}",
        events_stream=f"{tag.upper()}EV{n}",
        deltas_stream=f"{tag.upper()}DL{n}",
        registry_bucket=f"{tag}reg{n}",
        snapshot_bucket=f"{tag}snap{n}",
        **overrides,
    )  # type: ignore[arg-type]


# ---- processes ----------------------------------------------------------------------------------


class Service:
    """``python -m projector <command>`` for one config, restartable; each run logs to a file."""

    def __init__(self, command: str, config: Config, url: str, log_dir: Path) -> None:
        self.command = command
        self.config = config
        self.url = url
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs: list[Path] = []
        self.kills = 0
        self.mark = 0  # the progress observed when the current run started
        self._consumers: set[str] = set()  # the input stream's consumers before this run

    def argv(self) -> list[str]:
        c = self.config
        argv = [
            sys.executable,
            "-m",
            "projector",
            self.command,
            "--namespace",
            c.namespace,
            "--events-stream",
            c.events_stream,
            "--deltas-stream",
            c.deltas_stream,
            "--registry-bucket",
            c.registry_bucket,
            "--snapshot-bucket",
            c.snapshot_bucket,
            "--log-level",
            "warning",
        ]
        if c.replicas != 1:  # as an operator starts a cluster's consumers
            argv += ["--replicas", str(c.replicas)]
        if c.dynamo_endpoint and self.command in ("writer", "projector"):
            argv += ["--dynamo-endpoint", c.dynamo_endpoint]
        if self.command == "writer":  # each command takes the settings it uses, no others
            argv += [
                "--snapshot-every-events",
                str(c.snapshot_every_events),
                "--idle-tick-s",
                repr(c.idle_tick_s),
                "--tick-every-s",
                repr(c.tick_every_s),
            ]
            for name in FOLD:  # every rule of the fold, as uninterrupted_fold folds
                value = getattr(c, name)
                text = repr(value) if isinstance(value, float) else str(value)
                argv += [f"--{name.replace('_', '-')}", "off" if value is None else text]
        if self.command in ("writer", "projector"):  # when a lag is worth a warning
            argv += [
                "--behind-warn-events",
                _off(c.behind_warn_events),
                "--behind-warn-s",
                _off(c.behind_warn_s),
                "--lag-check-s",
                repr(c.lag_check_s),
            ]
        return argv

    def env(self) -> dict[str, str]:
        env = {
            k: v for k, v in os.environ.items() if not k.startswith("SEQSTATE_") and k != "NATS_URL"
        }
        env["NATS_URL"] = self.url
        return env

    @property
    def input_stream(self) -> str:
        return self.config.events_stream if self.command == "writer" else self.config.deltas_stream

    async def _consumer_names(self, js: JetStreamContext) -> set[str]:
        return {info.name for info in await js.consumers_info(self.input_stream)}

    async def start(self, js: JetStreamContext, mark: int) -> None:
        assert self.proc is None, "already running"
        self.mark = mark
        self._consumers = await self._consumer_names(js)
        name = f"{self.config.registry_bucket}-{self.command}-{len(self.runs) + 1}.log"
        path = self.log_dir / name
        self.runs.append(path)
        with path.open("wb") as out:
            self.proc = subprocess.Popen(
                self.argv(), stdout=out, stderr=subprocess.STDOUT, env=self.env(), cwd=ROOT
            )

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        assert proc is not None, "not running"
        if proc.poll() is not None:
            raise AssertionError(
                f"{self.command} had already exited with {proc.returncode}\n{self.logs()}"
            )
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        self.kills += 1

    async def wait_ready(self, js: JetStreamContext) -> None:
        """Until this run has subscribed to its input stream: its SIGTERM handler is in place
        by then (``until_signal`` installs it before the command's task first runs)."""

        async def new_consumers() -> set[str]:
            return await self._consumer_names(js) - self._consumers

        await eventually(
            new_consumers,
            what=f"{self.command} run {len(self.runs)} subscribed",
            retry_on=BUSY,
            watch=self.logs,
            check=self.check,
        )

    async def stop(self, timeout: float = WAIT_S) -> int:
        """SIGTERM (a clean stop) and the exit code."""
        proc, self.proc = self.proc, None
        assert proc is not None, "not running"
        proc.send_signal(signal.SIGTERM)
        try:
            return await eventually(
                proc.poll,
                lambda code: code is not None,
                what=f"{self.command} stopped on SIGTERM",
                timeout=timeout,
                watch=self.logs,
            )
        finally:
            if proc.poll() is None:  # it ignored SIGTERM: the failure is raised, now clean up
                proc.kill()
                proc.wait(10)

    def check(self) -> None:
        """Fail, with the logs, if the current run exited on its own."""
        if self.proc is not None and self.proc.poll() is not None:
            code = self.proc.returncode
            raise AssertionError(f"{self.command} exited on its own with {code}\n{self.logs()}")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for path in self.runs:
            text = path.read_text(errors="replace") if path.exists() else "(no log)"
            parts.append(f"--- {path.name} ---\n{text[-tail:] or '(empty)'}")
        return "\n".join(parts)


class StepCount:
    """How far a publishing task has got, for a task that acts at a given step (a crash, a
    restart): it wakes when the publisher gets there, never polls, and has no deadline of its
    own, since each publish the publisher makes has one."""

    def __init__(self) -> None:
        self.done = 0
        self._moved = asyncio.Condition()

    async def advance(self, done: int) -> None:
        async with self._moved:
            self.done = done
            self._moved.notify_all()

    async def reached(self, step: int) -> None:
        async with self._moved:
            await self._moved.wait_for(lambda: self.done >= step)


# ---- observing the pipeline -------------------------------------------------------------------


async def delta_source_seq(js: JetStreamContext, config: Config) -> int:
    """The source sequence of the newest delta on the DELTAS stream (0 if none)."""
    try:
        raw = await js.get_last_msg(config.deltas_stream, config.deltas_subject)
    except NotFoundError:
        return 0
    return int((raw.headers or {}).get(SOURCE_SEQ, 0))


async def bucket_position(js: JetStreamContext, config: Config) -> Position:
    """The namespace's position key in ``config.registry_bucket`` (zeros if none yet)."""
    kv = await js.key_value(config.registry_bucket)
    try:
        entry = await kv.get(position_key(config.namespace))
    except KeyNotFoundError:
        return Position(0, 0, 0)
    return decode_position(entry.value or b"")


async def wait_current(
    js: JetStreamContext, writer: Service, projector: Service, last: int, *, interval: float = 0.25
) -> None:
    """Until the writer's deltas, then the bucket, reflect event ``last``; fails at once,
    with its logs, if either process exits on its own."""
    config = writer.config

    async def deltas() -> int:
        return await delta_source_seq(js, config)

    async def applied() -> int:
        return (await bucket_position(js, config)).applied_seq

    waits = ((deltas, writer, "the writer"), (applied, projector, "the bucket"))
    for probe, service, what in waits:
        await eventually(
            probe,
            lambda seq: seq >= last,
            what=f"{what} reflects event {last}",
            interval=interval,
            retry_on=BUSY,
            watch=service.logs,
            check=service.check,
        )


# ---- the workload -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One publish: an event through the RouterPublisher, or raw bytes straight to a subject."""

    event: Event | None = None
    subject: str = ""
    raw: bytes = b""


EXTRA_WORKER = 9  # the worker that is registered, removed and registered again


def workload(seed: int, config: Config, requests: int) -> list[Step]:
    """Adds sharing system-prompt prefixes, marks, frees (some of unknown requests), a worker
    that comes, goes and comes back, and a few malformed messages; ends with a valid event."""
    rng = random.Random(seed)
    prompts = [[rng.getrandbits(63) for _ in range(rng.randint(2, 8))] for _ in range(6)]
    ranks = [(w, r) for w in range(4) for r in range(2)]
    extra_size = 0
    live: list[tuple[str, int, int, bool]] = []
    steps: list[Step] = []
    malformed = sorted(rng.sample(range(requests // 5, requests - 10), 3))
    topology = {requests // 4: 2, requests // 2: 0, 3 * requests // 4: 3}  # dp_size; 0: removed
    garbage = [
        b"\xc1 not msgpack",
        msgspec.msgpack.encode([1, {"type": "Nope"}]),
        msgspec.msgpack.encode([1, {"type": "AddRequest", "worker_id": -1}]),
    ]
    for i in range(requests):
        if i in topology:
            extra_size = topology[i]
            event: Event = (
                WorkerAdded(worker_id=EXTRA_WORKER, dp_size=extra_size)
                if extra_size
                else WorkerRemoved(worker_id=EXTRA_WORKER)
            )
            steps.append(Step(event))
        if i in malformed:
            w, r = rng.choice(ranks)
            steps.append(Step(subject=config.event_subject(w, r), raw=garbage[malformed.index(i)]))
        if extra_size and rng.random() < 0.25:
            w, r = EXTRA_WORKER, rng.randrange(extra_size)
        else:
            w, r = rng.choice(ranks)
        rid = f"s{seed}-{i}"
        blocks = rng.choice(prompts) + [rng.getrandbits(63) for _ in range(rng.randint(0, 6))]
        steps.append(
            Step(
                AddRequest(
                    request_id=rid,
                    worker_id=w,
                    dp_rank=r,
                    block_hashes=blocks,
                    prefill_tokens=rng.randint(16, 4000),
                    expected_prefill_ms=rng.choice([None, round(rng.uniform(5.0, 900.0), 3)]),
                    expected_output_tokens=rng.choice([None, rng.randint(1, 512)]),
                )
            )
        )
        live.append((rid, w, r, False))
        while live and rng.random() < 0.6:
            j = rng.randrange(len(live))
            rid, w, r, marked = live[j]
            if not marked and rng.random() < 0.7:
                steps.append(Step(MarkPrefillCompleted(request_id=rid, worker_id=w, dp_rank=r)))
                live[j] = (rid, w, r, True)
            else:
                steps.append(Step(Free(request_id=rid, worker_id=w, dp_rank=r)))
                live.pop(j)
        if rng.random() < 0.02:  # a Free that overtakes its Add (or never had one)
            steps.append(Step(Free(request_id=f"ghost{seed}-{i}", worker_id=w, dp_rank=r)))
    for rid, w, r, _ in live[::2]:
        steps.append(Step(Free(request_id=rid, worker_id=w, dp_rank=r)))
    assert steps[-1].event is not None
    return steps


def kill_schedule(seed: int, steps: int, kills: int) -> list[tuple[int, int, bool]]:
    """``(kill_at, restart_at, late)``: one kill in the first half of each of ``kills`` equal
    segments of the steps, the restart 0-150 events later (events pile up meanwhile). Half
    the kills are *late*: the process is first given time to get further (the writer to save
    a snapshot of its own), the others hit it as soon as it shows progress."""
    rng = random.Random(f"kills-{seed}")
    segment = (steps - 200) // kills
    late = [k % 2 == 1 for k in range(kills)]
    rng.shuffle(late)
    out = []
    for k in range(kills):
        start = 100 + k * segment
        kill_at = rng.randrange(start, start + segment // 2)
        out.append((kill_at, kill_at + rng.choice([0, 0, rng.randint(1, 150)]), late[k]))
    return out


async def run_with_kills(
    nc: Client,
    config: Config,
    steps: list[Step],
    service: Service,
    schedule: list[tuple[int, int, bool]],
    *,
    progress: Callable[[], Awaitable[int]],
    late_probe: Callable[[], Awaitable[int]],
    late_target: Callable[[], Awaitable[int]],
    router_id: str,
) -> int:
    """Publish ``steps`` in order (one acknowledged publish after another) while ``service``
    runs, is SIGKILLed and restarted by ``schedule``; the stream sequence of the last step.

    ``progress`` is what the service has visibly done (the writer's last delta, the projector's
    position): an early kill waits, publishing paused, for progress newer than the run's start
    and kills at once (often mid catch-up). A late kill waits in the background, publishing on,
    until ``late_probe`` passes what ``late_target`` said at the kill point (a snapshot of what
    was published by then saved, more positions flushed), then kills and restarts at once; it
    fires anyway once the
    publisher reaches its next action (it waits for it: a writer takes snapshots only as events
    arrive). The last ``TAIL`` steps are published to the final run only, so that its progress
    reaching the last step proves that this run, not an earlier one, has folded it all.
    """
    pub = RouterPublisher(nc, namespace=config.namespace, router_id=router_id, config=config)
    js = nc.jetstream()
    kills: dict[int, list[bool]] = collections.defaultdict(list)
    restarts: collections.Counter[int] = collections.Counter()
    for kill_at, restart_at, late in schedule:
        kills[kill_at].append(late)
        if not late:
            restarts[restart_at] += 1
    now = {"step": 0, "last": 0, "started_at": 0}
    final = len(steps) - TAIL
    pending: asyncio.Task[None] | None = None
    force = asyncio.Event()  # the publisher reached its next action: a pending late kill fires

    async def start() -> None:
        now["started_at"] = now["step"]
        await service.start(js, await progress())

    async def has_progressed() -> None:
        await eventually(
            progress,
            lambda seen: seen > service.mark,
            what=f"{service.command} run {len(service.runs)} made progress",
            retry_on=BUSY,
            watch=service.logs,
            check=service.check,
        )

    async def late_kill() -> None:
        await has_progressed()
        target = await late_target()

        async def seen() -> tuple[int, int]:
            return await late_probe(), await progress()

        await eventually(
            seen,
            lambda v: v[0] > target or force.is_set(),
            what=f"{service.command} run {len(service.runs)} got further",
            interval=0.02,
            retry_on=BUSY,
            watch=service.logs,
            check=service.check,
        )
        service.kill()
        await start()

    await start()
    try:
        for i, step in enumerate(steps):
            now["step"] = i
            if (i in kills or i in restarts or i == final) and pending is not None:
                force.set()
                await pending
                pending = None
                force.clear()
            for late in kills.pop(i, []):
                if now["started_at"] == i:
                    # The run started at this very step (a late kill just fired): it can show
                    # progress only on events published after it started, so kill it later.
                    kills[i + 25].append(late)
                    restarts[i + 25] += restarts.pop(i, 0)
                elif late:
                    pending = asyncio.create_task(late_kill())
                else:
                    await has_progressed()
                    service.kill()
            for _ in range(restarts.pop(i, 0)):
                await start()
            if step.event is not None:
                now["last"] = await pub.publish(step.event)
            else:
                now["last"] = (await js.publish(step.subject, step.raw)).seq
            assert i < final or not (kills or restarts), "a kill was deferred into the tail"
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
    return now["last"]


# ---- what an uninterrupted run gives ----------------------------------------------------------


def fold_differences(values: dict[str, bytes], got: dict[str, bytes]) -> str:
    """Where a bucket's values ``got`` (the position aside) differ from those of an
    uninterrupted fold (``values``); "" where nowhere."""
    missing = sorted(set(values) - set(got))
    extra = sorted(set(got) - set(values))
    differing = sorted(k for k in values if k in got and got[k] != values[k])
    if not (missing or extra or differing):
        return ""
    return (
        f"bucket differs from an uninterrupted fold: missing {missing[:5]}, extra "
        f"{extra[:5]}, differing {differing[:5]}"
    )


@dataclass
class Fold:
    """One uninterrupted fold of the whole log, as the writer folds it."""

    state: SequenceState  # its registry deferred, as the writer's: ``sync_registry`` to read it
    image: BucketImage  # what a projector given its deltas writes
    last: int  # the last event's stream sequence
    last_ns: int  # that event's log time


async def fold_log(nc: Client, config: Config) -> Fold:
    """The log folded by the writer's one fold (``seqstate.fold.Fold``, its configuration's
    rules), a record batch event by event: what it refuses, the writer dead-lettered."""
    fold = CoreFold(config.new_state(), config.fold_rules)
    fold.state.defer_registry()  # as the writer folds
    image = BucketImage(config.namespace)
    last = last_ns = 0
    for seq, at_ns, subject, data in await read_events(nc, config):
        last, last_ns = seq, at_ns
        verdict = fold(seq, at_ns, subject, data)
        for each in verdict if isinstance(verdict, list) else [verdict]:  # a record batch
            if type(each) is not Refusal:
                image.apply(each)
    return Fold(fold.state, image, last, last_ns)


async def stop_all(services: list[Service]) -> None:
    """SIGTERM each service in turn: each must stop cleanly (exit 0)."""
    for service in services:
        code = await service.stop()
        assert code == 0, f"{service.command} exited with {code}\n{service.logs()}"


async def assert_exact(nc: Client, config: Config, last: int) -> bytes:
    """The ledger after a clean stop at event ``last``: the newest snapshot is at ``last`` and
    is the snapshot of one uninterrupted fold of the log, and the bucket (its position aside)
    holds exactly that fold's values. Returns the snapshot."""
    snapshot, values, logged = await uninterrupted_fold(nc, config)
    assert logged == last
    store = await SnapshotStore(nc, config).open()
    newest = (await store.list())[-1]
    assert newest.applied_seq == last and await store.fetch(newest.name) == snapshot
    got = await bucket_values(nc, config)
    assert got.pop(position_key(config.namespace)), "no position"
    assert got == values
    return snapshot


async def uninterrupted_fold(nc: Client, config: Config) -> tuple[bytes, dict[str, bytes], int]:
    """One uninterrupted fold of the whole log: the write model's snapshot, the bucket values a
    projector given its deltas writes (the lease and position aside), the last event."""
    fold = await fold_log(nc, config)
    return fold.state.snapshot(), fold.image.everything(), fold.last
