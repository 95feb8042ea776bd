"""What each setting may be, and how a value is shown in an error: the checks a Config runs.

A check takes one value and returns the problem in words ("" when the value is fine), so the
one list :data:`CHECKS` is read by :meth:`projector.settings.config.Config.validate`, which
names the setting the way the user gave it. Secrets and URL passwords are masked wherever a
value is shown (:func:`as_shown`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from projector.settings.redaction import redact

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
# A namespace is a token of every subject and KV key of its pipeline; NATS reads a protocol
# line (``HPUB <subject> <reply> <sizes>``) into its max_control_line, 4,096 bytes by default,
# and ends the connection on a longer one. Half is the namespace's, half the rest of the line's.
MAX_NAMESPACE_BYTES = 2048

_SCHEMES = ("nats", "tls", "ws", "wss")
_HOST = re.compile(r"[A-Za-z0-9._%:-]+")  # a name, IPv4, or IPv6 (urlsplit drops the brackets)
# A literal NATS subject: names without wildcards, whitespace or controls, joined by dots.
_SUBJECT = re.compile(r"[^.*>\s\x00-\x1f\x7f]+(\.[^.*>\s\x00-\x1f\x7f]+)*")


def is_literal_subject(text: str) -> bool:
    """Whether ``text`` is a NATS subject with no wildcard (a prefix of inboxes, say)."""
    return _SUBJECT.fullmatch(text) is not None


# Settings whose value is a secret: never shown (help, errors, a Config's repr).
SECRET_SETTINGS = ("nats_password", "nats_token", "http_token")


def as_shown(setting: str, value: object) -> object:
    """A setting's value as an error may show it: a secret, or a URL's password, masked."""
    if setting in SECRET_SETTINGS and value is not None:
        return "***"
    if setting != "nats_url" or not isinstance(value, str):
        return value
    return redact(value)


def _check_url(url: str | None) -> str:
    if url is None:
        return ""
    for item in url.split(","):
        item = item.strip()
        if not _is_nats_url(item):
            return (
                f"{as_shown('nats_url', item)!r} is not a NATS URL (nats://host:port; "
                "several, comma-separated)"
            )
    return ""


def _is_nats_url(item: str) -> bool:
    if "://" not in item:
        # nats-py accepts host:port without a scheme; a bare word is a typo, not a host.
        item = f"nats://{item}" if re.fullmatch(r"[^\s:/@]+:\d+", item) else ""
    try:
        parts = urlsplit(item)
        _ = parts.port  # raises on a port that is not a number
    except ValueError:
        return False
    host = parts.hostname or ""
    return parts.scheme in _SCHEMES and bool(_HOST.fullmatch(host))


def _file(path: str | None) -> str:
    return "" if path is None or os.path.isfile(path) else "no such file"


def _positive(value: float) -> str:
    return "" if value > 0 else "must be positive"


def _not_negative(value: float | None) -> str:
    return "" if value is None or value >= 0 else "must not be negative"


MIN_STREAM_BYTES = 8 * 1024**2  # a stream's byte limit: room for a few of the largest messages


def _stream_bytes(value: int | None) -> str:
    if value is None or value >= MIN_STREAM_BYTES:
        return ""
    return f"must be at least {MIN_STREAM_BYTES} (8 MiB), or 'off'"


def _name(value: str) -> str:
    return "" if _TOKEN.match(value) else "use letters, digits, '-' and '_' only"


def _namespace(value: str) -> str:
    if len(value) > MAX_NAMESPACE_BYTES:
        return f"at most {MAX_NAMESPACE_BYTES} characters (a token of NATS subjects)"
    return _name(value)


def _check_endpoints(value: str | None) -> str:
    if value is None:
        return ""
    for endpoint in value.split(","):
        tokens = endpoint.strip().split(".")
        if len(tokens) != 3 or not all(_TOKEN.match(t) for t in tokens):
            return (
                f"{endpoint.strip()!r} is not a Dynamo endpoint: NAMESPACE.COMPONENT.ENDPOINT, "
                "each of letters, digits, '-' and '_' (several, comma-separated)"
            )
    return ""


def _auto_or_off(value: str) -> str:
    return "" if value in ("auto", "off") else f"{value!r}: 'auto' or 'off'"


CHECKS: list[tuple[str, Callable[[Any], str]]] = [
    ("nats_url", _check_url),
    ("namespace", _namespace),
    ("dynamo_endpoint", _check_endpoints),
    ("dynamo_resync", _auto_or_off),
    ("events_stream", _name),
    ("deltas_stream", _name),
    ("registry_bucket", _name),
    ("snapshot_bucket", _name),
    (
        "duplicate_window_s",
        lambda v: "" if v >= 120 else "must be at least 120 seconds (retried publishes)",
    ),
    ("capture_max_bytes", _stream_bytes),
    ("dead_letter_max_bytes", _stream_bytes),
    ("expiry_s", lambda v: "" if v is None or v > 0 else "must be positive, or 'off'"),
    (
        "expiry_scan_s",
        lambda v: (
            ""
            if v is None or 0 < v <= 86_400 * 365
            else "must be positive (at most a year), or 'off'"
        ),
    ),
    ("idle_tick_s", _positive),
    ("flush_interval_s", _positive),
    ("replicas", lambda v: "" if v in (1, 3, 5) else "use 1, 3 or 5"),
    ("snapshot_every_events", _not_negative),
    ("snapshot_every_s", _not_negative),
    ("snapshots_keep", lambda v: "" if v >= 1 else "keep at least 1"),
    ("snapshot_history_every", lambda v: "" if v is None or v >= 1 else "at least 1, or 'off'"),
    ("snapshot_history_keep", _not_negative),
    ("retain_events", _not_negative),
    (
        "forget_lazy_ranks_s",
        lambda v: (
            ""
            if v is None or 0 < v <= 86_400 * 365
            else "must be positive (at most a year), or 'off'"
        ),
    ),
    (
        "orphan_after_s",
        lambda v: (
            ""
            if v is None or 0 < v <= 86_400 * 365
            else "must be positive (at most a year), or 'off'"
        ),
    ),
    (
        "rules",
        lambda v: "" if v in ("router", "slot-tracker") else "use 'router' or 'slot-tracker'",
    ),
    (
        "worker_grace_s",
        lambda v: "" if 0 <= v <= 86_400 * 365 else "must be 0 (off) or positive, at most a year",
    ),
    ("tick_every_s", _positive),
    ("behind_warn_events", lambda v: "" if v is None or v >= 1 else "must be at least 1, or 'off'"),
    ("behind_warn_s", lambda v: "" if v is None or v > 0 else "must be positive, or 'off'"),
    ("lag_check_s", _positive),
    ("consumer_window", lambda v: "" if 16 <= v <= 1_000_000 else "must be 16 to 1000000"),
    ("max_ranks_per_worker", _positive),
    ("max_ranks", _positive),
    ("max_event_bytes", _positive),
    ("max_tombstones", _not_negative),
    ("max_ended", _not_negative),
    ("tls_ca", _file),
    ("tls_cert", _file),
    ("tls_key", _file),
    ("nats_nkey_seed", _file),
    ("nats_creds", _file),
    ("nats_user", lambda v: "" if v is None or v.strip() else "must not be empty"),
    (
        "nats_inbox_prefix",
        lambda v: (
            ""
            if v is None or is_literal_subject(v)
            else "not a subject prefix: dot-separated names, no wildcard, space or empty name"
        ),
    ),
    (
        "metrics_port",
        lambda v: (
            ""
            if v is None or 0 <= v <= 65_535
            else "not a port: use 0-65535 (0: any free port), or 'off'"
        ),
    ),
    (
        "metrics_host",
        lambda v: (
            ""
            if v.strip() and not any(c.isspace() for c in v)
            else "not an address: a host name or an IP address"
        ),
    ),
    ("ready_lag_events", _not_negative),
    (
        "http_host",
        lambda v: (
            ""
            if v.strip() and not any(c.isspace() for c in v)
            else "not an address: a host name or an IP address"
        ),
    ),
    (
        "http_port",
        lambda v: "" if 0 <= v <= 65_535 else "not a port: use 0-65535 (0: any free port)",
    ),
    ("http_max_connections", lambda v: "" if 1 <= v <= 1_000_000 else "must be 1 to 1000000"),
    ("max_trackers", lambda v: "" if 1 <= v <= 1_000_000 else "must be 1 to 1000000"),
    ("http_token", lambda v: "" if v is None else bearer_problem(v)),
    (
        "event_loop",
        lambda v: "" if v in ("auto", "uvloop", "asyncio") else "use 'auto', 'uvloop' or 'asyncio'",
    ),
    ("http_token_file", _file),
    ("ready_lag_s", lambda v: "" if v is None or v > 0 else "must be positive, or 'off'"),
]


def bearer_problem(token: str) -> str:
    """Why ``token`` cannot be a bearer token ('' if it can): what a client sends after
    ``Bearer `` is one word of visible ASCII (RFC 6750's token68, loosely)."""
    if not token:
        return "must not be empty"
    if not all("\x21" <= c <= "\x7e" for c in token):
        return "use visible ASCII only, no spaces (it travels in an HTTP header)"
    return ""


def rule(value: object) -> str:
    return "off" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
