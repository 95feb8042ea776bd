"""Where to follow Dynamo's discovery: a spec (``etcd:URL[,URL]``, ``file:DIR``, ``none``), or,
when none is given, Dynamo's own environment, read with Dynamo's own defaults.

An operator who starts seqstate with the fleet's environment needs no flag: Dynamo 1.6.1 reads
``DYN_DISCOVERY_BACKEND`` (``etcd`` when unset), ``ETCD_ENDPOINTS`` (comma-separated; default
``http://localhost:2379``) and ``DYN_FILE_KV`` (default ``$TMPDIR/dynamo_store_kv``), and so
does :func:`parse_discovery`. TLS to etcd follows Dynamo's variables too: ``ETCD_AUTH_CA``,
``ETCD_AUTH_CLIENT_CERT``, ``ETCD_AUTH_CLIENT_KEY``. Every mistake is one
:class:`DiscoveryConfigError` line naming what was given and where it came from.
"""

from __future__ import annotations

import os
import ssl
import tempfile
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from projector.dynamo.discovery import DiscoveryFollower
from projector.dynamo.discovery_etcd import EtcdSource
from projector.dynamo.discovery_files import FileSource
from seqstate.errors import SeqstateError

BACKEND_ENV: Final = "DYN_DISCOVERY_BACKEND"
ETCD_ENV: Final = "ETCD_ENDPOINTS"
FILE_ENV: Final = "DYN_FILE_KV"
ETCD_DEFAULT: Final = "http://localhost:2379"
ETCD_PORT: Final = 2379
FILE_DEFAULT_NAME: Final = "dynamo_store_kv"  # under $TMPDIR, as Dynamo's std::env::temp_dir
TLS_ENV: Final = ("ETCD_AUTH_CA", "ETCD_AUTH_CLIENT_CERT", "ETCD_AUTH_CLIENT_KEY")
AUTH_ENV: Final = ("ETCD_AUTH_USERNAME", "ETCD_AUTH_PASSWORD")
FORMS: Final = "etcd[:URL[,URL...]], file[:DIR] or none"


class DiscoveryConfigError(SeqstateError, ValueError):
    """A discovery spec or environment seqstate cannot follow; the message says which."""


@dataclass(frozen=True)
class EtcdDiscovery:
    """etcd at ``endpoints`` (``http(s)://host:port``); TLS files from Dynamo's variables."""

    endpoints: tuple[str, ...]
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __str__(self) -> str:
        return f"etcd:{','.join(self.endpoints)}"


@dataclass(frozen=True)
class FileDiscovery:
    """Dynamo's file discovery in ``root`` (what ``DYN_FILE_KV`` names)."""

    root: Path

    def __str__(self) -> str:
        return f"file:{self.root}"


@dataclass(frozen=True)
class NoDiscovery:
    """Discovery is not followed."""

    def __str__(self) -> str:
        return "none"


DiscoverySpec = EtcdDiscovery | FileDiscovery | NoDiscovery


def parse_discovery(spec: str | None, env: Mapping[str, str] | None = None) -> DiscoverySpec:
    """``spec`` (e.g. ``etcd:http://h:2379,http://h2:2379``, ``file:/path``, ``none``), or,
    when None or empty, Dynamo's environment ``env`` (``os.environ`` by default).

    ``etcd`` and ``file`` alone take their address from the environment, as Dynamo does."""
    env = os.environ if env is None else env
    if spec is None or not spec.strip():
        backend = env.get(BACKEND_ENV, "").strip() or "etcd"
        return _backend(backend, None, env, f"{BACKEND_ENV}={backend}")
    kind, colon, rest = spec.strip().partition(":")
    return _backend(kind, rest if colon else None, env, repr(spec))


def _backend(kind: str, rest: str | None, env: Mapping[str, str], given: str) -> DiscoverySpec:
    match kind.lower():
        case "none" if rest is None:
            return NoDiscovery()
        case "etcd":
            if rest is None:
                raw = env.get(ETCD_ENV, "").strip() or ETCD_DEFAULT
                where = f"{ETCD_ENV}={raw}" if env.get(ETCD_ENV, "").strip() else "the default"
            else:
                raw, where = rest, given
            return _etcd(raw, where, env)
        case "file":
            if rest is None:
                raw = env.get(FILE_ENV, "").strip()
                root = Path(raw) if raw else Path(tempfile.gettempdir()) / FILE_DEFAULT_NAME
                where = f"{FILE_ENV}={raw}" if raw else "the default"
            else:
                root, where = Path(rest), given
            return _file(root, where)
        case "kubernetes":
            raise DiscoveryConfigError(
                f"discovery {given}: Dynamo's Kubernetes discovery is not followed yet; use the "
                "spec none (or etcd:URL / file:DIR if the fleet also registers there)"
            )
        case "mem":
            raise DiscoveryConfigError(
                f"discovery {given}: Dynamo's in-memory discovery lives inside one process and "
                "cannot be read from outside; use the spec none"
            )
    raise DiscoveryConfigError(f"discovery {given} is not one of {FORMS}")


def _etcd(raw: str, where: str, env: Mapping[str, str]) -> EtcdDiscovery:
    set_auth = [name for name in AUTH_ENV if env.get(name)]
    if set_auth:
        raise DiscoveryConfigError(
            f"{' and '.join(set_auth)} set: etcd user/password authentication is not "
            "supported by seqstate's discovery (TLS client certificates are: ETCD_AUTH_CA, "
            "ETCD_AUTH_CLIENT_CERT, ETCD_AUTH_CLIENT_KEY)"
        )
    endpoints = tuple(_url(part.strip(), where) for part in raw.split(",") if part.strip())
    if not endpoints:
        raise DiscoveryConfigError(f"etcd discovery from {where}: no endpoint given")
    ca, cert, key = (env.get(name) or None for name in TLS_ENV)
    if (cert is None) != (key is None):
        raise DiscoveryConfigError(
            "ETCD_AUTH_CLIENT_CERT and ETCD_AUTH_CLIENT_KEY go together: one is set alone"
        )
    for name, path in zip(TLS_ENV, (ca, cert, key), strict=True):
        if path is not None and not Path(path).is_file():
            raise DiscoveryConfigError(f"{name}={path}: no such file")
    return EtcdDiscovery(endpoints, ca, cert, key)


def _url(part: str, where: str) -> str:
    """``http(s)://host[:port]`` (``host:port`` alone is http, as for Dynamo's client)."""
    url = part if "://" in part else f"http://{part}"
    parsed = urllib.parse.urlsplit(url)
    try:
        port = parsed.port or ETCD_PORT
    except ValueError:
        port = -1
    if (
        parsed.scheme not in ("http", "https")
        or not parsed.hostname
        or port < 1
        or parsed.path not in ("", "/")
        or parsed.query
        or parsed.username
    ):
        raise DiscoveryConfigError(
            f"etcd endpoint {part!r} (from {where}) is not http(s)://HOST[:PORT]"
        )
    host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
    return f"{parsed.scheme}://{host}:{port}"


def _file(root: Path, where: str) -> FileDiscovery:
    if not str(root).strip():
        raise DiscoveryConfigError(f"file discovery from {where}: no directory given")
    if root.exists() and not root.is_dir():
        raise DiscoveryConfigError(f"file discovery from {where}: {root} is not a directory")
    return FileDiscovery(root.absolute())


def tls_context(spec: EtcdDiscovery) -> ssl.SSLContext | None:
    """The TLS context of an etcd spec: its CA and client certificate, or None for the
    system's defaults."""
    if spec.ca_file is None and spec.cert_file is None:
        return None
    try:
        context = ssl.create_default_context(cafile=spec.ca_file)
        if spec.cert_file is not None:
            context.load_cert_chain(spec.cert_file, spec.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise DiscoveryConfigError(f"etcd TLS files: {exc}") from None
    return context


def open_discovery(spec: DiscoverySpec) -> DiscoveryFollower | None:
    """A follower of ``spec``'s backend (None for :class:`NoDiscovery`); nothing is read until
    its :meth:`~projector.dynamo.discovery.DiscoveryFollower.changes` runs."""
    match spec:
        case EtcdDiscovery():
            return DiscoveryFollower(EtcdSource(spec.endpoints, tls=tls_context(spec)))
        case FileDiscovery():
            return DiscoveryFollower(FileSource(spec.root))
        case NoDiscovery():
            return None
