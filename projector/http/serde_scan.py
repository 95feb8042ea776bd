"""serde_json's lexical reading of a body: bytes, literals, numbers, strings, skipped values.

Which refusal a bad body gets depends on what serde_json reads first, so this reads as
``Deserializer<SliceRead>`` does: byte by byte, with the same lookahead, the same number
parsing (a u64 significand, a float past it, serde's own multiplication by powers of ten),
the same string checks (UTF-8 only once a string is whole, none for an unknown field's) and
the same skipping of unknown fields (no recursion: no depth limit). Where it stops, it names
a row of :data:`.serde_cases.CASES`, which holds the texts and the position rules;
:mod:`.serde_reader` reads the typed fields on top of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from projector.http.rust_text import rust_float
from projector.http.serde_cases import Refusal

_U64_MAX: Final = 2**64 - 1
_I64_MIN: Final = -(2**63)
_I64_MAX: Final = 2**63 - 1
_I32_MAX: Final = 2**31 - 1
_I32_MIN: Final = -(2**31)
DIGITS: Final = range(0x30, 0x3A)
_EXPONENT: Final = (0x45, 0x65)  # E e
LITERALS: Final = {
    0x6E: (b"ull", "null"),
    0x74: (b"rue", "boolean `true`"),
    0x66: (b"alse", "boolean `false`"),
}
_SIMPLE_ESCAPES: Final = {
    0x22: b'"',
    0x5C: b"\\",
    0x2F: b"/",
    0x62: b"\b",
    0x66: b"\f",
    0x6E: b"\n",
    0x72: b"\r",
    0x74: b"\t",
}
CLOSES: Final = {0x5B: (0x5D, "list"), 0x7B: (0x7D, "object")}
# serde_json multiplies or divides by these (1e0 ... 1e308), each the nearest double, as
# Python's float() reads it; it does not round correctly overall, and this copies that.
_POW10: Final = tuple(float(f"1e{n}") for n in range(309))


def _overflows(value: int, digit: int, limit: int) -> bool:
    return value >= limit // 10 and (value > limit // 10 or digit > limit % 10)


@dataclass(frozen=True)
class _Number:
    """serde_json's ParserNumber: a non-negative integer, a negative one, or a float."""

    value: int | float

    def unexpected(self) -> str:
        if isinstance(self.value, float):
            return f"floating point `{rust_float(self.value)}`"
        return f"integer `{self.value}`"


class Scanner:
    """serde_json's ``Deserializer<SliceRead>``: the bytes and an index into them."""

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

    def fail(self, case: str, **words: object) -> Refusal:
        """The refusal of :data:`CASES` row ``case``, positioned by its rule."""
        return Refusal.of(case, self.index, len(self.body), **words)

    def fix_position(self, error: Refusal) -> Refusal:
        if error.at is None:
            error.at = self.index
        return error

    # -- literals and numbers

    def ident(self, rest: bytes) -> None:
        for expected in rest:
            got = self.next()
            if got is None:
                raise self.fail("literal.eof")
            if got != expected:
                raise self.fail("literal.wrong")

    def integer(self, positive: bool) -> _Number:
        first = self.next()
        if first is None:
            raise self.fail("number.eof")
        if first == 0x30:  # '0': only one leading zero
            if self.peek_or_null() in DIGITS:
                raise self.fail("number.leading_zero")
            return self.number(positive, 0)
        if first not in DIGITS:
            raise self.fail("number.first")
        significand = first - 0x30
        while (peeked := self.peek_or_null()) in DIGITS:
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
        if peeked in _EXPONENT:
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
            if peeked in DIGITS:
                self.eat()
                exponent += 1
            elif peeked == 0x2E:
                return self.decimal(positive, significand, exponent)
            elif peeked in _EXPONENT:
                return self.exponent(positive, significand, exponent)
            else:
                return self.f64_from_parts(positive, significand, exponent)

    def decimal(self, positive: bool, significand: int, exponent_before: int) -> float:
        self.eat()
        exponent_after = 0
        while (peeked := self.peek_or_null()) in DIGITS:
            digit = peeked - 0x30
            if _overflows(significand, digit, _U64_MAX):
                while self.peek_or_null() in DIGITS:  # the digits past u64 count for nothing
                    self.eat()
                break
            self.eat()
            significand = significand * 10 + digit
            exponent_after -= 1
        else:
            if exponent_after == 0:
                raise self.fail(
                    "number.fraction" if self.peek() is not None else "number.fraction_eof"
                )
        exponent = exponent_before + exponent_after
        if self.peek_or_null() in _EXPONENT:
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
            raise self.fail("number.exponent_eof")
        if first not in DIGITS:
            raise self.fail("number.exponent")
        exponent = first - 0x30
        while (peeked := self.peek_or_null()) in DIGITS:
            self.eat()
            digit = peeked - 0x30
            if _overflows(exponent, digit, _I32_MAX):
                if significand != 0 and positive_exponent:
                    raise self.fail("number.range")
                while self.peek_or_null() in DIGITS:
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
                        raise self.fail("number.range")
                else:
                    value /= _POW10[-exponent]
                break
            if value == 0.0:
                break
            if exponent >= 0:
                raise self.fail("number.range")
            value /= 1e308
            exponent += 308
        return value if positive else -value

    # -- strings

    def plain(self) -> int:
        """Skips to the next quote, backslash or control character and returns it (not
        eaten); a string cut there is a refusal."""
        body = self.body
        while (
            self.index < len(body) and body[self.index] not in b'"\\' and body[self.index] >= 0x20
        ):
            self.index += 1
        if self.index == len(body):
            raise self.fail("string.eof")
        return body[self.index]

    def string(self) -> str:
        """The rest of a string whose opening quote was eaten, unescaped and checked."""
        raw = bytearray()
        start = self.index
        body = self.body
        while True:
            byte = self.plain()
            if byte == 0x22:
                raw += body[start : self.index]
                self.index += 1
                try:
                    return raw.decode("utf-8")  # checked once the string is whole
                except UnicodeDecodeError:
                    raise self.fail("string.utf8") from None
            if byte == 0x5C:
                raw += body[start : self.index]
                self.index += 1
                self.escape(raw)
                start = self.index
            else:
                self.index += 1
                raise self.fail("string.control")

    def escape(self, raw: bytearray) -> None:
        char = self.next()
        if char is None:
            raise self.fail("string.eof")
        if char in _SIMPLE_ESCAPES:
            raw += _SIMPLE_ESCAPES[char]
        elif char == 0x75:  # 'u'
            raw += self.unicode_escape().encode("utf-8")
        else:
            raise self.fail("string.escape")

    def hex_escape(self) -> int:
        digits = self.body[self.index : self.index + 4]
        if len(digits) < 4:
            self.index = len(self.body)
            raise self.fail("string.eof")
        self.index += 4
        if not all(c in b"0123456789abcdefABCDEF" for c in digits):
            raise self.fail("string.escape")
        return int(digits, 16)

    def unicode_escape(self) -> str:
        code = self.hex_escape()
        if 0xDC00 <= code <= 0xDFFF:
            raise self.fail("string.lone_trailing")
        if not 0xD800 <= code <= 0xDBFF:
            return chr(code)
        for expected in (0x5C, 0x75):  # the trailing surrogate's `\u`
            got = self.peek()
            if got is None:
                raise self.fail("string.eof")
            self.eat()
            if got != expected:
                raise self.fail("string.hex_end")
        low = self.hex_escape()
        if not 0xDC00 <= low <= 0xDFFF:
            raise self.fail("string.lone_trailing")
        return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00))

    # -- skipping an unknown field's value

    def ignore_string(self) -> None:
        """Skips a string without decoding it: no UTF-8 check and no surrogate check (serde
        accepts those in an unknown field), and a control character is reported where it
        is, not after it."""
        while True:
            byte = self.plain()
            if byte == 0x22:
                self.index += 1
                return
            if byte != 0x5C:
                raise self.fail("skipped_string.control")
            self.index += 1
            char = self.next()
            if char is None:
                raise self.fail("string.eof")
            if char == 0x75:
                self.hex_escape()
            elif char not in b'"\\/bfnrt':
                raise self.fail("string.escape")

    def ignore_integer(self) -> None:
        first = self.next()
        if first == 0x30:
            if self.peek_or_null() in DIGITS:
                raise self.fail("skipped_number.leading_zero")
        elif first is not None and 0x31 <= first <= 0x39:
            while self.peek_or_null() in DIGITS:
                self.eat()
        else:
            raise self.fail("skipped_number.first")
        if self.peek_or_null() == 0x2E:
            self.eat()
            if self.peek_or_null() not in DIGITS:
                raise self.fail("skipped_number.fraction")
            while self.peek_or_null() in DIGITS:
                self.eat()
        if self.peek_or_null() in _EXPONENT:
            self.eat()
            if self.peek_or_null() in (0x2B, 0x2D):
                self.eat()
            exponent = self.next()
            if exponent is None or exponent not in DIGITS:
                raise self.fail("skipped_number.exponent")
            while self.peek_or_null() in DIGITS:
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
                close, kind = CLOSES[frame]
                if peeked is None:
                    raise self.fail(f"{kind}.eof")
                if peeked != close:
                    if accept_comma:
                        raise self.fail(f"{kind}.comma")
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
            raise self.fail("value.eof")
        if peeked in LITERALS:
            self.eat()
            self.ident(LITERALS[peeked][0])
        elif peeked == 0x2D:
            self.eat()
            self.ignore_integer()
        elif peeked in DIGITS:
            self.ignore_integer()
        elif peeked == 0x22:
            self.eat()
            self.ignore_string()
        elif peeked in b"[{":
            self.eat()
            return peeked
        else:
            raise self.fail("value.none")
        return None

    def ignore_member_key(self) -> None:
        """The next object member's key and its colon, each missing one with serde's error."""
        self.member_byte(0x22, "object.key")
        self.ignore_string()
        self.colon()

    def colon(self) -> None:
        self.member_byte(0x3A, "object.colon")

    def member_byte(self, wanted: int, otherwise: str) -> None:
        """``wanted`` (a key's quote, a colon) eaten inside an object, or the refusal."""
        peeked = self.whitespace()
        if peeked is None:
            raise self.fail("object.eof")
        if peeked != wanted:
            raise self.fail(otherwise)
        self.eat()
