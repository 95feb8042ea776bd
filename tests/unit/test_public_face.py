"""What users import: ``projector``'s public names, and the 0.1 module paths kept for a release."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import projector
from projector._moved import MOVED


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
    assert RegistryView.__module__ == "projector.read.reader"
    assert Config.__module__ == "projector.wire.config"


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        _ = projector.Nothing  # type: ignore[attr-defined]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_new_module_with_a_warning(old: str) -> None:
    new = importlib.import_module(f"projector.{MOVED[old]}.{old}")
    sys.modules.pop(f"projector.{old}", None)
    with pytest.warns(DeprecationWarning, match=rf"projector\.{old} moved to {new.__name__}"):
        aliased = importlib.import_module(f"projector.{old}")
    assert aliased is new


def test_every_module_of_a_wing_is_in_the_table_or_new() -> None:
    """The table names real modules only: an alias to nothing would fail at import."""
    for old, wing in MOVED.items():
        assert importlib.util.find_spec(f"projector.{wing}.{old}") is not None, old


def test_importing_projector_imports_no_wing() -> None:
    """The CLI and the replay reader's child import ``projector`` first: it must stay cheap."""
    code = (
        "import sys, projector; print(sorted(m for m in sys.modules if m.startswith('projector.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['projector._moved']"


def test_the_new_paths_do_not_warn() -> None:
    code = (
        "import warnings; warnings.simplefilter('error'); "
        "from projector import RouterPublisher, RegistryView, Config; "
        "import projector.route.publisher, projector.ops.cli"
    )
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.import_module("projector.read.reader")
