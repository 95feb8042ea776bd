"""What the command line's suites (tests/integration/test_cli_*.py) share: the one line a
refused command says, and ``seqstate run`` started in the background and stopped."""

from __future__ import annotations

import subprocess
from pathlib import Path

from log_text import plain_lines
from pipeline_kit import spawned_run


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = plain_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("seqstate: error: ")
    return lines[0]


def started_run(store: Path, *args: str) -> tuple[subprocess.Popen[str], list[str]]:
    """``seqstate run`` in the background, once it says its pipeline runs; its log so far."""
    return spawned_run(store, *args)


def stopped(proc: subprocess.Popen[str]) -> str:
    proc.terminate()
    _, rest = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    return rest
