"""Writer and projector in one process: what ``seqstate run`` runs, and what tests start.

They stay two independent consumers (each could run in its own process, as compose does); this
only supervises them: both start, both are caught up before ``__aenter__`` returns, and if
either stops on its own (a lost delta publish, a broken connection) the other is stopped too
and the failure is raised, rather than leaving half a pipeline running.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import Any

from nats.aio.client import Client

from projector.config import Config
from projector.projection import Projector
from projector.writer import Writer
from seqstate.errors import SeqstateError


class PipelineStopped(SeqstateError, RuntimeError):
    """One of the two consumers ended on its own."""


class Pipeline:
    def __init__(self, nc: Client, config: Config, *, start_timeout: float = 60.0) -> None:
        self.nc = nc
        self.config = config
        self.writer = Writer(nc, config)
        self.projector = Projector(nc, config)
        self._start_timeout = start_timeout
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> Pipeline:
        self._tasks = [
            asyncio.create_task(self.writer.run(), name="seqstate-writer"),
            asyncio.create_task(self.projector.run(), name="seqstate-projector"),
        ]
        ready = asyncio.gather(self.writer.caught_up.wait(), self.projector.caught_up.wait())
        waits: list[asyncio.Future[Any]] = [ready, *self._tasks]
        done, _ = await asyncio.wait(
            waits, timeout=self._start_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if ready not in done:
            ready.cancel()
            await self.stop()
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
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            except Exception:  # already ended with an error; wait() reports it
                pass

    async def wait_applied(self, seq: int) -> None:
        """Until the bucket's position reflects event sequence ``seq``."""
        await self.writer.wait_applied(seq)
        await self.writer.flush()
        await self.projector.wait_flushed(seq)

    async def __aenter__(self) -> Pipeline:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
