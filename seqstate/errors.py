"""The root of every error seqstate raises, core and pipeline alike.

One root, as nats.py has ``nats.errors.Error``: a caller (the CLI first of all) tells "an
error this project raises on purpose, with a message meant for a person" from a bug with one
``isinstance``. Each concrete error also keeps the builtin base its callers may already catch
(``ValueError`` for bad input, ``RuntimeError`` for a failed operation).
"""

from __future__ import annotations


class SeqstateError(Exception):
    """Any error seqstate raises on purpose; its message is one line for a person."""
