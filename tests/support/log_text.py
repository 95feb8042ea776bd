"""What a person reads in a ``seqstate`` process's stderr, whichever format it was written in.

Piped, as in these tests, the CLI writes JSON records (``--log-format auto``), the default a
user gets; tests that check what a line *says* read it through :func:`plain_lines`, so they
run the default path and still compare words. A JSON record reads as the console would show
it (``seqstate: error: ...`` for the final error, ``LEVEL logger: msg`` otherwise); any other
line (argparse's usage errors, a child's own line) is kept as written.
"""

from __future__ import annotations

import json
import subprocess


def plain(line: str) -> str:
    if not line.startswith("{"):
        return line
    record = json.loads(line)
    level, logger, msg = record["level"], record["logger"], record["msg"]
    if logger == "seqstate" and level == "error":
        return f"seqstate: error: {msg}"
    return f"{level.upper()} {logger}: {msg}"


def plain_lines(text: str) -> list[str]:
    """The non-blank lines of ``text``, each as :func:`plain` reads it."""
    return [plain(line) for line in text.splitlines() if line.strip()]


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused command says (exit 1, nothing on stdout), as a person reads it."""
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = plain_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    return lines[0]
