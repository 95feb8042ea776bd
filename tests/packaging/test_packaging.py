"""The package installs with pip from a checkout and from its sdist, compiled or not.

Every other test imports the core from the source tree, so none of them notices a package
that cannot be built, an sdist that lacks a source, or a wheel that ships without its
compiled modules (``pip install .`` once failed because mypyc type-checked the core
without msgspec). These tests do what a user does: build with the PEP 517 front ends in
isolated build environments, install into a clean virtualenv (runtime dependencies from the
index or pip's cache), and run the installed ``seqstate`` and a fold from outside the
checkout, so only the installed package can be imported.

One ``python -m build`` makes the sdist and then the wheel from that sdist (what
``pip install seqstate-*.tar.gz`` does), compiled when a C compiler is present. A second
build, from a checkout with no usable compiler (``CC=/nonexistent``), must still install,
pure. The tests build their own core in a venv of their own, so they do not depend on which
in-tree build the suite loads: they run in the compiled pass of ``make test`` only.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("seqstate", "projector")
# The modules setup.py compiles, and mypyc's shared runtime library for them.
COMPILED = {
    "_native__mypyc",
    "batches",
    "blocks",
    "decay",
    "departures",
    "fold",
    "invariants",
    "prefill",
    "publishers",
    "recent",
    "registry",
    "request_index",
    "sequences",
    "state",
}
# A guard against a hung pip, far above the time any step takes: not a speed requirement.
HANG_S = 1800

pytestmark = pytest.mark.skipif(
    os.environ.get("SEQSTATE_PURE") == "1",
    reason="builds and installs its own core in a clean venv: runs once, in the compiled pass",
)

# Two requests on two ranks of worker 3, read 400 ms after both were added: the modeled
# prefill (1200 tokens in 800 ms) is half done, the unmodeled one (300 tokens) is not.
FOLD = """
import json, msgspec, seqstate, seqstate.state
state = seqstate.SequenceState()
state.apply(seqstate.AddRequest(request_id="r1", worker_id=3, block_hashes=[11, 12, 13],
                                prefill_tokens=1200, expected_prefill_ms=800.0), 1_000_000_000)
state.apply(seqstate.AddRequest(request_id="r2", worker_id=3, dp_rank=1, block_hashes=[11, 12],
                                prefill_tokens=300), 1_000_000_000)
rows = state.registry.loads(1_400_000_000)
print(json.dumps({"core": seqstate.state.__file__, "loads": msgspec.to_builtins(rows)}))
"""
EXPECTED_LOADS = [
    {
        "worker_id": 3,
        "dp_rank": 0,
        "active_blocks": 3,
        "active_prefill_tokens": 600,
        "active_requests": 1,
        "modeled_remaining_prefill_ms": 400,
    },
    {
        "worker_id": 3,
        "dp_rank": 1,
        "active_blocks": 2,
        "active_prefill_tokens": 300,
        "active_requests": 1,
        "modeled_remaining_prefill_ms": None,
    },
]


def has_c_compiler() -> bool:
    """Whether setuptools can compile an extension here: the compiler and Python.h."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    compiler = shutil.which(shlex.split(cc)[0])
    headers = Path(sysconfig.get_paths()["include"], "Python.h")
    return compiler is not None and headers.is_file()


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without this checkout's venv or build settings in it."""
    drop = {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SEQSTATE_")}
    env.update(extra)
    return env


def run(args: list[str | Path], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(arg) for arg in args],
        cwd=cwd,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result


def checkout(into: Path) -> Path:
    """A copy of the checkout as a clean clone has it: no venv, build output or compiled core."""
    junk = shutil.ignore_patterns(
        ".git",
        ".venv",
        "venv",
        "build",
        "dist",
        "*.egg-info",
        "__pycache__",
        "*.so",
        ".native-built",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        ".hypothesis",
        ".seqstate",
        "*.prof",
    )
    return Path(shutil.copytree(REPO, into / "seqstate-src", ignore=junk))


# The pictures' page is package data: its script and style, and uPlot with its licence.
ASSETS = ("projector/ops/ui/*.js", "projector/ops/ui/*.css", "projector/ops/ui/uPlot.LICENSE")


def sources() -> set[str]:
    """Every module of each package, its wings included, and the page's assets, as the
    archives name them."""
    modules = {f for p in PACKAGES for f in (REPO / p).rglob("*.py")}
    assets = {f for pattern in ASSETS for f in REPO.glob(pattern)}
    return {f.relative_to(REPO).as_posix() for f in modules | assets}


@dataclass(frozen=True)
class Venv:
    root: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def pip_install(self, target: Path, cwd: Path, **env: str) -> str:
        """Install with this venv's own pip; its log, with the build backend's output."""
        result = run([self.bin / "python", "-m", "pip", "install", "-v", target], cwd, **env)
        return result.stdout + result.stderr

    def check_installed(self, cwd: Path) -> str:
        """Run the installed command and a fold; the file the core's state module came from."""
        help_ = run([self.bin / "seqstate", "--help"], cwd)
        assert help_.stdout.startswith("usage: seqstate")
        out = json.loads(run([self.bin / "python", "-c", FOLD], cwd).stdout)
        assert out["loads"] == EXPECTED_LOADS
        core = Path(out["core"])
        assert core.is_relative_to(self.root), f"{core} is not the installed package"
        return core.name


def make_venv(tmp_path: Path) -> Venv:
    root = tmp_path / "venv"
    run([sys.executable, "-m", "venv", root], tmp_path)
    return Venv(root)


@dataclass(frozen=True)
class Dists:
    sdist: Path
    wheel: Path


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    """An sdist of a clean checkout, and the wheel ``python -m build`` built from that sdist."""
    work = tmp_path_factory.mktemp("build")
    out = work / "dist"
    run([sys.executable, "-m", "build", "--outdir", out, checkout(work)], work)
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Dists(sdist, wheel)


def test_the_sdist_carries_every_source_and_nothing_else(dists: Dists) -> None:
    with tarfile.open(dists.sdist) as tar:
        files = {m.name.partition("/")[2] for m in tar.getmembers() if m.isfile()}
    assert {"setup.py", "pyproject.toml", "README.md", "PKG-INFO"} <= files
    assert {n for n in files if n.startswith(tuple(f"{p}/" for p in PACKAGES))} == sources()
    stray = {n for n in files if "/" in n and not n.startswith("seqstate.egg-info/")}
    assert stray <= sources(), f"not sources of the package: {sorted(stray - sources())}"


def test_the_wheel_from_the_sdist_installs_compiled(dists: Dists, tmp_path: Path) -> None:
    compiled = has_c_compiler()
    with zipfile.ZipFile(dists.wheel) as whl:
        names = set(whl.namelist())
    modules = {n for n in names if not n.startswith("seqstate-0.1.0.dist-info/")}
    shipped = {n for n in modules if not n.endswith(".so")}
    native = {n.split("/")[1].split(".")[0] for n in modules if n.endswith(".so")}
    assert shipped == sources()  # nothing missing, no junk
    assert native == (COMPILED if compiled else set())
    assert all(n.startswith("seqstate/") for n in modules - shipped)
    assert dists.wheel.name.endswith("-py3-none-any.whl") != compiled

    venv = make_venv(tmp_path)
    venv.pip_install(dists.wheel, tmp_path)
    core = venv.check_installed(tmp_path)
    assert core.endswith(".so" if compiled else ".py"), core


def test_a_checkout_without_a_c_compiler_installs_pure(tmp_path: Path) -> None:
    source = checkout(tmp_path)
    venv = make_venv(tmp_path)
    log = venv.pip_install(source, tmp_path, CC="/nonexistent")
    assert "seqstate: compiling the core failed" in log  # the fallback, not mypyc, made it pure
    assert venv.check_installed(tmp_path) == "state.py"
