"""Which build of the core the tests run against: compiled (mypyc) by default, or pure.

The pure sources are the reference and the compiled modules a faster build of the same code,
so ``make test`` runs the whole suite against both. ``SEQSTATE_PURE=1`` makes every import of
a compiled module load its ``.py`` source instead. A compiled module older than its source
would test stale code, so that stops the run with the command that fixes it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "seqstate"
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


def pytest_report_header() -> str:
    import seqstate.state

    built = "compiled" if seqstate.state.__file__.endswith(".so") else "pure Python"
    return f"seqstate core: {built} ({seqstate.state.__file__})"
