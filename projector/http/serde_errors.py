"""The error texts Dynamo's slot tracker answers for a request body it cannot extract.

Dynamo's HTTP server is axum: its ``Json`` extractor runs serde_json, through
serde_path_to_error, over the body into a ``#[derive(Deserialize)]`` struct, and answers the
error's text, ``<path>: <serde_json message> at line L column C``. A syntax or EOF error is a
400 (``Failed to parse the request body as JSON: ...``) and a data error a 422 (``Failed to
deserialize the JSON body into the target type: ...``). msgspec refuses the same bodies with
other words, and the texts are part of the drop-in's contract
(docs/slot-tracker-api.md), so this module replays serde's walk over a refused
body: a small scanner that reads the body in document order, as serde_json does, with the same
position bookkeeping (byte columns; which errors point at the byte read last and which at the
byte peeked at), the same path rules and the same value formatting (Rust's ``{:?}`` of a
string, serde_json's shortest float).

It only runs on the error path, so it is written for being checked line by line against
serde_json's deserializer rather than for speed. Every rule was compared with the 1.6.1 wheel
(tests/unit/test_serde_errors.py lists the cases).

msgspec and serde do not refuse quite the same bodies. Dynamo accepts, where msgspec refuses:
anything after the body's first value (axum's extractor never checks for trailing
characters); a positional array (a derived struct reads one field by field); an unknown
field's string with a lone surrogate escape; an unknown field nested deeper than msgspec can
go. :func:`extractor_error` answers None for those. Dynamo refuses, where msgspec accepts: a
field given twice, an integer written ``-0``, and invalid UTF-8 in an unknown field's key;
:func:`error_for_accepted` finds those cheaply on the success path.
"""

from __future__ import annotations

import functools
import json
import math
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Final, TypeVar

from seqstate.errors import SeqstateError

PARSE_PREFIX: Final = "Failed to parse the request body as JSON: "
DATA_PREFIX: Final = "Failed to deserialize the JSON body into the target type: "

_T = TypeVar("_T")
_U64_MAX: Final = 2**64 - 1
_I64_MIN: Final = -(2**63)
_I64_MAX: Final = 2**63 - 1
_I32_MAX: Final = 2**31 - 1
_I32_MIN: Final = -(2**31)

# serde_json's ErrorCode texts: every one of them is a syntax or EOF error, a 400.
_EOF_LIST: Final = "EOF while parsing a list"
_EOF_OBJECT: Final = "EOF while parsing an object"
_EOF_STRING: Final = "EOF while parsing a string"
_EOF_VALUE: Final = "EOF while parsing a value"
_EXPECTED_COLON: Final = "expected `:`"
_EXPECTED_LIST_COMMA_OR_END: Final = "expected `,` or `]`"
_EXPECTED_OBJECT_COMMA_OR_END: Final = "expected `,` or `}`"
_EXPECTED_IDENT: Final = "expected ident"
_EXPECTED_VALUE: Final = "expected value"
_INVALID_ESCAPE: Final = "invalid escape"
_INVALID_NUMBER: Final = "invalid number"
_NUMBER_OUT_OF_RANGE: Final = "number out of range"
_INVALID_UNICODE: Final = "invalid unicode code point"
_CONTROL_CHARACTER: Final = "control character (\\u0000-\\u001F) found while parsing a string"
_KEY_MUST_BE_A_STRING: Final = "key must be a string"
_LONE_SURROGATE: Final = "lone leading surrogate in hex escape"
_TRAILING_COMMA: Final = "trailing comma"
_TRAILING_CHARACTERS: Final = "trailing characters"
_END_OF_HEX_ESCAPE: Final = "unexpected end of hex escape"


# ---- the target structs ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Field:
    name: str
    kind: str  # a key of _KINDS
    required: bool = True  # False: `#[serde(default)]` (a missing one is no error)


@dataclass(frozen=True)
class _Struct:
    """One of Dynamo's request structs, as serde derives it: the name and the field order are
    the Rust declaration's (not slot_api's), because they show in the texts: the first missing
    field is named in declaration order, and a JSON array is read positionally into the fields
    (``invalid length N, expected struct X with M elements``)."""

    name: str
    fields: tuple[_Field, ...]

    def field(self, key: str) -> _Field | None:
        return next((f for f in self.fields if f.name == key), None)


@dataclass(frozen=True)
class _Kind:
    expected: str  # serde's `expecting` text for the type
    low: int = 0
    high: int = _U64_MAX


_KINDS: Final[dict[str, _Kind]] = {
    "string": _Kind("a string"),
    "u64": _Kind("u64"),
    "u32": _Kind("u32", high=2**32 - 1),
    "usize": _Kind("usize"),
    "i64": _Kind("i64", low=_I64_MIN, high=_I64_MAX),
    # Dynamo's own deserializer for the hashes: a sequence of i64 under another name.
    "hashes": _Kind("an array of signed 64-bit sequence hashes"),
}

_MODEL = _Field("model_name", "string")
_GROUP = _Field("routing_group", "string", required=False)  # a default, not an Option: no null
_LIFECYCLE = _Struct("LifecycleRequest", (_MODEL, _GROUP, _Field("request_id", "string")))

# One table for every route's body, observed on the wheel (field order from `[]`, `[{}]`, ...
# and from which missing field `{}` names first).
STRUCTS: Final[dict[str, _Struct]] = {
    "/register": _Struct(
        "RegisterRequest",
        (
            _Field("worker_id", "u64"),
            _MODEL,
            _GROUP,
            _Field("block_size", "u32"),
            _Field("dp_start", "u32"),
            _Field("dp_size", "u32"),
        ),
    ),
    "/unregister": _Struct("UnregisterRequest", (_Field("worker_id", "u64"), _MODEL, _GROUP)),
    "/add": _Struct(
        "AddRequest",
        (
            _MODEL,
            _GROUP,
            _Field("request_id", "string"),
            _Field("worker_id", "u64"),
            _Field("dp_rank", "u32"),
            _Field("sequence_hashes", "hashes"),
            _Field("new_isl_tokens", "usize", required=False),
        ),
    ),
    "/prefill_complete": _LIFECYCLE,
    "/free": _LIFECYCLE,
    "/potential_loads": _Struct(
        "PotentialLoadsRequest",
        (
            _MODEL,
            _GROUP,
            _Field("sequence_hashes", "hashes"),
            _Field("new_isl_tokens", "usize", required=False),
        ),
    ),
}


# ---- errors ---------------------------------------------------------------------------------


class _Error(SeqstateError, ValueError):
    """serde_json's error, with what serde_path_to_error adds.

    ``at`` is the byte offset the position is computed from; None until serde_json's
    ``fix_position`` gives a position-less (data) error the offset the reader is at when the
    error leaves the value being deserialized. ``path`` is set once, by the innermost value the
    error leaves (serde_path_to_error keeps the first path it is told about).
    """

    def __init__(self, message: str, *, data: bool = False, at: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.data = data
        self.at = at
        self.path: tuple[str | int, ...] | None = None

    def text(self, body: bytes) -> str:
        assert self.at is not None
        start = body.rfind(b"\n", 0, self.at) + 1
        line = 1 + body.count(b"\n", 0, start)
        where = _path_text(self.path or ())
        prefix = DATA_PREFIX if self.data else PARSE_PREFIX
        return f"{prefix}{where}{self.message} at line {line} column {self.at - start}"


def _path_text(path: tuple[str | int, ...]) -> str:
    """serde_path_to_error's ``Display`` of a path, with the ``: `` that follows it (nothing
    for the root): keys joined by dots, indices as ``[i]`` with no dot before them."""
    if not path:
        return ""
    out = ""
    for i, segment in enumerate(path):
        if isinstance(segment, int):
            out += f"[{segment}]"
        else:
            out += ("." if i else "") + segment
    return out + ": "


def _tracked(path: tuple[str | int, ...], run: Callable[[], _T]) -> _T:
    """Runs a step whose errors belong to ``path`` unless a deeper step claimed them first."""
    try:
        return run()
    except _Error as error:
        if error.path is None:
            error.path = path
        raise


def _invalid_type(unexpected: str, expected: str) -> _Error:
    return _Error(f"invalid type: {unexpected}, expected {expected}", data=True)


def _invalid_value(unexpected: str, expected: str) -> _Error:
    return _Error(f"invalid value: {unexpected}, expected {expected}", data=True)


# ---- values as serde shows them ---------------------------------------------------------------

# Rust's `{:?}` of a str escapes a char that is Grapheme_Extend or not printable (general
# category Cc, Cf, Cs, Co, Cn, Zl, Zp or Zs, but space). Python knows Mn and Me but not the
# rest of Grapheme_Extend, and its character database (3.11: Unicode 14.0) is older than the
# wheel's Rust (Unicode 17.0): both gaps are listed here, as measured on the wheel over every
# code point (the second list: printed by the wheel, though unassigned, or Mn, in Unicode
# 14.0). With them, this rule matches the wheel on all of them.
_ALSO_GRAPHEME_EXTEND: Final = (
    (0x9BE, 0x9BE),
    (0x9D7, 0x9D7),
    (0xB3E, 0xB3E),
    (0xB57, 0xB57),
    (0xBBE, 0xBBE),
    (0xBD7, 0xBD7),
    (0xCC0, 0xCC0),
    (0xCC2, 0xCC2),
    (0xCC7, 0xCC8),
    (0xCCA, 0xCCB),
    (0xCD5, 0xCD6),
    (0xD3E, 0xD3E),
    (0xD57, 0xD57),
    (0xDCF, 0xDCF),
    (0xDDF, 0xDDF),
    (0x1715, 0x1715),
    (0x1734, 0x1734),
    (0x1B35, 0x1B35),
    (0x1B3B, 0x1B3B),
    (0x1B3D, 0x1B3D),
    (0x1B43, 0x1B44),
    (0x1BAA, 0x1BAA),
    (0x1BF2, 0x1BF3),
    (0x302E, 0x302F),
    (0xA953, 0xA953),
    (0xA9C0, 0xA9C0),
    (0xFF9E, 0xFF9F),
    (0x111C0, 0x111C0),
    (0x11235, 0x11235),
    (0x1133E, 0x1133E),
    (0x1134D, 0x1134D),
    (0x11357, 0x11357),
    (0x114B0, 0x114B0),
    (0x114BD, 0x114BD),
    (0x115AF, 0x115AF),
    (0x116B6, 0x116B6),
    (0x11930, 0x11930),
    (0x1193D, 0x1193D),
    (0x16FF0, 0x16FF1),
    (0x1D165, 0x1D166),
    (0x1D16D, 0x1D172),
)
_PRINTABLE_SINCE_UNICODE_14: Final = (
    (0x88F, 0x88F),
    (0xC5C, 0xC5C),
    (0xCDC, 0xCDC),
    (0xCF3, 0xCF3),
    (0x1B4E, 0x1B4F),
    (0x1B7F, 0x1B7F),
    (0x1C89, 0x1C8A),
    (0x20C1, 0x20C1),
    (0x2427, 0x2429),
    (0x2B96, 0x2B96),
    (0x2FFC, 0x2FFF),
    (0x31E4, 0x31E5),
    (0x31EF, 0x31EF),
    (0xA7CB, 0xA7CF),
    (0xA7D2, 0xA7D2),
    (0xA7D4, 0xA7D4),
    (0xA7DA, 0xA7DC),
    (0xA7F1, 0xA7F1),
    (0xFBC3, 0xFBD2),
    (0xFD90, 0xFD91),
    (0xFDC8, 0xFDCE),
    (0x105C0, 0x105F3),
    (0x10940, 0x10959),
    (0x10D40, 0x10D65),
    (0x10D6E, 0x10D85),
    (0x10D8E, 0x10D8F),
    (0x10EC2, 0x10EC7),
    (0x10ED0, 0x10ED8),
    (0x1123F, 0x11240),
    (0x11380, 0x11389),
    (0x1138B, 0x1138B),
    (0x1138E, 0x1138E),
    (0x11390, 0x113B5),
    (0x113B7, 0x113B7),
    (0x113B9, 0x113BA),
    (0x113CA, 0x113CA),
    (0x113CC, 0x113CD),
    (0x113D1, 0x113D1),
    (0x113D3, 0x113D5),
    (0x113D7, 0x113D8),
    (0x116D0, 0x116E3),
    (0x1171E, 0x1171E),
    (0x11B00, 0x11B09),
    (0x11B61, 0x11B61),
    (0x11B65, 0x11B65),
    (0x11B67, 0x11B67),
    (0x11BC0, 0x11BE1),
    (0x11BF0, 0x11BF9),
    (0x11DB0, 0x11DDB),
    (0x11DE0, 0x11DE9),
    (0x11F02, 0x11F10),
    (0x11F12, 0x11F35),
    (0x11F3E, 0x11F3F),
    (0x11F43, 0x11F59),
    (0x1342F, 0x1342F),
    (0x13441, 0x13446),
    (0x13460, 0x143FA),
    (0x16100, 0x1611D),
    (0x1612A, 0x1612C),
    (0x16130, 0x16139),
    (0x16D40, 0x16D79),
    (0x16EA0, 0x16EB8),
    (0x16EBB, 0x16ED3),
    (0x16FF2, 0x16FF6),
    (0x187F8, 0x187FF),
    (0x18CFF, 0x18CFF),
    (0x18D09, 0x18D1E),
    (0x18D80, 0x18DF2),
    (0x1B132, 0x1B132),
    (0x1B155, 0x1B155),
    (0x1CC00, 0x1CCFC),
    (0x1CD00, 0x1CEB3),
    (0x1CEBA, 0x1CED0),
    (0x1CEE0, 0x1CEF0),
    (0x1D2C0, 0x1D2D3),
    (0x1DF25, 0x1DF2A),
    (0x1E030, 0x1E06D),
    (0x1E4D0, 0x1E4EB),
    (0x1E4F0, 0x1E4F9),
    (0x1E5D0, 0x1E5ED),
    (0x1E5F0, 0x1E5FA),
    (0x1E5FF, 0x1E5FF),
    (0x1E6C0, 0x1E6DE),
    (0x1E6E0, 0x1E6E2),
    (0x1E6E4, 0x1E6E5),
    (0x1E6E7, 0x1E6ED),
    (0x1E6F0, 0x1E6F4),
    (0x1E6FE, 0x1E6FF),
    (0x1F6D8, 0x1F6D8),
    (0x1F6DC, 0x1F6DC),
    (0x1F774, 0x1F77F),
    (0x1F7D9, 0x1F7D9),
    (0x1F8B2, 0x1F8BB),
    (0x1F8C0, 0x1F8C1),
    (0x1F8D0, 0x1F8D8),
    (0x1FA54, 0x1FA57),
    (0x1FA75, 0x1FA77),
    (0x1FA87, 0x1FA8A),
    (0x1FA8E, 0x1FA8F),
    (0x1FAAD, 0x1FAAF),
    (0x1FABB, 0x1FABF),
    (0x1FAC6, 0x1FAC6),
    (0x1FAC8, 0x1FAC8),
    (0x1FACD, 0x1FACF),
    (0x1FADA, 0x1FADC),
    (0x1FADF, 0x1FADF),
    (0x1FAE8, 0x1FAEA),
    (0x1FAEF, 0x1FAEF),
    (0x1FAF7, 0x1FAF8),
    (0x1FBCB, 0x1FBEF),
    (0x1FBFA, 0x1FBFA),
    (0x2B739, 0x2B73F),
    (0x2CEA2, 0x2CEAD),
    (0x2EBF0, 0x2EE5D),
    (0x31350, 0x33479),
)
_NOT_PRINTABLE: Final = frozenset(("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"))
_SHORT_ESCAPES: Final = {
    "\0": "\\0",
    "\t": "\\t",
    "\r": "\\r",
    "\n": "\\n",
    "\\": "\\\\",
    '"': '\\"',
}


def _within(code: int, ranges: tuple[tuple[int, int], ...]) -> bool:
    return any(low <= code <= high for low, high in ranges)


def _escaped(char: str) -> bool:
    code = ord(char)
    if _within(code, _ALSO_GRAPHEME_EXTEND):
        return True
    if _within(code, _PRINTABLE_SINCE_UNICODE_14):
        return False
    category = unicodedata.category(char)
    return category in ("Mn", "Me") or (category in _NOT_PRINTABLE and char != " ")


def rust_debug(text: str) -> str:
    """Rust's ``{:?}`` of a ``str`` (serde shows a string it did not want as ``string "…"``)."""
    out = ['"']
    for char in text:
        if char in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[char])
        elif _escaped(char):
            out.append(f"\\u{{{ord(char):x}}}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def rust_float(value: float) -> str:
    """serde_json's text for a float it did not want: the shortest digits that read back as
    ``value`` (Python's ``repr`` finds the same ones), laid out as ``1000.0``, ``0.00001``,
    ``1e-6``, ``1.5e+300``: plain for 10^-5 <= |v| < 10^16, else an exponent with its sign."""
    if value == 0:
        return "-0.0" if math.copysign(1.0, value) < 0 else "0.0"
    sign = "-" if value < 0 else ""
    _, digit_tuple, exponent = Decimal(repr(abs(value))).as_tuple()
    assert isinstance(exponent, int)
    digits = "".join(map(str, digit_tuple)).rstrip("0")
    exponent += len(digit_tuple) - len(digits)
    length = len(digits)
    point = length + exponent  # the value is 0.<digits> * 10^point
    if exponent >= 0 and point <= 16:
        return f"{sign}{digits}{'0' * exponent}.0"
    if 0 < point <= 16:
        return f"{sign}{digits[:point]}.{digits[point:]}"
    if -5 < point <= 0:
        return f"{sign}0.{'0' * -point}{digits}"
    mantissa = digits if length == 1 else f"{digits[0]}.{digits[1:]}"
    power = point - 1
    return f"{sign}{mantissa}e{'+' if power >= 0 else '-'}{abs(power)}"


# ---- numbers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Number:
    """serde_json's ParserNumber: a non-negative integer, a negative one, or a float."""

    value: int | float

    def unexpected(self) -> str:
        if isinstance(self.value, float):
            return f"floating point `{rust_float(self.value)}`"
        return f"integer `{self.value}`"


# serde_json multiplies or divides by these (1e0 ... 1e308), each the nearest double, as
# Python's float() reads it; it does not round correctly overall, and this copies that.
_POW10: Final = tuple(float(f"1e{n}") for n in range(309))


def _overflows(value: int, digit: int, limit: int) -> bool:
    return value >= limit // 10 and (value > limit // 10 or digit > limit % 10)


# ---- the reader -----------------------------------------------------------------------------


class _Reader:
    """serde_json's ``Deserializer<SliceRead>``: the bytes and an index into them.

    Two kinds of position, as in serde_json: ``error`` points at the index (after the byte
    that was read last), ``peek_error`` one past it (at the byte that was peeked at).
    """

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.index = 0

    # -- bytes

    def peek(self) -> int | None:
        return self.body[self.index] if self.index < len(self.body) else None

    def peek_or_null(self) -> int:
        peeked = self.peek()
        return 0 if peeked is None else peeked

    def eat(self) -> None:
        self.index += 1

    def next(self) -> int | None:
        peeked = self.peek()
        if peeked is not None:
            self.index += 1
        return peeked

    def whitespace(self) -> int | None:
        while (peeked := self.peek()) in (0x20, 0x0A, 0x09, 0x0D):
            self.index += 1
        return peeked

    def error(self, message: str) -> _Error:
        return _Error(message, at=self.index)

    def peek_error(self, message: str) -> _Error:
        return _Error(message, at=min(len(self.body), self.index + 1))

    def fix_position(self, error: _Error) -> _Error:
        if error.at is None:
            error.at = self.index
        return error

    # -- literals and numbers

    def ident(self, rest: bytes) -> None:
        for expected in rest:
            got = self.next()
            if got is None:
                raise self.error(_EOF_VALUE)
            if got != expected:
                raise self.error(_EXPECTED_IDENT)

    def integer(self, positive: bool) -> _Number:
        first = self.next()
        if first is None:
            raise self.error(_EOF_VALUE)
        if first == 0x30:  # '0': only one leading zero
            if 0x30 <= self.peek_or_null() <= 0x39:
                raise self.peek_error(_INVALID_NUMBER)
            return self.number(positive, 0)
        if not 0x31 <= first <= 0x39:
            raise self.error(_INVALID_NUMBER)
        significand = first - 0x30
        while 0x30 <= (peeked := self.peek_or_null()) <= 0x39:
            digit = peeked - 0x30
            if _overflows(significand, digit, _U64_MAX):
                return _Number(self.long_integer(positive, significand))
            self.eat()
            significand = significand * 10 + digit
        return self.number(positive, significand)

    def number(self, positive: bool, significand: int) -> _Number:
        peeked = self.peek_or_null()
        if peeked == 0x2E:  # '.'
            return _Number(self.decimal(positive, significand, 0))
        if peeked in (0x45, 0x65):  # 'E', 'e'
            return _Number(self.exponent(positive, significand, 0))
        if positive:
            return _Number(significand)
        # `(significand as i64).wrapping_neg()`; a result >= 0 (-0, or below i64::MIN) is a
        # float.
        as_i64 = significand - 2**64 if significand > _I64_MAX else significand
        negated = as_i64 if as_i64 == _I64_MIN else -as_i64
        return _Number(-float(significand)) if negated >= 0 else _Number(negated)

    def long_integer(self, positive: bool, significand: int) -> float:
        exponent = 0
        while True:
            peeked = self.peek_or_null()
            if 0x30 <= peeked <= 0x39:
                self.eat()
                exponent += 1
            elif peeked == 0x2E:
                return self.decimal(positive, significand, exponent)
            elif peeked in (0x45, 0x65):
                return self.exponent(positive, significand, exponent)
            else:
                return self.f64_from_parts(positive, significand, exponent)

    def decimal(self, positive: bool, significand: int, exponent_before: int) -> float:
        self.eat()
        exponent_after = 0
        while 0x30 <= (peeked := self.peek_or_null()) <= 0x39:
            digit = peeked - 0x30
            if _overflows(significand, digit, _U64_MAX):
                exponent = exponent_before + exponent_after
                return self.decimal_overflow(positive, significand, exponent)
            self.eat()
            significand = significand * 10 + digit
            exponent_after -= 1
        if exponent_after == 0:
            raise self.peek_error(_INVALID_NUMBER if self.peek() is not None else _EOF_VALUE)
        exponent = exponent_before + exponent_after
        if self.peek_or_null() in (0x45, 0x65):
            return self.exponent(positive, significand, exponent)
        return self.f64_from_parts(positive, significand, exponent)

    def decimal_overflow(self, positive: bool, significand: int, exponent: int) -> float:
        while 0x30 <= self.peek_or_null() <= 0x39:
            self.eat()
        if self.peek_or_null() in (0x45, 0x65):
            return self.exponent(positive, significand, exponent)
        return self.f64_from_parts(positive, significand, exponent)

    def exponent(self, positive: bool, significand: int, starting: int) -> float:
        self.eat()
        positive_exponent = True
        if self.peek_or_null() == 0x2B:  # '+'
            self.eat()
        elif self.peek_or_null() == 0x2D:  # '-'
            self.eat()
            positive_exponent = False
        first = self.next()
        if first is None:
            raise self.error(_EOF_VALUE)
        if not 0x30 <= first <= 0x39:
            raise self.error(_INVALID_NUMBER)
        exponent = first - 0x30
        while 0x30 <= (peeked := self.peek_or_null()) <= 0x39:
            self.eat()
            digit = peeked - 0x30
            if _overflows(exponent, digit, _I32_MAX):
                if significand != 0 and positive_exponent:
                    raise self.error(_NUMBER_OUT_OF_RANGE)
                while 0x30 <= self.peek_or_null() <= 0x39:
                    self.eat()
                return 0.0 if positive else -0.0
            exponent = exponent * 10 + digit
        final = starting + exponent if positive_exponent else starting - exponent
        return self.f64_from_parts(positive, significand, max(_I32_MIN, min(_I32_MAX, final)))

    def f64_from_parts(self, positive: bool, significand: int, exponent: int) -> float:
        value = float(significand)
        while True:
            if abs(exponent) < len(_POW10):
                if exponent >= 0:
                    value *= _POW10[exponent]
                    if math.isinf(value):
                        raise self.error(_NUMBER_OUT_OF_RANGE)
                else:
                    value /= _POW10[-exponent]
                break
            if value == 0.0:
                break
            if exponent >= 0:
                raise self.error(_NUMBER_OUT_OF_RANGE)
            value /= 1e308
            exponent += 308
        return value if positive else -value

    # -- strings

    def skip_plain(self) -> None:
        """Up to the next quote, backslash or control character (or the end)."""
        body = self.body
        while (
            self.index < len(body) and body[self.index] not in b'"\\' and body[self.index] >= 0x20
        ):
            self.index += 1

    def string(self) -> str:
        """The rest of a string whose opening quote was eaten, unescaped and checked."""
        raw = bytearray()
        start = self.index
        body = self.body
        while True:
            self.skip_plain()
            if self.index == len(body):
                raise self.error(_EOF_STRING)
            byte = body[self.index]
            if byte == 0x22:
                raw += body[start : self.index]
                self.index += 1
                try:
                    return raw.decode("utf-8")  # checked once the string is whole
                except UnicodeDecodeError:
                    raise self.error(_INVALID_UNICODE) from None
            if byte == 0x5C:
                raw += body[start : self.index]
                self.index += 1
                self.escape(raw)
                start = self.index
            else:
                self.index += 1
                raise self.error(_CONTROL_CHARACTER)

    def escape(self, raw: bytearray) -> None:
        char = self.next()
        if char is None:
            raise self.error(_EOF_STRING)
        simple = {
            0x22: b'"',
            0x5C: b"\\",
            0x2F: b"/",
            0x62: b"\b",
            0x66: b"\f",
            0x6E: b"\n",
            0x72: b"\r",
            0x74: b"\t",
        }
        if char in simple:
            raw += simple[char]
        elif char == 0x75:  # 'u'
            raw += self.unicode_escape().encode("utf-8")
        else:
            raise self.error(_INVALID_ESCAPE)

    def hex_escape(self) -> int:
        digits = self.body[self.index : self.index + 4]
        if len(digits) < 4:
            self.index = len(self.body)
            raise self.error(_EOF_STRING)
        self.index += 4
        try:
            if not all(c in b"0123456789abcdefABCDEF" for c in digits):
                raise ValueError
            return int(digits, 16)
        except ValueError:
            raise self.error(_INVALID_ESCAPE) from None

    def unicode_escape(self) -> str:
        code = self.hex_escape()
        if 0xDC00 <= code <= 0xDFFF:
            raise self.error(_LONE_SURROGATE)
        if not 0xD800 <= code <= 0xDBFF:
            return chr(code)
        for expected in (0x5C, 0x75):  # the trailing surrogate's `\u`
            got = self.peek()
            if got is None:
                raise self.error(_EOF_STRING)
            self.eat()
            if got != expected:
                raise self.error(_END_OF_HEX_ESCAPE)
        low = self.hex_escape()
        if not 0xDC00 <= low <= 0xDFFF:
            raise self.error(_LONE_SURROGATE)
        return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00))

    # -- skipping an unknown field's value

    def ignore_string(self) -> None:
        """Skips a string without decoding it: no UTF-8 check and no surrogate check (serde
        accepts those in an unknown field), and a control character is reported where it
        is, not after it."""
        body = self.body
        while True:
            self.skip_plain()
            if self.index == len(body):
                raise self.error(_EOF_STRING)
            byte = body[self.index]
            if byte == 0x22:
                self.index += 1
                return
            if byte != 0x5C:
                raise self.error(_CONTROL_CHARACTER)
            self.index += 1
            char = self.next()
            if char is None:
                raise self.error(_EOF_STRING)
            if char == 0x75:
                self.hex_escape()
            elif char not in b'"\\/bfnrt':
                raise self.error(_INVALID_ESCAPE)

    def ignore_integer(self) -> None:
        first = self.next()
        if first == 0x30:
            if 0x30 <= self.peek_or_null() <= 0x39:
                raise self.peek_error(_INVALID_NUMBER)
        elif first is not None and 0x31 <= first <= 0x39:
            while 0x30 <= self.peek_or_null() <= 0x39:
                self.eat()
        else:
            raise self.error(_INVALID_NUMBER)  # EOF included: no EOF error here
        if self.peek_or_null() == 0x2E:
            self.eat()
            if not 0x30 <= self.peek_or_null() <= 0x39:
                raise self.peek_error(_INVALID_NUMBER)
            while 0x30 <= self.peek_or_null() <= 0x39:
                self.eat()
        if self.peek_or_null() in (0x45, 0x65):
            self.eat()
            if self.peek_or_null() in (0x2B, 0x2D):
                self.eat()
            exponent = self.next()
            if exponent is None or not 0x30 <= exponent <= 0x39:
                raise self.error(_INVALID_NUMBER)
            while 0x30 <= self.peek_or_null() <= 0x39:
                self.eat()

    def ignore_value(self) -> None:
        """Skips one value of any depth: serde_json does it without recursion, with a stack
        of the open brackets, so it has no depth limit (and its own error choices)."""
        stack: list[int] = []
        while True:
            opened = self.ignore_scalar_or_open()
            if opened is not None:
                accept_comma, frame = False, opened
            elif stack:
                accept_comma, frame = True, stack.pop()
            else:
                return
            while True:  # closes as many brackets as follow
                peeked = self.whitespace()
                if peeked == 0x2C and accept_comma:
                    self.eat()
                    break
                if peeked is None:
                    raise self.peek_error(_EOF_LIST if frame == 0x5B else _EOF_OBJECT)
                if (peeked, frame) not in ((0x5D, 0x5B), (0x7D, 0x7B)):
                    if accept_comma:
                        raise self.peek_error(
                            _EXPECTED_LIST_COMMA_OR_END
                            if frame == 0x5B
                            else _EXPECTED_OBJECT_COMMA_OR_END
                        )
                    break
                self.eat()
                if not stack:
                    return
                frame = stack.pop()
                accept_comma = True
            if frame == 0x7B:
                self.ignore_member_key()
            stack.append(frame)

    def ignore_scalar_or_open(self) -> int | None:
        """The next value skipped if it is a scalar; if it is an array or an object, its
        bracket eaten and returned, for :meth:`ignore_value` to push."""
        peeked = self.whitespace()
        if peeked is None:
            raise self.peek_error(_EOF_VALUE)
        if peeked in b"ntf":
            self.eat()
            self.ident({0x6E: b"ull", 0x74: b"rue", 0x66: b"alse"}[peeked])
        elif peeked == 0x2D:
            self.eat()
            self.ignore_integer()
        elif 0x30 <= peeked <= 0x39:
            self.ignore_integer()
        elif peeked == 0x22:
            self.eat()
            self.ignore_string()
        elif peeked in b"[{":
            self.eat()
            return peeked
        else:
            raise self.peek_error(_EXPECTED_VALUE)
        return None

    def ignore_member_key(self) -> None:
        """The next object member's key and its colon, each missing one with serde's error."""
        peeked = self.whitespace()
        if peeked is None:
            raise self.peek_error(_EOF_OBJECT)
        if peeked != 0x22:
            raise self.peek_error(_KEY_MUST_BE_A_STRING)
        self.eat()
        self.ignore_string()
        peeked = self.whitespace()
        if peeked is None:
            raise self.peek_error(_EOF_OBJECT)
        if peeked != 0x3A:
            raise self.peek_error(_EXPECTED_COLON)
        self.eat()

    # -- a value of a given type

    def invalid_type(self, expected: str) -> _Error:
        """serde_json's ``peek_invalid_type``: reads the value that is not what ``expected``
        wants (a syntax error in it wins) to name it; a bracket is named unread."""
        peeked = self.peek_or_null()
        error: _Error
        if peeked in b"ntf":
            self.eat()
            self.ident({0x6E: b"ull", 0x74: b"rue", 0x66: b"alse"}[peeked])
            unexpected = {0x6E: "null", 0x74: "boolean `true`", 0x66: "boolean `false`"}[peeked]
            error = _invalid_type(unexpected, expected)
        elif peeked == 0x2D:
            self.eat()
            error = _invalid_type(self.integer(False).unexpected(), expected)
        elif 0x30 <= peeked <= 0x39:
            error = _invalid_type(self.integer(True).unexpected(), expected)
        elif peeked == 0x22:
            self.eat()
            error = _invalid_type(f"string {rust_debug(self.string())}", expected)
        elif peeked == 0x5B:
            error = _invalid_type("sequence", expected)
        elif peeked == 0x7B:
            error = _invalid_type("map", expected)
        else:
            error = self.peek_error(_EXPECTED_VALUE)
        return self.fix_position(error)

    def value(self, kind: str, path: tuple[str | int, ...]) -> None:
        """Deserializes one value of a field's type (its errors are ``path``'s)."""
        _tracked(path, lambda: self._value(kind, path))

    def _value(self, kind: str, path: tuple[str | int, ...]) -> None:
        spec = _KINDS[kind]
        peeked = self.whitespace()
        if peeked is None:
            raise self.peek_error(_EOF_VALUE)
        try:
            if kind == "string":
                if peeked != 0x22:
                    raise self.invalid_type(spec.expected)
                self.eat()
                self.string()
            elif kind == "hashes":
                if peeked != 0x5B:
                    raise self.invalid_type(spec.expected)
                self.eat()
                try:
                    self.elements(path, lambda index: self.value("i64", (*path, index)))
                except _Error:
                    self.end_seq(quiet=True)
                    raise
                self.end_seq()
            else:
                if peeked == 0x2D:
                    self.eat()
                    number = self.integer(False)
                elif 0x30 <= peeked <= 0x39:
                    number = self.integer(True)
                else:
                    raise self.invalid_type(spec.expected)
                if isinstance(number.value, float):
                    raise _invalid_type(number.unexpected(), spec.expected)
                if not spec.low <= number.value <= spec.high:
                    raise _invalid_value(number.unexpected(), spec.expected)
        except _Error as error:
            raise self.fix_position(error) from None

    # -- sequences and maps

    def elements(
        self, path: tuple[str | int, ...], element: Callable[[int], None], count: int | None = None
    ) -> int:
        """Reads up to ``count`` elements (all of them if None) of a sequence whose ``[`` was
        eaten, and returns how many there were; errors between elements are ``path``'s."""
        index = 0
        while count is None or index < count:
            peeked = _tracked(path, functools.partial(self.next_element, index == 0))
            if peeked is None:
                return index
            element(index)
            index += 1
        return index

    def next_element(self, first: bool) -> int | None:
        """serde_json's ``SeqAccess::next_element_seed`` up to the element: the byte that
        starts it, None at the closing bracket."""
        peeked = self.whitespace()
        if peeked == 0x5D:
            return None
        if peeked == 0x2C and not first:
            self.eat()
            peeked = self.whitespace()
        elif peeked is None:
            raise self.peek_error(_EOF_LIST)
        elif not first:
            raise self.peek_error(_EXPECTED_LIST_COMMA_OR_END)
        if peeked == 0x5D:
            raise self.peek_error(_TRAILING_COMMA)
        if peeked is None:
            raise self.peek_error(_EOF_VALUE)
        return peeked

    def end_seq(self, *, quiet: bool = False) -> None:
        """serde_json runs this after the visitor even when the visitor failed (``quiet``):
        then only where it leaves the index matters, for the failure's position."""
        peeked = self.whitespace()
        error: _Error
        if peeked == 0x5D:
            self.eat()
            return
        if peeked == 0x2C:
            self.eat()
            after = self.whitespace()
            error = self.peek_error(_TRAILING_COMMA if after == 0x5D else _TRAILING_CHARACTERS)
        elif peeked is None:
            error = self.peek_error(_EOF_LIST)
        else:
            error = self.peek_error(_TRAILING_CHARACTERS)
        if not quiet:
            raise error

    def end_map(self, *, quiet: bool = False) -> None:
        peeked = self.whitespace()
        error: _Error
        if peeked == 0x7D:
            self.eat()
            return
        if peeked == 0x2C:
            error = self.peek_error(_TRAILING_COMMA)
        elif peeked is None:
            error = self.peek_error(_EOF_OBJECT)
        else:
            error = self.peek_error(_TRAILING_CHARACTERS)
        if not quiet:
            raise error

    def next_key(self, first: bool) -> str | None:
        """serde_json's ``MapAccess::next_key_seed``: the next key, None at the closing
        brace."""
        peeked = self.whitespace()
        if peeked == 0x7D:
            return None
        if peeked == 0x2C and not first:
            self.eat()
            peeked = self.whitespace()
        elif peeked is None:
            raise self.peek_error(_EOF_OBJECT)
        elif not first:
            raise self.peek_error(_EXPECTED_OBJECT_COMMA_OR_END)
        if peeked == 0x22:
            self.eat()
            return self.string()
        if peeked == 0x7D:
            raise self.peek_error(_TRAILING_COMMA)
        if peeked is None:
            raise self.peek_error(_EOF_VALUE)
        raise self.peek_error(_KEY_MUST_BE_A_STRING)

    def colon(self) -> None:
        peeked = self.whitespace()
        if peeked is None:
            raise self.peek_error(_EOF_OBJECT)
        if peeked != 0x3A:
            raise self.peek_error(_EXPECTED_COLON)
        self.eat()

    # -- the request struct

    def request(self, struct: _Struct) -> None:
        """serde_json's ``deserialize_struct`` with serde's derived visitor: an object by
        field name, or an array by field position."""
        peeked = self.whitespace()
        if peeked is None:
            raise self.peek_error(_EOF_VALUE)
        try:
            if peeked == 0x7B:
                self.eat()
                try:
                    self.members(struct)
                except _Error:
                    self.end_map(quiet=True)
                    raise
                self.end_map()
            elif peeked == 0x5B:
                self.eat()
                try:
                    self.positional(struct)
                except _Error:
                    self.end_seq(quiet=True)
                    raise
                self.end_seq()
            else:
                raise self.invalid_type(f"struct {struct.name}")
        except _Error as error:
            raise self.fix_position(error) from None

    def members(self, struct: _Struct) -> None:
        seen: set[str] = set()
        first = True
        while (key := self.next_key(first)) is not None:
            first = False
            field = struct.field(key)
            if field is not None and key in seen:
                raise _Error(f"duplicate field `{key}`", data=True)  # before its colon
            self.colon()  # a missing colon is the object's error, not the field's
            if field is None:
                _tracked((key,), self.ignore_value)
            else:
                seen.add(key)
                self.value(field.kind, (key,))
        for field in struct.fields:
            if field.required and field.name not in seen:
                raise _Error(f"missing field `{field.name}`", data=True)

    def positional(self, struct: _Struct) -> None:
        def element(index: int) -> None:
            self.value(struct.fields[index].kind, (index,))

        read = self.elements((), element, count=len(struct.fields))
        for index in range(read, len(struct.fields)):
            if struct.fields[index].required:
                raise _Error(
                    f"invalid length {index}, expected struct {struct.name} with "
                    f"{len(struct.fields)} elements",
                    data=True,
                )


def extractor_error(route: str, body: bytes) -> tuple[int, str] | None:
    """The status (400 or 422) and the error text Dynamo's tracker answers ``body`` on
    ``route`` with; None if Dynamo accepts the body (for a body msgspec refused, one of the
    cases the module's docstring lists)."""
    reader = _Reader(body)
    try:
        reader.request(STRUCTS[route])
    except _Error as error:
        return (422 if error.data else 400), error.text(body)
    return None


# An integer written -0, as a value: serde_json reads it as the float -0.0, refused by every
# integer field (msgspec reads 0). A match in a string only costs the full scan.
_NEGATIVE_ZERO: Final = re.compile(rb"[:\[,][ \t\n\r]*-0[ \t\n\r]*[,\]}]")


def error_for_accepted(route: str, body: bytes) -> tuple[int, str] | None:
    """For a body msgspec accepted: the error Dynamo answers it with, or None if Dynamo
    accepts it too.

    Each body msgspec accepts and serde refuses has something rare in it: a field's quoted
    name twice, or a backslash (a key may spell a field's name with escapes); a ``-0`` value;
    bytes that are not UTF-8. The scan of :func:`extractor_error` runs only on those, so the
    common body costs a few substring counts, one regex search and, if it is not ASCII, a
    UTF-8 check.
    """
    suspect = (
        b"\\" in body
        or any(body.count(quoted) > 1 for quoted in _QUOTED[route])
        or _NEGATIVE_ZERO.search(body) is not None
        or not _is_utf8(body)
    )
    return extractor_error(route, body) if suspect else None


_QUOTED: Final = {
    route: tuple(f'"{field.name}"'.encode() for field in struct.fields)
    for route, struct in STRUCTS.items()
}


def accepted_fields(route: str, body: bytes) -> object:
    """The value Dynamo reads from a body it accepts and msgspec refused (the cases the module's
    docstring lists; :func:`extractor_error` said None): the body's first JSON value, what
    follows it ignored, and an array read positionally into the struct's fields, ready for
    ``msgspec.convert``. Raises ``RecursionError`` for nesting deeper than Python's parser
    goes, the one body of those this cannot read."""
    text = body.decode("utf-8", "surrogateescape")
    start = len(text) - len(text.lstrip(" \t\n\r"))
    value, _ = json.JSONDecoder().raw_decode(text, start)
    if isinstance(value, list):
        fields = STRUCTS[route].fields  # a shorter array: its missing fields are optional ones
        value = {field.name: item for field, item in zip(fields, value, strict=False)}
    return value


def _is_utf8(body: bytes) -> bool:
    if body.isascii():
        return True
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
