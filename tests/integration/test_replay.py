"""Replay, verify and rebuild against a real server, through the API and the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import fcntl
import json
import os
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import msgspec
import pytest
from log_text import plain_lines
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError
from pipeline_kit import fill, fresh_config, name_flags, read_log, run_cli

from projector.bucket.contents import read_bucket
from projector.bucket.reader import RegistryView
from projector.ops.replay import rebuild, verify
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from projector.wire.values import decode_request, encode_request, load_key, slot_key
from projector.write.log_fold import replay
from seqstate import EventDecodeError, SequenceState, WorkerAdded, decode_event

REPO = Path(__file__).resolve().parents[2]


async def lifecycle(pub: RouterPublisher, prefix: str, n: int) -> int:
    last = await pub.publish(WorkerAdded(worker_id=0, dp_size=2))
    for i in range(n):
        rid, rank = f"{prefix}{i}", i % 2
        last = await pub.add(
            rid,
            0,
            rank,
            block_hashes=[7, 8, 100 + i],
            prefill_tokens=50 + i,
            expected_prefill_ms=30.0,
        )
        if i % 3 == 1:
            last = await pub.free(rid, 0, rank)
    return last


async def fold_upto(
    nc: Client, config: Config, *, seq: int | None = None, at_ns: int | None = None
) -> SequenceState:
    state = config.new_state()
    for s, t, data in await read_log(nc, config):
        if (seq is not None and s > seq) or (at_ns is not None and t > at_ns):
            break
        with contextlib.suppress(EventDecodeError):
            state.apply(decode_event(data), t)
    return state


async def filled(nc: Client, n: int = 20, **overrides: object) -> tuple[Config, int]:
    config = fresh_config(
        "r", snapshot_bucket=f"rsnap{id(overrides)}{n}", snapshot_every_events=9, **overrides
    )
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="rp", config=config)
        last = await lifecycle(pub, "q", n)
        await pipeline.wait_applied(last)
    return config, last


async def test_replay_to_any_sequence_equals_the_fold_of_that_prefix(nc: Client) -> None:
    config, last = await filled(nc)
    for target in (1, 5, 12, last - 1, last):
        done = await replay(nc, config, to_seq=target)
        assert done.last_seq == target
        assert done.state.snapshot() == (await fold_upto(nc, config, seq=target)).snapshot()
    whole = await replay(nc, config)
    assert whole.snapshot is not None  # the writer's snapshots made it cost the tail
    assert whole.events == last - whole.snapshot.applied_seq


async def test_replay_at_a_log_time_stops_there_and_reads_loads_there(nc: Client) -> None:
    config, _ = await filled(nc)
    log = await read_log(nc, config)
    _, t10, _ = log[9]
    at = t10 + 5_000_000  # 5 ms after the 10th event: decay is read at `at`
    done = await replay(nc, config, at_ns=at)
    expected = await fold_upto(nc, config, at_ns=at)
    assert done.state.snapshot() == expected.snapshot()
    assert done.as_of_ns == at
    assert done.loads() == expected.registry.loads(at)


async def test_verify_names_the_keys_that_differ(nc: Client) -> None:
    config, _ = await filled(nc)
    assert await verify(nc, config) == []
    kv = await nc.jetstream().key_value(config.registry_bucket)
    key = load_key(config.namespace, (0, 1))
    value = json.loads((await kv.get(key)).value or b"")
    value["active_blocks"] += 1
    await kv.put(key, json.dumps(value).encode())
    diffs = await verify(nc, config)
    assert len(diffs) == 1 and diffs[0].startswith(f"{key}: bucket (blocks ")


async def test_rebuild_rederives_the_bucket_and_the_projector_resumes_after_it(
    nc: Client,
) -> None:
    config, _ = await filled(nc)
    kv = await nc.jetstream().key_value(config.registry_bucket)
    await kv.put(load_key(config.namespace, (0, 0)), b'{"garbage": true}')
    await kv.put(load_key(config.namespace, (5, 0)), b"{}")  # a rank the state never had
    await kv.delete(slot_key(config.namespace, (0, 1), 0))
    diffs = await verify(nc, config)
    assert len(diffs) == 3 and "unreadable" in diffs[0]
    done = await rebuild(nc, config)
    assert await verify(nc, config) == []
    bucket = await read_bucket(nc, config)
    assert bucket.position is not None and bucket.position.applied_seq == done.last_seq
    assert (5, 0) not in bucket.loads
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="rq", config=config)
        last = await lifecycle(pub, "after", 4)
        await pipeline.wait_applied(last)
        assert pipeline.projector.stats.deltas == last - done.last_seq
    assert await verify(nc, config) == []
    async with RegistryView(nc, config=config) as view:
        state = await fold_upto(nc, config)
        assert view.loads(state.now_ns) == state.registry.loads(state.now_ns)


async def test_verify_names_tampered_request_slots_and_rebuild_repairs_them(nc: Client) -> None:
    """Broke: nothing; request slot values (``<ns>.req.<w>.<r>.<slot>``) were covered only as a
    deleted key. Tampered here: one hash of a live request flipped (still a valid value),
    garbage bytes in a second live slot, packed hashes cut short by a byte in a third, and a
    request that is not live written into a slot key beyond the rank's. Expected: verify
    names exactly those four keys, each with what is wrong; rebuild rewrites each slot with the
    request of a fresh fold of the log (and deletes the invented key), and verify is then []."""
    config, _ = await filled(nc)
    kv = await nc.jetstream().key_value(config.registry_bucket)
    state = await fold_upto(nc, config)
    ns = config.namespace
    live = {
        slot_key(ns, rank, r.slot): (rid, r.hashes)
        for rank, slot in state.workers.slots.items()
        for rid, r in slot.requests.items()
    }
    flipped, garbage, cut = sorted(live)[:3]
    value = decode_request((await kv.get(flipped)).value or b"")
    hashes = value.hash_list()
    assert (value.request_id, hashes) == live[flipped]
    hashes[1] ^= 1 << 40
    await kv.put(flipped, encode_request(value.applied_seq, value.request_id, hashes))
    await kv.put(garbage, b"\xc1 not msgpack")
    value = decode_request((await kv.get(cut)).value or b"")
    short = msgspec.structs.replace(value, hashes=value.hashes[:-1])  # valid msgpack
    await kv.put(cut, msgspec.msgpack.encode(short))
    invented = slot_key(ns, (0, 1), 99)
    await kv.put(invented, encode_request(1, "ghost", [7, 8]))
    rid, want = live[flipped]
    assert sorted(await verify(nc, config)) == sorted(
        [
            f"{flipped}: bucket request {rid!r} ({len(want)} hashes), replay {rid!r} "
            f"({len(want)} hashes)",
            f"{garbage}: unreadable (MessagePack data is malformed: invalid opcode '\\xc1' "
            "(byte 0))",
            f"{cut}: unreadable (packed hashes of {len(live[cut][1]) * 8 - 1} bytes, not a "
            "multiple of 8)",
            f"{invented}: request 'ghost' in the bucket, not live in the replayed state",
        ]
    )
    await rebuild(nc, config)
    assert await verify(nc, config) == []
    for key, (rid, want) in live.items():
        value = decode_request((await kv.get(key)).value or b"")
        assert (value.request_id, value.hash_list()) == (rid, want), key
    bucket = await read_bucket(nc, config)
    assert 99 not in bucket.slots[(0, 1)] and not bucket.unreadable


async def test_verify_names_a_key_that_does_not_parse_and_rebuild_deletes_it(
    nc: Client, nats_server: object
) -> None:
    """A key of the namespace that names nothing the projector writes
    (``<ns>.load.x.y``) was skipped by the bucket read: verify called the bucket identical and
    rebuild left it there. Now verify names each such key, rebuild deletes it, and the keys
    that are no read model but are kept (the lease) stay unnamed."""
    url = nats_server.url  # type: ignore[attr-defined]
    config, _ = await filled(nc)
    ns = config.namespace
    kv = await nc.jetstream().key_value(config.registry_bucket)
    strays = [
        f"{ns}.load.x.y",
        f"{ns}.req.0.1",
        f"{ns}.req.0.0.-1",
        f"{ns}.load.0.0.0",
        f"{ns}.what",
    ]
    for key in strays:
        await kv.put(key, b"{}")
    named = [f"{key}: not a key of the read model" for key in sorted(strays)]
    assert await verify(nc, config) == named
    out = await run_cli(config, url, "replay", "--verify")
    assert out.returncode == 1 and out.stdout.splitlines() == [
        *named,
        f"DIVERGED: {len(strays)} keys differ",
    ], out.stdout
    await rebuild(nc, config)
    assert await verify(nc, config) == []
    assert (await read_bucket(nc, config)).strays == []
    for key in strays:
        with pytest.raises(KeyNotFoundError):
            await kv.get(key)


async def test_verify_of_a_bucket_that_does_not_exist_is_one_clear_line(
    nc: Client, nats_server: object
) -> None:
    """``replay --verify`` on a missing bucket printed the client's raw error. Now
    one line that names the bucket, and a non-zero exit; the same whether the log exists (the
    bucket deleted) or nothing was ever made."""
    url = nats_server.url  # type: ignore[attr-defined]
    config, _ = await filled(nc)
    await nc.jetstream().delete_key_value(config.registry_bucket)
    for names in (config, fresh_config("vm")):
        out = await run_cli(names, url, "replay", "--verify", "--no-progress")
        assert out.returncode == 1, out
        assert out.stdout == ""
        assert plain_lines(out.stderr) == [
            f"seqstate: error: bucket {names.registry_bucket!r} does not exist: nothing to "
            "verify (no projector has run with these names)"
        ]


def in_a_terminal(config: Config, url: str, *args: str) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal (80x24), as in an operator's shell."""
    flags = name_flags(config)
    env = {**os.environ, "NATS_URL": url, "TERM": "xterm-256color", "COLUMNS": "80"}
    env.pop("NO_COLOR", None)
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "projector", *args, *flags],
        env=env,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
    )
    os.close(slave)
    screen: list[bytes] = []

    def read_terminal() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                return
            if not chunk:
                return
            screen.append(chunk)

    reader = threading.Thread(target=read_terminal)
    reader.start()
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        reader.join(10)
        os.close(master)
    return proc.returncode, out.decode(), b"".join(screen).decode(errors="replace")


async def test_the_cli_replays_verifies_rebuilds_and_manages_snapshots(
    nc: Client, nats_server: object
) -> None:
    url = nats_server.url  # type: ignore[attr-defined]
    config, last = await filled(nc)
    out = await run_cli(config, url, "replay", "--json", "--to-seq", "10")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    state = await fold_upto(nc, config, seq=10)
    assert [r["active_requests"] for r in rows] == [
        r.active_requests for r in state.registry.loads(state.now_ns)
    ]
    log = await read_log(nc, config)
    clock = dt.datetime.fromtimestamp(log[4][1] / 1e9, dt.UTC).time().isoformat()
    out = await run_cli(config, url, "replay", "--at", clock)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("replayed ")
    out = await run_cli(config, url, "replay", "--verify")
    assert out.returncode == 0 and "identical: 0 keys differ" in out.stdout, out.stdout
    kv = await nc.jetstream().key_value(config.registry_bucket)
    await kv.delete(load_key(config.namespace, (0, 0)))
    out = await run_cli(config, url, "replay", "--verify")
    assert out.returncode == 1
    assert f"{load_key(config.namespace, (0, 0))}: missing from the bucket" in out.stdout
    out = await run_cli(config, url, "rebuild")
    assert out.returncode == 0 and f"at event {last}" in out.stdout, out.stderr
    out = await run_cli(config, url, "replay", "--verify")
    assert out.returncode == 0, out.stdout
    out = await run_cli(config, url, "snapshot", "save")
    assert out.returncode == 0 and "saved and verified" in out.stdout, out.stderr
    out = await run_cli(config, url, "snapshot", "list")
    assert out.returncode == 0 and f"{config.namespace}.{last:020d}" in out.stdout
    out = await run_cli(config, url, "snapshot", "show", "latest")
    assert out.returncode == 0 and f"event {last}" in out.stdout, out.stderr
    out = await run_cli(config, url, "replay", "--verify", "--to-seq", "3")
    assert out.returncode == 1
    assert plain_lines(out.stderr)[0].startswith("seqstate: error: --verify")


@pytest.mark.parametrize(
    "args",
    [
        ("replay",),
        ("replay", "--verify"),
        ("replay", "--at", "AT"),
        ("rebuild",),
        ("snapshot", "save"),
    ],
)
async def test_long_commands_show_their_progress_bar_in_a_terminal(
    nc: Client, nats_server: object, args: tuple[str, ...]
) -> None:
    url = nats_server.url  # type: ignore[attr-defined]
    config, last = await filled(nc, 30)
    log = await read_log(nc, config)
    # a millisecond after the last event: --at takes microseconds, the log has nanoseconds
    at = dt.datetime.fromtimestamp(log[-1][1] / 1e9 + 0.001, dt.UTC).isoformat()
    args = tuple(at if a == "AT" else a for a in args)
    code, out, terminal = await asyncio.to_thread(in_a_terminal, config, url, *args)
    assert "Traceback" not in terminal, terminal
    assert code == 0, terminal
    assert out.strip(), "no result printed"
    if args[0] == "replay" and "--verify" not in args:
        assert f"to event {last}" in out


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ("--to-seq", "-5"),
            "--to-seq -5 is outside the log: the log of namespace {ns!r} holds "
            "events 1 to {last}, from ",
        ),
        (("--to-seq", "{beyond}"), "--to-seq {beyond} is outside the log"),
        (("--from-seq", "10", "--to-seq", "5"), "--from-seq 10 is after --to-seq 5"),
        (("--from-seq", "0"), "--from-seq 0 is outside the log"),
        (
            ("--at", "2001-02-03T04:05:06"),
            "--at 2001-02-03T04:05:06.000000+00:00 is before the "
            "first event: the log of namespace {ns!r} holds",
        ),
    ],
)
async def test_replay_refuses_a_range_outside_the_log_naming_the_log(
    nc: Client, nats_server: object, args: tuple[str, ...], expected: str
) -> None:
    url = nats_server.url  # type: ignore[attr-defined]
    config, last = await filled(nc, 6)
    fill = {"ns": config.namespace, "last": last, "beyond": last + 1}
    out = await run_cli(config, url, "replay", *(a.format(**fill) for a in args))
    assert out.returncode == 1 and out.stdout == ""
    lines = plain_lines(out.stderr)
    assert len(lines) == 1 and lines[0].startswith("seqstate: error: "), out.stderr
    assert expected.format(**fill) in lines[0]


async def test_replay_of_a_range_holding_none_of_the_namespaces_events_says_so(
    nc: Client, nats_server: object
) -> None:
    """On a stream shared by two namespaces, a range that holds only the other's events
    printed "replayed 0 events from event X to event 0 ... as of log time 1970" and an empty
    table, exit 0. It names the range and what the namespace's log holds, exit 1."""
    url = nats_server.url  # type: ignore[attr-defined]
    config, last = await filled(nc, 6)
    other = config.with_namespace(f"{config.namespace}-other")
    async with Pipeline(nc, other) as pipeline:
        pub = RouterPublisher(nc, config=other, router_id="rq")
        first = await pub.add("o1", 1, block_hashes=[1])
        end = await pub.add("o2", 1, block_hashes=[2])
        await pipeline.wait_applied(end)
    after = await RouterPublisher(nc, config=config, router_id="rp2").free("q0", 0, 0)
    assert last < first < end < after  # the range: the other namespace's two events
    out = await run_cli(config, url, "replay", "--from-seq", str(first), "--to-seq", str(end))
    assert (out.returncode, out.stdout) == (1, ""), out.stdout
    (line,) = plain_lines(out.stderr)
    assert line.startswith(
        f"seqstate: error: no event of namespace {config.namespace!r} from event {first} to "
        f"event {end}: the log of namespace {config.namespace!r} holds events 1 to "
    ), line


async def test_the_fast_path_equals_the_client_path_and_falls_back(
    nc: Client, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from projector.write.log_fold import fold_stream

    config = fresh_config("f")
    last = await fill(nc, config, 6000)  # enough bytes for the server to ask for flow control
    results = {}
    for fast in (True, False):
        state = config.new_state()
        counts = await fold_stream(nc, config, state, start_seq=1, end_seq=last, fast=fast)
        results[fast] = (counts, state.snapshot(), state.registry.loads(state.now_ns))
    assert results[True] == results[False]
    assert results[True][0] == (1, last, last, 1)
    assert "fast replay path stopped" not in caplog.text  # the fast path did the work
    caplog.set_level("WARNING", logger="seqstate.replay")
    # The reader cannot start: the fold goes on through the client and ends the same.
    monkeypatch.setattr("projector.nats.stream_reader.sys.executable", "/bin/false")
    state = config.new_state()
    counts = await fold_stream(nc, config, state, start_seq=1, end_seq=last)
    assert (counts, state.snapshot()) == results[True][:2]
    assert "fast replay path stopped" in caplog.text
    # A range inside the log, both ends exact.
    state = config.new_state()
    counts = await fold_stream(nc, config, state, start_seq=100, end_seq=200)
    assert counts == (100, 200, 101, 0)
