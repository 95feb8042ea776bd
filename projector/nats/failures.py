"""What a failed NATS request says in a log line or an error: one place, so a full disk is named.

nats-py's JetStream errors carry their meaning in fields (``code``, ``err_code``,
``description``) and none in their arguments, so ``repr`` shows ``ServiceUnavailableError()``:
a server out of storage was logged that way, for as long as the writer retried, and never
named. :func:`describe` says what the server said, with its error code, and names the two
conditions an operator must act on: JetStream's storage (the server's or the account's) is
full, or a stream has reached a limit of its own.
"""

from __future__ import annotations

import nats.errors
import nats.js.errors

from seqstate.errors import SeqstateError

# JetStream's error codes for a write it cannot store. A limit of the stream's own ("maximum
# messages exceeded", bytes, messages per subject, with the discard policy new) comes as the
# generic "store failed"; the server's or the account's storage running out as one of the
# others (10023 is what a full max_file_store answers a publish with).
STREAM_LIMIT = 10077
NO_STORAGE = 10023  # insufficient resources
STORAGE_EXCEEDED = 10047  # insufficient storage resources available
MEMORY_EXCEEDED = 10028  # insufficient memory resources available
ACCOUNT_LIMITS = 10002  # resource limits exceeded for account
OUT_OF_STORAGE = frozenset({NO_STORAGE, STORAGE_EXCEEDED, MEMORY_EXCEEDED, ACCOUNT_LIMITS})


def storage_full(exc: BaseException) -> bool:
    """The server (or the account) has no JetStream storage left for this write."""
    return isinstance(exc, nats.js.errors.APIError) and exc.err_code in OUT_OF_STORAGE


def describe(exc: BaseException) -> str:
    """One line for a failed request: what the server said, a full disk or stream named."""
    if isinstance(exc, TimeoutError | nats.errors.TimeoutError):
        return "no answer in time"
    if isinstance(exc, nats.js.errors.APIError) and exc.err_code is not None:
        said = f"{exc.description} (JetStream error {exc.err_code})"
        if storage_full(exc):
            return f"JetStream storage is full: {said}"
        if exc.err_code == STREAM_LIMIT and "exceeded" in (exc.description or ""):
            return f"the stream is full: {said}"
        return said
    if isinstance(exc, SeqstateError):  # ours: its message is the whole sentence
        return str(exc) or type(exc).__name__
    if isinstance(exc, nats.js.errors.APIError):  # no JetStream error code: the status only
        return f"{type(exc).__name__} (status {exc.code}): {exc.description or 'no description'}"
    text = str(exc)
    name = type(exc).__name__
    return f"{name}: {text}" if text and text != name else name


def refusal(exc: BaseException) -> str:
    """Why a publish was not stored, in one bounded word (a metric's label): ``stream_full``
    (a limit of the stream's own), ``storage_full`` (the server's or the account's),
    ``no_answer`` (no ack in time), or ``other``."""
    if storage_full(exc):
        return "storage_full"
    if isinstance(exc, nats.js.errors.APIError) and exc.err_code == STREAM_LIMIT:
        return "stream_full"
    if isinstance(exc, TimeoutError | nats.errors.TimeoutError):
        return "no_answer"
    return "other"
