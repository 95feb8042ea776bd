"""Fault tests: a real nats-server per module, the writer and projector as real
processes killed with SIGKILL at random points, restarted, and compared with an uninterrupted run.

The server fixtures (``nats_server``, ``nc``) come from ``tests/conftest.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# ``read_log`` (the log as the writer saw it, at nanosecond log times) lives with the
# integration tests; share it rather than copy it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))
