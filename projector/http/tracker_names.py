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

A namespace is bounded: at most ``MAX_NAMESPACE_BYTES`` (2,048). It is one token of every
subject and KV key of its tracker, and NATS reads a whole protocol line (``HPUB <subject>
<reply> <sizes>``) into at most its ``max_control_line``, 4,096 bytes by default: a longer line
ends the connection ("maximum control line exceeded"). Half of it is the namespace's; the
other half holds the rest of the longest line a namespace goes into (a direct get of a KV key:
``$JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<namespace>.req.<worker>.<rank>.<slot>``, the
bucket's name twice, a reply inbox, the sizes) with room to spare. Names that make a longer
one are :class:`TrackerNameTooLong` before anything reaches NATS.

The ``st-`` prefix keeps a drop-in's namespaces apart from a router's own. A deployment other
than ``default`` (``serve-http --namespace``) adds itself as a third token, so two deployments
sharing one NATS server (staging and production, say) each keep their own tracker of one
model: ``namespace_for("Qwen", "default", "staging") == "st-Qwen-default-staging"``.
"""

from __future__ import annotations

import functools
import re
from typing import Final

from projector.settings.checks import MAX_NAMESPACE_BYTES
from seqstate.errors import SeqstateError

PREFIX: Final = "st-"
_KEPT = re.compile(rb"[A-Za-z0-9]")
_ALNUM = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_TOKEN = r"((?:[A-Za-z0-9]|_[0-9A-F]{2})*)"
_NAMESPACE = re.compile(rf"^st-{_TOKEN}-{_TOKEN}(?:-{_TOKEN})?$")


class NotATrackerNamespace(SeqstateError, ValueError):
    """A namespace that :func:`namespace_for` did not make."""


class TrackerNameTooLong(SeqstateError, ValueError):
    """A model_name and routing_group whose namespace would be over ``MAX_NAMESPACE_BYTES``."""


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
    """The namespace of one slot tracker of a deployment, or :class:`TrackerNameTooLong`."""
    own = "" if deployment == "default" else f"-{_encode(deployment)}"
    size = len(PREFIX) + _encoded_size(model_name) + 1 + _encoded_size(routing_group) + len(own)
    if size > MAX_NAMESPACE_BYTES:  # measured, not encoded: a name may be 2 MiB long
        raise TrackerNameTooLong(
            f"model_name and routing_group too long: their tracker's namespace, a token of "
            f"NATS subjects and KV keys, would take {size:,} bytes, over the limit of "
            f"{MAX_NAMESPACE_BYTES:,} (an ASCII letter or digit takes 1 byte, any other byte "
            "of the UTF-8 names 3)"
        )
    return f"{PREFIX}{_encode(model_name)}-{_encode(routing_group)}{own}"


def _encoded_size(name: str) -> int:
    raw = name.encode("utf-8")
    return len(raw) + 2 * len(raw.translate(None, _ALNUM))  # each other byte is _XX


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
