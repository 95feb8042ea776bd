"""The garbage collector of a seqstate process: collecting the young rarely.

CPython collects its youngest generation whenever 700 more container objects have been
allocated than freed, and every tenth of those collections the next one. A writer catching up
allocates a few dozen containers per event (the event's hash list, its delta's lists and
structs, nats-py's message), nearly all freed within the event or once its delta is stored;
the count still crossed 700 about every 65 events, and the collections (with the older ones
they set off, which walk the write model) took 10-15% of the CPU of a writer and projector
catching up. Nothing the fold or the readers build holds a cycle that must go soon, so the
threshold is raised: collections of the young then come every ``YOUNG`` allocations not freed,
which a catch-up hardly reaches (none in 60,000 events), and each still bounds what garbage in
cycles (asyncio's exceptions and their tracebacks) can pile up to.
"""

from __future__ import annotations

import gc
from typing import Final

YOUNG: Final = 50_000  # container objects allocated and not freed between young collections


def tune_collector() -> None:
    """Collect the young every ``YOUNG`` allocations not freed; the older generations' own
    thresholds are kept (each a count of the collections below it)."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG, middle, old)
