"""What a consumer asks of its server besides its stream, bound to its namespace's names.

The writer and the projector provision the streams and buckets they use at every start, and
register themselves as NATS services while they run. Both are done from the whole
configuration (:mod:`projector.nats.resources`, :mod:`projector.nats.services`); the consumer
is handed them bound, by :mod:`projector.run.assemble`, so it needs no configuration for them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

Status = Callable[[], dict[str, Any]]


@dataclass(frozen=True)
class Host:
    """``provision()``: create or update every stream and bucket; ``announce(kind, status)``:
    registered as a service while inside, ``status()`` answering its status endpoint."""

    provision: Callable[[], Awaitable[object]]
    announce: Callable[[str, Status], AbstractAsyncContextManager[object]]
