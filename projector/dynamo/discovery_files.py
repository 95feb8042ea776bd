"""Dynamo's file discovery (``DYN_FILE_KV=DIR``), followed by polling the directory.

Dynamo 1.6.1 keeps one file per key under ``DIR/v1/<bucket>/``, named by the key within the
bucket, percent-encoded (every byte but ASCII letters and digits: ``dynamo%2Fbackend%2F...``),
holding the JSON value. A file is written whole under a temporary name (``.tmp_...``) and
renamed or linked into place, so a reader never sees half a value, and a new value is a new
inode. There is no lease: each process touches its own files every ``max(TTL / 3, 1 s)``
(TTL 10 s: every 3.3 s), and every live Dynamo process, in the same sweep, deletes any file in
the buckets it uses whose mtime is older than the TTL. So a SIGKILLed worker's files are
deleted by the first sweep of another process after its last touch plus 10 s (measured: 13.4 s
after the last touch, 11 s after the kill), and the frontends, which watch the directory,
drop the worker when its files go.

This follower goes by the same rule: a key is present while its file exists, and it goes when
the file is deleted (``why="deleted"``: what the frontends see) or, when no Dynamo process is
left to sweep, once the file is older than the TTL plus one sweep interval (``why="stale"``):
by then any live sweeper would have deleted it, so a key never leaves here before it leaves
the frontends' view. A file that is stale at the first listing is not listed.

Why polling (``os.scandir`` every :data:`POLL_S`) rather than inotify (``watchfiles``): the
staleness rule needs every file's mtime looked at anyway (a touch is the only sign of life,
and inotify would report every touch of every file); Dynamo's directory is meant to be on
shared storage for a multi-node fleet, where inotify sees no other node's writes; and it is
no new dependency. A poll stats every file (11 per worker of 2 ranks) and reads only the files
whose inode or size changed: measured, 86 ms a poll for 1,000 such workers (11,000 files, ~8 µs
a file; 9 ms for 100 workers), in a worker thread, off the event loop. The pause between polls
is at least three times the last poll's length, so a huge directory costs at most a quarter of
a core, and is looked at less often.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from projector.dynamo.discovery import BUCKETS, MAX_VALUE_BYTES, DeleteWhy, Emit, RawBatch

log = logging.getLogger("seqstate.dynamo.discovery")

POLL_S: Final = 0.25
# Dynamo 1.6.1's FileStore: a key untouched for TTL has expired; its owner touches it, and
# every live store sweeps for expired files, every max(TTL / 3, 1 s).
DYNAMO_TTL_S: Final = 10.0
DYNAMO_SWEEP_S: Final = max(DYNAMO_TTL_S / 3, 1.0)
STALE_AFTER_S: Final = DYNAMO_TTL_S + DYNAMO_SWEEP_S
TEMP_PREFIX: Final = ".tmp_"  # Dynamo's files being written


@dataclass
class _Scan:
    """One poll's result, computed in a worker thread."""

    puts: dict[str, bytes] = field(default_factory=dict)
    deletes: dict[str, DeleteWhy] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    missing: bool = False


class FileSource:
    """``DIR/v1``'s four buckets, polled every ``poll_s``; see the module's docstring."""

    def __init__(
        self,
        root: str | Path,
        *,
        poll_s: float = POLL_S,
        stale_after_s: float = STALE_AFTER_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = Path(root)
        self.poll_s = poll_s
        self.stale_after_s = stale_after_s
        self._clock = clock  # the files' mtimes are wall-clock times
        # key -> (device, inode, size) of its file as last looked at: a new inode or size is a
        # new value (Dynamo never rewrites a file in place; its keep-alive changes the mtime).
        self._seen: dict[str, tuple[int, int, int]] = {}
        self._connected = False
        self._said_missing = False
        self._other_buckets: set[str] = set()

    def describe(self) -> str:
        return f"file discovery in {self.root}"

    @property
    def connected(self) -> bool:
        return self._connected

    async def run(self, emit: Emit) -> None:
        first = True
        while True:
            started = time.monotonic()
            scan = await asyncio.to_thread(self._scan)
            took = time.monotonic() - started
            self._note(scan)
            if first:
                await emit(
                    RawBatch(puts=scan.puts, snapshot=True, initial=True, skipped=scan.skipped)
                )
                first = False
            elif scan.puts or scan.deletes or scan.skipped:
                await emit(RawBatch(puts=scan.puts, deletes=scan.deletes, skipped=scan.skipped))
            await asyncio.sleep(max(self.poll_s, 3 * took))

    def _note(self, scan: _Scan) -> None:
        self._connected = not scan.missing
        if scan.missing and not self._said_missing:
            log.warning(
                "discovery: %s does not exist (yet): no Dynamo process has written there; "
                "watching for it",
                self.root / "v1",
            )
        elif not scan.missing and self._said_missing:
            log.info("discovery: %s appeared", self.root / "v1")
        self._said_missing = scan.missing

    def _scan(self) -> _Scan:
        """Every bucket's files against what was seen: new or changed ones read, deleted or
        stale ones gone. Runs in a worker thread; ``_seen`` is only ever touched here."""
        scan = _Scan(missing=not (self.root / "v1").is_dir())
        self._note_other_buckets(scan)
        present: set[str] = set()
        stale_before = self._clock() - self.stale_after_s
        for bucket in BUCKETS:
            try:
                entries = list(os.scandir(self.root / bucket))
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                scan.skipped[str(self.root / bucket)] = f"an unreadable bucket: {exc.strerror}"
                continue
            for entry in entries:
                self._look(bucket, entry, stale_before, scan, present)
        for key in [key for key in self._seen if key not in present]:
            del self._seen[key]
            scan.deletes.setdefault(key, "deleted")  # a key the view never held is no change
        return scan

    def _note_other_buckets(self, scan: _Scan) -> None:
        """A bucket seqstate does not read (a newer Dynamo's) is counted once, unread."""
        try:
            names = {e.name for e in os.scandir(self.root / "v1") if e.is_dir()}
        except OSError:
            return
        for name in sorted(names - self._other_buckets):
            bucket = f"v1/{name}/"
            if bucket not in BUCKETS:
                scan.skipped[bucket] = f"a key of a kind not followed ({bucket})"
        self._other_buckets |= names

    def _look(
        self,
        bucket: str,
        entry: os.DirEntry[str],
        stale_before: float,
        scan: _Scan,
        present: set[str],
    ) -> None:
        if entry.name.startswith(TEMP_PREFIX):
            return
        try:
            key = bucket + urllib.parse.unquote(entry.name, errors="strict")
        except UnicodeDecodeError:
            scan.skipped[bucket + entry.name] = "a file name that is not percent-encoded UTF-8"
            return
        try:
            if not entry.is_file(follow_symlinks=False):
                return
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # deleted since the directory was read
            return
        except OSError as exc:
            scan.skipped[key] = f"a file that cannot be read: {exc.strerror}"
            return
        if st.st_mtime < stale_before:
            if self._seen.pop(key, None) is not None:
                scan.deletes[key] = "stale"
            return
        present.add(key)
        identity = (st.st_dev, st.st_ino, st.st_size)
        if self._seen.get(key) == identity:
            return
        # Looked at once per version: a file skipped here is not skipped (and counted) again
        # until it changes.
        self._seen[key] = identity
        if st.st_size > MAX_VALUE_BYTES:
            scan.skipped[key] = f"a value larger than {MAX_VALUE_BYTES} bytes"
            return
        try:
            with open(entry.path, "rb") as file:
                value = file.read(MAX_VALUE_BYTES + 1)
        except FileNotFoundError:  # deleted since it was looked at
            present.discard(key)
            return
        except OSError as exc:
            scan.skipped[key] = f"a file that cannot be read: {exc.strerror}"
            return
        scan.puts[key] = value
