"""seqstate's NATS side: what routers, schedulers and operators import.

``from projector import Scheduler, RouterPublisher, RegistryView, Config`` is the public
face; the wings below (``projector.route``, ``projector.read``, ``projector.wire``...) are the
layout, and a name imported from a wing may move. Every error is a :class:`SeqstateError`.

Names are imported when first used, so that ``import projector`` (which every module of the
package runs first, the CLI and the replay reader's child process included) costs nothing.
The module paths of 0.1 (``projector.publisher``, ``projector.reader``...) still import, with a
DeprecationWarning, for one release (:mod:`projector._moved`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from projector import _moved


def _check_the_core() -> None:
    """A clone named ``seqstate`` beside the script shadows the core (:mod:`projector._shadowed`):
    one ``stat`` here, the module only when the first entry of ``sys.path`` holds one."""
    import os
    import sys

    first = (sys.path[0] if sys.path else "") or os.curdir
    if os.path.isfile(os.path.join(first, "seqstate", "seqstate", "__init__.py")):
        from projector._shadowed import refuse_a_shadowed_core

        refuse_a_shadowed_core()


_check_the_core()

if TYPE_CHECKING:
    from projector.nats.connection import ConnectError, connect
    from projector.ops.workers import (
        WorkerChange,
        WorkerControl,
        WorkerControlError,
        WorkerNotRegistered,
        WorkerRefused,
    )
    from projector.read.reader import (
        BlockSizeUnknown,
        RegistryUnavailable,
        RegistryView,
        Staleness,
    )
    from projector.read.view_metrics import view_collector
    from projector.route.publisher import EventTooLarge, PublishError, RouterPublisher
    from projector.route.refusals import publisher_collector
    from projector.schedule.scheduler import (
        DuplicateRequest,
        NoCandidates,
        Scheduler,
        UnknownRequest,
    )
    from projector.wire.config import Config, ConfigError
    from seqstate.cost import CostRow, CostWeights
    from seqstate.errors import SeqstateError

# name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "RouterPublisher": "projector.route.publisher",
    "PublishError": "projector.route.publisher",
    "EventTooLarge": "projector.route.publisher",
    "RegistryView": "projector.read.reader",
    "RegistryUnavailable": "projector.read.reader",
    "BlockSizeUnknown": "projector.read.reader",
    "CostWeights": "seqstate.cost",
    "CostRow": "seqstate.cost",
    "view_collector": "projector.read.view_metrics",
    "publisher_collector": "projector.route.refusals",
    "Config": "projector.wire.config",
    "ConfigError": "projector.wire.config",
    "connect": "projector.nats.connection",
    "ConnectError": "projector.nats.connection",
    "WorkerControl": "projector.ops.workers",
    "WorkerChange": "projector.ops.workers",
    "WorkerControlError": "projector.ops.workers",
    "WorkerNotRegistered": "projector.ops.workers",
    "WorkerRefused": "projector.ops.workers",
    "SeqstateError": "seqstate.errors",
    "Scheduler": "projector.schedule.scheduler",
    "Staleness": "projector.read.reader",
    "NoCandidates": "projector.schedule.scheduler",
    "UnknownRequest": "projector.schedule.scheduler",
    "DuplicateRequest": "projector.schedule.scheduler",
}

__all__ = [
    "BlockSizeUnknown",
    "Config",
    "ConfigError",
    "ConnectError",
    "CostRow",
    "CostWeights",
    "DuplicateRequest",
    "EventTooLarge",
    "NoCandidates",
    "PublishError",
    "RegistryUnavailable",
    "RegistryView",
    "RouterPublisher",
    "Scheduler",
    "SeqstateError",
    "Staleness",
    "UnknownRequest",
    "WorkerChange",
    "WorkerControl",
    "WorkerControlError",
    "WorkerNotRegistered",
    "WorkerRefused",
    "connect",
    "publisher_collector",
    "view_collector",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'projector' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_moved.install()
