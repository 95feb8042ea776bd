"""The ``seqstate`` command line as an operator runs it: subprocesses against real servers."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import nats
import pytest
from dynamo_capture import CAPTURE, ENDPOINT, SUBJECT
from eventually import eventually
from holding_proxy import HoldingProxy
from log_text import plain_lines
from nats.aio.client import Client
from nats.js.errors import NotFoundError
from pipeline_kit import cli_env, fresh_config, name_flags, seqstate, spawned_run

from projector.bucket.contents import read_bucket
from projector.bucket.reader import RegistryView
from projector.nats.backlog import covered_seq
from projector.nats.lease import Holder
from projector.nats.resources import dynamo_capture
from projector.nats.server import LOCK_FILE, NatsServer
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from projector.wire.values import Position, encode_position, lease_key, position_key
from seqstate import decode_deltas
from seqstate.dynamo import captured_subject

REPO = Path(__file__).resolve().parents[2]


async def aseqstate(*args: str, stdin: bytes = b"", **env: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "projector",
        *args,
        env=cli_env(**env),
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    return proc.returncode or 0, out.decode(), err.decode()


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = plain_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("seqstate: error: ")
    return lines[0]


def test_run_demo_for_ten_seconds_fills_the_bucket(tmp_path: Path) -> None:
    store = tmp_path / "store"
    result = seqstate(
        "run",
        "--demo",
        "--duration",
        "10",
        "--no-live",
        "--workers",
        "4",
        "--store-dir",
        str(store),
        "--port",
        "0",
        "--log-level",
        "warning",
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    summary = [line for line in result.stdout.splitlines() if line.startswith("demo: routed")]
    assert summary, result.stdout
    routed = int(summary[0].split()[2])
    assert routed > 10

    async def inspect() -> tuple[set[tuple[int, int]], dict[int, int], int, int]:
        import nats

        async with NatsServer(store) as server:
            nc = await nats.connect(server.url)
            try:
                js = nc.jetstream()
                # nats-py's kv.keys() can miss values right after a server start: its end
                # marker may overtake them. read_bucket waits for the last pending one.
                bucket = await read_bucket(nc, Config())
                ranks = set(bucket.loads)
                position = bucket.position
                assert position is not None
                events = await js.stream_info("SEQSTATE_EVENTS")
                deltas = await js.stream_info("SEQSTATE_DELTAS")
                peak: dict[int, int] = {}
                for seq in range(deltas.state.first_seq, deltas.state.last_seq + 1):
                    raw = (await js.get_msg("SEQSTATE_DELTAS", seq)).data or b""
                    for change in (c for d in decode_deltas(raw) for c in d.changes):
                        w = change.rank[0]
                        peak[w] = max(peak.get(w, 0), change.load.active_requests)
                return ranks, peak, position.applied_seq, events.state.last_seq
            finally:
                await nc.close()

    ranks, peak, applied, last = asyncio.run(inspect())
    assert ranks == {(w, 0) for w in range(4)}
    assert all(peak.get(w, 0) > 0 for w in range(4)), peak  # every demo worker carried load
    assert applied == last  # the bucket reflects the whole log, the drain's frees included


def test_bad_flag_is_one_line_and_exit_2() -> None:
    result = seqstate("run", "--no-such-flag")
    assert result.returncode == 2
    assert "--no-such-flag" in one_line_error(result)


def test_missing_trace_is_one_line() -> None:
    line = one_line_error(seqstate("run", "--demo", "--trace", "/nonexistent/trace.jsonl"))
    assert "/nonexistent/trace.jsonl" in line


def test_unreachable_nats_is_one_line() -> None:
    line = one_line_error(seqstate("loads", NATS_URL="nats://127.0.0.1:1"))
    assert "cannot reach NATS at nats://127.0.0.1:1" in line


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (
            ("projector", "--flush-interval-s", "soon"),
            {},
            "--flush-interval-s 'soon': not a number (seconds)",
        ),
        (
            ("writer", "--expiry-s", "banana"),
            {},
            "--expiry-s 'banana': not a number (seconds, or 'off')",
        ),
        (("run", "--flush-interval-s", "-1"), {}, "--flush-interval-s '-1': must be positive"),
        (
            ("writer",),
            {"SEQSTATE_EXPIRY_S": "banana"},
            "SEQSTATE_EXPIRY_S='banana': not a number (seconds, or 'off')",
        ),
        (("loads",), {"NATS_URL": "garbage"}, "NATS_URL='garbage': 'garbage' is not a NATS URL"),
        (
            ("status", "--nats-url", "http://x:1"),
            {},
            "--nats-url 'http://x:1': 'http://x:1' is not a NATS URL",
        ),
    ],
)
def test_a_bad_setting_is_one_line_naming_it_as_typed(
    args: tuple[str, ...], env: dict[str, str], said: str
) -> None:
    assert one_line_error(seqstate(*args, **env)).startswith(f"seqstate: error: {said}")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("demo", "--speedup", "0"), "--speedup 0: must be a positive number"),
        (("demo", "--speedup", "-2"), "--speedup -2: must be a positive number"),
        (("demo", "--speedup", "nan"), "--speedup nan: must be a positive number"),
        (("demo", "--rate", "0"), "--rate 0: must be a positive number"),
        (("demo", "--workers", "0"), "--workers 0: must be at least 1"),
        (("run", "--demo", "--speedup", "0"), "--speedup 0: must be a positive number"),
        (("run", "--port", "-3"), "--port -3: must be a port (1-65535), or 0 for any free port"),
        (
            ("run", "--port", "70000"),
            "--port 70000: must be a port (1-65535), or 0 for any free port",
        ),
    ],
)
def test_a_bad_demo_or_port_number_is_one_line_before_anything_starts(
    args: tuple[str, ...], said: str, tmp_path: Path
) -> None:
    # --speedup 0 divided the arrival rate by zero once the run was up: a traceback.
    # run: its embedded server, in a store of its own; demo: a server that is not there.
    where = {} if args[0] == "run" else {"NATS_URL": "nats://127.0.0.1:1"}
    store = ("--store-dir", str(tmp_path / "store")) if args[0] == "run" else ()
    result = seqstate(*args, *store, "--duration", "5", timeout=30, **where)
    assert one_line_error(result) == f"seqstate: error: {said}"
    assert not (tmp_path / "store").exists()  # refused before a server was started


def test_run_port_0_listens_on_a_free_port_and_says_which(tmp_path: Path) -> None:
    # nats-server's own -p 0 means its default, 4222: `run --port 0` listened there (or, with
    # 4222 taken, failed), where a user means "any free port", as a socket does.
    proc, lines = started_run(tmp_path / "store", "--port", "0", "--log-level", "info")
    try:
        url = embedded_url(lines)
        port = int(url.rsplit(":", 1)[1])
        assert port not in (0, 4222), url
        assert not any("is taken" in line for line in lines), lines
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            assert conn.recv(5) == b"INFO "  # a NATS server is there
    finally:
        stopped(proc)


def test_help_speaks_the_users_language() -> None:
    helps = {
        name: seqstate(name, "--help").stdout
        for name in (
            "run",
            "writer",
            "projector",
            "demo",
            "publish",
            "loads",
            "watch",
            "status",
            "replay",
            "rebuild",
            "snapshot",
            "report",
            "inspect",
            "top",
        )
    }
    top = seqstate("--help").stdout
    helps = {name: " ".join(text.split()) for name, text in helps.items()}  # unwrapped
    for name, text in [*helps.items(), ("", top)]:
        assert "``" not in text and ":class:" not in text, name  # no markup leaks
        assert "-durable" not in text, name  # settings that nothing read are gone
        shown = text.replace("[env SEQSTATE_", "").replace("SEQSTATE_EVENTS", "")
        shown = shown.replace("_SEQSTATE_INBOX", "")  # the inbox prefix's default, a subject
        assert "SEQSTATE_" not in shown.replace("SEQSTATE_DELTAS", ""), name  # not as metavars
    assert "unset: start an embedded nats-server" in helps["run"]
    for name in ("loads", "status", "publish", "writer"):
        assert "embedded" not in helps[name], name
        assert "--nats-url URL" in helps[name]
    readers = ("loads", "watch", "status", "publish", "replay", "inspect", "top")
    for name in readers:  # readers: no writer knobs
        for knob in ("--flush-interval-s", "--snapshot-every-events", "--idle-tick-s"):
            assert knob not in helps[name], (name, knob)
    writer = helps["writer"]
    assert "(default: 300) [env SEQSTATE_EXPIRY_S]" in writer
    assert "(default: 10000) [env SEQSTATE_SNAPSHOT_EVERY_EVENTS]" in writer
    publish = helps["publish"]
    for event in (
        "AddRequest",
        "MarkPrefillCompleted",
        "Free",
        "AddOutputBlock",
        "WorkerAdded",
        "WorkerRemoved",
        "Tick",
    ):
        assert f"{event}:" in publish
    assert "request_id, worker_id, dp_rank=0, block_hashes=[], prefill_tokens=0," in publish
    assert "(default: 4222) [env SEQSTATE_PORT]" in helps["run"]


def test_version_is_the_package_version() -> None:
    from importlib.metadata import version

    result = seqstate("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"seqstate {version('seqstate')} (event schema 1)"


def test_a_server_that_never_answers_fails_in_one_line_within_seconds() -> None:
    # A host that accepts and then says nothing (no INFO): a one-shot command gives up after
    # one attempt and a little, instead of retrying for about 14 s as it did.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"nats://127.0.0.1:{silent.getsockname()[1]}"
        line = one_line_error(seqstate("status", NATS_URL=url, timeout=30))
    assert line == f"seqstate: error: cannot reach NATS at {url}: no answer in time"


def test_missing_publish_file_is_one_line(nats_server: NatsServer) -> None:
    line = one_line_error(seqstate("publish", "/nonexistent.jsonl", NATS_URL=nats_server.url))
    assert "/nonexistent.jsonl" in line


async def test_publish_then_loads_and_status(nc: Client, nats_server: NatsServer) -> None:
    config = fresh_config("c")
    flags = name_flags(config)
    lines = [
        {"type": "WorkerAdded", "worker_id": 3, "dp_size": 2},
        {
            "type": "AddRequest",
            "request_id": "a",
            "worker_id": 3,
            "dp_rank": 1,
            "block_hashes": [1, 2, 3],
            "prefill_tokens": 40,
        },
        {"type": "AddRequest", "request_id": "b", "worker_id": 3, "block_hashes": [1, 2]},
        {"type": "Free", "request_id": "b", "worker_id": 3},
    ]
    stdin = "\n".join(json.dumps(line) for line in lines).encode()
    async with Pipeline(nc, config) as pipeline:
        rc, out, err = await aseqstate(
            "publish", "-", *flags, stdin=stdin, NATS_URL=nats_server.url
        )
        assert rc == 0, err
        assert out.strip() == "published 4 events, last sequence 4"
        await pipeline.wait_applied(4)
        rc, out, err = await aseqstate("loads", "--json", *flags, NATS_URL=nats_server.url)
        assert rc == 0, err
        rows = [json.loads(line) for line in out.splitlines()]
        assert [
            (r["worker_id"], r["dp_rank"], r["active_requests"], r["active_blocks"]) for r in rows
        ] == [(3, 0, 0, 0), (3, 1, 1, 3)]
        rc, out, err = await aseqstate("status", "--json", *flags, NATS_URL=nats_server.url)
        assert rc == 0, err
        status = json.loads(out)
        assert status["applied_seq"] == 4 and status["lag_events"] == 0 and status["ranks"] == 2
        assert status["streams"][0]["last_seq"] == 4
        rc, out, err = await aseqstate("status", *flags, NATS_URL=nats_server.url)
        assert rc == 0 and "lag: 0 events behind the log" in out


@pytest.mark.parametrize(
    ("line", "said"),
    [
        (
            '{"type":"AddRequest","request_id":"t","worker_id":5,"block_hashes":[1],'
            '"prefil_tokens":500}',
            "stdin:1: not an event: Object contains unknown field `prefil_tokens`",
        ),
        (
            '{"type":"AddRequest","request_id":"t","worker_id":5,'
            '"block_hashes":[18446744073709551616]}',
            "stdin:1: not an event: invalid event: 18446744073709551616 does not fit in 64 bits - "
            "at `$.block_hashes[0]`",
        ),
    ],
)
async def test_publish_names_a_typo_or_an_overflow_and_publishes_nothing(
    nats_server: NatsServer, line: str, said: str
) -> None:
    config = fresh_config("t")
    rc, out, err = await aseqstate(
        "publish",
        "--namespace",
        config.namespace,
        "--events-stream",
        config.events_stream,
        stdin=line.encode(),
        NATS_URL=nats_server.url,
    )
    assert (rc, out) == (1, "")
    assert plain_lines(err) == [f"seqstate: error: {said}"]


async def test_publish_refuses_an_event_too_large_to_store_and_sends_nothing(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("t")
    small = '{"type": "Free", "request_id": "x", "worker_id": 1}'
    huge = json.dumps(
        {
            "type": "AddRequest",
            "request_id": "huge",
            "worker_id": 1,
            "block_hashes": list(range(2**62, 2**62 + 120_000)),
        }
    )
    rc, out, err = await aseqstate(
        "publish",
        "--namespace",
        config.namespace,
        "--events-stream",
        config.events_stream,
        "--router-id",
        "cli-test",
        NATS_URL=nats_server.url,
        stdin=f"{small}\n{huge}\n".encode(),
    )
    assert (rc, out) == (1, "")
    assert plain_lines(err) == [
        "seqstate: error: stdin:2: AddRequest for request 'huge': 1,080,083 bytes encoded, over "
        "the 1,043,456 bytes one event may take (the server's max_payload of 1,048,576 less 5,120 "
        "for its delta); it was not sent"
    ]
    with pytest.raises(NotFoundError):  # not even the stream was made: nothing was sent
        await nc.jetstream().stream_info(config.events_stream)


async def test_publish_counts_in_words(nats_server: NatsServer) -> None:
    config = fresh_config("w")
    line = b'{"type": "Free", "request_id": "x", "worker_id": 1}\n'
    rc, out, err = await aseqstate(
        "publish",
        "--namespace",
        config.namespace,
        "--events-stream",
        config.events_stream,
        NATS_URL=nats_server.url,
        stdin=line,
    )
    assert rc == 0, err
    assert out.strip() == "published 1 event, last sequence 1"


async def test_status_never_shows_a_negative_lag(nc: Client, nats_server: NatsServer) -> None:
    config = fresh_config("c")
    flags = name_flags(config)
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="lag", config=config)
        await pipeline.wait_applied(await pub.add("a", 1))
    # A position no fold of this log could have written (once shown as `lag: -999...`).
    kv = await nc.jetstream().key_value(config.registry_bucket)
    await kv.put(position_key(config.namespace), encode_position(Position(10**12, 0, 1)))
    rc, out, err = await aseqstate("status", "--json", *flags, NATS_URL=nats_server.url)
    assert rc == 0, err
    report = json.loads(out)
    assert (report["lag_events"], report["position_beyond_log"]) == (0, True)
    rc, out, err = await aseqstate("status", *flags, NATS_URL=nats_server.url)
    assert rc == 0 and "is beyond the log's newest event" in out and "lag: -" not in out


async def test_publish_rejects_an_invalid_line_naming_it(nats_server: NatsServer) -> None:
    stdin = b'{"type": "Free", "request_id": "x", "worker_id": 1}\n{"type": "Nope"}\n'
    rc, _, err = await aseqstate("publish", stdin=stdin, NATS_URL=nats_server.url)
    assert rc == 1 and plain_lines(err)[0].startswith("seqstate: error: stdin:2: not an event")


@pytest.mark.parametrize("command", ["loads", "status"])
async def test_reads_of_a_missing_bucket_fail_clearly(
    nats_server: NatsServer, command: str
) -> None:
    rc, out, err = await aseqstate(
        command, "--registry-bucket", "never-made", NATS_URL=nats_server.url
    )
    if command == "loads":
        assert rc == 1 and "never-made" in err and "Traceback" not in err
    else:
        assert rc == 0 and "never-made: missing" in out


def test_run_demo_replays_a_mooncake_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": t, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2 + i]}
        for i, t in enumerate([0, 10, 20, 30])
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    result = seqstate(
        "run",
        "--demo",
        "--trace",
        str(trace),
        "--speedup",
        "1",
        "--no-live",
        "--workers",
        "2",
        "--store-dir",
        str(tmp_path / "store"),
        "--port",
        "0",
        "--duration",
        "30",
        "--log-level",
        "warning",
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    # The trace ends: the demo stops by itself, every request routed and completed.
    assert "demo: routed 4 requests (4 completed" in result.stdout, result.stdout


def started_run(store: Path, *args: str) -> tuple[subprocess.Popen[str], list[str]]:
    """``seqstate run`` in the background, once it says its pipeline runs; its log so far."""
    return spawned_run(store, *args)


def stopped(proc: subprocess.Popen[str]) -> str:
    proc.terminate()
    _, rest = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    return rest


def test_a_second_run_on_the_same_store_refuses_in_one_line(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first, _ = started_run(store, "--port", "0")
    try:
        second = seqstate("run", "--store-dir", str(store), "--duration", "5")
        line = one_line_error(second)
        assert f"the store {store} is in use by another nats-server" in line
    finally:
        stopped(first)
    # Released with the first run: the store starts again, and its snapshot is still there.
    again = seqstate("run", "--store-dir", str(store), "--port", "0", "--duration", "0.5")
    assert again.returncode == 0, again.stderr


def store_locked(store: Path) -> bool:
    """Does a process (a run, or its nats-server) hold the store's lock right now?"""
    fd = os.open(store / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases it, if it was taken
    return False


def server_pid(store: Path) -> int:
    return int((store / LOCK_FILE).read_text().split()[0])


def running(pid: int) -> bool:
    """Alive and not a zombie (a dead orphan may wait for a reaper that never comes)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


async def test_a_killed_run_takes_its_server_with_it_and_the_next_run_starts(
    tmp_path: Path,
) -> None:
    # Before the fix the server outlived a SIGKILLed run, holding the store: every later run
    # refused it ("in use by another nats-server") until someone found and killed the server.
    store = tmp_path / "store"
    first, _ = started_run(store, "--port", "0")
    pid = server_pid(store)
    first.kill()
    first.wait()
    try:
        await eventually(lambda: running(pid), lambda alive: not alive, what="the server died")
        await eventually(lambda: store_locked(store), lambda held: not held, what="store freed")
    finally:
        if running(pid):
            os.kill(pid, signal.SIGKILL)
    again = await asyncio.to_thread(
        seqstate, "run", "--store-dir", str(store), "--port", "0", "--duration", "0.5"
    )
    assert again.returncode == 0, again.stderr


ORPHAN_MAKER = """
import os, sys
from projector.nats.server import NatsServer
server = NatsServer(sys.argv[1]).start()  # as a run started it before the fix
print(server.url, flush=True)
os.kill(os.getpid(), 9)
"""


async def test_a_run_stops_a_server_left_over_from_a_killed_run(tmp_path: Path) -> None:
    # A server whose run is gone (killed before the fix, or its death signal lost): the next
    # run stops it and takes the store, instead of refusing the store for good.
    store = tmp_path / "store"
    maker = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", ORPHAN_MAKER, str(store)],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
        cwd=REPO,
    )
    assert maker.returncode == -signal.SIGKILL, maker.stderr
    pid = server_pid(store)
    try:
        assert running(pid) and store_locked(store)  # the orphan holds the store
        again = await asyncio.to_thread(
            seqstate,
            "run",
            "--store-dir",
            str(store),
            "--port",
            "0",
            "--duration",
            "0.5",
            "--log-level",
            "info",
        )
        assert again.returncode == 0, again.stderr
        said = plain_lines(again.stderr)
        stopping = f"stopping nats-server pid {pid}: it holds the store {store}, left over"
        assert any(stopping in line for line in said), said
        assert not running(pid)
    finally:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def embedded_url(lines: list[str]) -> str:
    said = [line for line in plain_lines("".join(lines)) if "embedded nats-server at" in line]
    assert len(said) == 1, lines
    return said[0].split("embedded nats-server at ", 1)[1].split()[0]


def test_a_second_run_on_a_served_namespace_refuses_in_one_line(tmp_path: Path) -> None:
    # Before the fix it waited for the first's lease, said it was running anyway (on a
    # signal), logged an asyncio traceback at each restart, and folded beside the first.
    first, lines = started_run(tmp_path / "store", "--port", "0", "--log-level", "info")
    try:
        url = embedded_url(lines)
        second = seqstate("run", "--duration", "30", timeout=90, NATS_URL=url)
        line = one_line_error(second)
        assert line.startswith(
            f"seqstate: error: a projector of namespace 'default' is running (pid {first.pid} "
        ), line
        assert line.endswith(
            ": one run per namespace and server; stop that one first, or use another --namespace"
        ), line
        assert second.stdout == ""
        # Another namespace on the same server is another pipeline: it runs.
        other = seqstate("run", "--duration", "0.5", "--namespace", "other", NATS_URL=url)
        assert other.returncode == 0, other.stderr
        assert "Traceback" not in other.stderr
    finally:
        stopped(first)


def test_run_listens_on_the_same_port_each_time(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # A long store path: a fixed-width log handler would break this line in two.
    store = tmp_path / ("a-store-directory-with-a-rather-long-name-" * 3) / "jetstream"
    url = f"nats://127.0.0.1:{port}"
    for _ in range(2):
        proc, lines = started_run(store, "--port", str(port))
        stopped(proc)
        said = [line for line in lines if "embedded nats-server at" in line]
        assert len(said) == 1 and f"at {url} (export NATS_URL={url})" in said[0]
        assert str(store) in said[0]  # one record, one line: nothing wrapped off a terminal


def test_run_restarts_a_failed_pipeline_in_process_and_says_so(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc, lines = started_run(tmp_path / "store", "--port", str(port), "--log-level", "info")
    url = f"nats://127.0.0.1:{port}"
    try:

        async def break_then_use() -> tuple[int, int]:
            import nats

            nc = await nats.connect(url)
            try:
                # Another holder takes the projector's lease: its projector must stop (a lease
                # lost is a failure); the run restarts the pipeline, whose new projector waits
                # out the stranger's short lease and takes over.
                kv = await nc.jetstream().key_value(Config().registry_bucket)
                stranger = Holder("projector", "stranger", "elsewhere", 1, "", ttl_s=0.5)
                await kv.put(lease_key("default"), msgspec.json.encode(stranger))

                async def holder() -> Holder:
                    entry = await kv.get(lease_key("default"))
                    return msgspec.json.decode(entry.value or b"{}", type=Holder)

                await eventually(
                    holder,
                    lambda held: held.id != "stranger",
                    what="a new projector took the lease back",
                    timeout=60,
                )
                pub = RouterPublisher(nc, router_id="restart-test")
                seq = await pub.add("after-restart", 7, block_hashes=[1, 2])
                async with RegistryView(nc) as view:
                    await view.wait_for(seq, timeout=60)
                    (row,) = view.loads()
                    return seq, row.active_requests
            finally:
                await nc.close()

        _, active = asyncio.run(break_then_use())
        assert active == 1
    finally:
        rest = stopped(proc)
    log = "".join(lines) + rest
    assert "pipeline stopped (" in log and "restarting it in 1s" in log, log
    assert "pipeline running again (restart 1)" in log, log


async def test_run_captures_dynamo_from_the_moment_it_says_it_runs(tmp_path: Path) -> None:
    """``seqstate run --dynamo-endpoint E`` says so in the line that says it runs, and it is
    provisioned by then: Dynamo's messages published right after that line (a frontend's
    first six AddRequests, NATS Core) are stored and folded, none lost."""
    proc, lines = started_run(
        tmp_path / "store", "--port", "0", "--namespace", "dynrun", "--dynamo-endpoint", ENDPOINT
    )
    try:
        line = lines[-1]
        assert f"capturing Dynamo endpoint {ENDPOINT}" in line, line
        url = line.split(" at ", 1)[1].split(",", 1)[0]
        nc = await nats.connect(url)
        try:
            for message in CAPTURE[:6]:
                await nc.publish(SUBJECT, message.data)
            await nc.flush()
            config = Config(namespace="dynrun")
            captured = captured_subject(config.namespace, ENDPOINT)
            js = nc.jetstream()

            async def stored() -> int:
                """The last capture sequence in the log (the forwarder's header names it)."""
                try:
                    newest = await js.get_last_msg(config.events_stream, captured)
                except NotFoundError:
                    return 0
                return covered_seq(newest.headers, dynamo_capture(config))

            await eventually(stored, lambda n: n == 6, what="the six AddRequests stored")
        finally:
            await nc.close()
    finally:
        stopped(proc)


async def _publishing(
    url: str, config: Config, path: Path, *flags: str
) -> asyncio.subprocess.Process:
    """``seqstate publish FILE --router-id p3 FLAGS`` started against ``url``, as typed."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "projector",
        "publish",
        str(path),
        "--router-id",
        "p3",
        *name_flags(config),
        *flags,
        env=cli_env(NATS_URL=url),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


async def _interrupted_publish(
    nats_server: NatsServer, config: Config, path: Path, *flags: str
) -> tuple[int, str]:
    """``seqstate publish FILE --router-id p3`` interrupted (SIGINT, as Ctrl-C sends it) once
    it has stored 200 events; its exit code and its one line."""
    proc = await _publishing(nats_server.url, config, path, *flags)
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()

        async def stored() -> int:
            try:
                return (await js.stream_info(config.events_stream)).state.messages
            except NotFoundError:
                return 0

        await eventually(stored, lambda n: n >= 200, what="200 events stored")
    finally:
        await nc.close()
    proc.send_signal(signal.SIGINT)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert out == b"", out
    (line,) = plain_lines(err.decode())
    return proc.returncode or 0, line


def _frees(count: int) -> str:
    return "".join(
        json.dumps({"type": "Free", "request_id": f"f{i}", "worker_id": 1}) + "\n"
        for i in range(count)
    )


async def _stored_ids(nats_server: NatsServer, config: Config) -> list[str]:
    """The request id of every event stored, in stream order."""
    from seqstate import decode_event

    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        count = (await js.stream_info(config.events_stream)).state.messages
        msgs = [await js.get_msg(config.events_stream, s) for s in range(1, count + 1)]
        return [decode_event(m.data).request_id for m in msgs]  # type: ignore[union-attr]
    finally:
        await nc.close()


async def _resumed(
    nats_server: NatsServer, config: Config, path: Path, stored: int, total: int
) -> None:
    """``publish FILE --router-id p3 --resume``: the rest published, the whole file stored
    once, in order."""
    resumed = seqstate(
        "publish",
        str(path),
        "--router-id",
        "p3",
        "--resume",
        *name_flags(config),
        NATS_URL=nats_server.url,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout == (
        f"published {total - stored} events ({stored} already stored), last sequence {total}\n"
    )
    assert await _stored_ids(nats_server, config) == [f"f{i}" for i in range(total)]


async def test_an_interrupted_publish_says_what_it_stored_and_resumes(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """Ctrl-C on ``publish FILE`` of 20,000 events: exit 130 and one line saying how many
    were stored and how to resume. Run again with the same router id, without ``--resume``:
    refused in one line, nothing stored. With ``--resume``: the rest, each event once, in
    the file's order."""
    config = fresh_config("pub")
    path = tmp_path / "frees.jsonl"
    path.write_text(_frees(20_000))
    rc, line = await _interrupted_publish(nats_server, config, path)
    assert rc == 130
    hint = f"`seqstate publish {path} --router-id p3 --resume` checks them and publishes the rest"
    assert line.startswith("seqstate: interrupted: "), line
    assert line.endswith(
        f"of 20000 events of {path} stored (router id 'p3'; the next one may be too); {hint}"
    ), line
    said = int(line.split("interrupted: ")[1].split(" of ")[0])
    assert said >= 200
    stored = len(await _stored_ids(nats_server, config))
    assert stored in (said, said + 1)

    again = seqstate(
        "publish", str(path), "--router-id", "p3", *name_flags(config), NATS_URL=nats_server.url
    )
    assert again.returncode == 1 and again.stdout == ""
    error = one_line_error(again)
    assert error.startswith(
        "seqstate: error: router id 'p3' already stored events (msg-id p3:1:"
    ), error
    assert "is at stream sequence 1; 0 stored by this run)" in error, error
    assert len(await _stored_ids(nats_server, config)) == stored

    await _resumed(nats_server, config, path, stored, 20_000)


def test_publish_refuses_a_router_id_no_msg_id_can_carry_in_one_line(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """``--router-id`` of 257 characters ended in a traceback (the publisher's ValueError),
    and an empty one published under a default id instead. Each is one line, nothing
    stored."""
    config = fresh_config("rid")
    path = tmp_path / "one.jsonl"
    path.write_text(_frees(1))
    refused = {
        "r" * 257: "router_id 'rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr'… (257 "
        "characters): at most 256 characters (what a RouterHeartbeat carries)",
        "": "router_id must not be empty",
    }
    for router_id, why in refused.items():
        result = seqstate(
            "publish",
            str(path),
            "--router-id",
            router_id,
            *name_flags(config),
            NATS_URL=nats_server.url,
        )
        assert one_line_error(result) == f"seqstate: error: --router-id: {why}"
        assert result.returncode == 1


async def test_ctrl_c_before_a_resume_has_read_the_log_says_that_nothing_was_published(
    tmp_path: Path,
) -> None:
    """Ctrl-C on ``publish FILE --resume`` while it reads the log for the events its router id
    stored: exit 130 and one line saying that this run published none and how to go on. It
    exited 130 without a word, and only after its drain had waited for the read called off.
    A proxy holds the command at the consumer it reads the log with, whatever the speed."""
    path = tmp_path / "frees.jsonl"
    path.write_text(_frees(300))
    config = fresh_config("pub")
    with NatsServer(tmp_path / "nats") as server:
        first = seqstate(
            "publish", str(path), "--router-id", "p3", *name_flags(config), NATS_URL=server.url
        )
        assert first.returncode == 0, first.stderr
        port = int(server.url.rsplit(":", 1)[1])
        proxy = await HoldingProxy(port, hold_at="$JS.API.CONSUMER.CREATE.").start()
        try:
            proc = await _publishing(proxy.url, config, path, "--resume")
            await asyncio.wait_for(proxy.held.wait(), 60)
            proc.send_signal(signal.SIGINT)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            await proxy.stop()
        assert len(await _stored_ids(server, config)) == 300
    assert (proc.returncode, out) == (130, b""), err
    assert plain_lines(err.decode()) == [
        "seqstate: interrupted before checking the events router id 'p3' stored earlier: none "
        f"of {path} published by this run; `seqstate publish {path} --router-id p3 --resume` "
        "checks them and publishes the rest"
    ]


async def test_a_resume_after_the_duplicate_window_stores_each_event_once(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The stream's duplicate window (here 100 ms, its least) has long passed when
    ``--resume`` runs, so JetStream no longer knows the first run's msg-ids: the log does, and
    each event of the file is stored once, none skipped. A file that is not the one the router
    id published is refused, nothing stored."""
    config = fresh_config("pub")
    nc = await nats.connect(nats_server.url)
    try:  # the deployment's streams, the events stream's window shrunk below any run's gap
        from projector.nats.resources import ensure

        info = (await ensure(nc, config)).events
        info.config.duplicate_window = 0.1
        await nc.jetstream().update_stream(info.config)
    finally:
        await nc.close()
    path = tmp_path / "frees.jsonl"
    path.write_text(_frees(5_000))
    rc, line = await _interrupted_publish(nats_server, config, path)
    assert rc == 130, line
    stored = len(await _stored_ids(nats_server, config))

    other = tmp_path / "other.jsonl"
    other.write_text(_frees(3) + _frees(5_000)[3 * len(_frees(1)) :].replace('"f5"', '"g5"'))
    refused = seqstate(
        "publish",
        str(other),
        "--router-id",
        "p3",
        "--resume",
        *name_flags(config),
        NATS_URL=nats_server.url,
    )
    assert one_line_error(refused) == (
        "seqstate: error: router id 'p3' stored, as its event 6 (stream sequence 6), another "
        f"event than {other}:6: not a run of this file, not resuming"
    )

    await _resumed(nats_server, config, path, stored, 5_000)
