"""Writer and projector in one process: what ``seqstate run`` runs, and what tests start.

They stay two independent consumers (each could run in its own process, as compose does); this
only supervises them: both start, both are caught up before ``__aenter__`` returns, and if
either stops on its own (a lost delta publish, a broken connection) the other is stopped too
and the failure is raised, rather than leaving half a pipeline running.

:func:`supervise` is what a process supervisor does for the separate processes, in process:
a pipeline that failed is started again after a backoff (each consumer resumes from what it
stored: the last delta, the bucket's position), and the log says so. A failure that no restart
can mend (a setting, a trimmed log with no snapshot, a gap in the deltas) ends it instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.client import Client

from projector.aio.lifetime import Started
from projector.aio.tasks import cancel_all
from projector.bucket.projection import BucketUnfit, DeltaGap
from projector.nats.failures import describe
from projector.nats.lease import Lease
from projector.nats.resources import ProvisioningError
from projector.run.assemble import build_projector, build_writer
from projector.settings.config import Config, ConfigError
from projector.write.snapshotter import SnapshotUnavailable
from projector.write.writer import EventLimitUnfit
from seqstate.errors import SeqstateError

log = logging.getLogger("seqstate")


class PipelineStopped(SeqstateError, RuntimeError):
    """One of the two consumers ended on its own."""


PERMANENT: tuple[type[BaseException], ...] = (
    ConfigError,
    EventLimitUnfit,
    ProvisioningError,
    SnapshotUnavailable,
    DeltaGap,
    BucketUnfit,
)
STABLE_S = 60.0  # a pipeline that ran this long before failing starts the backoff afresh
# How long a start-up that is called off gives the consumers to stop by themselves before they
# are cancelled: a signal while ``run`` catches up must end the process within 2 s, the
# embedded server's stop and the client's close included.
ABORT_S = 0.8


async def supervise(
    nc: Client,
    config: Config,
    *,
    started: asyncio.Event | None = None,
    backoff_s: float = 1.0,
    max_backoff_s: float = 30.0,
    on_pipeline: Callable[[Pipeline | None], None] | None = None,
) -> None:
    """Run the pipeline until cancelled, restarting it after a failure a restart can mend.

    ``started`` is set once the first pipeline is caught up. ``on_pipeline`` is told of each
    pipeline as it starts (before it has caught up: the metrics report its replay) and told
    None once it has stopped.
    """
    loop = asyncio.get_running_loop()
    delay = backoff_s
    restarts = 0
    tell = on_pipeline or (lambda _: None)
    while True:
        began = loop.time()
        try:
            pipeline = Pipeline(nc, config)
            tell(pipeline)
            try:
                async with pipeline:
                    if started is not None:
                        started.set()
                    if restarts:
                        log.warning("pipeline running again (restart %d)", restarts)
                    await pipeline.wait()
            finally:
                tell(None)
        except PERMANENT:
            raise
        except (SeqstateError, nats.errors.Error, TimeoutError, ConnectionError) as exc:
            if loop.time() - began >= STABLE_S:
                delay = backoff_s
            restarts += 1
            log.error("pipeline stopped (%s); restarting it in %gs", describe(exc), delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_backoff_s)


async def _called_off(future: asyncio.Future[Any]) -> None:
    future.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await future  # else asyncio logs its cancellation as a traceback


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


class Pipeline(Started):
    def __init__(
        self,
        nc: Client,
        config: Config,
        *,
        start_timeout: float = 60.0,
        held_lease: Lease | None = None,
    ) -> None:
        self.nc = nc
        self.config = config
        self.writer = writer = build_writer(nc, config)
        self.projector = build_projector(
            nc, config, held_lease=held_lease, stored_up_to=lambda: writer.stats.last_seq
        )
        self._start_timeout = start_timeout
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> Pipeline:
        self._tasks = [
            asyncio.create_task(self.writer.run(), name="seqstate-writer"),
            asyncio.create_task(self.projector.run(), name="seqstate-projector"),
        ]
        ready = asyncio.gather(self.writer.caught_up.wait(), self.projector.caught_up.wait())
        waits: list[asyncio.Future[Any]] = [ready, *self._tasks]
        try:
            done, _ = await asyncio.wait(
                waits, timeout=self._start_timeout, return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:  # called off (a signal): stop at once
            await _called_off(ready)
            await self.abort()
            raise
        if ready not in done:
            await _called_off(ready)
            await self.stop()
            for task in self._tasks:  # one that failed at start says why (a setting, ...)
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            raise PipelineStopped("the writer or the projector did not catch up with its stream")
        return self

    async def wait(self) -> None:
        """Until one consumer ends; then stop the other and raise what ended it."""
        done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
        await self.stop()
        for task in done:
            if not task.cancelled() and (exc := task.exception()) is not None:
                raise exc
        raise PipelineStopped(f"{next(iter(done)).get_name()} stopped")

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop the writer, let the projector take in what it published, then stop that too."""
        self.writer.stop()
        if self._tasks and not self._tasks[0].done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._tasks[0]), timeout)
        if self._tasks and not self._tasks[1].done() and self.writer.stats.last_delta_seq:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self.projector.wait_flushed(self.writer.stats.last_delta_seq), timeout
                )
        self.projector.stop()
        for task in self._tasks:
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout)
            except TimeoutError:
                await cancel_all([task], None)
            except Exception:  # already ended with an error; wait() reports it
                pass

    async def abort(self, within_s: float = ABORT_S) -> None:
        """Stop both at once, as a start-up called off must: the writer stores what it has
        folded but takes no final snapshot, and whatever has not ended after ``within_s``
        (a snapshot being read, the bucket being read back) is cancelled. As safe as a kill:
        each consumer resumes from what it stored, the writer from its newest snapshot."""
        self.writer.stop(final_snapshot=False)
        self.projector.stop()
        running = [task for task in self._tasks if not task.done()]
        if running:
            _, late = await asyncio.wait(running, timeout=within_s)
            await cancel_all(late, within_s / 2)
        for task in self._tasks:  # retrieved: a consumer called off has nothing to report
            task.add_done_callback(_retrieved)

    async def wait_applied(self, seq: int) -> None:
        """Until the bucket's position reflects event sequence ``seq``."""
        await self.writer.wait_applied(seq)
        await self.writer.flush()
        await self.projector.wait_flushed(seq)
