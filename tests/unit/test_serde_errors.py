"""The error texts of Dynamo's slot tracker for bodies its extractor refuses, byte for byte.

Every case here was sent to the 1.6.1 wheel (``python -m dynamo.slot_tracker``), and its
status and text are the wheel's answer, copied verbatim. Beyond these, the module was compared
with the wheel on about 140 000 generated bodies (random objects, arrays, numbers, strings and
byte-level mutations of them) with no difference, and ``rust_debug`` on every code point.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest

from projector.http.serde_errors import STRUCTS, error_for_accepted, extractor_error
from projector.http.slot_routes import DECODERS, parse

PREFIX = {
    400: "Failed to parse the request body as JSON: ",
    422: "Failed to deserialize the JSON body into the target type: ",
}

A = b'{"model_name":"m","request_id":"r","worker_id":1,"dp_rank":0,'  # /add, up to the hashes
P = b'{"model_name":"m",'

# (what, route, body, status, the text after the status's prefix)
CASES: list[tuple[str, str, bytes, int, str]] = [
    (
        "truncated after a key",
        "/add",
        b'{"model_name":',
        400,
        "model_name: EOF while parsing a value at line 1 column 14",
    ),
    ("empty body", "/add", b"", 400, "EOF while parsing a value at line 1 column 0"),
    (
        "request_id an integer",
        "/add",
        b'{"model_name":"m","request_id":5,"worker_id":1,"dp_rank":0,"sequence_hashes":[]}',
        422,
        "request_id: invalid type: integer `5`, expected a string at line 1 column 32",
    ),
    (
        "sequence_hashes missing",
        "/add",
        b'{"model_name":"m","request_id":"r","worker_id":1,"dp_rank":0}',
        422,
        "missing field `sequence_hashes` at line 1 column 61",
    ),
    (
        "hash 2^63",
        "/add",
        A + b'"sequence_hashes":[9223372036854775808]}',
        422,
        "sequence_hashes[0]: invalid value: integer `9223372036854775808`, expected i64 at "
        "line 1 column 99",
    ),
    (
        "hash null",
        "/add",
        A + b'"sequence_hashes":[1, 2, null], "new_isl_tokens": 0}',
        422,
        "sequence_hashes[2]: invalid type: null, expected i64 at line 1 column 90",
    ),
    (
        "new_isl_tokens -1",
        "/add",
        A + b'"sequence_hashes":[1,2,3],"new_isl_tokens":-1}',
        422,
        "new_isl_tokens: invalid value: integer `-1`, expected usize at line 1 column 106",
    ),
    (
        "worker_id 2^64",
        "/add",
        b'{"model_name":"m","request_id":"r","worker_id":18446744073709551616,"dp_rank":0,'
        b'"sequence_hashes":[]}',
        422,
        "worker_id: invalid type: floating point `1.8446744073709552e+19`, expected u64 at "
        "line 1 column 67",
    ),
    ("whitespace only", "/free", b" \n\t ", 400, "EOF while parsing a value at line 2 column 2"),
    ("a lone brace", "/free", b"{", 400, "EOF while parsing an object at line 1 column 1"),
    (
        "a lone brace after newlines",
        "/free",
        b"\n\n  {  \n",
        400,
        "EOF while parsing an object at line 4 column 0",
    ),
    (
        "top-level number",
        "/register",
        b"5",
        422,
        "invalid type: integer `5`, expected struct RegisterRequest at line 1 column 1",
    ),
    (
        "top-level negative float",
        "/register",
        b" -1.5e3 ",
        422,
        "invalid type: floating point `-1500.0`, expected struct RegisterRequest at line 1 "
        "column 7",
    ),
    (
        "top-level string",
        "/unregister",
        b'"worker"',
        422,
        'invalid type: string "worker", expected struct UnregisterRequest at line 1 column 8',
    ),
    (
        "top-level null",
        "/add",
        b"null",
        422,
        "invalid type: null, expected struct AddRequest at line 1 column 4",
    ),
    (
        "top-level true",
        "/potential_loads",
        b"true",
        422,
        "invalid type: boolean `true`, expected struct PotentialLoadsRequest at line 1 column 4",
    ),
    ("top-level bad literal", "/free", b"nul", 400, "EOF while parsing a value at line 1 column 3"),
    ("top-level garbage", "/free", b"x", 400, "expected value at line 1 column 1"),
    (
        "byte order mark",
        "/free",
        b'\xef\xbb\xbf{"model_name":"m","request_id":"r"}',
        400,
        "expected value at line 1 column 1",
    ),
    (
        "top-level empty array",
        "/add",
        b"[]",
        422,
        "invalid length 0, expected struct AddRequest with 7 elements at line 1 column 2",
    ),
    (
        "positional: too short at a default",
        "/register",
        b'[1,"m"]',
        422,
        "invalid length 3, expected struct RegisterRequest with 6 elements at line 1 column 7",
    ),
    (
        "positional: wrong type",
        "/register",
        b'[1,"m","g",{}]',
        422,
        "[3]: invalid type: map, expected u32 at line 1 column 11",
    ),
    (
        "positional: too long",
        "/free",
        b'["m","g","r",1]',
        400,
        "trailing characters at line 1 column 14",
    ),
    (
        "positional: trailing comma",
        "/free",
        b'["m","g","r",]',
        400,
        "trailing comma at line 1 column 14",
    ),
    (
        "positional: hash out of range",
        "/potential_loads",
        b'["m","g",[1,-9223372036854775809]]',
        422,
        "[2][1]: invalid type: floating point `-9.223372036854776e+18`, expected i64 at line "
        "1 column 32",
    ),
    ("register: nothing", "/register", b"{}", 422, "missing field `worker_id` at line 1 column 2"),
    (
        "register: block_size before dp_start",
        "/register",
        b'{"worker_id":1,"model_name":"m","dp_size":1,"dp_start":1}',
        422,
        "missing field `block_size` at line 1 column 57",
    ),
    (
        "register: dp_size",
        "/register",
        b'{"worker_id":1,"model_name":"m","block_size":16,"dp_start":0}',
        422,
        "missing field `dp_size` at line 1 column 61",
    ),
    (
        "unregister: model_name",
        "/unregister",
        b'{"worker_id":1}',
        422,
        "missing field `model_name` at line 1 column 15",
    ),
    (
        "add: worker_id",
        "/add",
        b'{"request_id":"r","model_name":"m"}',
        422,
        "missing field `worker_id` at line 1 column 35",
    ),
    (
        "prefill_complete: request_id",
        "/prefill_complete",
        b'{"model_name":"m","routing_group":"g"}',
        422,
        "missing field `request_id` at line 1 column 38",
    ),
    (
        "free: model_name",
        "/free",
        b'{"request_id":"r"}',
        422,
        "missing field `model_name` at line 1 column 18",
    ),
    (
        "potential_loads: sequence_hashes, multi-line",
        "/potential_loads",
        b'{\n  "model_name": "m"\n}\n',
        422,
        "missing field `sequence_hashes` at line 3 column 1",
    ),
    (
        "worker_id a string",
        "/register",
        b'{"worker_id":"7","model_name":"m","block_size":16,"dp_start":0,"dp_size":1}',
        422,
        'worker_id: invalid type: string "7", expected u64 at line 1 column 16',
    ),
    (
        "model_name null",
        "/register",
        b'{"worker_id":7,"model_name":null}',
        422,
        "model_name: invalid type: null, expected a string at line 1 column 32",
    ),
    (
        "routing_group null",
        "/free",
        b'{"model_name":"m","routing_group":null,"request_id":"r"}',
        422,
        "routing_group: invalid type: null, expected a string at line 1 column 38",
    ),
    (
        "routing_group a number",
        "/unregister",
        b'{"worker_id":7,"model_name":"m","routing_group":3}',
        422,
        "routing_group: invalid type: integer `3`, expected a string at line 1 column 49",
    ),
    (
        "block_size 2^32",
        "/register",
        b'{"worker_id":7,"model_name":"m","block_size":4294967296,"dp_start":0,"dp_size":1}',
        422,
        "block_size: invalid value: integer `4294967296`, expected u32 at line 1 column 55",
    ),
    (
        "dp_start negative",
        "/register",
        b'{"worker_id":7,"model_name":"m","block_size":16,"dp_start":-1,"dp_size":1}',
        422,
        "dp_start: invalid value: integer `-1`, expected u32 at line 1 column 61",
    ),
    (
        "dp_size a float",
        "/register",
        b'{"worker_id":7,"model_name":"m","block_size":16,"dp_start":0,"dp_size":1.0}',
        422,
        "dp_size: invalid type: floating point `1.0`, expected u32 at line 1 column 74",
    ),
    (
        "dp_rank true",
        "/add",
        b'{"model_name":"m","request_id":"r","worker_id":1,"dp_rank":true,"sequence_hashes":[]}',
        422,
        "dp_rank: invalid type: boolean `true`, expected u32 at line 1 column 63",
    ),
    (
        "request_id an array",
        "/prefill_complete",
        b'{"model_name":"m","request_id":["r"]}',
        422,
        "request_id: invalid type: sequence, expected a string at line 1 column 31",
    ),
    (
        "request_id an object",
        "/free",
        b'{"model_name":"m","request_id":{"id":"r"}}',
        422,
        "request_id: invalid type: map, expected a string at line 1 column 31",
    ),
    (
        "sequence_hashes a map",
        "/potential_loads",
        P + b'"sequence_hashes":{"0":1}}',
        422,
        "sequence_hashes: invalid type: map, expected an array of signed 64-bit sequence "
        "hashes at line 1 column 36",
    ),
    (
        "sequence_hashes a string",
        "/potential_loads",
        P + b'"sequence_hashes":"1,2"}',
        422,
        'sequence_hashes: invalid type: string "1,2", expected an array of signed 64-bit '
        "sequence hashes at line 1 column 41",
    ),
    (
        "sequence_hashes a number",
        "/add",
        A + b'"sequence_hashes":5}',
        422,
        "sequence_hashes: invalid type: integer `5`, expected an array of signed 64-bit "
        "sequence hashes at line 1 column 80",
    ),
    (
        "a hash that is a string",
        "/potential_loads",
        P + b'"sequence_hashes":[1,"2"]}',
        422,
        'sequence_hashes[1]: invalid type: string "2", expected i64 at line 1 column 42',
    ),
    (
        "a hash that is an array",
        "/potential_loads",
        P + b'"sequence_hashes":[[1]]}',
        422,
        "sequence_hashes[0]: invalid type: sequence, expected i64 at line 1 column 37",
    ),
    (
        "a hash 1.0",
        "/add",
        A + b'"sequence_hashes":[1.0]}',
        422,
        "sequence_hashes[0]: invalid type: floating point `1.0`, expected i64 at line 1 column 83",
    ),
    (
        "a hash 1e3",
        "/add",
        A + b'"sequence_hashes":[1e3]}',
        422,
        "sequence_hashes[0]: invalid type: floating point `1000.0`, expected i64 at line 1 "
        "column 83",
    ),
    (
        "new_isl_tokens null",
        "/potential_loads",
        P + b'"sequence_hashes":[],"new_isl_tokens":null}',
        422,
        "new_isl_tokens: invalid type: null, expected usize at line 1 column 60",
    ),
    (
        "new_isl_tokens a string",
        "/potential_loads",
        P + b'"sequence_hashes":[],"new_isl_tokens":"5"}',
        422,
        'new_isl_tokens: invalid type: string "5", expected usize at line 1 column 59',
    ),
    (
        "worker_id false",
        "/unregister",
        b'{"worker_id":false,"model_name":"m"}',
        422,
        "worker_id: invalid type: boolean `false`, expected u64 at line 1 column 18",
    ),
    (
        "u32 at u64 max",
        "/register",
        b'{"worker_id":7,"model_name":"m","block_size":18446744073709551615}',
        422,
        "block_size: invalid value: integer `18446744073709551615`, expected u32 at line 1 "
        "column 65",
    ),
    (
        "u64 one past i64",
        "/unregister",
        b'{"worker_id":-9223372036854775809,"model_name":"m"}',
        422,
        "worker_id: invalid type: floating point `-9.223372036854776e+18`, expected u64 at "
        "line 1 column 33",
    ),
    (
        "i64 minus 2^64",
        "/add",
        A + b'"sequence_hashes":[-18446744073709551616]}',
        422,
        "sequence_hashes[0]: invalid type: floating point `-1.8446744073709552e+19`, expected "
        "i64 at line 1 column 101",
    ),
    (
        "-0 for a string",
        "/free",
        b'{"model_name":-0}',
        422,
        "model_name: invalid type: floating point `-0.0`, expected a string at line 1 column 16",
    ),
    (
        "negative zero float",
        "/unregister",
        b'{"worker_id":-0.0,"model_name":"m"}',
        422,
        "worker_id: invalid type: floating point `-0.0`, expected u64 at line 1 column 17",
    ),
    (
        "huge integer",
        "/unregister",
        b'{"worker_id":123456789012345678901234567890,"model_name":"m"}',
        422,
        "worker_id: invalid type: floating point `1.2345678901234568e+29`, expected u64 at "
        "line 1 column 43",
    ),
    (
        "a float serde_json rounds imprecisely",
        "/free",
        b'{"model_name":123456789012345680000}',
        422,
        "model_name: invalid type: floating point `1.2345678901234567e+20`, expected a string "
        "at line 1 column 35",
    ),
    (
        "tiny float",
        "/free",
        b'{"model_name":1e-7}',
        422,
        "model_name: invalid type: floating point `1e-7`, expected a string at line 1 column 18",
    ),
    (
        "small float, plain",
        "/free",
        b'{"model_name":0.00001234}',
        422,
        "model_name: invalid type: floating point `0.00001234`, expected a string at line 1 "
        "column 24",
    ),
    (
        "float 1e16",
        "/free",
        b'{"model_name":1e16}',
        422,
        "model_name: invalid type: floating point `1e+16`, expected a string at line 1 column 18",
    ),
    (
        "float 1e15",
        "/free",
        b'{"model_name":1e15}',
        422,
        "model_name: invalid type: floating point `1000000000000000.0`, expected a string at "
        "line 1 column 18",
    ),
    (
        "number out of range",
        "/unregister",
        b'{"worker_id":1e400,"model_name":"m"}',
        400,
        "worker_id: number out of range at line 1 column 18",
    ),
    (
        "exponent that overflows i32",
        "/unregister",
        b'{"worker_id":1e999999999999,"model_name":"m"}',
        400,
        "worker_id: number out of range at line 1 column 25",
    ),
    (
        "underflow to zero",
        "/unregister",
        b'{"worker_id":-1e-400,"model_name":"m"}',
        422,
        "worker_id: invalid type: floating point `-0.0`, expected u64 at line 1 column 20",
    ),
    (
        "leading zero",
        "/unregister",
        b'{"worker_id":01,"model_name":"m"}',
        400,
        "worker_id: invalid number at line 1 column 15",
    ),
    (
        "lone minus",
        "/unregister",
        b'{"worker_id":-,"model_name":"m"}',
        400,
        "worker_id: invalid number at line 1 column 15",
    ),
    (
        "no digit after the point",
        "/unregister",
        b'{"worker_id":1.,"model_name":"m"}',
        400,
        "worker_id: invalid number at line 1 column 16",
    ),
    (
        "EOF after the point",
        "/unregister",
        b'{"worker_id":1.',
        400,
        "worker_id: EOF while parsing a value at line 1 column 15",
    ),
    (
        "no digit in the exponent",
        "/unregister",
        b'{"worker_id":1e+,"model_name":"m"}',
        400,
        "worker_id: invalid number at line 1 column 17",
    ),
    (
        "a plus sign",
        "/unregister",
        b'{"worker_id":+1,"model_name":"m"}',
        400,
        "worker_id: expected value at line 1 column 14",
    ),
    (
        "hex",
        "/unregister",
        b'{"worker_id":0x10,"model_name":"m"}',
        400,
        "expected `,` or `}` at line 1 column 15",
    ),
    (
        "NaN",
        "/unregister",
        b'{"worker_id":NaN,"model_name":"m"}',
        400,
        "worker_id: expected value at line 1 column 14",
    ),
    ("missing colon", "/free", b'{"model_name" "m"}', 400, "expected `:` at line 1 column 15"),
    (
        "EOF after a key",
        "/free",
        b'{"model_name"',
        400,
        "EOF while parsing an object at line 1 column 13",
    ),
    ("EOF in a key", "/free", b'{"model_na', 400, "EOF while parsing a string at line 1 column 10"),
    (
        "EOF after a value",
        "/free",
        b'{"model_name":"m"',
        400,
        "EOF while parsing an object at line 1 column 17",
    ),
    (
        "missing comma",
        "/free",
        b'{"model_name":"m" "request_id":"r"}',
        400,
        "expected `,` or `}` at line 1 column 19",
    ),
    (
        "trailing comma in the object",
        "/free",
        b'{"model_name":"m","request_id":"r",}',
        400,
        "trailing comma at line 1 column 36",
    ),
    (
        "EOF after a comma",
        "/free",
        b'{"model_name":"m",',
        400,
        "EOF while parsing a value at line 1 column 18",
    ),
    (
        "key not a string",
        "/free",
        b'{"model_name":"m",request_id:"r"}',
        400,
        "key must be a string at line 1 column 19",
    ),
    (
        "leading comma",
        "/free",
        b'{,"model_name":"m"}',
        400,
        "key must be a string at line 1 column 2",
    ),
    (
        "bad literal",
        "/free",
        b'{"model_name":tru}',
        400,
        "model_name: expected ident at line 1 column 18",
    ),
    (
        "literal cut short",
        "/free",
        b'{"model_name":nul',
        400,
        "model_name: EOF while parsing a value at line 1 column 17",
    ),
    (
        "trailing comma in hashes",
        "/add",
        A + b'"sequence_hashes":[1,2,]}',
        400,
        "sequence_hashes: trailing comma at line 1 column 85",
    ),
    (
        "missing comma in hashes",
        "/add",
        A + b'"sequence_hashes":[1 2]}',
        400,
        "sequence_hashes: expected `,` or `]` at line 1 column 83",
    ),
    (
        "leading comma in hashes",
        "/add",
        A + b'"sequence_hashes":[,1]}',
        400,
        "sequence_hashes[0]: expected value at line 1 column 81",
    ),
    (
        "EOF in hashes",
        "/add",
        A + b'"sequence_hashes":[1,2',
        400,
        "sequence_hashes: EOF while parsing a list at line 1 column 83",
    ),
    (
        "EOF after a comma in hashes",
        "/add",
        A + b'"sequence_hashes":[1,',
        400,
        "sequence_hashes: EOF while parsing a value at line 1 column 82",
    ),
    (
        "EOF after hashes",
        "/add",
        A + b'"sequence_hashes":[1]',
        400,
        "EOF while parsing an object at line 1 column 82",
    ),
    (
        "invalid escape",
        "/free",
        b'{"model_name":"a\\qb"}',
        400,
        "model_name: invalid escape at line 1 column 18",
    ),
    (
        "short unicode escape",
        "/free",
        b'{"model_name":"\\u12"}',
        400,
        "model_name: invalid escape at line 1 column 21",
    ),
    (
        "non-hex unicode escape",
        "/free",
        b'{"model_name":"\\u12G4x"}',
        400,
        "model_name: invalid escape at line 1 column 21",
    ),
    (
        "lone leading surrogate",
        "/free",
        b'{"model_name":"\\ud800"}',
        400,
        "model_name: unexpected end of hex escape at line 1 column 22",
    ),
    (
        "leading surrogate then a letter",
        "/free",
        b'{"model_name":"\\ud800x"}',
        400,
        "model_name: unexpected end of hex escape at line 1 column 22",
    ),
    (
        "leading surrogate then a non-surrogate",
        "/free",
        b'{"model_name":"\\ud800\\u0041"}',
        400,
        "model_name: lone leading surrogate in hex escape at line 1 column 27",
    ),
    (
        "lone trailing surrogate",
        "/free",
        b'{"model_name":"\\udc00"}',
        400,
        "model_name: lone leading surrogate in hex escape at line 1 column 21",
    ),
    (
        "tab in a string",
        "/free",
        b'{"model_name":"a\tb"}',
        400,
        "model_name: control character (\\u0000-\\u001F) found while parsing a string at line "
        "1 column 17",
    ),
    (
        "newline in a string",
        "/free",
        b'{"model_name":"a\nb"}',
        400,
        "model_name: control character (\\u0000-\\u001F) found while parsing a string at line "
        "2 column 0",
    ),
    (
        "EOF in a string",
        "/free",
        b'{"model_name":"abc',
        400,
        "model_name: EOF while parsing a string at line 1 column 18",
    ),
    (
        "EOF after a backslash",
        "/free",
        b'{"model_name":"abc\\',
        400,
        "model_name: EOF while parsing a string at line 1 column 19",
    ),
    (
        "invalid UTF-8 in a value",
        "/free",
        b'{"model_name":"m\xff","request_id":"r"}',
        400,
        "model_name: invalid unicode code point at line 1 column 18",
    ),
    (
        "truncated UTF-8 in a value",
        "/free",
        b'{"model_name":"\xc3","request_id":"r"}',
        400,
        "model_name: invalid unicode code point at line 1 column 17",
    ),
    (
        "invalid UTF-8 in a key",
        "/free",
        b'{"model_\xffname":"m","request_id":"r"}',
        400,
        "invalid unicode code point at line 1 column 14",
    ),
    (
        "escaped surrogate in an unknown key",
        "/free",
        b'{"model_name":"m","\\ud800":1}',
        400,
        "unexpected end of hex escape at line 1 column 26",
    ),
    (
        "unicode: columns count bytes",
        "/unregister",
        '{"model_name":"é日本語😀", "worker_id":"x"}'.encode(),
        422,
        'worker_id: invalid type: string "x", expected u64 at line 1 column 48',
    ),
    (
        "unicode: multi-line",
        "/unregister",
        '{"model_name":"é日本語😀",\n "worker_id" : "x"}'.encode(),
        422,
        'worker_id: invalid type: string "x", expected u64 at line 2 column 18',
    ),
    (
        "CRLF line ends",
        "/unregister",
        '{\r\n "model_name":"é",\r\n "worker_id" : 1.5}'.encode(),
        422,
        "worker_id: invalid type: floating point `1.5`, expected u64 at line 3 column 18",
    ),
    (
        "Debug escapes",
        "/unregister",
        b'{"model_name":"m","worker_id":"\\u00e9\\n\\t\\r\\"\\\\ '
        b'\\u0000\\u0001\\u001f\\u007f\\u0080\\u00a0\\u00ad"}',
        422,
        'worker_id: invalid type: string "é\\n\\t\\r\\"\\\\ '
        '\\0\\u{1}\\u{1f}\\u{7f}\\u{80}\\u{a0}\\u{ad}", expected u64 at line 1 column 91',
    ),
    (
        "Debug escapes: format and combining",
        "/unregister",
        b'{"model_name":"m","worker_id":"\\u200b\\u200d\\u2028\\ufeff\\ue000\\uffff '
        b'a\\u0301 \\u0cc0 \\uff9e"}',
        422,
        "worker_id: invalid type: string "
        '"\\u{200b}\\u{200d}\\u{2028}\\u{feff}\\u{e000}\\u{ffff} a\\u{301} \\u{cc0} '
        '\\u{ff9e}", expected u64 at line 1 column 90',
    ),
    (
        "Debug escapes: astral",
        "/unregister",
        b'{"model_name":"m","worker_id":"\\ud83d\\ude00 \\udb40\\udc01 '
        b'\\u0378 \\u3000 \\ud83c\\udffb"}',
        422,
        'worker_id: invalid type: string "😀 \\u{e0001} \\u{378} \\u{3000} 🏻", expected u64 at '
        "line 1 column 84",
    ),
    (
        "raw UTF-8 in a string that is not wanted",
        "/register",
        '{"worker_id":"日本\u0301"}'.encode(),
        422,
        'worker_id: invalid type: string "日本\\u{301}", expected u64 at line 1 column 23',
    ),
    (
        "escaped key matches a field",
        "/free",
        b'{"model_name":"m","model\\u005fname":"n"}',
        422,
        "duplicate field `model_name` at line 1 column 35",
    ),
    (
        "duplicate field: position after blanks",
        "/free",
        b'{"model_name":"m", "model_name"\n\n  :5}',
        422,
        "duplicate field `model_name` at line 3 column 2",
    ),
    (
        "duplicate routing_group",
        "/add",
        b'{"routing_group":"a","model_name":"m","routing_group":"b"}',
        422,
        "duplicate field `routing_group` at line 1 column 53",
    ),
    (
        "unknown field: trailing comma in an array",
        "/free",
        b'{"model_name":"m","request_id":"r","x":[1,2,]}',
        400,
        "x: expected value at line 1 column 45",
    ),
    (
        "unknown field: trailing comma in an object",
        "/free",
        b'{"model_name":"m","request_id":"r","x":{"a":1,}}',
        400,
        "x: key must be a string at line 1 column 47",
    ),
    (
        "unknown field: missing colon",
        "/free",
        b'{"model_name":"m","x":{"a" 1}}',
        400,
        "x: expected `:` at line 1 column 28",
    ),
    (
        "unknown field: key not a string",
        "/free",
        b'{"x":{1:1},"model_name":"m"}',
        400,
        "x: key must be a string at line 1 column 7",
    ),
    (
        "unknown field: wrong closer",
        "/free",
        b'{"x":[1}',
        400,
        "x: expected `,` or `]` at line 1 column 8",
    ),
    (
        "unknown field: EOF inside",
        "/free",
        b'{"model_name":"m","x":[[{"a":[',
        400,
        "x: EOF while parsing a list at line 1 column 30",
    ),
    (
        "unknown field: bad number",
        "/free",
        b'{"x":[1e400, 01]}',
        400,
        "x: invalid number at line 1 column 15",
    ),
    (
        "unknown field: EOF after minus",
        "/free",
        b'{"x":-',
        400,
        "x: invalid number at line 1 column 6",
    ),
    (
        "unknown field: EOF in exponent",
        "/free",
        b'{"x":1e',
        400,
        "x: invalid number at line 1 column 7",
    ),
    (
        "unknown field: control character",
        "/free",
        b'{"x":"a\nb","model_name":"m"}',
        400,
        "x: control character (\\u0000-\\u001F) found while parsing a string at line 1 column 7",
    ),
    (
        "unknown field: invalid escape",
        "/free",
        b'{"x":"\\x"}',
        400,
        "x: invalid escape at line 1 column 8",
    ),
    (
        "unknown field: a dotted key",
        "/free",
        b'{"a.b[0]":[1,}',
        400,
        "a.b[0]: expected value at line 1 column 14",
    ),
    (
        "unknown field: an empty key",
        "/free",
        b'{"":[1,}',
        400,
        ": expected value at line 1 column 8",
    ),
    (
        "unknown field: deep, then an error",
        "/free",
        b'{"x":' + b"[" * 300 + b"]" * 299 + b"}",
        400,
        "x: expected `,` or `]` at line 1 column 605",
    ),
    (
        "unknown field: ignored, then a missing field",
        "/free",
        b'{"x":{"y":[1,{"z":null}]},"model_name":"m"}',
        422,
        "missing field `request_id` at line 1 column 43",
    ),
]

# msgspec refuses these, Dynamo accepts them (extractor_error: None). The 5000-deep one is a
# RecursionError in msgspec, not a DecodeError: it escapes SlotService.call's except clauses.
ACCEPTED_BY_DYNAMO: list[tuple[str, str, bytes]] = [
    ("characters after the object", "/free", b'{"model_name":"m","request_id":"r"} x'),
    ("a second object", "/free", b'{"model_name":"m","request_id":"r"}{"model_name":1}'),
    ("a second closing brace", "/free", b'{"model_name":"m","request_id":"r"}}'),
    ("invalid UTF-8 after the object", "/free", b'{"model_name":"m","request_id":"r"}\xff'),
    ("positional", "/add", b'["m","g","r",1,0,[1,2],5]'),
    ("positional without the default", "/potential_loads", b'["m","g",[]]'),
    (
        "unknown field: lone surrogate",
        "/free",
        b'{"model_name":"m","request_id":"r","x":"\\ud800"}',
    ),
    (
        "unknown field: surrogate pair broken",
        "/free",
        b'{"model_name":"m","request_id":"r","x":"\\ud800\\u0041"}',
    ),
    (
        "unknown field: 5000 deep",
        "/free",
        b'{"model_name":"m","request_id":"r","x":' + b"[" * 5000 + b"]" * 5000 + b"}",
    ),
]

# msgspec accepts these, Dynamo refuses them (error_for_accepted finds them).
REFUSED_BY_DYNAMO_ONLY: list[tuple[str, str, bytes, int, str]] = [
    (
        "duplicate field",
        "/free",
        b'{"model_name":"m","model_name":"x","request_id":"r"}',
        422,
        "duplicate field `model_name` at line 1 column 30",
    ),
    (
        "escaped duplicate",
        "/free",
        b'{"model_name":"m","request_id":"r","model\\u005fname":"n"}',
        422,
        "duplicate field `model_name` at line 1 column 52",
    ),
    (
        "hash -0",
        "/add",
        A + b'"sequence_hashes":[-0]}',
        422,
        "sequence_hashes[0]: invalid type: floating point `-0.0`, expected i64 at line 1 column 82",
    ),
    (
        "worker_id -0",
        "/unregister",
        b'{"worker_id":-0,"model_name":"m"}',
        422,
        "worker_id: invalid type: floating point `-0.0`, expected u64 at line 1 column 15",
    ),
]

# Both accept these; some look like the ones above to a cheap check.
VALID: list[tuple[str, str, bytes]] = [
    ("plain add", "/add", A + b'"sequence_hashes":[-1,9223372036854775807,-9223372036854775808]}'),
    (
        "a UUID request id with -0 in it",
        "/free",
        b'{"model_name":"m","request_id":"5f1c-0a9e-40d1"}',
    ),
    ("a -0 inside a string value", "/free", b'{"model_name":"a:-0,","request_id":"r"}'),
    ("a field name as a value", "/free", b'{"model_name":"request_id","request_id":"r"}'),
    ("unicode names", "/free", '{"model_name":"模型-é","request_id":"r😀"}'.encode()),
    ("escapes in a value", "/free", b'{"model_name":"m\\u00e9\\n","request_id":"r"}'),
    (
        "invalid UTF-8 in an unknown value",
        "/free",
        b'{"model_name":"m","request_id":"r","x":"\xff"}',
    ),
    ("negative numbers", "/unregister", b'{"worker_id":0,"model_name":"m","x":[-0.5,-10,-0e1]}'),
]


def _ids(cases: Sequence[tuple[object, ...]]) -> list[str]:
    return [f"{case[1]} {case[0]}" for case in cases]


@pytest.mark.parametrize(("what", "route", "body", "status", "text"), CASES, ids=_ids(CASES))
def test_dynamo_text(what: str, route: str, body: bytes, status: int, text: str) -> None:
    assert extractor_error(route, body) == (status, PREFIX[status] + text)


@pytest.mark.parametrize(("what", "route", "body", "status", "text"), CASES, ids=_ids(CASES))
def test_msgspec_refuses_each_case(
    what: str, route: str, body: bytes, status: int, text: str
) -> None:
    """extractor_error is only asked about bodies msgspec refused."""
    with pytest.raises(msgspec.DecodeError):
        DECODERS[route].decode(body)


# The fields Dynamo reads from each body of ACCEPTED_BY_DYNAMO (an unknown field skipped
# unread, whatever its depth; an array read by position).
READ_AS = {
    "/free": {"model_name": "m", "routing_group": "default", "request_id": "r"},
    "/add": {
        "model_name": "m",
        "routing_group": "g",
        "request_id": "r",
        "worker_id": 1,
        "dp_rank": 0,
        "sequence_hashes": [1, 2],
        "new_isl_tokens": 5,
    },
    "/potential_loads": {
        "model_name": "m",
        "routing_group": "g",
        "sequence_hashes": [],
        "new_isl_tokens": 0,
    },
}


@pytest.mark.parametrize(
    ("what", "route", "body"), ACCEPTED_BY_DYNAMO, ids=_ids(ACCEPTED_BY_DYNAMO)
)
def test_bodies_only_dynamo_accepts(what: str, route: str, body: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, RecursionError)):
        DECODERS[route].decode(body)
    assert extractor_error(route, body) is None
    assert msgspec.to_builtins(parse(route, body)) == READ_AS[route]  # what Dynamo reads


@pytest.mark.parametrize(
    ("what", "route", "body", "status", "text"),
    REFUSED_BY_DYNAMO_ONLY,
    ids=_ids(REFUSED_BY_DYNAMO_ONLY),
)
def test_bodies_only_dynamo_refuses(
    what: str, route: str, body: bytes, status: int, text: str
) -> None:
    DECODERS[route].decode(body)
    assert error_for_accepted(route, body) == (status, PREFIX[status] + text)


@pytest.mark.parametrize(("what", "route", "body"), VALID, ids=_ids(VALID))
def test_valid_bodies(what: str, route: str, body: bytes) -> None:
    DECODERS[route].decode(body)
    assert extractor_error(route, body) is None
    assert error_for_accepted(route, body) is None


@pytest.mark.parametrize("route", sorted(STRUCTS))
def test_fields_are_slot_apis(route: str) -> None:
    """The Rust structs' table names the fields slot_api's Structs decode, with the same ones
    optional."""
    info = msgspec.inspect.type_info(DECODERS[route].type)
    assert isinstance(info, msgspec.inspect.StructType)
    ours = {field.name: field.required for field in info.fields}
    assert ours == {field.name: field.required for field in STRUCTS[route].fields}
