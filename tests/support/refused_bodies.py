"""The bodies Dynamo's slot tracker refuses, with its status and text, byte for byte.

Every case was sent to the 1.6.1 wheel (``python -m dynamo.slot_tracker``), and its status
and text are the wheel's answer, copied verbatim (refused_values, refused_syntax). What the
slot-tracker suites (tests/unit/test_serde_errors_*.py) share.
"""

from __future__ import annotations

from collections.abc import Sequence

from refused_syntax import SYNTAX_CASES
from refused_values import VALUE_CASES

PREFIX = {
    400: "Failed to parse the request body as JSON: ",
    422: "Failed to deserialize the JSON body into the target type: ",
}

# (what, route, body, status, the text after the status's prefix)
CASES: list[tuple[str, str, bytes, int, str]] = [*VALUE_CASES, *SYNTAX_CASES]


def _ids(cases: Sequence[tuple[object, ...]]) -> list[str]:
    return [f"{case[1]} {case[0]}" for case in cases]
