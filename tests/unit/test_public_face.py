"""What users import: ``projector``'s public names, listed once, and nothing of 0.1's paths."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import projector


def test_every_public_name_imports_from_projector() -> None:
    for name in projector.__all__:
        value = getattr(projector, name)
        assert value is not None, name
        if hasattr(value, "__module__") and value.__module__.startswith("projector."):
            home = importlib.import_module(value.__module__)
            assert getattr(home, name) is value


def test_the_readme_names_are_public() -> None:
    from projector import Config, PublishError, RegistryView, RouterPublisher, SeqstateError

    assert issubclass(PublishError, SeqstateError)
    assert RouterPublisher.__module__ == "projector.route.publisher"
    assert RegistryView.__module__ == "projector.bucket.reader"
    assert Config.__module__ == "projector.settings.config"


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        _ = projector.Nothing  # type: ignore[attr-defined]


# The module paths of 0.1, before projector/ was split into wings: never released.
OLD_PATHS = ("publisher", "reader", "config", "cli", "stream", "writer", "projection")


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_old_module_path_is_gone(old: str) -> None:
    sys.modules.pop(f"projector.{old}", None)
    with pytest.raises(ModuleNotFoundError, match=rf"No module named 'projector\.{old}'"):
        importlib.import_module(f"projector.{old}")


def test_the_public_names_are_listed_once() -> None:
    """``__all__`` is the ``TYPE_CHECKING`` block's names: one list, each name where it lives."""
    source = Path(projector.__file__).read_text()
    assert "__all__ =" not in source and "_EXPORTS" not in source
    block = next(
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    listed = [alias.name for node in block.body for alias in node.names]  # type: ignore[attr-defined]
    assert sorted(listed) == projector.__all__ == sorted(set(listed))
    assert len(listed) == 25
    assert set(projector.__all__) <= set(dir(projector))
    code = "from projector import *; print(sorted(k for k in dir() if not k.startswith('_')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(projector.__all__)


def test_importing_projector_imports_no_wing() -> None:
    """The CLI and the replay reader's child import ``projector`` first: it must stay cheap."""
    code = (
        "import sys, projector; print(sorted(m for m in sys.modules if m.startswith('projector.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_new_paths_do_not_warn() -> None:
    code = (
        "import warnings; warnings.simplefilter('error'); "
        "from projector import RouterPublisher, RegistryView, Config; "
        "import projector.route.publisher, projector.ops.cli"
    )
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.import_module("projector.bucket.reader")
