"""``seqstate run`` as an operator runs it: the demo filling the bucket, the embedded server's
port, one run per namespace, a failed pipeline restarted in process, a Dynamo endpoint
captured from the moment it says it runs."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import msgspec
import nats
from cli_kit import one_line_error, started_run, stopped
from dynamo_capture import CAPTURE, ENDPOINT, SUBJECT
from eventually import eventually
from log_text import plain_lines
from nats.js.errors import NotFoundError
from pipeline_kit import seqstate

from projector.bucket.contents import read_bucket
from projector.bucket.reader import RegistryView
from projector.nats.backlog import covered_seq
from projector.nats.lease import Holder
from projector.nats.resources import dynamo_capture
from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.settings.config import Config
from projector.wire.values import lease_key
from seqstate import decode_deltas
from seqstate.dynamo import captured_subject


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
