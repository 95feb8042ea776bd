"""A namespace's pipeline, run by whichever of several processes holds the namespace's lease.

Several processes can each offer to run one namespace's writer and projector (replicas of
``serve-http``, which start a pipeline for every tracker they serve). Exactly one runs them at
a time: the holder of the namespace's lease (``<ns>.lease``, see :mod:`projector.nats.lease`). The
others wait on the lease; when the holder stops, its successor takes over at once, and when it
dies, within the lease's TTL. The writer starts only once the lease is held and stops with the
projector, so the lease guards the pair; in the moment of a handover the delta chain's
compare-and-set still refuses a second writer.
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
from nats.aio.client import Client

from projector.nats.lease import DEFAULT_TTL_S, LeaseLost
from projector.run.assemble import build_lease
from projector.run.pipeline import PERMANENT, Pipeline
from projector.settings.config import Config
from seqstate.errors import SeqstateError

log = logging.getLogger("seqstate.standby")


class StandbyPipeline:
    """``await StandbyPipeline(nc, config).run()`` until cancelled: waits for the lease, runs
    the pipeline while it holds it, and waits again if the pipeline fails or the lease is
    lost. ``active`` is set while this process runs the namespace."""

    def __init__(
        self,
        nc: Client,
        config: Config,
        *,
        lease_ttl_s: float = DEFAULT_TTL_S,
        retry_s: float = 1.0,
    ) -> None:
        self.nc = nc
        self.config = config
        self.lease_ttl_s = lease_ttl_s
        self.retry_s = retry_s
        self.active = asyncio.Event()
        self.pipeline: Pipeline | None = None
        self.terms = 0  # how many times this process has taken the namespace over

    async def run(self) -> None:
        while True:
            lease = build_lease(
                self.nc, self.config, "projector", ttl_s=self.lease_ttl_s, on_lost=self._lost
            )
            await lease.acquire(wait=True)
            try:
                self.pipeline = Pipeline(self.nc, self.config, held_lease=lease)
                async with self.pipeline as pipeline:
                    self.terms += 1
                    self.active.set()
                    log.info(
                        "running namespace %r (term %d)",
                        self.config.namespace,
                        self.terms,
                        extra={"namespace": self.config.namespace},
                    )
                    await pipeline.wait()
            except PERMANENT:
                raise
            except (SeqstateError, nats.errors.Error, TimeoutError, ConnectionError) as exc:
                log.warning(
                    "namespace %r: pipeline stopped (%s); standing by",
                    self.config.namespace,
                    exc,
                    extra={"namespace": self.config.namespace},
                )
            finally:
                self.active.clear()
                self.pipeline = None
                await lease.release()
            await asyncio.sleep(self.retry_s)

    def _lost(self, exc: LeaseLost) -> None:
        if self.pipeline is not None:
            self.pipeline.projector.lease_lost(exc)
