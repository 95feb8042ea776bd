"""Which build of the core the tests run against: compiled (mypyc) by default, or pure.

The pure sources are the reference and the compiled modules a faster build of the same code,
so ``make test`` runs the whole suite against the compiled build, then the tests marked
``core`` against the pure one (``SEQSTATE_PURE=1 pytest -m core``). A ``core`` test exercises
seqstate/ itself and needs no nats-server (a module's ``pytestmark = pytest.mark.core``, or a
parameter's mark as in tests/integration/test_scenarios.py); the collection below refuses one
that asks for the server, which would bring the slow half of the suite back into the pure pass.

``SEQSTATE_PURE=1`` makes every import of a compiled module load its ``.py`` source instead. A
compiled module older than its source would test stale code, so that stops the run with the
command that fixes it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "seqstate"
# The shared helpers (tests/support/) assert too: their failures explain themselves as a test's
# do, once pytest rewrites them like test modules (before anything imports them).
pytest.register_assert_rewrite(*(p.stem for p in (Path(__file__).parent / "support").glob("*.py")))
PURE = os.environ.get("SEQSTATE_PURE") == "1"


def _compiled(source: Path) -> list[Path]:
    return sorted(CORE.glob(f"{source.stem}.*.so"))


class _SourceFirst:
    """A meta-path finder that serves seqstate's modules from source, never from a .so."""

    def find_spec(self, name: str, path: object, target: object = None) -> object:
        if not name.startswith("seqstate.") or name.count(".") != 1:
            return None
        source = CORE / f"{name.split('.')[1]}.py"
        if not source.is_file():
            return None
        loader = importlib.machinery.SourceFileLoader(name, str(source))
        return importlib.util.spec_from_file_location(name, source, loader=loader)


if PURE:
    sys.meta_path.insert(0, _SourceFirst())
else:
    stale = [
        source.name
        for source in CORE.glob("*.py")
        for built in _compiled(source)
        if built.stat().st_mtime < source.stat().st_mtime
    ]
    if stale:
        pytest.exit(
            f"compiled core is older than {', '.join(stale)}: run `make native` "
            "(or `make pure` to drop the compiled modules)",
            returncode=2,
        )


# The shared fixtures (a real nats-server, a client, a real etcd) live in tests/support/, loaded
# here, after the core's import hook is in place.
pytest_plugins = ["server_fixtures"]  # not "fixtures": pytest has a plugin of that name


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A ``core`` test may not use the nats-server: the pure pass is the core's, and fast.

    A ``dynamo`` test (tests/dynamo: a real Dynamo fleet, ``make test-dynamo``) runs only when
    the ``-m`` expression names that marker; any other run deselects it. Deselected rather than
    skipped when the Dynamo venv is absent: what ``make test`` runs, and how long it takes, must
    not depend on whether this machine happens to have a Dynamo venv in its cache.
    """
    if "dynamo" not in (config.getoption("markexpr") or ""):
        live = [item for item in items if item.get_closest_marker("dynamo")]
        if live:
            config.hook.pytest_deselected(items=live)
            items[:] = [item for item in items if not item.get_closest_marker("dynamo")]
    served = [
        item.nodeid
        for item in items
        if item.get_closest_marker("core") and "nats_server" in getattr(item, "fixturenames", ())
    ]
    if served:
        raise pytest.UsageError(f"core tests that need a nats-server: {', '.join(served[:5])}")


def pytest_report_header() -> str:
    import seqstate.state

    built = "compiled" if seqstate.state.__file__.endswith(".so") else "pure Python"
    return f"seqstate core: {built} ({seqstate.state.__file__})"
