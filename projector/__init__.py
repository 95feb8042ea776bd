"""seqstate's NATS side: what routers, schedulers and operators import.

``from projector import Scheduler, RouterPublisher, RegistryView, Config`` is the public
face; the wings below (``projector.route``, ``projector.bucket``, ``projector.wire``...) are the
layout, and a name imported from a wing may move. Every error is a :class:`SeqstateError`.

Names are imported when first used, so that ``import projector`` (which every module of the
package runs first, the CLI and the replay reader's child process included) costs nothing. The
public names are listed once, in the ``TYPE_CHECKING`` block below: type checkers read it as it
is, and :func:`__getattr__` reads it from this file's source at the first name asked for, to
know where each name lives (as ``lazy_loader`` reads a stub).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any


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

if TYPE_CHECKING:  # the public names, each once: ``__all__`` is these
    # ``X as X``: re-exported, for a type checker in strict mode (one import per module)
    # isort: off
    from projector.nats.connection import (
        ConnectError as ConnectError,
        connect as connect,
    )
    from projector.control.workers import (
        WorkerChange as WorkerChange,
        WorkerControl as WorkerControl,
        WorkerControlError as WorkerControlError,
        WorkerNotRegistered as WorkerNotRegistered,
        WorkerRefused as WorkerRefused,
    )
    from projector.bucket.reader import (
        BlockSizeUnknown as BlockSizeUnknown,
        RegistryUnavailable as RegistryUnavailable,
        RegistryView as RegistryView,
        Staleness as Staleness,
    )
    from projector.bucket.view_metrics import view_collector as view_collector
    from projector.route.publisher import (
        EventTooLarge as EventTooLarge,
        PublishError as PublishError,
        RouterPublisher as RouterPublisher,
    )
    from projector.route.refusals import publisher_collector as publisher_collector
    from projector.schedule.scheduler import (
        DuplicateRequest as DuplicateRequest,
        NoCandidates as NoCandidates,
        Scheduler as Scheduler,
        UnknownRequest as UnknownRequest,
    )
    from projector.settings.config import (
        Config as Config,
        ConfigError as ConfigError,
    )
    from seqstate.cost import (
        CostRow as CostRow,
        CostWeights as CostWeights,
    )
    from seqstate.errors import SeqstateError as SeqstateError
    # isort: on

_homes: dict[str, str] = {}  # public name -> the module that defines it, read at first use


def _exports() -> dict[str, str]:
    """The names of the ``TYPE_CHECKING`` block above, each with its module, read from this
    file once: the one list, where a table and ``__all__`` beside it had to be kept equal to
    it by hand."""
    if not _homes:
        import ast
        from pathlib import Path

        tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
        (block,) = (
            node
            for node in tree.body
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        )
        _homes.update(
            (alias.asname or alias.name, node.module or "")
            for node in block.body
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        )
    return _homes


def __getattr__(name: str) -> Any:
    if name == "__all__":
        value: Any = sorted(_exports())
    else:
        module = _exports().get(name)
        if module is None:
            raise AttributeError(f"module 'projector' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_exports()))
