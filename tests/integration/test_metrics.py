"""Prometheus metrics and health probes on ``--metrics-port``.

The writer and the projector run as the ``seqstate`` commands an operator types; a scripted
lifecycle goes through them; ``/metrics`` is scraped over HTTP and parsed with
prometheus_client's own parser, and every value is compared with what it must be exactly (the
per-worker gauges also with a fold of the same log by the core itself). ``/readyz`` is watched
while a writer replays a backlog: not ready, with the reason, then ready.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from eventually import eventually
from http_kit import http_get
from log_text import plain_lines
from nats.aio.client import Client
from pipeline_kit import REPO, fill, fresh_config, name_flags, read_log, second_loopback
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from projector.bucket.reader import RegistryView
from projector.bucket.view_metrics import view_collector
from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.nats.stream import last_seq_of
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from seqstate import (
    AddRequest,
    EventDecodeError,
    Free,
    MarkPrefillCompleted,
    WorkerAdded,
    WorkerRemoved,
    decode_event,
    encode_event,
)

WAIT_S = 30.0
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse(text: str) -> Samples:
    """Every sample by (name, labels)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def pick(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def series(samples: Samples, name: str, **labels: str) -> dict[frozenset[tuple[str, str]], float]:
    """The samples of ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return {k: v for (n, k), v in samples.items() if n == name and wanted <= k}


async def scrape(port: int) -> Samples:
    status, kind, body = await http_get(port, "/metrics")
    assert status == 200 and kind.startswith("text/plain"), (status, kind)
    return parse(body)


def cli_env(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEQSTATE_")}
    env["NATS_URL"] = url
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@asynccontextmanager
async def command(url: str, log: Path, *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """``seqstate ARGS`` in the background; SIGTERM at the end, which must stop it cleanly."""
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "projector",
            *args,
            env=cli_env(url),
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
        try:
            yield proc
        finally:
            if proc.returncode is None:
                proc.terminate()
            code = await asyncio.wait_for(proc.wait(), 30)
    text = log.read_text()
    assert code == 0, text
    assert "Traceback" not in text, text


async def publish(nc: Client, config: Config, script: list[object | bytes]) -> int:
    """The events (or raw bytes) in order, each on its own subject; the last sequence."""
    js = nc.jetstream()
    seq = 0
    for item in script:
        if isinstance(item, bytes):
            subject, data = config.event_subject(0), item
        else:
            subject, data = config.subject_of(item), encode_event(item)  # type: ignore[arg-type]
        seq = (await js.publish(subject, data)).seq
    return seq


def folded_loads(log: list[tuple[int, int, bytes]], config: Config) -> dict[tuple[int, int], tuple]:
    """The per-rank loads a fold of the log by the core gives, at its last event's log time."""
    state = config.new_state()
    for _, at_ns, data in log:
        try:
            event = decode_event(data)
        except EventDecodeError:
            continue
        state.apply(event, at_ns)
    return {
        (r.worker_id, r.dp_rank): (
            r.active_blocks,
            r.active_prefill_tokens,
            r.active_requests,
            r.modeled_remaining_prefill_ms,
        )
        for r in state.registry.loads(state.now_ns)
    }


def gauges(samples: Samples, namespace: str) -> dict[tuple[int, int], tuple]:
    """The per-worker gauges, as :func:`folded_loads` gives them (a missing remaining: None)."""
    out = {}
    for labels in series(samples, "seqstate_worker_active_requests", namespace=namespace):
        d = dict(labels)
        key = (int(d["worker"]), int(d["dp_rank"]))
        at = {"namespace": namespace, "worker": d["worker"], "dp_rank": d["dp_rank"]}
        remaining = pick(samples, "seqstate_worker_remaining_prefill_ms", **at)
        out[key] = (
            pick(samples, "seqstate_worker_active_blocks", **at),
            pick(samples, "seqstate_worker_active_prefill_tokens", **at),
            pick(samples, "seqstate_worker_active_requests", **at),
            None if remaining is None else int(remaining),
        )
    return out


SCRIPT: list[object | bytes] = [
    WorkerAdded(7),
    WorkerAdded(8, dp_size=2),
    WorkerAdded(9),
    AddRequest("a1", 7, block_hashes=[1, 2, 3], prefill_tokens=100, expected_prefill_ms=600_000),
    AddRequest("a2", 7, block_hashes=[1, 2, 4, 5], prefill_tokens=50, expected_prefill_ms=6e5),
    MarkPrefillCompleted("a1", 7),
    AddRequest("b1", 8, dp_rank=1, block_hashes=[9], prefill_tokens=10),
    b"\xc1 not an event",  # dead-lettered: undecodable
    AddRequest("a2", 7, block_hashes=[6]),  # a duplicate: changes nothing
    Free("b1", 8, dp_rank=1),
    AddRequest("c1", 9, block_hashes=[1], prefill_tokens=5),
    WorkerRemoved(9),
]
APPLIED = 10  # every event above but the duplicate (and the bytes, which are not an event)


async def test_writer_and_projector_commands_export_exact_metrics(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    config = fresh_config("mx")
    await ensure(nc, config)
    assert isinstance(SCRIPT[-1], WorkerRemoved)
    before_removal = await publish(nc, config, SCRIPT[:-1])
    w_port, p_port = free_port(), free_port()
    quiet = ["--idle-tick-s", "3600", "--tick-every-s", "3600"]  # no Tick adds to the counts
    async with (
        command(
            nats_server.url,
            tmp_path / "writer.log",
            "writer",
            *name_flags(config),
            *quiet,
            "--lag-check-s",
            "0.2",
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(w_port),
        ),
        command(
            nats_server.url,
            tmp_path / "projector.log",
            "projector",
            *name_flags(config),
            "--lag-check-s",
            "0.2",
            "--metrics-port",
            str(p_port),
        ),
    ):
        ns = config.namespace
        caught_up = {"namespace": ns, "role": "writer"}
        # Worker 9 holds c1 (one block): its series are there before it is removed...
        for port, role in ((w_port, "writer"), (p_port, "projector")):
            at = {"namespace": ns, "role": role}
            seen = await eventually(
                lambda port=port: scrape(port),
                lambda s, at=at: pick(s, "seqstate_applied_seq", **at) == before_removal,
                what=f"the {role} before the removal",
                interval=0.05,
                retry_on=(OSError,),
            )
            nine = {"namespace": ns, "worker": "9", "dp_rank": "0"}
            assert pick(seen, "seqstate_worker_active_blocks", **nine) == 1
            assert pick(seen, "seqstate_worker_active_requests", **nine) == 1
        # ... and gone after it.
        last = await publish(nc, config, SCRIPT[-1:])
        w = await eventually(
            lambda: scrape(w_port),
            lambda s: (
                pick(s, "seqstate_applied_seq", **caught_up) == last
                and pick(s, "seqstate_lag_events", **caught_up) == 0
            ),
            what="the writer at the last event",
            interval=0.05,
            retry_on=(OSError,),
        )
        at_p = {"namespace": ns, "role": "projector"}
        p = await eventually(
            lambda: scrape(p_port),
            lambda s: (
                pick(s, "seqstate_applied_seq", **at_p) == last
                and pick(s, "seqstate_lag_events", **at_p) == 0
            ),
            what="the projector at the last event",
            interval=0.05,
            retry_on=(OSError,),
        )
        assert last == await last_seq_of(
            nc.jetstream(), config.events_stream, config.events_subjects
        )

        # Per-worker gauges: worker 7 holds a1 (prefill done) and a2 (prefilling), blocks
        # 1-5 once each; worker 8's ranks are empty; worker 9 is gone, and so are its series.
        expected = folded_loads(await read_log(nc, config), config)
        assert set(expected) == {(7, 0), (8, 0), (8, 1)}
        assert expected[(7, 0)][0] == 5 and expected[(7, 0)][2] == 2
        assert 0 < expected[(7, 0)][1] <= 50 and 0 < (expected[(7, 0)][3] or 0) <= 600_000
        assert expected[(8, 1)] == (0, 0, 0, 0)
        for samples in (w, p):  # the writer's state, the projector's image: one same truth
            assert gauges(samples, ns) == expected
            assert not series(samples, "seqstate_worker_active_blocks", worker="9")
            assert not series(samples, "seqstate_worker_active_requests", worker="9")

        # The writer: its fold's outcomes, its dead letter by a word, its deltas, its flushes.
        events = series(w, "seqstate_events_total", namespace=ns)
        assert pick(w, "seqstate_events_total", namespace=ns, outcome="applied") == APPLIED
        assert pick(w, "seqstate_events_total", namespace=ns, outcome="duplicate") == 1
        assert pick(w, "seqstate_events_total", namespace=ns, outcome="unknown_request") == 0
        assert len(events) >= 8  # every outcome, zero or not
        assert (
            pick(
                w, "seqstate_dead_letters_total", namespace=ns, role="writer", reason="undecodable"
            )
            == 1
        )
        assert sum(series(w, "seqstate_dead_letters_total", namespace=ns).values()) == 1
        assert (pick(w, "seqstate_deltas_total", namespace=ns) or 0) >= 1
        assert (pick(w, "seqstate_flush_seconds_count", namespace=ns, role="writer") or 0) >= 1
        assert pick(w, "seqstate_lag_seconds", namespace=ns, role="writer") == 0
        assert not series(w, "seqstate_kv_writes_total")  # the projector's, not the writer's

        # The projector: its position, its writes, its flushes; no dead letter of its own.
        assert (pick(p, "seqstate_kv_writes_total", namespace=ns) or 0) >= 4
        assert (pick(p, "seqstate_flush_seconds_count", namespace=ns, role="projector") or 0) >= 1
        assert sum(series(p, "seqstate_dead_letters_total", namespace=ns).values()) == 0
        assert not series(p, "seqstate_events_total")

        # No request id anywhere, in any label.
        for samples in (w, p):
            for _, labels in samples:
                assert not any(v in ("a1", "a2", "b1", "c1") for _, v in labels)

        # Health on the same port.
        assert (await http_get(w_port, "/healthz"))[0] == 200
        assert (await http_get(p_port, "/readyz"))[:1] == (200,)
        status, _, body = await http_get(w_port, "/readyz")
        assert (status, body) == (200, "ready\n")


async def test_readyz_is_503_while_the_writer_replays_a_backlog_then_200(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    config = fresh_config("rz")
    last = await fill(nc, config, 30_000)
    port = free_port()
    async with command(
        nats_server.url,
        tmp_path / "writer.log",
        "writer",
        *name_flags(config),
        "--ready-lag-events",
        "10",
        "--metrics-port",
        str(port),
    ):
        answers: list[tuple[int, str]] = []

        async def readyz() -> int:
            status, _, body = await http_get(port, "/readyz")
            answers.append((status, body))
            return status

        await eventually(
            readyz,
            lambda status: status == 200,
            what="/readyz 200 once the backlog is replayed",
            timeout=WAIT_S,
            interval=0.02,
            retry_on=(OSError,),  # not listening yet
            watch=lambda: f"{len(answers)} answers, the last: {answers[-5:]}",
        )
        first_status, first_body = answers[0]
        assert first_status == 503 and first_body.startswith("replaying: "), answers[0]
        assert answers[-1] == (200, "ready\n"), answers[-5:]
        said = [re.match(r"replaying: (\d+) events behind", b) for s, b in answers if s == 503]
        behind = [int(m.group(1)) for m in said if m]
        assert behind and max(behind) > 10, answers[:5]
        assert all(s == 503 for s, _ in answers[:-1])
        samples = await scrape(port)
        assert (
            pick(samples, "seqstate_applied_seq", namespace=config.namespace, role="writer") == last
        )
        assert (
            pick(
                samples,
                "seqstate_dead_letters_total",
                namespace=config.namespace,
                role="writer",
                reason="undecodable",
            )
            == 1
        )

        assert (await http_get(port, "/healthz"))[:1] == (200,)
        assert (await http_get(port, "/nope"))[0] == 404
        assert (await http_get(port, "/metrics", method="POST"))[0] == 405


async def test_the_projectors_readyz_is_503_while_the_writer_is_paused_then_200(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """A writer SIGSTOPped under load left the projector's /readyz saying ready on a
    bucket 30 s stale (no delta came, so the projector had nothing to wait for).

    Broke: a writer and a projector as commands; the writer SIGSTOPped; 2 events published
    (under --ready-lag-events 20), then 40 more. Expected: the projector's /readyz 503 by age
    first (the oldest event not in the bucket waited over --ready-lag-s 1), then by count
    (42 events behind); SIGCONT: 200 again. An undecodable event published last (it gets no
    delta, only a dead letter) does not make the bucket look stale: still 200 well after
    --ready-lag-s."""
    config = fresh_config("rp")
    await ensure(nc, config)
    w_port, p_port = free_port(), free_port()
    common = (*name_flags(config), "--lag-check-s", "0.1")
    ready = ("--ready-lag-events", "20", "--ready-lag-s", "1")
    w_log, p_log = tmp_path / "writer.log", tmp_path / "projector.log"
    answers: list[tuple[int, str]] = []

    async def readyz() -> tuple[int, str]:
        status, _, body = await http_get(p_port, "/readyz")
        answers.append((status, body))
        return status, body

    def said() -> str:
        return f"answers {answers[-3:]}\n{w_log.read_text()[-1500:]}\n{p_log.read_text()[-1500:]}"

    async with (
        command(
            nats_server.url,
            w_log,
            "writer",
            *common,
            "--idle-tick-s",
            "3600",
            "--metrics-port",
            str(w_port),
        ) as writer,
        command(
            nats_server.url, p_log, "projector", *common, *ready, "--metrics-port", str(p_port)
        ),
    ):
        first = await publish(nc, config, [WorkerAdded(7)])
        await eventually(
            lambda: scrape(p_port),
            lambda s: (
                pick(s, "seqstate_applied_seq", namespace=config.namespace, role="projector")
                == first
            ),
            what="the first event in the bucket",
            timeout=WAIT_S,
            interval=0.05,
            retry_on=(OSError,),
            watch=said,
        )
        await eventually(
            readyz,
            lambda a: a[0] == 200,
            what="the projector ready",
            timeout=WAIT_S,
            interval=0.05,
            retry_on=(OSError,),
            watch=said,
        )
        writer.send_signal(signal.SIGSTOP)
        try:
            await publish(nc, config, [Free(f"gone{i}", 7) for i in range(2)])
            status, body = await eventually(
                readyz,
                lambda a: a[0] == 503,
                what="/readyz 503: the oldest event not in the bucket waits too long",
                timeout=WAIT_S,
                interval=0.05,
                watch=said,
            )
            assert re.match(r"replaying: 2 events behind, the oldest waiting", body), body
            await publish(nc, config, [Free(f"more{i}", 7) for i in range(40)])
            status, body = await eventually(
                readyz,
                lambda a: a[1].startswith("replaying: 42 events behind (projector"),
                what="/readyz 503: 42 events behind",
                timeout=WAIT_S,
                interval=0.05,
                watch=said,
            )
            assert status == 503, body
        finally:
            writer.send_signal(signal.SIGCONT)
        await eventually(
            readyz,
            lambda a: a == (200, "ready\n"),
            what="the projector ready once the writer caught up",
            timeout=WAIT_S,
            interval=0.05,
            watch=said,
        )
        loop = asyncio.get_running_loop()
        published = loop.time()
        await publish(nc, config, [b"\xc1 not an event"])

        async def since() -> tuple[float, tuple[int, str]]:
            return loop.time() - published, await readyz()

        # Ready at a time well past --ready-lag-s after it: were the dead-lettered event taken
        # for one the writer has not handled, /readyz would stay 503 from 1 s on, for good.
        await eventually(
            since,
            lambda a: a[0] > 2.5 and a[1] == (200, "ready\n"),
            what="/readyz 200 2.5 s after an undecodable event",
            timeout=WAIT_S,
            interval=0.1,
            watch=said,
        )


async def test_a_scheduler_exports_a_views_per_worker_gauges_from_its_own_registry(
    nc: Client,
) -> None:
    config = fresh_config("vc")
    async with Pipeline(nc, config) as pipeline:
        last = await publish(nc, config, SCRIPT)
        await pipeline.wait_applied(last)
        async with RegistryView(nc, config=config) as view:
            await view.wait_for(last, timeout=WAIT_S)
            registry = CollectorRegistry()
            collector = view.export_metrics(registry)
            samples = parse(generate_latest(registry).decode())
            registry.unregister(collector)
            assert generate_latest(registry) == b""
            # Several views (namespaces) in one registry: one collector of them all.
            registry.register(view_collector(view))
            assert parse(generate_latest(registry).decode()) == samples
    expected = folded_loads(await read_log(nc, config), config)
    assert gauges(samples, config.namespace) == expected
    assert {name for name, _ in samples} == {
        "seqstate_worker_active_blocks",
        "seqstate_worker_active_prefill_tokens",
        "seqstate_worker_active_requests",
        "seqstate_worker_remaining_prefill_ms",
    }


async def test_run_exports_each_workers_series_once_from_the_writer(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    config = fresh_config("mr")
    await ensure(nc, config)
    last = await publish(nc, config, SCRIPT)
    port = free_port()
    async with command(
        nats_server.url,
        tmp_path / "run.log",
        "run",
        *name_flags(config),
        "--idle-tick-s",
        "3600",
        "--tick-every-s",
        "3600",
        "--lag-check-s",
        "0.2",
        "--metrics-port",
        str(port),
    ):
        ns = config.namespace
        both = await eventually(
            lambda: scrape(port),
            lambda s: all(
                pick(s, "seqstate_applied_seq", namespace=ns, role=role) == last
                and pick(s, "seqstate_lag_events", namespace=ns, role=role) == 0
                for role in ("writer", "projector")
            ),
            what="both consumers at the last event",
            interval=0.05,
            retry_on=(OSError,),
        )
        _, _, text = await http_get(port, "/metrics")
        status, _, body = await http_get(port, "/readyz")
    assert (status, body) == (200, "ready\n")
    assert gauges(both, ns) == folded_loads(await read_log(nc, config), config)
    # Once each: three ranks, one sample per gauge and rank (not again from the projector).
    samples = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "seqstate_worker_active_requests"
    ]
    assert len(samples) == 3
    assert pick(both, "seqstate_events_total", namespace=ns, outcome="applied") == APPLIED
    assert (pick(both, "seqstate_kv_writes_total", namespace=ns) or 0) >= 4
    assert (
        pick(both, "seqstate_dead_letters_total", namespace=ns, role="writer", reason="undecodable")
        == 1
    )


async def test_serve_http_exports_its_trackers_workers(nats_server: NatsServer) -> None:
    from http_kit import exchange, serve_http

    config = fresh_config("mh")
    port = free_port()
    m = {"model_name": "metrics-model"}
    async with serve_http(nats_server.url, config, "--metrics-port", str(port)) as http:
        answers = await exchange(
            http,
            [
                (
                    "POST",
                    "/register",
                    {**m, "worker_id": 3, "block_size": 16, "dp_start": 0, "dp_size": 2},
                ),
                (
                    "POST",
                    "/add",
                    {
                        **m,
                        "request_id": "a",
                        "worker_id": 3,
                        "dp_rank": 1,
                        "sequence_hashes": [11, -12, 13],
                        "new_isl_tokens": 200,
                    },
                ),
            ],
        )
        assert [status for status, _ in answers] == [201, 201]
        samples = await eventually(
            lambda: scrape(port),
            lambda s: any(
                v == 1
                for v in series(
                    s, "seqstate_worker_active_requests", worker="3", dp_rank="1"
                ).values()
            ),
            what="the tracker's worker",
            interval=0.05,
            retry_on=(OSError,),
        )
        blocks = series(samples, "seqstate_worker_active_blocks", worker="3")
        assert sorted(blocks.values()) == [0, 3]
        assert (await http_get(port, "/readyz"))[0] == 200


async def test_a_bad_or_taken_metrics_port_is_one_line(nats_server: NatsServer) -> None:
    config = fresh_config("mp")

    async def writer(*args: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "projector",
            "writer",
            *name_flags(config),
            *args,
            env=cli_env(nats_server.url),
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 1, err
        lines = plain_lines(err.decode())
        assert len(lines) == 1 and lines[0].startswith("seqstate: error: "), lines
        return lines[0]

    line = await writer("--metrics-port", "70000")
    assert line == (
        "seqstate: error: --metrics-port '70000': not a port: use 0-65535 (0: any "
        "free port), or 'off'"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = await writer(
            "--metrics-host", "127.0.0.1", "--metrics-port", str(port), "--log-level", "error"
        )
    assert line.startswith(f"seqstate: error: cannot listen on 127.0.0.1:{port} for metrics: ")


@pytest.mark.skipif(not second_loopback(), reason="127.0.0.2 does not reach this host")
async def test_the_metrics_port_listens_on_loopback_unless_asked(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """The metrics port listened on 0.0.0.0 by default. Now on 127.0.0.1, and on
    every address when ``--metrics-host 0.0.0.0`` (compose asks for it) says so."""
    config = fresh_config("mh")
    await ensure(nc, config)
    for asked, beyond in (((), False), (("--metrics-host", "0.0.0.0"), True)):
        port = free_port()
        async with command(
            nats_server.url,
            tmp_path / f"projector-{beyond}.log",
            "projector",
            *name_flags(config),
            *asked,
            "--metrics-port",
            str(port),
        ):
            await eventually(
                lambda port=port: http_get(port, "/healthz"),
                lambda answer: answer[0] == 200,
                what="the projector's /healthz on 127.0.0.1",
                interval=0.05,
                retry_on=(OSError,),
            )
            try:
                status = (await http_get(port, "/healthz", address="127.0.0.2"))[0]
            except ConnectionRefusedError:
                status = None
            assert status == (200 if beyond else None), (asked, status)
