"""Values as Dynamo's error texts show them: Rust's ``{:?}`` of a string, serde_json's float.

serde names a value it did not want (``invalid type: string "…", expected u64``), in Rust's
words; serve-http answers the same bytes (docs/slot-tracker-api.md), so the two formats are
copied here, each checked against the 1.6.1 wheel (tests/unit/test_serde_errors_text.py).
"""

from __future__ import annotations

import math
import unicodedata
from decimal import Decimal
from typing import Final


def _ranges(text: str) -> tuple[tuple[int, int], ...]:
    """``"9BE CC7-CC8"`` as ((0x9BE, 0x9BE), (0xCC7, 0xCC8)): code point ranges, in hex."""
    out = []
    for token in text.split():
        low, _, high = token.partition("-")
        out.append((int(low, 16), int(high or low, 16)))
    return tuple(out)


# Rust's `{:?}` of a str escapes a char that is Grapheme_Extend or not printable (general
# category Cc, Cf, Cs, Co, Cn, Zl, Zp or Zs, but space). Python knows Mn and Me but not the
# rest of Grapheme_Extend, and its character database (3.11: Unicode 14.0) is older than the
# wheel's Rust (Unicode 17.0): both gaps are listed here, as measured on the wheel over every
# code point (the second list: printed by the wheel, though unassigned, or Mn, in Unicode
# 14.0). With them, this rule matches the wheel on all of them.
_ALSO_GRAPHEME_EXTEND: Final = _ranges(
    """
    9BE 9D7 B3E B57 BBE BD7 CC0 CC2 CC7-CC8 CCA-CCB CD5-CD6 D3E D57 DCF DDF 1715 1734 1B35
    1B3B 1B3D 1B43-1B44 1BAA 1BF2-1BF3 302E-302F A953 A9C0 FF9E-FF9F 111C0 11235 1133E
    1134D 11357 114B0 114BD 115AF 116B6 11930 1193D 16FF0-16FF1 1D165-1D166 1D16D-1D172
    """
)
_PRINTABLE_SINCE_UNICODE_14: Final = _ranges(
    """
    88F C5C CDC CF3 1B4E-1B4F 1B7F 1C89-1C8A 20C1 2427-2429 2B96 2FFC-2FFF 31E4-31E5 31EF
    A7CB-A7CF A7D2 A7D4 A7DA-A7DC A7F1 FBC3-FBD2 FD90-FD91 FDC8-FDCE 105C0-105F3
    10940-10959 10D40-10D65 10D6E-10D85 10D8E-10D8F 10EC2-10EC7 10ED0-10ED8 1123F-11240
    11380-11389 1138B 1138E 11390-113B5 113B7 113B9-113BA 113CA 113CC-113CD 113D1
    113D3-113D5 113D7-113D8 116D0-116E3 1171E 11B00-11B09 11B61 11B65 11B67 11BC0-11BE1
    11BF0-11BF9 11DB0-11DDB 11DE0-11DE9 11F02-11F10 11F12-11F35 11F3E-11F3F 11F43-11F59
    1342F 13441-13446 13460-143FA 16100-1611D 1612A-1612C 16130-16139 16D40-16D79
    16EA0-16EB8 16EBB-16ED3 16FF2-16FF6 187F8-187FF 18CFF 18D09-18D1E 18D80-18DF2 1B132
    1B155 1CC00-1CCFC 1CD00-1CEB3 1CEBA-1CED0 1CEE0-1CEF0 1D2C0-1D2D3 1DF25-1DF2A
    1E030-1E06D 1E4D0-1E4EB 1E4F0-1E4F9 1E5D0-1E5ED 1E5F0-1E5FA 1E5FF 1E6C0-1E6DE
    1E6E0-1E6E2 1E6E4-1E6E5 1E6E7-1E6ED 1E6F0-1E6F4 1E6FE-1E6FF 1F6D8 1F6DC 1F774-1F77F
    1F7D9 1F8B2-1F8BB 1F8C0-1F8C1 1F8D0-1F8D8 1FA54-1FA57 1FA75-1FA77 1FA87-1FA8A
    1FA8E-1FA8F 1FAAD-1FAAF 1FABB-1FABF 1FAC6 1FAC8 1FACD-1FACF 1FADA-1FADC 1FADF
    1FAE8-1FAEA 1FAEF 1FAF7-1FAF8 1FBCB-1FBEF 1FBFA 2B739-2B73F 2CEA2-2CEAD 2EBF0-2EE5D
    31350-33479
    """
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
