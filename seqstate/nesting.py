"""How deep a msgpack message nests, read without recursion.

msgspec's decoder recurses as the bytes nest, and Python's recursion limit counts the
caller's frames too: the same hostile bytes could be refused for one reason on a writer's
stack and another (or a RecursionError) on a replay's. No event nests deeper than three
levels, so a message that nests past :data:`MAX_NESTING` is refused for that, by this
iterative reading, whatever the stack. It runs only on bytes the decoder has already
refused, never on the fold's hot path.
"""

from __future__ import annotations

from typing import Final

MAX_NESTING: Final = 16  # an event nests three deep: [version, {field: [item]}]

# Bytes that open an array or a map (fixarray, fixmap, array16/32, map16/32).
_OPENERS: Final = bytes([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])
# Other type bytes: how many bytes of data follow (_FIXED), or how many bytes give the
# length of the data, and how many more precede it (_SIZED: an ext type byte).
_FIXED: Final = {
    0xC0: 0,
    0xC2: 0,
    0xC3: 0,
    0xCA: 4,
    0xCB: 8,
    0xCC: 1,
    0xCD: 2,
    0xCE: 4,
    0xCF: 8,
    0xD0: 1,
    0xD1: 2,
    0xD2: 4,
    0xD3: 8,
    0xD4: 2,
    0xD5: 3,
    0xD6: 5,
    0xD7: 9,
    0xD8: 17,
}
_SIZED: Final = {
    0xC4: (1, 0),
    0xC5: (2, 0),
    0xC6: (4, 0),
    0xC7: (1, 1),
    0xC8: (2, 1),
    0xC9: (4, 1),
    0xD9: (1, 0),
    0xDA: (2, 0),
    0xDB: (4, 0),
}


def nests_deeper(data: bytes | bytearray | memoryview, limit: int = MAX_NESTING) -> bool:
    """Whether ``data`` opens more than ``limit`` arrays or maps one inside another before it
    ends or stops making sense (truncated or invalid bytes end the reading: what was opened
    until then counts)."""
    raw = bytes(data)
    if sum(raw.count(b) for b in _OPENERS) <= limit:  # C speed: most refusals stop here
        return False
    left: list[int] = []  # items still to read in each open container
    pos, end = 0, len(raw)
    while pos < end:
        b = raw[pos]
        pos += 1
        items = -1
        if b <= 0x7F or b >= 0xE0:
            pass
        elif b <= 0x8F:
            items = 2 * (b & 0x0F)
        elif b <= 0x9F:
            items = b & 0x0F
        elif b <= 0xBF:
            pos += b & 0x1F
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED:
            width, extra = _SIZED[b]
            pos += width + extra + int.from_bytes(raw[pos : pos + width], "big")
        elif b >= 0xDC:  # 0xDC-0xDF: array16/32, map16/32
            width = 2 if b in (0xDC, 0xDE) else 4
            count = int.from_bytes(raw[pos : pos + width], "big")
            pos += width
            items = count if b <= 0xDD else 2 * count
        else:  # 0xC1: never used
            return False
        if items >= 0:
            if len(left) + 1 > limit:
                return True
            if items:
                left.append(items)
                continue
        while left:  # one item done: close the containers it completes
            left[-1] -= 1
            if left[-1]:
                break
            left.pop()
    return False
