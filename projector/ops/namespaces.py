"""Which namespaces a server knows, so that a read of one it does not is said so, not answered
empty: a mistyped ``--namespace dynn`` printed an empty table "as of event 0" and exited 0.

A namespace is known where seqstate's resources carry it, as far as the command may read them:

- the registry bucket holds a key directly under it (``<ns>.lease``, ``<ns>.position``,
  ``<ns>.tracker``, ``<ns>.trimmed``): a projector, a ``rebuild`` or a tracker has written it
  (a lease released leaves its delete marker, so a pipeline that ever ran stays known). Every
  reader of the bucket, the scheduler's role included, may ask the bucket's stream which of
  those keys exist (stream info with a subject filter): one request, a few subjects a namespace;
- for a command that reads the log as well, the events stream is provisioned for it
  (``seqstate.events.<ns>.>`` among its subjects: a writer, ``run``, ``publish`` or ``worker
  add`` provisioned it, and no event of a namespace can be stored before that). The stream's
  configuration lists every namespace: one request, whatever the number of events.

A pipeline running with nothing folded yet holds its lease, so an existing, empty namespace is
known (its answer is empty, exit 0). A resource that does not exist gives no verdict: the
command says that it is missing, as it did. A lookup the server refuses is a permission error
(:func:`~projector.nats.connection.refused_or`), never read as "unknown".
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from nats.aio.client import Client
from nats.js.errors import NotFoundError

from projector.nats.connection import refused_or
from projector.settings.config import Config
from seqstate import SeqstateError

SHOWN = 20  # known namespaces named in the error, at most
_EVENTS = ["seqstate", "events"]


class UnknownNamespace(SeqstateError, LookupError):
    """No resource the command reads knows the namespace; the message lists those it knows."""


async def require_namespace(nc: Client, config: Config, *, log: bool = False) -> None:
    """Raise :class:`UnknownNamespace` unless ``config.namespace`` is known here: by the
    bucket, and with ``log`` (a command that reads the events stream) by that stream too."""
    await refused_or(
        nc,
        _require(nc, config, log),
        user=config.nats_user,
        names=[config.events_stream, bucket_stream(config)],
        lacks=True,  # in the words of the command's own refusals
    )


@contextlib.asynccontextmanager
async def known(nc: Client, config: Config, *, log: bool = False) -> AsyncIterator[None]:
    """:func:`require_namespace` as a step of an ``async with`` chain, before what reads."""
    await require_namespace(nc, config, log=log)
    yield


def bucket_stream(config: Config) -> str:
    return f"KV_{config.registry_bucket}"


async def _require(nc: Client, config: Config, log: bool) -> None:
    js = nc.jetstream()
    namespace = config.namespace
    bucket = await _bucket_keys(nc, config, f"{namespace}.*")  # a few subjects at most
    if bucket:
        return
    sources = [] if bucket is None else [f"bucket {config.registry_bucket}"]
    known: set[str] = set()
    if log:
        try:
            events = await js.stream_info(config.events_stream)
        except NotFoundError:
            pass
        else:
            patterns = events.config.subjects or []
            if any(_matches(p, f"seqstate.events.{namespace}.control") for p in patterns):
                return
            sources.insert(0, f"stream {config.events_stream}")
            known.update(_provisioned(patterns))
    if not sources:  # nothing to look in: the command says what is missing
        return
    # Only now every namespace's keys: one subject per key directly under a namespace.
    known.update(key.split(".", 1)[0] for key in await _bucket_keys(nc, config, "*.*") or [])
    names = sorted(known)
    listed = ", ".join(names[:SHOWN]) + (
        f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    )
    raise UnknownNamespace(
        f"unknown namespace {namespace!r}: nothing of it in {' or '.join(sources)}; "
        + (f"known namespaces: {listed}" if names else "no namespace is known there")
    )


async def _bucket_keys(nc: Client, config: Config, keys: str) -> list[str] | None:
    """The bucket's keys matching ``keys`` that have (or had: a delete marker) a value, from
    its stream's per-subject counts; None if there is no bucket."""
    prefix = f"$KV.{config.registry_bucket}."
    try:
        js = nc.jetstream()
        info = await js.stream_info(bucket_stream(config), subjects_filter=prefix + keys)
    except NotFoundError:
        return None
    return [subject[len(prefix) :] for subject in info.state.subjects or {}]


def _provisioned(patterns: list[str]) -> list[str]:
    """The namespaces an events stream's subjects name (``seqstate.events.<ns>.>``)."""
    found = []
    for tokens in (pattern.split(".") for pattern in patterns):
        if len(tokens) == 4 and tokens[:2] == _EVENTS and tokens[3] == ">":
            found += [] if tokens[2] in ("*", ">") else [tokens[2]]
    return found


def _matches(pattern: str, subject: str) -> bool:
    """Whether the NATS subject ``pattern`` (``*``, ``>``) matches ``subject``."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)
