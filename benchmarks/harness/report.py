"""The head of every report: what machine, what checkout, what load a figure was measured on.

A figure is only worth recording with its conditions (two shared cores under another job's
load halve a throughput), so every script puts :func:`machine` first in its report.
"""

from __future__ import annotations

import datetime as dt
import gc
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, Final

import msgspec

import seqstate.state

REPO_ROOT: Final = Path(__file__).resolve().parents[2]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_revision() -> str:
    """The commit, and the product files changed on top of it: a figure of uncommitted code
    says so."""
    try:
        rev = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--", "seqstate", "projector"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    changed = sorted({line[3:] for line in dirty if line.strip()})
    return f"{rev}{' + uncommitted: ' + ', '.join(changed) if changed else ''}"


def source_digest() -> str:
    """sha256 of seqstate/*.py: identifies the measured core even when it is uncommitted."""
    digest = hashlib.sha256()
    for path in sorted((REPO_ROOT / "seqstate").glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def core_build() -> str:
    """Compiled or pure core: the two differ several-fold, so a figure names which it had."""
    path = Path(seqstate.state.__file__ or "")
    kind = "compiled (mypyc)" if path.suffix == ".so" else "pure Python"
    return f"{kind}: {path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}"


def nats_server_version(binary: str) -> str:
    try:
        return subprocess.run(
            [binary, "--version"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine(**extra: Any) -> dict[str, Any]:
    """The conditions of this run, taken at its start (the load is the 1-minute average)."""
    return {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
        "cwd": os.getcwd(),
        "platform": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "nats_py": metadata.version("nats-py"),
        "msgspec": msgspec.__version__,
        "cpu": cpu_model(),
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_count": os.cpu_count(),
        "gc_enabled": gc.isenabled(),
        "loadavg_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "git": git_revision(),
        "seqstate_sha256": source_digest(),
        "core": core_build(),
        **extra,
    }


MEETS_MISSES: Final = ("MEETS", "MISSES")
PASS_FAIL: Final = ("PASS", "FAIL")


def machine_line() -> str:
    """The machine in one line, for the short reports that print no :func:`machine` head."""
    return f"{cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def verdict(ok: bool, words: tuple[str, str] = MEETS_MISSES) -> str:
    """A target's verdict, in the words of the report that states it."""
    return words[0] if ok else words[1]


def fmt_rates(values: Any) -> str:
    return ", ".join(f"{v:,.0f}" for v in values)


def head_line(title: str, m: dict[str, Any]) -> str:
    """A short report's first line: its title, then when, at which commit and how loaded."""
    return (
        f"{title}, {m['date_utc']}, git {m['git']}, nproc {m['nproc']}, "
        f"load {m['loadavg_1m_at_start']:.2f}"
    )


def print_head(title: str, m: dict[str, Any]) -> None:
    """The first lines of a printed report: its title, then when, how and on what it ran."""
    print(title)
    print(f"  date (UTC) : {m['date_utc']}")
    print(f"  command    : {m['command']}  (cwd {m['cwd']})")
    print(
        f"  machine    : {m['platform']}; {m['cpu']}; nproc {m['nproc']}; "
        f"load avg (1 min) at start {m['loadavg_1m_at_start']}"
    )


def print_software(m: dict[str, Any], nats_server: str, core_note: str = "") -> None:
    """The software lines of a report that ran against a nats-server."""
    print(
        f"  software   : {m['python']}; nats-py {m['nats_py']}; nats-server "
        f"{nats_server}; msgspec {m['msgspec']}"
    )
    print(f"  seqstate   : git {m['git']}; core {m['core']}{core_note}")


def emit(
    report: dict[str, Any],
    as_json: bool,
    printer: Callable[..., None],
    *args: Any,
    indent: int | None = 2,
) -> None:
    """``--json``: the report as one JSON document on stdout; else ``printer(report, *args)``,
    the script's own text."""
    if as_json:
        print(json.dumps(report, indent=indent))
    else:
        printer(report, *args)


def print_fields(report: dict[str, Any], width: int = 0) -> None:
    """A flat report, a ``key: value`` line each, keys right-aligned to ``width``."""
    for key, value in report.items():
        print(f"{key:>{width}}: {value}")


def write_json(path: Path | str | None, report: Any) -> None:
    """Write ``report`` to ``path`` (``-``: stdout), indented; nothing when ``path`` is None."""
    if path is None:
        return
    text = json.dumps(report, indent=2, default=str) + "\n"
    if str(path) == "-":
        sys.stdout.write(text)
    else:
        Path(path).write_text(text)
