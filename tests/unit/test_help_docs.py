"""``help()`` documents the public API in the compiled build as in the pure one.

mypyc compiles a docstring into nothing but the text signature; setup.py writes the sources'
docstrings back into the generated C. Each documented name's ``pydoc`` page must show the first
line of its docstring as written in the source (read from the source, not from ``__doc__``,
which is what is under test). Meaningful in the compiled pass of ``make test``; the pure pass
runs the same check against the sources.
"""

from __future__ import annotations

import ast
import importlib
import os
import pydoc
from pathlib import Path

import seqstate
from projector import RegistryView

ROOT = Path(__file__).resolve().parents[2]

DOCUMENTED = [
    "seqstate.registry.PromptRegistry",
    "seqstate.registry.PromptRegistry.apply",
    "seqstate.registry.PromptRegistry.loads",
    "seqstate.registry.PromptRegistry.potential_loads",
    "seqstate.registry.PromptRegistry.overlap_depths",
    "seqstate.state.SequenceState",
    "seqstate.loads.LoadRow",
    "seqstate.loads.PotentialLoadRow",
    "projector.bucket.reader.RegistryView",
    *(
        f"projector.bucket.reader.RegistryView.{name}"
        for name in (
            "start",
            "stop",
            "loads",
            "potential_loads",
            "overlap_depths",
            "rank_of",
            "wait_for",
            "log_now_ns",
            "receive",
            "export_metrics",
            "on_change",
            "remove_listener",
            "changes",
        )
    ),
    "projector.route.publisher.RouterPublisher.add",
]


def source_doc(dotted: str) -> tuple[object, str]:
    """The object named ``module.Class[.method]`` and its docstring's first line in the source."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
            break
        except ImportError:
            continue
    names = parts[cut:]
    obj: object = module
    for name in names:
        obj = getattr(obj, name)
    path = ROOT.joinpath(*parts[:cut]).with_suffix(".py")
    body: list[ast.stmt] = ast.parse(path.read_text(encoding="utf-8")).body
    doc = None
    for name in names:
        node = next(
            n
            for n in body
            if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name == name
        )
        doc = ast.get_docstring(node)
        body = node.body
    assert doc, f"{dotted} has no docstring in its source"
    return obj, doc.splitlines()[0]


def test_help_shows_each_public_docstring_in_the_build_under_test() -> None:
    compiled = str(seqstate.registry.__file__).endswith(".so")
    built = any((ROOT / "seqstate").glob("registry.*.so"))
    assert compiled == (built and os.environ.get("SEQSTATE_PURE") != "1")
    bare = []
    for dotted in DOCUMENTED:
        obj, first_line = source_doc(dotted)
        if first_line not in pydoc.render_doc(obj, renderer=pydoc.plaintext):
            bare.append(dotted)
    assert bare == []


def test_help_of_the_view_names_what_a_scheduler_reads() -> None:
    page = pydoc.render_doc(RegistryView, renderer=pydoc.plaintext)
    for attribute in ("unreadable", "bad_values", "block_size", "applied_seq"):
        assert f"``{attribute}``" in page, attribute
    assert "ranks whose load value in the bucket" in page
