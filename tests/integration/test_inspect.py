"""``seqstate inspect``, ``top`` and ``watch --json`` as an operator runs them, against a
scripted lifecycle folded by a real pipeline."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import termios
import threading
from typing import Any

from eventually import eventually
from log_text import plain_lines
from nats.aio.client import Client
from pipeline_kit import REPO, cli, fresh_config, name_flags, run_cli

from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from seqstate import PrefillSnapshot, WorkerAdded, WorkerRemoved


async def lifecycle(nc: Client, config: Config, pipeline: Pipeline) -> dict[str, int]:
    """The script every test below reads back; returns each step's event sequence."""
    pub = RouterPublisher(nc, namespace=config.namespace, router_id="rtr-a", config=config)
    seq = {}
    seq["w3"] = await pub.publish(WorkerAdded(worker_id=3, dp_size=2))
    seq["active"] = await pub.add(
        "r-active", 3, 1, block_hashes=[1, 2, 3], prefill_tokens=40, expected_prefill_ms=60_000
    )
    seq["done.add"] = await pub.add("r-done", 3, 0, block_hashes=[7, 8], prefill_tokens=10)
    seq["done.mark"] = await pub.mark_prefill_completed("r-done", 3, 0)
    seq["done.free"] = await pub.free("r-done", 3, 0)
    seq["marked.add"] = await pub.add("r-marked", 3, 0, block_hashes=[9], prefill_tokens=5)
    seq["marked.mark"] = await pub.mark_prefill_completed("r-marked", 3, 0)
    seq["ghost"] = await pub.free("r-ghost", 3, 1)
    seq["w4"] = await pub.publish(WorkerAdded(worker_id=4))
    seq["gone.add"] = await pub.add("r-gone", 4, 0, block_hashes=[5], prefill_tokens=1)
    seq["w4.removed"] = await pub.publish(WorkerRemoved(worker_id=4))
    await pipeline.wait_applied(seq["w4.removed"])
    return seq


def events_of(report: dict) -> list[tuple[int, str, str]]:  # type: ignore[type-arg]
    return [(e["seq"], e["type"], e["outcome"]) for e in report["events"]]


async def inspect_json(config: Config, url: str, *args: str) -> dict:  # type: ignore[type-arg]
    """The report; an unknown request's with exit 1, every other with exit 0."""
    out = await run_cli(config, url, "inspect", *args, "--json")
    report = json.loads(out.stdout)
    assert out.returncode == (1 if report.get("state") == "unknown" else 0), out.stderr
    return report  # type: ignore[no-any-return]


async def test_inspect_request_tells_each_requests_story(
    nc: Client, nats_server: NatsServer
) -> None:
    url = nats_server.url
    config = fresh_config("i")
    async with Pipeline(nc, config) as pipeline:
        seq = await lifecycle(nc, config, pipeline)
        last = seq["w4.removed"]

        r = await inspect_json(config, url, "request", "r-active")
        assert (r["state"], r["detail"], r["router"]) == ("active", "prefill pending", "rtr-a")
        assert (r["worker_id"], r["dp_rank"], r["slot"]) == (3, 1, 0)
        assert events_of(r) == [(seq["active"], "AddRequest", "applied")]
        # Found on its rank's subject from its booking on, not by reading the log.
        assert r["searched"] == {
            "subject": config.event_subject(3, 1),
            "from_seq": seq["active"],
            "to_seq": last,
            "whole_log": False,
        }

        r = await inspect_json(config, url, "request", "r-marked")
        assert (r["state"], r["detail"], r["worker_id"], r["dp_rank"]) == (
            "active",
            "prefill done",
            3,
            0,
        )
        assert events_of(r) == [
            (seq["marked.add"], "AddRequest", "applied"),
            (seq["marked.mark"], "MarkPrefillCompleted", "applied"),
        ]

        r = await inspect_json(config, url, "request", "r-done")
        assert r["state"] == "ended" and r["slot"] is None
        assert r["detail"].startswith(f"freed by event {seq['done.free']} at ")
        assert (r["router"], r["worker_id"], r["dp_rank"]) == ("rtr-a", 3, 0)
        assert events_of(r) == [
            (seq["done.add"], "AddRequest", "applied"),
            (seq["done.mark"], "MarkPrefillCompleted", "applied"),
            (seq["done.free"], "Free", "applied"),
        ]
        assert r["searched"]["subject"] == config.events_subjects and r["searched"]["whole_log"]
        times = [e["log_time_ns"] for e in r["events"]]
        assert times == sorted(times) and all(t > 0 for t in times)

        r = await inspect_json(config, url, "request", "r-ghost")
        assert r["state"] == "tombstoned" and (r["worker_id"], r["dp_rank"]) == (3, 1)
        assert events_of(r) == [(seq["ghost"], "Free", "unknown_request")]

        r = await inspect_json(config, url, "request", "r-gone")
        assert r["state"] == "ended"
        assert r["detail"] == (
            f"dropped with its rank at event {seq['w4.removed']} (worker removed)"
        )
        assert events_of(r) == [(seq["gone.add"], "AddRequest", "applied")]

        r = await inspect_json(config, url, "request", "r-never")
        assert r["state"] == "unknown" and r["events"] == []

        # A bounded window says what it read, and misses what is older.
        r = await inspect_json(config, url, "request", "r-done", "--window", "3")
        assert r["state"] == "unknown" and r["searched"]["from_seq"] == last - 2
        assert not r["searched"]["whole_log"]
        r = await inspect_json(
            config, url, "request", "r-done", "--since-seq", str(seq["done.mark"])
        )
        assert events_of(r) == [
            (seq["done.mark"], "MarkPrefillCompleted", "applied"),
            (seq["done.free"], "Free", "applied"),
        ]

        # The table an operator reads.
        out = await run_cli(config, url, "inspect", "request", "r-done")
        assert out.returncode == 0, out.stderr
        text = out.stdout
        assert "state:  ended: freed by event" in text and "router: rtr-a" in text
        assert "worker 3, rank 0" in text
        for s, kind in ((seq["done.add"], "AddRequest"), (seq["done.free"], "Free")):
            assert any(
                line.split()[:1] == [str(s)] and kind in line and "applied" in line
                for line in text.splitlines()
            ), text


async def test_inspect_worker_lists_ranks_requests_and_prefill(
    nc: Client, nats_server: NatsServer
) -> None:
    url = nats_server.url
    config = fresh_config("j")
    async with Pipeline(nc, config) as pipeline:
        seq = await lifecycle(nc, config, pipeline)
        w = await inspect_json(config, url, "worker", "3")
        assert w["worker_id"] == 3 and w["applied_seq"] == seq["w4.removed"]
        rank0, rank1 = w["ranks"]
        assert (rank0["dp_rank"], rank0["active_requests"], rank0["active_blocks"]) == (0, 1, 1)
        assert rank0["requests"] == [
            {"slot": 0, "request_id": "r-marked", "booked_seq": seq["marked.add"]}
        ]
        assert rank0["prefill"]["full_tokens"] == 0
        assert rank0["prefill"]["modeled_remaining_ms"] == 0
        assert (rank1["dp_rank"], rank1["active_requests"], rank1["active_blocks"]) == (1, 1, 3)
        assert rank1["requests"] == [
            {"slot": 0, "request_id": "r-active", "booked_seq": seq["active"]}
        ]
        p = rank1["prefill"]
        assert p["full_tokens"] == 40 and p["anchored_since_ns"] is not None
        # The modeled remaining time is the core's, at the log time the report names.
        snap = PrefillSnapshot(
            p["full_tokens"],
            p["anchor_tokens"],
            p["anchor_duration_ns"],
            p["anchored_since_ns"],
            p["modeled_ms"],
        )
        assert p["modeled_remaining_ms"] == snap.modeled_remaining_ms(w["log_time_ns"])
        assert 0 < p["modeled_remaining_ms"] <= 60_000
        assert p["active_tokens"] == snap.active_tokens(w["log_time_ns"])

        out = await run_cli(config, url, "inspect", "worker", "3")
        assert out.returncode == 0, out.stderr
        assert "rank 1: 1 request, 3 active blocks" in out.stdout
        assert "r-active  (booked at event" in out.stdout
        assert "prefill queue: 40 tokens queued" in out.stdout

        for args, said in (
            (("worker", "4"), "worker 4 is not in the registry"),
            (("worker", "x"), "not a worker id"),
            (("request", "r", "--window", "0"), "--window 0"),
        ):
            out = await run_cli(config, url, "inspect", *args)
            lines = plain_lines(out.stderr)
            assert out.returncode == 1 and len(lines) == 1, out.stderr
            assert lines[0].startswith("seqstate: error: ") and said in lines[0]


async def test_top_once_prints_a_row_per_worker(nc: Client, nats_server: NatsServer) -> None:
    url = nats_server.url
    config = fresh_config("k")
    async with Pipeline(nc, config) as pipeline:
        await lifecycle(nc, config, pipeline)
        out = await run_cli(config, url, "top", "--once", "--interval", "0.2")
        assert out.returncode == 0, out.stderr
        lines = out.stdout.strip().splitlines()
        assert lines[0].split() == [
            "worker",
            "ranks",
            "requests",
            "active_blocks",
            "prefill_tokens",
            "remaining_prefill_ms",
            "adds_per_s",
            "frees_per_s",
        ]
        assert lines[1].split()[:5] == ["3", "2", "2", "4", "40"]
        assert lines[1].split()[6:] == ["0.0", "0.0"]  # nothing moved during the interval
        assert lines[2].startswith("as of event ")
        out = await run_cli(config, url, "top", "--once", "--json", "--interval", "0.2")
        rows = [json.loads(line) for line in out.stdout.splitlines()]
        assert [
            (r["worker_id"], r["ranks"], r["active_requests"], r["active_blocks"]) for r in rows
        ] == [(3, 2, 2, 4)]


async def test_top_counts_adds_and_frees(nc: Client, nats_server: NatsServer) -> None:
    url = nats_server.url
    config = fresh_config("m")
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="top", config=config)
        await pipeline.wait_applied(await pub.publish(WorkerAdded(worker_id=1)))
        proc = await spawn(config, url, "top", "--json", "--interval", "0.5")
        try:
            # Traffic until a refresh shows it: each refresh is a JSON line per worker.
            n = 0

            async def traffic_then_refresh() -> dict[str, Any]:
                nonlocal n
                n += 1
                # Each in a flush of its own: the bucket (top's source) never shows a request
                # booked and freed within one flush interval.
                await pipeline.wait_applied(await pub.add(f"a{n}", 1))
                await pipeline.wait_applied(await pub.free(f"a{n}", 1))
                line = await asyncio.wait_for(proc.stdout.readline(), 10)  # type: ignore[union-attr]
                row: dict[str, Any] = json.loads(line)
                return row

            row = await eventually(
                traffic_then_refresh,
                lambda row: row["adds_per_s"] and row["frees_per_s"],
                what="a refresh of top showing adds and frees",
                interval=0,  # each try waits for a refresh already
            )
            assert row["worker_id"] == 1 and row["adds_per_s"] > 0 and row["frees_per_s"] > 0
        finally:
            proc.terminate()
            assert await asyncio.wait_for(proc.wait(), 15) == 0
            assert b"Traceback" not in await proc.stderr.read()  # type: ignore[union-attr]


async def spawn(config: Config, url: str, *args: str) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEQSTATE_")}
    env["NATS_URL"] = url
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "projector",
        *args,
        *name_flags(config),
        env=env,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


async def test_watch_json_piped_prints_each_change_as_it_happens(
    nc: Client, nats_server: NatsServer
) -> None:
    url = nats_server.url
    config = fresh_config("n")
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="w", config=config)
        await pipeline.wait_applied(await pub.publish(WorkerAdded(worker_id=2, dp_size=2)))
        proc = await spawn(config, url, "watch", "--json")
        assert proc.stdout is not None and proc.stderr is not None

        async def line() -> dict:  # type: ignore[type-arg]
            return json.loads(await asyncio.wait_for(proc.stdout.readline(), 15))  # type: ignore[union-attr]

        try:
            first = [await line(), await line()]  # the current state: one line per rank
            assert [(r["worker_id"], r["dp_rank"], r["active_requests"]) for r in first] == [
                (2, 0, 0),
                (2, 1, 0),
            ]
            # Each change arrives while the process runs, before the next is published.
            s = await pub.add("q", 2, 1, block_hashes=[1, 2], prefill_tokens=8)
            got = await line()
            assert (
                got["worker_id"],
                got["dp_rank"],
                got["active_requests"],
                got["active_blocks"],
            ) == (2, 1, 1, 2)
            assert got["applied_seq"] >= s
            await pub.free("q", 2, 1)
            got = await line()
            assert (got["dp_rank"], got["active_requests"], got["active_blocks"]) == (1, 0, 0)
            await pub.publish(WorkerRemoved(worker_id=2))
            removed = [await line(), await line()]
            assert sorted((r["dp_rank"], r["removed"]) for r in removed) == [(0, True), (1, True)]
        finally:
            proc.terminate()
            assert await asyncio.wait_for(proc.wait(), 15) == 0
            assert b"Traceback" not in await proc.stderr.read()


class Terminal:
    """A child process on a pseudo-terminal (160x40); what it drew, read in the background."""

    def __init__(self, config: Config, url: str, *args: str, stdout_too: bool = True) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        env = {k: v for k, v in os.environ.items() if not k.startswith("SEQSTATE_")}
        env.update(NATS_URL=url, TERM="xterm-256color", COLUMNS="160")
        env.pop("NO_COLOR", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "projector", *args, *name_flags(config)],
            env=env,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=slave if stdout_too else subprocess.PIPE,
            stderr=slave,
        )
        os.close(slave)
        self.master = master
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: the child closed its end
                return
            if not chunk:
                return
            self.chunks.append(chunk)

    @property
    def screen(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")

    async def until(self, *texts: str, timeout: float = 20) -> None:
        """Until the screen shows every one of ``texts``; at once a failure if the program has
        exited without showing them."""

        def running() -> None:
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}\n{self.screen}"

        await eventually(
            lambda: [text for text in texts if text not in self.screen],
            lambda missing: not missing,
            what=f"the terminal showed {texts}",
            timeout=timeout,
            interval=0.05,
            watch=lambda: self.screen,
            check=running,
        )

    async def finish(self, timeout: float = 30) -> int:
        code = await asyncio.to_thread(self.proc.wait, timeout)
        await asyncio.to_thread(self.reader.join, 10)
        os.close(self.master)
        return code


async def test_top_in_a_terminal_is_live_and_stops_cleanly(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("p")
    async with Pipeline(nc, config) as pipeline:
        await lifecycle(nc, config, pipeline)
        for sig in (signal.SIGINT, signal.SIGTERM):
            term = Terminal(config, nats_server.url, "top", "--interval", "0.2")
            try:
                await term.until(f"seqstate top · {config.namespace}", "events/s", "adds/s")
                await term.until("Ctrl-C to quit")
            finally:
                term.proc.send_signal(sig)
            assert await term.finish() == 0, term.screen
            assert "Traceback" not in term.screen


async def test_inspect_request_in_a_terminal_with_its_progress_bar(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("q")
    async with Pipeline(nc, config) as pipeline:
        seq = await lifecycle(nc, config, pipeline)
        term = Terminal(config, nats_server.url, "inspect", "request", "r-done", stdout_too=False)
        out = await asyncio.to_thread(term.proc.stdout.read)  # type: ignore[union-attr]
        assert await term.finish() == 0, term.screen
        assert "Traceback" not in term.screen
        assert f"state:  ended: freed by event {seq['done.free']}" in out.decode()


async def test_watch_piped_prints_the_table_at_each_change(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("r")
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="w", config=config)
        await pipeline.wait_applied(await pub.publish(WorkerAdded(worker_id=5)))
        proc = await spawn(config, nats_server.url, "watch")
        assert proc.stdout is not None and proc.stderr is not None

        async def table() -> list[str]:
            lines = []
            while (line := (await asyncio.wait_for(proc.stdout.readline(), 15)).decode()) != "\n":  # type: ignore[union-attr]
                lines.append(line.rstrip("\n"))
            return lines

        try:
            first = await table()
            assert first[0].split()[:3] == ["worker", "rank", "requests"]
            assert first[1].split()[:4] == ["5", "0", "0", "0"]
            s = await pub.add("z", 5, block_hashes=[4, 5, 6])
            nxt = await table()
            assert nxt[1].split()[:4] == ["5", "0", "1", "3"]
            assert int(nxt[-1].split()[-1]) >= s  # "as of event N"
        finally:
            proc.terminate()
            assert await asyncio.wait_for(proc.wait(), 15) == 0
            assert b"Traceback" not in await proc.stderr.read()


async def test_errors_are_one_line(nats_server: NatsServer) -> None:
    config = fresh_config("e")  # nothing provisioned: no stream, no bucket
    cases = [
        (("inspect", "request", "r1"), nats_server.url, "bucket"),
        (("inspect", "worker", "1"), nats_server.url, "bucket"),
        (("top", "--once"), nats_server.url, "bucket"),
        (("top", "--interval", "0"), nats_server.url, "--interval 0: must be positive"),
        (("inspect", "request", "r1"), "nats://127.0.0.1:1", "cannot reach NATS"),
        (("top", "--once"), "nats://127.0.0.1:1", "cannot reach NATS"),
    ]
    for args, url, said in cases:
        out = await asyncio.to_thread(cli, config, url, *args)
        lines = plain_lines(out.stderr)
        assert out.returncode == 1 and len(lines) == 1, (args, out.stderr)
        assert lines[0].startswith("seqstate: error: ") and said in lines[0], (args, lines)


async def test_inspect_request_names_a_goodbye_that_ended_it(
    nc: Client, nats_server: NatsServer
) -> None:
    url = nats_server.url
    config = fresh_config("g")
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="rtr-b", config=config)
        await pub.publish(WorkerAdded(worker_id=1))
        await pub.start()  # its requests are its own from its first heartbeat on
        await pub.add("r-bye", 1)
        await pub.close(goodbye=True)  # frees what it holds: r-bye is orphaned by the goodbye
        bye = await pub.flush() or 0
        await pipeline.wait_applied(bye)
        r = await inspect_json(config, url, "request", "r-bye")
        assert (r["state"], r["router"]) == ("ended", "rtr-b")
        assert r["detail"] == f"freed by its router's goodbye (event {bye})"
