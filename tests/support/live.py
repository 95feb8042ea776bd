"""Bringing a :class:`fleet.Fleet` up, with every wait an ``eventually`` on something observable.

Ready, for a frontend, means three things, each checked where it shows:
1. ``GET /v1/models`` lists ``tiny`` (the frontend found a worker's model card);
2. a warm-up request routed by it completed, and its AddRequest on NATS names the frontend's
   ``router_id`` (so the replica-sync path works, and the tests know which replica is which);
3. its ``/metrics`` says ``dynamo_component_router_worker_registered`` for every (worker,
   dp_rank) that file discovery lists, and no decode block or prefill token is left of the
   warm-up. (The decode-block gauges themselves are no readiness signal: a rank's series
   appears only once the router has had a request on it.)
``/v1/models`` alone is not enough: a frontend lists the model as soon as one worker's card is
read, possibly before its router has registered every worker and rank.

The warm-up prompts use block tags of their own (``WARMUP_TAG``), so no test's prefix is
cached on a worker by them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from dynamo_kit import Capture, Stream, block, models, scrape
from eventually import eventually
from fleet import HIGH_ID_TRIES, TOP_BIT, Fleet, Frontend, Proc

WARMUP_TAG = 9_000_000_000_000_000
START_S = 120.0  # only a hang reaches it: a fleet starts in ~20 s on 2 busy cores


@dataclass
class LiveFleet:
    fleet: Fleet
    capture: Capture

    @property
    def frontends(self) -> list[Frontend]:
        return self.fleet.frontends

    async def start_discovery(self) -> None:
        """On etcd discovery, the fleet's etcd, until its gateway answers healthy; files need
        nothing started."""
        if self.fleet.discovery != "etcd":
            return
        self.fleet.start_etcd()
        await eventually(
            self.fleet.gateway.healthy,
            what="etcd healthy",
            timeout=START_S,
            check=self.fleet.check,
            watch=self.fleet.tails,
        )

    async def start_workers(self) -> None:
        """A mocker with one rank and one with ``--data-parallel-size 2``; on file discovery,
        the first restarted until some worker id is above 2^63 (see fleet.py). On etcd a
        worker's instance id is its etcd lease id, which etcd draws below 2^63: no restart
        would give one."""
        single = self.fleet.start_mocker("mocker-a")
        double = self.fleet.start_mocker("mocker-b-dp2", dp=2)
        for attempt in range(1, HIGH_ID_TRIES + 1):
            await self.registered([single, double])
            ids = self.fleet.worker_ids()
            if self.fleet.discovery != "file" or max(ids.values()) >= TOP_BIT:
                return
            if attempt == HIGH_ID_TRIES:
                raise AssertionError(f"no worker id above 2^63 in {attempt} starts: {ids}")
            self.fleet.stop_proc(single)
            await self._deregistered(single)
            single = self.fleet.start_mocker("mocker-a")

    async def _deregistered(self, mocker: Proc) -> None:
        """A SIGTERMed mocker removes its discovery records (in ~2 s): until they are gone."""
        await eventually(
            lambda: mocker.rpc_port not in self.fleet.worker_ids(),
            what=f"{mocker.name}'s discovery records removed after SIGTERM",
            watch=self.fleet.tails,
        )

    async def registered(self, mockers: list[Proc]) -> None:
        def seen() -> bool:
            ids = self.fleet.worker_ids()
            return all(m.rpc_port in ids for m in mockers) and len(self.fleet.ranks()) == 3

        await eventually(
            seen,
            what="both mockers registered (instances) with 3 ranks (event sources)",
            timeout=START_S,
            check=self.fleet.check,
            watch=self.fleet.tails,
        )

    async def start_frontend(
        self, name: str, *extra: str, env: dict[str, str] | None = None
    ) -> Frontend:
        """Start a frontend and wait until it is ready (see the module's docstring)."""
        front = self.fleet.start_frontend(name, *extra, env=env)
        await eventually(
            lambda: models(front.http_port),
            lambda ids: "tiny" in ids,
            what=f"{name} lists the model",
            timeout=START_S,
            retry_on=(OSError,),
            check=front.check,
            watch=self.fleet.tails,
        )
        front.router_id = await self.warm_up(front)
        ranks = self.fleet.ranks()
        await eventually(
            lambda: scrape(front.http_port),
            lambda g: (
                g.registered == ranks and not any(g.decode.values()) and not any(g.prefill.values())
            ),
            what=f"{name} registered {sorted(ranks)}, nothing in flight",
            timeout=START_S,
            check=front.check,
            watch=self.fleet.tails,
        )
        return front

    async def warm_up(self, front: Frontend) -> int:
        """Route one short request through ``front``; the router_id its AddRequest names."""
        rid = str(uuid.uuid4())
        prompt = block(WARMUP_TAG + len(self.fleet.frontends)) + "1234"
        stream = await Stream(rid, front.http_port, prompt, 2).open()
        try:
            await eventually(
                lambda: stream.finished.is_set(),
                what=f"{front.name}'s warm-up completion",
                timeout=START_S,
                check=front.check,
                watch=self.fleet.tails,
            )
        finally:
            await stream.close()
        assert stream.completed, bytes(stream.received[:500])
        await eventually(
            lambda: self.capture.freed([rid]),
            what=f"the Free of {rid}",
            watch=self.fleet.tails,
        )
        (add,) = self.capture.adds([rid]).values()
        return add.event.router_id

    async def added(self, rids: list[str]) -> None:
        """Until the AddRequest of each of ``rids`` is captured."""
        await eventually(
            lambda: self.capture.adds(rids),
            lambda adds: len(adds) == len(rids),
            what=f"{len(rids)} AddRequests",
            watch=self.fleet.tails,
        )

    async def new_mocker(self, name: str) -> tuple[Proc, int]:
        """A single-rank mocker started now, and its instance id once discovery has it."""
        mocker = self.fleet.start_mocker(name)
        worker_id = await eventually(
            lambda: self.fleet.worker_of(mocker),
            lambda w: w is not None,
            what=f"{name} in discovery",
            timeout=60,
            check=mocker.check,
        )
        return mocker, worker_id

    def stop(self) -> None:
        self.fleet.stop()
