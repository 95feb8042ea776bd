"""The module paths of 0.1, before projector/ was split into wings: kept working for one release.

``from projector.publisher import RouterPublisher`` still imports, with a DeprecationWarning that
names the new path: the old name is an alias of the new module (the same object, so a patch
through either name is seen by both). New code imports from :mod:`projector` itself, or from the
wing. Remove in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

# each wing, and the 0.1 modules (projector.<name>) that moved into it
WINGS: dict[str, str] = {
    "wire": "config values",
    "nats": "connection security server resources stream frames retry tasks lease lag "
    "dead_letters retention snapshots logs progress stream_reader discovery",
    "write": "writer delta_log snapshotter",
    "read": "projection image bucket reader",
    "route": "publisher outcomes",
    "run": "pipeline standby",
    "http": "http_server slot_api slot_service serde_errors tracker_names",
    "ops": "cli flags status top live inspection replay progress_bar health metrics demo "
    "workload workers",
}
MOVED: dict[str, str] = {old: wing for wing, names in WINGS.items() for old in names.split()}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is the new one, already imported."""


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds ``projector.<old>`` as an alias of ``projector.<wing>.<old>``."""

    def find_spec(
        self, name: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, old = name.partition(".")
        if package != "projector" or old not in MOVED:
            return None
        new = f"projector.{MOVED[old]}.{old}"
        warnings.warn(
            f"{name} moved to {new} (import it from there, or from projector); the old path "
            "goes in 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.machinery.ModuleSpec(name, _Alias(new))


def install() -> None:
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedFinder())
