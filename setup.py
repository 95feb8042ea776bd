"""Build the hot modules of the core with mypyc (compiled C extensions of the same Python).

The fold runs ~30-40% faster compiled (see BENCHMARKS.md). The sources stay the reference:
``SEQSTATE_PURE=1`` builds without compiling, and nothing in them depends on being compiled.
Modules that define msgspec Structs (events, deltas, loads, topology, snapshot) stay
interpreted: mypyc does not keep a Struct's class options.
"""

from __future__ import annotations

import os

from setuptools import setup

NATIVE = [
    "seqstate/blocks.py",
    "seqstate/decay.py",
    "seqstate/prefill.py",
    "seqstate/recent.py",
    "seqstate/registry.py",
    "seqstate/request_index.py",
    "seqstate/sequences.py",
    "seqstate/state.py",
]

ext_modules = []
if os.environ.get("SEQSTATE_PURE") != "1":
    from mypyc.build import mypycify

    # The shared runtime library goes inside the package (seqstate/_native__mypyc...so).
    ext_modules = mypycify(NATIVE, opt_level="3", group_name="seqstate._native")

setup(ext_modules=ext_modules)
