"""The shipped role config (deploy/nats-roles.conf) on a real nats-server: each role does
its job with its own credential.

One server per module runs with the role config. The writer and the projector run with their
own credentials, a router publishes with its credential (heartbeat and goodbye included), the
control role registers the workers, a scheduler reads the bucket with its credential (and a
scheduler that books follows its peers with the chooser's), and an operator verifies with the
replay credential: the loads equal an in-process fold of the log exactly, and no client was
refused anything.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import nats
import nats.errors
import pytest
from eventually import eventually
from permissions_kit import (
    NO_ACK_S,
    PASSWORDS,
    VIOLATION,
    _last_seq,
    _refused,
    _refused_publish,
    _stored_since,
    as_role,
    role_config,
    violations,
)
from pipeline_kit import REPO, read_log

from projector.bucket.projection import Projector
from projector.bucket.reader import RegistryView
from projector.control.workers import WorkerControl
from projector.route.publisher import RouterPublisher
from projector.schedule.scheduler import Scheduler
from projector.settings.config import Config
from projector.write.writer import Writer
from seqstate import WorkerAdded, decode_event, encode_event

# The fixtures roles_server and pipeline, which the tests here take (a plugin: not imported).
pytest_plugins = ("permissions_fixtures",)


async def test_each_role_does_its_job_with_its_own_credential(
    roles_server: str, pipeline: tuple[Writer, Projector], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with (
        as_role(roles_server, "router") as rnc,
        as_role(roles_server, "scheduler") as snc,
        as_role(roles_server, "replay") as onc,
    ):
        async with as_role(roles_server, "control") as cnc:  # topology is the operator's
            added = await WorkerControl(cnc, config=Config()).add(1, dp_size=2)
            assert added.applied
        # RouterPublisher with its defaults: a heartbeat at start, a goodbye at close.
        pub = await RouterPublisher(rnc, router_id="perm-r", config=Config()).start()
        for i in range(12):
            await pub.add(
                f"r{i}", 1, i % 2, block_hashes=[100, 101, 200 + i], prefill_tokens=100 + i
            )
        last = await pub.free("r3", 1, 1)
        async with RegistryView(snc, config=Config()) as view:
            await view.wait_for(last, timeout=20)
            state = Config().new_state()
            last_ns = 0
            for _, at_ns, data in await read_log(onc, Config()):
                state.apply(decode_event(data), at_ns)
                last_ns = at_ns
            assert view.applied_seq >= last
            for offset_ns in (0, 10**6, 10**9):
                now = last_ns + offset_ns
                assert view.loads(now) == state.registry.loads(now)
                query = [100, 101, 205]
                assert view.potential_loads(query, 64, now) == state.registry.potential_loads(
                    query, 64, now
                )
        # An operator finds the writer and the projector as NATS services (nats micro).
        for kind in ("writer", "projector"):
            info = json.loads((await onc.request(f"$SRV.INFO.seqstate-{kind}", b"", 10)).data)
            assert info["metadata"]["namespace"] == "default"
            status = await onc.request(f"seqstate.svc.default.{kind}.status", b"", 10)
            assert json.loads(status.data)["kind"] == kind
        await pub.close()  # its goodbye, on the routers subject
        assert pub.heartbeat_failures == 0
    assert violations(caplog) == []


async def test_a_scheduler_books_and_follows_its_peers_with_the_chooser_credential(
    roles_server: str, pipeline: tuple[Writer, Projector], caplog: pytest.LogCaptureFixture
) -> None:
    """A Scheduler is a router that chooses: the chooser role lets it publish, read the bucket
    and follow the namespace's worker events through a consumer (its peers' bookings), and
    still not read the events stream's info, whose metadata holds the key of the Ticks."""
    caplog.set_level(logging.WARNING)
    async with as_role(roles_server, "chooser") as a_nc, as_role(roles_server, "chooser") as b_nc:
        async with (
            Scheduler(a_nc, config=Config(), router_id="perm-a", block_size=16) as a,
            Scheduler(b_nc, config=Config(), router_id="perm-b", block_size=16) as b,
        ):
            assert a.following and b.following
            await a.add("perm-s1", worker_id=9, block_hashes=[1, 2, 3], prefill_tokens=48)
            await eventually(
                lambda: [r.active_requests for r in b.costs([1, 2, 3], 48, [(9, 0)])],
                lambda n: n == [1],
                what="b counts a's booking",
            )
            last = await a.free("perm-s1")
            await b.view.wait_for(last, timeout=20)
        assert violations(caplog) == []
        with pytest.raises(nats.errors.TimeoutError):
            await a_nc.jetstream(timeout=NO_ACK_S).stream_info("SEQSTATE_EVENTS")


def test_replay_verify_runs_with_the_replay_credential(
    roles_server: str, pipeline: tuple[Writer, Projector]
) -> None:
    clean = {
        k: v for k, v in os.environ.items() if k != "NATS_URL" and not k.startswith("SEQSTATE_")
    }
    env = {
        **clean,
        "NATS_URL": roles_server,
        "SEQSTATE_NATS_USER": "replay",
        "SEQSTATE_NATS_PASSWORD": PASSWORDS["replay"],
        "COLUMNS": "400",
    }
    for argv in (["replay", "--verify", "--no-progress"], ["status"]):
        result = subprocess.run(
            [sys.executable, "-m", "projector", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=REPO,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert PASSWORDS["replay"] not in result.stdout + result.stderr
        assert VIOLATION not in (result.stdout + result.stderr).lower()


async def test_a_scheduler_hears_the_projectors_heartbeat_from_the_bucket_alone(
    roles_server: str, pipeline: tuple[Writer, Projector], caplog: pytest.LogCaptureFixture
) -> None:
    """The scheduler may read the bucket and nothing else (the events stream's info holds a
    key): the projector's lease renewals bring its view the log's head and what it lacks of
    it, under the scheduler's own credential."""
    caplog.set_level(logging.WARNING)
    async with (
        as_role(roles_server, "control") as cnc,
        as_role(roles_server, "router") as rnc,
        as_role(roles_server, "scheduler") as snc,
    ):
        assert (await WorkerControl(cnc, config=Config()).add(41)).applied
        pub = RouterPublisher(rnc, router_id="perm-hb", config=Config())
        last = await pub.add("hb1", 41, block_hashes=[7, 8], prefill_tokens=32)
        async with RegistryView(snc, config=Config()) as view:
            s = await eventually(
                view.staleness,
                lambda s: s.head >= last and s.behind_events == 0 and s.applied_seq >= last,
                what="a heartbeat of the log at the add or later, the view lacking none of it",
            )
            assert view.renewals > 0 and not s.silent and s.within(0, 0.0)
        assert not violations(caplog), violations(caplog)
        with pytest.raises(nats.errors.TimeoutError):  # and still no read of the log
            await snc.jetstream(timeout=NO_ACK_S).stream_info("SEQSTATE_EVENTS")
        await snc.flush()
    assert _refused(caplog, "$JS.API.STREAM.INFO.SEQSTATE_EVENTS"), caplog.text


async def test_the_control_role_manages_workers_and_a_scheduler_cannot(
    roles_server: str, pipeline: tuple[Writer, Projector], caplog: pytest.LogCaptureFixture
) -> None:
    """``seqstate worker`` as "control": add, list and remove go through, confirmed by the
    bucket. A scheduler's credential cannot register a worker: refused, nothing stored."""
    caplog.set_level(logging.WARNING)
    async with as_role(roles_server, "control") as cnc:
        control = WorkerControl(cnc, config=role_config(roles_server, "control"))
        added = await control.add(31, dp_size=2)
        assert (added.applied, added.dp_ranks) == (True, [0, 1])
        assert 31 in [w.worker_id for w in await control.workers()]
        removed = await control.remove(31)
        assert removed.applied and removed.dp_ranks == []
    assert not violations(caplog), violations(caplog)
    async with as_role(roles_server, "scheduler") as snc, as_role(roles_server, "replay") as onc:
        before = await _last_seq(onc, "SEQSTATE_EVENTS")
        forged = encode_event(WorkerAdded(worker_id=32))
        await _refused_publish(snc, Config().control_subject, forged)
        assert forged not in await _stored_since(onc, "SEQSTATE_EVENTS", before)
