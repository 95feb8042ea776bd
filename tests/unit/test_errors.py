"""Every error the project raises on purpose falls under one root, SeqstateError.

That is what lets the CLI print any of them as one line with one ``isinstance`` (as nats.py
does with ``nats.errors.Error``): an error class outside the root would end in a traceback.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import projector
import seqstate
from seqstate import SeqstateError

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

MODULES = sorted(
    info.name
    for package in (seqstate, projector)
    for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
    if not info.ispkg and not info.name.endswith(".__main__")
)


def _errors() -> list[type[BaseException]]:
    found = []
    for name in MODULES:
        module = importlib.import_module(name)
        for _, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, BaseException) and value.__module__ == name:
                found.append(value)
    return found


@pytest.mark.parametrize("error", _errors(), ids=lambda e: f"{e.__module__}.{e.__qualname__}")
def test_every_error_of_the_project_is_a_seqstate_error(error: type[BaseException]) -> None:
    assert issubclass(error, SeqstateError)


def test_the_errors_are_found() -> None:
    names = {e.__name__ for e in _errors()}
    assert {
        "EventDecodeError",
        "ConfigError",
        "ReplayError",
        "PublishError",
        "LeaseLost",
        "WriterStalled",
        "DeltaGap",
        "ConnectError",
        "NatsServerError",
    } <= names


def test_no_two_errors_share_a_name() -> None:
    """A name means one error: ``except WorkerNotFound`` must not depend on which was imported."""
    homes: dict[str, list[str]] = {}
    for error in _errors():
        homes.setdefault(error.__name__, []).append(error.__module__)
    assert {name: where for name, where in homes.items() if len(where) > 1} == {}
