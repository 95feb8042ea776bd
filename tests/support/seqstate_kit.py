"""seqstate as a user runs it beside a Dynamo fleet: ``seqstate run --dynamo-endpoint`` as a
process, every read through the CLI (``loads --json``), as an operator reads it.
Shared by test_seqstate.py and test_kills.py; the ``seqstate`` fixture is in conftest.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from dynamo_kit import nonzero, scrape
from eventually import eventually
from fleet import DYNAMO_ENDPOINT, EVENTS_SUBJECT, Frontend
from live import LiveFleet
from nats.js.errors import NotFoundError

NAMESPACE = "dyn"
HELD = 2000
SEQSTATE = [sys.executable, "-m", "projector.ops.cli"]
REPO = Path(__file__).resolve().parents[2]


@functools.cache
def _help(*command: str) -> str:
    done = subprocess.run(
        [*SEQSTATE, *command, "--help"], capture_output=True, text=True, cwd=REPO, check=False
    )
    return done.stdout if done.returncode == 0 else ""


def lacks(flag: str, *command: str) -> bool:
    return flag not in _help(*command)


Rank = tuple[int, int]


class Seqstate:
    """``seqstate run`` on the fleet's nats-server, folding the fleet's endpoint, as a user
    starts it; every read goes through the CLI, as the hidden check's does."""

    def __init__(self, live: LiveFleet, nats_url: str, args: tuple[str, ...] = ()) -> None:
        self.live = live
        self.nats_url = nats_url
        self.args = args
        self.log = live.fleet.root / "logs" / "seqstate-run.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        """As an operator starts it beside the fleet: with the fleet's discovery environment
        (``DYN_DISCOVERY_BACKEND`` and ``DYN_FILE_KV`` or ``ETCD_ENDPOINTS``), which seqstate
        follows with no flag."""
        fleet = self.live.fleet
        env = dict(os.environ, NATS_URL=self.nats_url, SEQSTATE_NAMESPACE=NAMESPACE)
        env["DYN_DISCOVERY_BACKEND"] = fleet.discovery
        if fleet.discovery == "etcd":
            env["ETCD_ENDPOINTS"] = fleet.gateway.url
        else:
            env["DYN_FILE_KV"] = str(fleet.file_kv)
        return env

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*SEQSTATE, "run", "--dynamo-endpoint", DYNAMO_ENDPOINT, *self.args],
                env=self.env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
            )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self) -> str:
        """For a failed wait: seqstate's log, its ``status`` (the streams' counts say where
        the events stopped: never captured, never sourced, or never folded), Dynamo's logs."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        status = subprocess.run(
            [*SEQSTATE, "status", "--json"],
            env=self.env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
        return "\n".join(
            [
                *text.splitlines()[-40:],
                f"--- seqstate status (rc {status.returncode}) ---",
                status.stdout.strip(),
                status.stderr.strip()[-2000:],
                self.live.fleet.tails(15),
            ]
        )

    async def cli(self, *args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            *SEQSTATE,
            *args,
            env=self.env(),
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    async def loads(self) -> dict[Rank, dict[str, int]]:
        """Per rank with anything in flight: active blocks, requests, prefill tokens."""
        rc, out, err = await self.cli("loads", "--json")
        assert rc == 0, err
        rows = {}
        for line in out.splitlines():
            row = json.loads(line)
            entry = {
                "blocks": row["active_blocks"],
                "requests": row["active_requests"],
                "prefill": row["active_prefill_tokens"],
            }
            if any(entry.values()):
                rows[(row["worker_id"], row["dp_rank"])] = entry
        return rows


def inspected(seq: Seqstate, request_id: str) -> str:
    """``seqstate inspect request``: what seqstate made of the request's events (for a
    failed wait's report)."""
    done = subprocess.run(
        [*SEQSTATE, "inspect", "--no-progress", "request", request_id],
        env=seq.env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    return "\n".join(
        [
            f"--- inspect request {request_id} (rc {done.returncode}) ---",
            done.stdout[-3000:],
            done.stderr[-1000:],
        ]
    )


async def agree(
    live: LiveFleet,
    seq: Seqstate,
    requests: dict[Rank, int],
    what: str,
    frontends: list[Frontend] | None = None,
    rids: list[str] | None = None,
) -> None:
    """seqstate's blocks per rank == every frontend's decode gauge (or ``frontends``'), its
    request counts == ``requests``. On a timeout the report has ``seqstate inspect request``
    of the first three ``rids``: what seqstate made of each request's events."""
    fronts = live.frontends if frontends is None else frontends

    def watch() -> str:
        return "\n".join([seq.tail(), *(inspected(seq, rid) for rid in (rids or [])[:3])])

    async def both() -> tuple[dict[Rank, dict[str, int]], list[dict[Rank, int]]]:
        views = [nonzero((await scrape(f.http_port)).decode) for f in fronts]
        return await seq.loads(), views

    await eventually(
        both,
        lambda got: (
            all({r: v["blocks"] for r, v in got[0].items()} == view for view in got[1])
            and {r: v["requests"] for r, v in got[0].items() if v["requests"]} == requests
        ),
        what=f"{what}: seqstate == the frontends' decode blocks, requests == {requests}",
        watch=watch,
    )


def per_rank(live: LiveFleet, rids: list[str]) -> dict[Rank, int]:
    counts: dict[Rank, int] = {}
    for add in live.capture.in_flight(rids).values():
        counts[add.rank] = counts.get(add.rank, 0) + 1
    return counts


@asynccontextmanager
async def running_seqstate(
    live: LiveFleet, nats_url: str, args: tuple[str, ...] = ()
) -> AsyncIterator[Seqstate]:
    """``seqstate run`` started, ready, stopped (SIGTERM) on leaving.

    Ready means a JetStream stream listens on Dynamo's subject (what Dynamo publishes from
    then on is kept) and ``status`` answers. ``status`` alone answered before the capture
    stream existed: a test's first AddRequests, sent right then, were lost to seqstate while
    their Marks, a few ms later, were captured (seen on a loaded machine)."""
    runner = Seqstate(live, nats_url, args)
    runner.start()
    js = live.capture.nc.jetstream()
    try:
        await eventually(
            lambda: js.find_stream_name_by_subject(EVENTS_SUBJECT),
            retry_on=(NotFoundError,),
            what=f"a stream capturing {EVENTS_SUBJECT}",
            watch=runner.tail,
        )
        await eventually(
            lambda: runner.cli("status", "--json"),
            lambda r: r[0] == 0,
            what="seqstate status answers for the Dynamo namespace",
            watch=runner.tail,
        )
        yield runner
    finally:
        runner.stop()
