"""Slot-tracker names: each (model_name, routing_group) of Dynamo's API is one namespace.

A namespace is one token of a NATS subject and of a KV key, so it may hold only letters,
digits, ``-`` and ``_``; a model name holds anything (``meta-llama/Llama-3.1-8B``, ``Qwen.2``,
any UTF-8). The mapping keeps ASCII letters and digits as they are, so a namespace still reads
as its model, and writes every other byte of the UTF-8 text as ``_`` and two upper-case hex
digits (``-`` is ``_2D``, ``/`` is ``_2F``, ``_`` itself is ``_5F``). That frees ``-`` to join
the two names, and makes the mapping one-to-one: ``tracker_of(namespace_for(m, g)) == (m, g)``
for every pair, and no two pairs share a namespace.

    namespace_for("meta-llama/Llama-3.1-8B", "default")
    == "st-meta_2Dllama_2FLlama_2D3_2E1_2D8B-default"

The ``st-`` prefix keeps a drop-in's namespaces apart from a router's own. A deployment other
than ``default`` (``serve-http --namespace``) adds itself as a third token, so two deployments
sharing one NATS server (staging and production, say) each keep their own tracker of one
model: ``namespace_for("Qwen", "default", "staging") == "st-Qwen-default-staging"``.
"""

from __future__ import annotations

import functools
import re
from typing import Final

from seqstate.errors import SeqstateError

PREFIX: Final = "st-"
_KEPT = re.compile(rb"[A-Za-z0-9]")
_TOKEN = r"((?:[A-Za-z0-9]|_[0-9A-F]{2})*)"
_NAMESPACE = re.compile(rf"^st-{_TOKEN}-{_TOKEN}(?:-{_TOKEN})?$")


class NotATrackerNamespace(SeqstateError, ValueError):
    """A namespace that :func:`namespace_for` did not make."""


def _encode(name: str) -> str:
    out = []
    for byte in name.encode("utf-8"):
        char = bytes((byte,))
        out.append(char.decode() if _KEPT.match(char) else f"_{byte:02X}")
    return "".join(out)


def _decode(token: str) -> str:
    raw = bytearray()
    i = 0
    while i < len(token):
        if token[i] == "_":
            raw.append(int(token[i + 1 : i + 3], 16))
            i += 3
        else:
            raw += token[i].encode()
            i += 1
    return raw.decode("utf-8")


@functools.lru_cache(maxsize=4096)  # asked once per call: a server sees few distinct names
def namespace_for(
    model_name: str, routing_group: str = "default", deployment: str = "default"
) -> str:
    """The namespace of one slot tracker of a deployment."""
    own = "" if deployment == "default" else f"-{_encode(deployment)}"
    return f"{PREFIX}{_encode(model_name)}-{_encode(routing_group)}{own}"


def tracker_of(namespace: str, deployment: str = "default") -> tuple[str, str]:
    """``(model_name, routing_group)`` of a namespace :func:`namespace_for` made for
    ``deployment`` (another deployment's is refused too)."""
    match = _NAMESPACE.match(namespace)
    if match is None:
        raise NotATrackerNamespace(f"{namespace!r} is not a slot tracker's namespace")
    try:
        model, group = _decode(match.group(1)), _decode(match.group(2))
        owner = "default" if match.group(3) is None else _decode(match.group(3))
    except UnicodeDecodeError:
        raise NotATrackerNamespace(f"{namespace!r} does not decode to UTF-8 names") from None
    if owner != deployment:
        raise NotATrackerNamespace(f"{namespace!r} is deployment {owner!r}'s, not {deployment!r}")
    return model, group
