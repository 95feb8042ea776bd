"""A script run from the folder that holds a clone named ``seqstate``: Python imports the
clone's root (no ``__init__.py``) as an empty namespace package instead of the package inside
it, and the first name imported from it failed with ``cannot import name 'PrefillSnapshot'
from 'seqstate' (unknown location)``. ``import projector`` now names the folder and the cause.
Reproduced in a temporary folder, by running a script there as a user would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from log_text import plain_lines

SCRIPT = "from projector import RegistryView\nprint(RegistryView.__name__)\n"


def run_script(folder: Path) -> subprocess.CompletedProcess[str]:
    (folder / "route.py").write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, "route.py"], cwd=folder, capture_output=True, text=True, timeout=60
    )


def test_a_clone_named_seqstate_beside_the_script_is_named_as_the_cause(tmp_path: Path) -> None:
    # Named otherwise, the same clone hides nothing: the script imports.
    clone = tmp_path / "seqstate-src"
    (clone / "seqstate").mkdir(parents=True)
    (clone / "seqstate" / "__init__.py").write_text("")  # the package, inside the clone
    (clone / "pyproject.toml").write_text("")
    out = run_script(tmp_path)
    assert (out.returncode, out.stdout) == (0, "RegistryView\n"), out.stderr
    clone = clone.rename(tmp_path / "seqstate")
    out = run_script(tmp_path)
    assert out.returncode == 1 and out.stdout == ""
    assert plain_lines(out.stderr)[-1] == (
        f"ImportError: 'import seqstate' finds the folder {clone} (a clone of the repository, "
        "named after its package), not the package inside it: Python imports a folder without "
        "__init__.py as an empty namespace package. Run the script from another folder, or "
        "rename the clone"
    ), out.stderr
