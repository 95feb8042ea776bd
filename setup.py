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

mypyc compiles a docstring into nothing but the text signature, so ``help()`` of a compiled
class or method (``PromptRegistry.potential_loads``) showed a bare signature.
:func:`_restore_docstrings` writes each docstring of the sources after that signature in the
generated C, where CPython reads ``__doc__`` from: the compiled build documents itself as the
pure one does, at no cost per call. (A method descriptor's ``__doc__`` cannot be set at import,
and ``help()`` never reads a ``.pyi`` stub.)
"""

from __future__ import annotations

import ast
import os
import re
import sys
import textwrap
from functools import cache
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = [
    "seqstate/batches.py",
    "seqstate/blocks.py",
    "seqstate/decay.py",
    "seqstate/fold.py",
    "seqstate/departures.py",
    "seqstate/invariants.py",
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

        extensions = tuple(mypycify(NATIVE, opt_level="3", group_name=GROUP))
        _restore_docstrings(extensions)
        return extensions
    except (Exception, SystemExit) as error:  # mypyc reports type errors with sys.exit
        if REQUIRE_COMPILED:
            raise
        _fall_back("mypyc", error)
        return ()


def _docstrings() -> dict[str, tuple[str, str]]:
    """The docstrings of the compiled modules' functions, classes and methods, keyed by the
    name mypyc gives each in C (``registry___PromptRegistry___loads``), with what it is."""
    docs: dict[str, tuple[str, str]] = {}
    for path in NATIVE:
        module = Path(path).stem
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                if doc:
                    docs[f"{module}___{node.name}"] = (kind, doc)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    doc = ast.get_docstring(item) if isinstance(item, ast.FunctionDef) else None
                    if doc:
                        docs[f"{module}___{node.name}___{item.name}"] = ("function", doc)
    return docs


def _c_text(text: str) -> str:
    """``text`` inside a C string literal: UTF-8, anything but plain ASCII as octal escapes
    (``?`` too: no trigraph)."""
    out = []
    for byte in text.encode("utf-8"):
        char = chr(byte)
        if char == "\n":
            out.append("\\n")
        elif 0x20 <= byte < 0x7F and char not in '"\\?':
            out.append(char)
        else:
            out.append(f"\\{byte:03o}")
    return "".join(out)


_SIGNATURE = r'PyDoc_STR\("(?:[^"\\]|\\.)*?\\n--\\n\\n'  # mypyc's doc: the text signature


def _restore_docstrings(extensions: tuple[Extension, ...]) -> None:
    """Write the sources' docstrings into mypyc's generated C, after each text signature.

    A method's doc is in its ``PyMethodDef`` (after ``(PyCFunction)CPyPy_<name>,``), a
    class's in its type template's ``tp_doc``. A name not found keeps the bare signature."""
    docs = _docstrings()
    for extension in extensions:
        for source in extension.sources:
            path = Path(source)
            if path.suffix != ".c" or not path.is_file():
                continue
            text = original = path.read_text(encoding="utf-8")
            for name, (kind, doc) in docs.items():
                where = re.escape(name)
                if kind == "class":
                    head = rf"CPyType_{where}_template_ = \{{[^}}]*?\.tp_doc = {_SIGNATURE}"
                else:
                    head = rf"\(PyCFunction\)CPyPy_{where},\s*[A-Z_ |]+,\s*{_SIGNATURE}"
                escaped = _c_text(doc)  # a function: re.sub would read escapes in a string
                text = re.sub(f'({head})(?="\\))', lambda m, e=escaped: m.group(1) + e, text)
            if text != original:
                path.write_text(text, encoding="utf-8")


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
