"""Build the hot modules of the core with mypyc (compiled C extensions of the same Python).

The fold runs ~30-40% faster compiled (see BENCHMARKS.md). The sources stay the reference:
nothing in them depends on being compiled, so a pure-Python install behaves the same, only
slower. That is why an install never fails for want of a compile: without a working C
compiler (or Python headers), or if mypyc rejects the code, the build warns and installs the
pure core. ``SEQSTATE_PURE`` decides:

- unset: compiled if possible, else pure with a warning (``pip install .``, the Dockerfile);
- ``1``: pure, mypyc is not even imported (``make test``'s editable install);
- ``0``: compiled or a failed build (``make native``, so that a broken compile stops CI
  instead of quietly testing the pure core twice).

mypyc runs when ``build_ext`` is prepared, not when setup.py is imported: the metadata and
sdist steps of a PEP 517 build then need neither mypy nor msgspec, and an sdist carries the
Python sources, never the generated C (which is specific to the mypy that wrote it).
Modules that define msgspec Structs (events, deltas, loads, topology, snapshot, dynamo, cost)
stay interpreted: mypyc does not keep a Struct's class options.
"""

from __future__ import annotations

import os
import sys
import textwrap
from functools import cache
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = [
    "seqstate/blocks.py",
    "seqstate/decay.py",
    "seqstate/departures.py",
    "seqstate/prefill.py",
    "seqstate/publishers.py",
    "seqstate/recent.py",
    "seqstate/registry.py",
    "seqstate/request_index.py",
    "seqstate/sequences.py",
    "seqstate/state.py",
]
GROUP = "seqstate._native"  # the shared runtime library: seqstate/_native__mypyc.<abi>.so
MODULES = [f"{GROUP}__mypyc", *(path[:-3].replace("/", ".") for path in NATIVE)]

MODE = os.environ.get("SEQSTATE_PURE", "")
PURE = MODE == "1"
REQUIRE_COMPILED = MODE == "0"


def _fall_back(step: str, error: BaseException) -> None:
    """Say loudly (pip shows it with -v) that this build is pure, and why."""
    if isinstance(error, SystemExit):  # mypyc printed its errors already
        reason = "see its errors above"
    else:
        reason = f"{type(error).__name__}: {error}"
    message = textwrap.dedent(f"""
        ************************************************************************
        seqstate: {step} failed ({reason}).
        The core is not compiled: using the pure-Python core, same behaviour but
        a slower fold. A compiled core needs a C compiler and the Python headers
        (Debian: build-essential python3-dev). SEQSTATE_PURE=0 makes this an error.
        ************************************************************************
    """)
    print(message, file=sys.stderr, flush=True)


@cache
def _mypycify() -> tuple[Extension, ...]:
    """The compiled modules' extensions (generated C under build/), or none if mypyc fails.

    Cached: setuptools prepares build_ext more than once in one build (an editable install
    reinitialises it), and one type check per process is enough.
    """
    try:
        from mypyc.build import mypycify

        return tuple(mypycify(NATIVE, opt_level="3", group_name=GROUP))
    except (Exception, SystemExit) as error:  # mypyc reports type errors with sys.exit
        if REQUIRE_COMPILED:
            raise
        _fall_back("mypyc", error)
        return ()


class BuildNative(build_ext):
    """build_ext that compiles the core with mypyc, or leaves it pure if it cannot."""

    def finalize_options(self) -> None:
        # egg_info and sdist prepare build_ext only to list its sources: they build nothing.
        listing_only = set(self.distribution.commands) <= {"egg_info", "dist_info", "sdist"}
        native = [] if listing_only else list(_mypycify())
        if native:
            self.distribution.ext_modules = native
        super().finalize_options()
        if not native:
            # Build nothing, but leave the placeholder to the distribution: the other commands
            # already laid the wheel out as platform-specific, and must keep agreeing on it.
            self.extensions = []

    def run(self) -> None:
        inplace = self.inplace  # setuptools clears it while building and, on an error, for good
        if not self.extensions:
            self._drop_compiled(inplace)
            return
        try:
            super().run()
        except Exception as error:  # CompileError, LinkError, no compiler at all, ...
            if REQUIRE_COMPILED:
                raise
            _fall_back("compiling the core", error)
            self.inplace = inplace
            self.extensions = []
            self._drop_compiled(inplace)

    def get_source_files(self) -> list[str]:
        # The extensions' sources are C that mypyc generates at build time; the sdist ships
        # the Python they come from (the packages), never a build directory.
        return []

    def _drop_compiled(self, inplace: bool) -> None:
        """Remove compiled modules a failed or earlier build left where this one installs
        from: a pure build that shipped one would run stale compiled code over the sources."""
        roots = [Path(self.build_lib)]
        if inplace:
            roots.append(Path(self.get_finalized_command("build_py").get_package_dir("")))
        for root in roots:
            for module in MODULES:
                (root / self.get_ext_filename(module)).unlink(missing_ok=True)


# A placeholder until build_ext is prepared: it makes the wheel platform-specific and has
# setuptools run build_ext at all, which then replaces it with mypyc's extensions.
placeholder = [] if PURE else [Extension(f"{GROUP}__mypyc", sources=[])]

setup(ext_modules=placeholder, cmdclass={} if PURE else {"build_ext": BuildNative})
