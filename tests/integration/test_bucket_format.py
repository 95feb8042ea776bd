"""docs/bucket-format.md is enough to read the bucket: a reader written from that page alone,
with no code of seqstate's (a msgpack decoder of a few lines, ``struct`` and ``json``), decodes
what a real pipeline writes, and the page's byte-by-byte example is what the projector wrote.

A scheduler in Go or Rust is written from the page; if the projector's bytes drift from it,
this fails before such a reader does.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from pipeline_kit import bucket_values, fresh_config

from projector.bucket.reader import RegistryView
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline

DOC = Path(__file__).resolve().parents[2] / "docs" / "bucket-format.md"


def unpack(data: bytes) -> Any:
    """The msgpack the page names: maps, strings, positive ints, bins; nothing else."""
    value, end = _item(data, 0)
    assert end == len(data), f"{len(data) - end} bytes after the value"
    return value


def _item(b: bytes, i: int) -> tuple[Any, int]:
    tag = b[i]
    if tag <= 0x7F:
        return tag, i + 1
    if 0x80 <= tag <= 0x8F or tag == 0xDE:
        n, i = (
            (tag & 0x0F, i + 1) if tag != 0xDE else (struct.unpack_from(">H", b, i + 1)[0], i + 3)
        )
        out = {}
        for _ in range(n):
            key, i = _item(b, i)
            out[key], i = _item(b, i)
        return out, i
    if 0xA0 <= tag <= 0xBF:
        n, i = tag & 0x1F, i + 1
        return b[i : i + n].decode(), i + n
    sizes = {0xD9: ">B", 0xDA: ">H", 0xDB: ">I", 0xC4: ">B", 0xC5: ">H", 0xC6: ">I"}
    if tag in sizes:
        fmt = sizes[tag]
        n = struct.unpack_from(fmt, b, i + 1)[0]
        i += 1 + struct.calcsize(fmt)
        raw = b[i : i + n]
        return (raw.decode() if tag >= 0xD9 else bytes(raw)), i + n
    ints = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q"}
    assert tag in ints, f"msgpack tag {tag:#x} is not one the page names"
    fmt = ints[tag]
    return struct.unpack_from(fmt, b, i + 1)[0], i + 1 + struct.calcsize(fmt)


def hashes(packed: bytes) -> list[int]:
    """8 bytes little-endian per hash, as the page says."""
    assert len(packed) % 8 == 0
    return list(struct.unpack(f"<{len(packed) // 8}Q", packed))


def documented_head() -> bytes:
    """The bytes of the page's worked example ("A head, byte by byte")."""
    text = DOC.read_text()
    block = re.search(r"A head, byte by byte.*?```text\n(.*?)```", text, re.S)
    assert block, "the page's byte-by-byte example"
    return bytes.fromhex(
        "".join(
            re.match(r"((?:[0-9a-f]{2} )*[0-9a-f]{2})", line).group(1) + " "  # type: ignore[union-attr]
            for line in block.group(1).splitlines()
        )
    )


async def test_a_reader_written_from_the_page_decodes_a_real_bucket(nc: Client) -> None:
    # No idle Tick before the first publish: the booking is event 1, as on the page.
    config = fresh_config("fmt", idle_tick_s=3600.0)
    big = [2**64 - 1 - i for i in range(4100)]  # a long prompt: a head and one part
    async with Pipeline(nc, config):
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="fmt")
        first = await pub.add(
            "req-1",
            worker_id=3,
            block_hashes=[11, 12, 13],
            prefill_tokens=1200,
            expected_prefill_ms=800.0,
        )
        last = await pub.add("long", worker_id=2**64 - 5, dp_rank=1, block_hashes=big)
        async with RegistryView(nc, namespace=config.namespace, config=config) as view:
            await view.wait_for(last, timeout=30)
        values = await bucket_values(nc, config)
    ns = config.namespace
    assert first == 1 and last == 2

    head = values[f"{ns}.req.3.0.0"]
    assert head == documented_head()
    assert unpack(head) == {"applied_seq": 1, "request_id": "req-1", "hashes": head[-24:]}
    assert hashes(unpack(head)["hashes"]) == [11, 12, 13]

    load = json.loads(values[f"{ns}.load.3.0"])
    assert load["worker_id"] == 3 and load["dp_rank"] == 0
    assert (load["active_blocks"], load["active_requests"], load["applied_seq"]) == (3, 1, 1)
    prefill = load["prefill"]
    assert (prefill["full_tokens"], prefill["anchor_tokens"]) == (1200, 1200)
    assert prefill["anchor_duration_ns"] == 800_000_000 and prefill["modeled_ms"] == 800
    assert prefill["anchored_since_ns"] == load["as_of"] > 0

    # The worker id's 64 bits, in the key and the value; the head's first 4,096 hashes, the
    # rest in part 1 stamped as its head.
    long_head = unpack(values[f"{ns}.req.{2**64 - 5}.1.0"])
    part = unpack(values[f"{ns}.req.{2**64 - 5}.1.0.1"])
    assert json.loads(values[f"{ns}.load.{2**64 - 5}.1"])["worker_id"] == 2**64 - 5
    assert (long_head["applied_seq"], long_head["request_id"], long_head["parts"]) == (2, "long", 1)
    assert set(part) == {"applied_seq", "hashes"} and part["applied_seq"] == 2
    assert hashes(long_head["hashes"]) == big[:4096] and hashes(part["hashes"]) == big[4096:]
    assert (
        values[f"{ns}.req.{2**64 - 5}.1.0"][0] == 0x84
        and values[f"{ns}.req.{2**64 - 5}.1.0.1"][0] == 0x82
    )

    position = json.loads(values[f"{ns}.position"])
    assert position["applied_seq"] == 2 and set(position) == {"applied_seq", "as_of", "delta_seq"}


async def test_a_freed_slot_is_the_one_byte_empty_map(nc: Client) -> None:
    config = fresh_config("fmt", idle_tick_s=3600.0)
    async with Pipeline(nc, config):
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="fmt")
        async with RegistryView(nc, namespace=config.namespace, config=config) as view:
            await view.wait_for(await pub.add("r", worker_id=0, block_hashes=[1, 2]), timeout=30)
            booked = await bucket_values(nc, config)
            await view.wait_for(await pub.free("r", worker_id=0), timeout=30)
        values = await bucket_values(nc, config)
    key = f"{config.namespace}.req.0.0.0"
    assert hashes(unpack(booked[key])["hashes"]) == [1, 2]
    documented = re.search(
        r"The \*\*empty value\*\* is the empty map, one byte `0x([0-9a-f]{2})`", DOC.read_text()
    )
    assert documented, "the page's empty value"
    assert values[key] == bytes.fromhex(documented.group(1)) and unpack(values[key]) == {}
    assert json.loads(values[f"{config.namespace}.load.0.0"])["active_requests"] == 0
