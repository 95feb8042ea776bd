"""serve-http's answers to malformed bodies, compared with the real tracker's, byte for byte.

Dynamo's standalone slot tracker (``python -m dynamo.slot_tracker`` from the Dynamo venv) and
``seqstate serve-http`` (its defaults but the port) each get the same calls on every route
that reads a JSON body: a corpus built to reach every case of serde's walk
(``projector.http.serde_cases``: truncations at every byte, a wrong value of every type in
every field, missing and repeated fields, unknown fields holding deep nesting, bad escapes,
lone surrogates, huge numbers and bytes that are not UTF-8, trailing characters, positional
arrays, the line and column after newlines, content types, a body at and past the size
bound), a seeded set of byte-level mutations of it, and seeded objects put together at random.
Every answer must be the tracker's: the same status and the same body; and the corpus must
reach every row of serde_cases' table.

Both trackers start empty and get the calls in the same order, so an answer past the
extractor (a 404 for a model never registered, a register's 400 for ``block_size`` 0) is
compared too. Where serve-http departs on purpose, the test says so (``DEPARTURES``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from eventually import eventually
from fleet import free_ports
from http_kit import request, serve_http
from pipeline_kit import fresh_config

from projector.http.http_server import MAX_BODY
from projector.http.serde_cases import CASES, STRUCTS, Refusal
from projector.http.serde_reader import Reader
from projector.http.slot_routes import EMPTY_ID
from projector.nats.server import NatsServer

pytestmark = [pytest.mark.dynamo, pytest.mark.asyncio(loop_scope="module")]

BATCH = 64  # calls pipelined on one connection
WAIT_S = 30.0

# One body per route that serde reads whole. Its answer past the extractor is the same on
# both and stores nothing: no model is registered (404), and a registration's block size is
# 0 (400), so a mutation that keeps the body valid creates no tracker either.
VALID: dict[str, bytes] = {
    "/register": b'{"worker_id":7,"model_name":"m","routing_group":"g","block_size":0,'
    b'"dp_start":0,"dp_size":1}',
    "/unregister": b'{"worker_id":7,"model_name":"m","routing_group":"g"}',
    "/add": b'{"model_name":"m","routing_group":"g","request_id":"r","worker_id":7,'
    b'"dp_rank":0,"sequence_hashes":[1,-2,3],"new_isl_tokens":5}',
    "/prefill_complete": b'{"model_name":"m","routing_group":"g","request_id":"r"}',
    "/free": b'{"model_name":"m","routing_group":"g","request_id":"r"}',
    "/potential_loads": b'{"model_name":"m","routing_group":"g","sequence_hashes":[1,2],'
    b'"new_isl_tokens":5}',
}

# A wrong value of every kind serde tells apart: literals (and broken ones), integers at and
# past each type's bounds, -0, floats (the shortest-digits text, both layouts), numbers serde
# cannot read, strings with escapes good and bad, lone and paired surrogates, control
# characters, bytes that are not UTF-8, arrays and objects (empty, nested, broken).
VALUES: tuple[bytes, ...] = (
    b"null",
    b"true",
    b"false",
    b"nul",
    b"tru",
    b"fals",
    b"nulx",
    b"truex",
    b"0",
    b"-0",
    b"-1",
    b"1",
    b"4294967295",
    b"4294967296",
    b"9223372036854775807",
    b"9223372036854775808",
    b"-9223372036854775808",
    b"-9223372036854775809",
    b"18446744073709551615",
    b"18446744073709551616",
    b"123456789012345678901234567890",
    b"-123456789012345678901234567890",
    b"1.5",
    b"-0.0",
    b"0.00001",
    b"0.000001",
    b"1e15",
    b"1e16",
    b"1e400",
    b"-1e400",
    b"1e-400",
    b"1e999999999999",
    b"0e999999999999",
    b"1e-999999999999",
    b"1.7976931348623157e308",
    b"2.2250738585072014e-308",
    b"123456789012345678901234567890.5e-3",
    b"01",
    b"00",
    b"1.",
    b"1.e5",
    b"1e",
    b"1e+",
    b"-",
    b"-x",
    b".5",
    b"+1",
    b"0x10",
    b"NaN",
    b"Infinity",
    b'"x"',
    b'""',
    b'"\\u00e9\\n\\t\\"\\\\\\/\\b\\f\\r"',
    b'"\xc3\xa9\xe2\x80\x8b\xcc\x81 \xe3\x81\x82\xf0\x9f\x98\x80"',
    b'"\\x"',
    b'"\\u12"',
    b'"\\u12g4"',
    b'"\\ud800"',
    b'"\\udc00"',
    b'"\\ud800\\u0041"',
    b'"\\ud800x"',
    b'"\\ud83d\\ude00"',
    b'"\x01"',
    b'"\x7f"',
    b'"\xff"',
    b'"\xc3"',
    b'"\xed\xa0\x80"',
    b'"unterminated',
    b"[]",
    b"[1,2]",
    b"[1,]",
    b"[,1]",
    b"[1 2]",
    b"[[[[[[]]]]]]",
    b'["a",null,1.5]',
    b"{}",
    b'{"a":1}',
    b'{"a" 1}',
    b"{1:2}",
    b'{"a":1,}',
    b"x",
    b"",
    b"\xff",
)

# Unknown fields: what serde skips without reading, and how far that goes.
UNKNOWN: tuple[bytes, ...] = (
    b"[" * 5000 + b"]" * 5000,
    b"{" + b'"a":{' * 3000 + b"}" * 3001,
    b"[" * 3000,
    b"[" * 200 + b"]" * 199 + b"}",
    b'"\\ud800"',
    b'"\\udc00\\udc00"',
    b'"\xff\xfe"',
    b'"\\u00"',
    b'"\\q"',
    b'"a\x00b"',
    b"1e999999",
    b"-",
    b"1.",
    b"1.5e+",
    b"01",
    b'{"a" "b"}',
    b"{1}",
    b'{"a":1 "b":2}',
    b"[1,]",
    b'{"a":1,}',
    b"tru",
    b"nan",
)

STRUCTURE: tuple[tuple[str, bytes], ...] = (
    ("top-level null", b"null"),
    ("top-level number", b"5"),
    ("top-level string", b'"s"'),
    ("top-level true", b"true"),
    ("empty", b""),
    ("whitespace", b" \n\t\r "),
    ("byte order mark", b'\xef\xbb\xbf{"model_name":"m"}'),
    ("key not a string", b'{model_name:"m"}'),
    ("key a number", b"{1:2}"),
    ("missing colon", b'{"model_name" "m"}'),
    ("missing comma", b'{"model_name":"m" "request_id":"r"}'),
    ("comma first", b'{,"model_name":"m"}'),
    ("trailing comma", b'{"model_name":"m",}'),
    ("double comma", b'{"model_name":"m",,"request_id":"r"}'),
    ("escaped key", b'{"model\\u005fname":"m","request_id":"r"}'),
    ("key with bad escape", b'{"model\\qname":"m"}'),
    ("key not UTF-8", b'{"\xff":1,"model_name":"m"}'),
    ("key lone surrogate", b'{"\\ud800":1}'),
    ("null byte outside", b'{"model_name":"m"}\x00'),
    ("closing bracket", b'{"model_name":"m"]'),
    ("array close only", b"]"),
    ("object close only", b"}"),
)

TRAILING: tuple[bytes, ...] = (b" ", b"\n", b"x", b",", b"}", b"]", b"{}", b" 1", b"\xff")

CONTENT_TYPES: tuple[str | None, ...] = (
    None,
    "text/plain",
    "application/json; charset=utf-8",
    "APPLICATION/JSON",
    "application/problem+json",
    "application/jsonx",
    "json",
)

# Where serve-http answers otherwise on purpose: (status, error text) it may give in place of
# the tracker's answer, and why.
DEPARTURES: dict[tuple[int, str], str] = {
    (422, EMPTY_ID): "serve-http keeps no request without an id in its log; Dynamo books one",
}


def _fields(route: str) -> list[tuple[bytes, bytes]]:
    """The valid body's members as (quoted key, value), in order (the bodies are flat but
    for the hashes, whose value holds no comma at the top)."""
    inner = VALID[route][1:-1]
    members, depth, start = [], 0, 0
    for at, byte in enumerate(inner):
        depth += (byte == 0x5B) - (byte == 0x5D)
        if byte == 0x2C and depth == 0:
            members.append(inner[start:at])
            start = at + 1
    members.append(inner[start:])
    return [(m.split(b":", 1)[0], m.split(b":", 1)[1]) for m in members]


def _object(members: list[tuple[bytes, bytes]]) -> bytes:
    return b"{" + b",".join(key + b":" + value for key, value in members) + b"}"


def corpus(route: str) -> Iterator[bytes]:
    """The hand-made bodies for ``route``: each case of serde's walk, in every field."""
    valid = VALID[route]
    members = _fields(route)
    yield valid
    yield from (valid[:end] for end in range(len(valid)))  # every truncation
    for at, (key, _) in enumerate(members):
        for value in VALUES:
            yield _object([*members[:at], (key, value), *members[at + 1 :]])
            yield _object([*members[:at], (key, value)])[:-1]  # the body ends with the value
        yield _object(members[:at] + members[at + 1 :])  # missing
        yield _object([*members, members[at]])  # twice
        yield _object([*members[:at], (key, b"\n  " + members[at][1]), *members[at + 1 :]])
        escaped = b'"\\u00' + key[1:2].hex().encode() + key[2:]  # its first letter escaped
        yield _object([*members, (escaped, members[at][1])])
    for value in UNKNOWN + VALUES:
        yield _object([(b'"zz"', value), *members])
        yield _object([(b'"zz"', value)])[:-1]
        yield _object([*members, (b'"zz"', value)])
    for _, body in STRUCTURE:
        yield body
    for tail in TRAILING:
        yield valid + tail
    values = [value for _, value in members]
    for count in range(len(values) + 2):  # positional: short, whole, long
        yield b"[" + b",".join([*values, b"0"][:count]) + b"]"
    yield b"[" + b",".join(values) + b",]"
    yield b"{\n" + b",\n".join(k + b": " + v for k, v in members) + b"\n}"  # pretty
    if b"[1," in valid:
        for value in VALUES[:40]:
            yield valid.replace(b"[1,", b"[1," + value + b",")  # an element
        yield valid.replace(b"[1,", b"[1,,")
        yield valid.replace(b"[1,", b"[1 ")


def generated(route: str, count: int, seed: int) -> Iterator[bytes]:
    """``count`` objects put together at random (a seeded generator: the same every run):
    the route's fields and unknown ones, in any order, some missing, some twice, each with a
    valid or a wrong value, whitespace and newlines between the tokens."""
    rng = random.Random(seed)
    members = _fields(route)
    keys = [key for key, _ in members] + [b'"zz"', b'"model\\u005fname"', b'"\xff"']
    good = [value for _, value in members]
    space = (b"", b"", b" ", b"\n", b"\t", b"\r\n  ")
    for _ in range(count):
        chosen = []
        for _ in range(rng.randint(0, len(members) + 2)):
            value = rng.choice(good) if rng.random() < 0.6 else rng.choice(VALUES + UNKNOWN[4:])
            chosen.append(rng.choice(space) + rng.choice(keys) + rng.choice(space) + b":" + value)
        body = b"{" + b",".join(chosen) + rng.choice(space) + b"}"
        yield body if rng.random() < 0.8 else body[: rng.randrange(len(body) + 1)]


def mutations(bodies: list[bytes], count: int, seed: int) -> Iterator[bytes]:
    """``count`` byte-level mutations of ``bodies``, seeded (the same every run): a byte
    deleted, replaced or inserted, or a span repeated, one to three times each."""
    rng = random.Random(seed)
    alphabet = b'{}[]":,.-+eE0123456789 \\u\n\x00\xff\xc3tnfrl'
    for _ in range(count):
        body = bytearray(rng.choice(bodies))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(body) + 1)
            kind = rng.randrange(4)
            if kind == 0 and body:
                del body[min(at, len(body) - 1)]
            elif kind == 1 and body:
                body[min(at, len(body) - 1)] = rng.choice(alphabet)
            elif kind == 2:
                body[at:at] = bytes([rng.choice(alphabet)])
            else:
                body[at:at] = body[at : at + rng.randint(1, 8)]
        yield bytes(body)


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    status = int((await asyncio.wait_for(reader.readline(), WAIT_S)).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return status, await reader.readexactly(length)


async def answers(port: int, calls: list[bytes]) -> list[tuple[int, bytes]]:
    """Each call's (status, body), ``BATCH`` calls pipelined per connection."""
    out = []
    for start in range(0, len(calls), BATCH):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            batch = calls[start : start + BATCH]
            writer.write(b"".join(batch))
            out += [await _read_answer(reader) for _ in batch]
        finally:
            writer.close()
    return out


@contextlib.asynccontextmanager
async def dynamo_tracker(python: Path, log: Path) -> AsyncIterator[int]:
    """``python -m dynamo.slot_tracker`` on a free port, until /health answers; stopped after."""
    port = free_ports(1)[0]
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [str(python), "-m", "dynamo.slot_tracker", "--port", str(port)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:

            async def health() -> int:
                return (await answers(port, [b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"]))[0][0]

            def running() -> None:
                if proc.poll() is not None:
                    raise AssertionError(f"the slot tracker exited: {log.read_text()[-2000:]}")

            await eventually(
                health,
                lambda status: status == 200,
                what=f"the slot tracker answered /health on port {port}",
                timeout=WAIT_S,
                interval=0.05,
                retry_on=(OSError,),
                check=running,
            )
            yield port
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def both(
    dynamo_python: Path, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[int, int]]:
    """(the tracker's port, serve-http's port), both started empty."""
    log = tmp_path_factory.mktemp("slot-tracker") / "slot_tracker.log"
    async with (
        dynamo_tracker(dynamo_python, log) as dynamo,
        serve_http(nats_server.url, fresh_config("xe")) as served,
    ):
        yield dynamo, served


DEPARTED: set[tuple[int, str]] = set()  # the departures the calls so far met


def differences(
    calls: list[tuple[str, bytes]], theirs: list[tuple[int, bytes]], ours: list[tuple[int, bytes]]
) -> list[str]:
    """Each call whose answers differ, but for a departure of ``DEPARTURES``."""
    out = []
    for (label, call), dynamo, served in zip(calls, theirs, ours, strict=True):
        if dynamo == served:
            continue
        if served[1].startswith(b'{"error":'):
            said = (served[0], json.loads(served[1])["error"])
            if said in DEPARTURES:
                DEPARTED.add(said)
                continue
        out.append(f"{label}: {call[-300:]!r}\n  dynamo {dynamo}\n  serve-http {served}")
    return out


async def compare(ports: tuple[int, int], calls: list[tuple[str, bytes]]) -> list[str]:
    raw = [call for _, call in calls]
    theirs = await answers(ports[0], raw)
    ours = await answers(ports[1], raw)
    return differences(calls, theirs, ours)


async def test_every_case_of_the_corpus_answers_as_the_tracker(both: tuple[int, int]) -> None:
    calls = [
        (route, request("POST", route, raw=body))
        for route in VALID
        for body in dict.fromkeys(corpus(route))
    ]
    assert len(calls) > 5000
    found = await compare(both, calls)
    assert not found, f"{len(found)} of {len(calls)} differ:\n" + "\n".join(found[:20])
    assert set(DEPARTURES) == DEPARTED  # each departure documented is met, none other


async def test_mutated_bodies_answer_as_the_tracker(both: tuple[int, int]) -> None:
    calls = []
    for seed, route in enumerate(VALID):
        bodies = list(dict.fromkeys(corpus(route)))
        calls += [
            (route, request("POST", route, raw=body)) for body in mutations(bodies, 600, seed)
        ]
    found = await compare(both, calls)
    assert not found, f"{len(found)} of {len(calls)} differ:\n" + "\n".join(found[:20])


async def test_generated_objects_answer_as_the_tracker(both: tuple[int, int]) -> None:
    calls = [
        (route, request("POST", route, raw=body))
        for seed, route in enumerate(VALID)
        for body in generated(route, 500, 100 + seed)
    ]
    found = await compare(both, calls)
    assert not found, f"{len(found)} of {len(calls)} differ:\n" + "\n".join(found[:20])


async def test_the_corpus_reaches_every_row_of_the_table() -> None:
    """Every refusal serde_cases knows is among the corpus's answers (so each is compared
    with the tracker's)."""
    reached = set()
    for route in VALID:
        for body in corpus(route):
            try:
                Reader(body).request(STRUCTS[route])
            except Refusal as refusal:
                reached.add(refusal.case)
    assert reached == set(CASES)


async def test_content_types_answer_as_the_tracker(both: tuple[int, int]) -> None:
    calls = [
        (f"{route} {kind}", request("POST", route, raw=body, content_type=kind))
        for route in VALID
        for kind in CONTENT_TYPES
        for body in (VALID[route], b"{", b"")
    ]
    found = await compare(both, calls)
    assert not found, "\n".join(found)


async def test_a_body_at_and_past_the_size_bound_answers_as_the_tracker(
    both: tuple[int, int],
) -> None:
    """axum's default limit is serve-http's: 2 MiB. A body of exactly that many bytes is
    read (a long unknown field, then the tracker's 404), one byte more is 413."""
    valid = VALID["/free"]
    filler = MAX_BODY - len(valid) - len(b'"zz":"",')
    at_bound = valid[:1] + b'"zz":"' + b"a" * filler + b'",' + valid[1:]
    assert len(at_bound) == MAX_BODY
    calls = [("at the bound", request("POST", "/free", raw=at_bound))]
    calls += [("past the bound", request("POST", "/free", raw=at_bound + b" "))]
    for label, call in calls:  # one a connection: a 413 closes it
        found = await compare(both, [(label, call)])
        assert not found, "\n".join(found)
