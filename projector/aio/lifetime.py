"""One spelling of start and stop for every long-lived part a user holds.

``async with RegistryView(...) as view`` starts it and stops it at the block's end, the same for
a scheduler and a pipeline; each says only what its ``start`` and ``stop`` do.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self


class Started:
    async def start(self) -> Self:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
