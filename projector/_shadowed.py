"""A clone of the repository named ``seqstate`` beside a script hides the core from it.

The repository's root holds the ``seqstate/`` package but no ``__init__.py`` of its own. Run a
script from the folder that holds the clone, and ``import seqstate`` finds the clone's root
first on ``sys.path``: Python takes a folder without ``__init__.py`` for a namespace package
(it would still prefer a regular package later on the path, but an editable install is found
by a hook that comes after the path search), so the import "succeeds" with an empty module and
the first ``from seqstate import ...`` fails with ``cannot import name ... (unknown
location)``, which names neither the folder nor the cause. ``projector`` imports the core in
every wing; this check, run once when ``projector`` is imported, says what happened instead.
"""

from __future__ import annotations

import importlib.util


def refuse_a_shadowed_core() -> None:
    """Raise ImportError naming the folder if ``seqstate`` would import as a clone's root.

    ``projector`` calls it only when the first entry of ``sys.path`` (the script's folder, or
    the current one) holds ``seqstate/seqstate/``; whether that folder shadows the core is
    the import system's answer, not a guess: an installed regular package would win."""
    spec = importlib.util.find_spec("seqstate")
    if spec is None or spec.origin is not None or not spec.submodule_search_locations:
        return  # a regular package (installed, or the clone's own) is what imports
    where = ", ".join(spec.submodule_search_locations)
    raise ImportError(
        f"'import seqstate' finds the folder {where} (a clone of the repository, named after "
        "its package), not the package inside it: Python imports a folder without "
        "__init__.py as an empty namespace package. Run the script from another folder, or "
        "rename the clone",
        name="seqstate",
        path=where,
    )
