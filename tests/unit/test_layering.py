"""The import contracts that ``make lint`` enforces (pyproject.toml, import-linter) hold, and
each one fails when its rule is broken: a contract that nothing can break checks nothing.

Each case copies the two packages beside pyproject.toml, adds one forbidden import, and runs
``lint-imports`` on the copy.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).parent / "lint-imports"
LAYERS = "projector's wings are layered"
INDEPENDENT = "write, bucket and route are independent of each other"
NO_NATS = "settings, wire names and asyncio helpers speak no NATS"
CORE = "the core is pure: no projector, no NATS, no asyncio"
NO_CONFIG = "the consumers take only the settings they read: no Config"


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT), "--no-cache"],  # the pyproject.toml in cwd
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for package in ("projector", "seqstate"):
        shutil.copytree(
            ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("*.so", "__pycache__")
        )
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_tree_keeps_every_contract(tree: Path) -> None:
    done = lint(tree)
    assert done.returncode == 0, done.stdout
    assert "5 kept, 0 broken" in done.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("projector/wire/values.py", "import projector.aio.tasks", [LAYERS]),
        ("projector/nats/lag.py", "import projector.write.delta_log", [LAYERS, INDEPENDENT]),
        ("projector/run/pipeline.py", "import projector.ops.status", [LAYERS]),
        ("projector/bucket/projection.py", "import projector.write.delta_log", [INDEPENDENT]),
        ("projector/route/publisher.py", "import projector.bucket.reader", [INDEPENDENT]),
        ("projector/write/writer.py", "import projector.route.outcomes", [INDEPENDENT]),
        ("projector/write/writer.py", "import projector.dynamo.forward", [LAYERS]),
        ("projector/dynamo/resync.py", "import projector.run.assemble", [LAYERS]),
        ("projector/dynamo/follow.py", "import projector.ops.replay", [LAYERS]),
        ("projector/control/workers.py", "import projector.ops.cli", [LAYERS]),
        ("projector/nats/stream.py", "import projector.bucket.contents", [LAYERS]),
        ("projector/settings/config.py", "import nats.errors", [NO_NATS]),
        ("projector/aio/tasks.py", "from nats.aio.client import Client", [NO_NATS]),
        ("seqstate/blocks.py", "import asyncio", [CORE]),
        ("seqstate/state.py", "import nats.errors", [CORE]),
        ("seqstate/events.py", "import projector.wire.values", [CORE]),
        ("projector/write/writer.py", "import projector.settings.config", [NO_CONFIG]),
        (
            "projector/write/delta_log.py",
            "from projector.settings.config import Config",
            [NO_CONFIG],
        ),
        ("projector/bucket/projection.py", "import projector.settings.config", [NO_CONFIG]),
        ("projector/bucket/image.py", "from projector.settings import config", [NO_CONFIG]),
    ],
)
def test_a_broken_rule_fails_its_contract(
    tree: Path, module: str, line: str, broken: list[str]
) -> None:
    path = tree / module
    source = path.read_text()
    head, sep, rest = source.partition("from __future__ import annotations\n")
    path.write_text(head + sep + line + "\n" + rest)
    done = lint(tree)
    assert done.returncode != 0
    for contract in broken:
        assert f"{contract} BROKEN" in done.stdout, done.stdout
    if CORE not in broken:
        assert f"{CORE} KEPT" in done.stdout, done.stdout
