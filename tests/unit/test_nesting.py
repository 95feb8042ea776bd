"""seqstate.nesting: msgpack nesting read without recursion, on bytes the decoder refused."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from seqstate.nesting import MAX_NESTING, nests_deeper

pytestmark = pytest.mark.core


def nested(depth: int, leaf: object = None) -> object:
    value = leaf
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


@pytest.mark.parametrize("depth", [0, 1, 3, MAX_NESTING])
def test_up_to_the_limit_is_not_deeper(depth: int) -> None:
    for leaf in (None, 1, "x", 2.5, b"b", 2**64 - 1, -(2**63)):
        assert not nests_deeper(msgspec.msgpack.encode(nested(depth, leaf)))


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 1000, 200_000])
def test_past_the_limit_is_deeper_even_truncated(depth: int) -> None:
    data = b"\x92\x01" + b"\x91" * depth + b"\xc0"
    assert nests_deeper(data)
    assert nests_deeper(data[: 2 + MAX_NESTING + 1])  # the bytes end: what was opened counts
    assert nests_deeper(b"\x92\x01" + b"\x81\xa1k" * depth + b"\xc0")
    assert nests_deeper(b"\xdc\x00\x01" * depth)  # array16 headers


def test_siblings_are_not_depth() -> None:
    wide = [[[1, 2]] * 50, {"a": [[]] * 40}, list(range(300))]
    assert not nests_deeper(msgspec.msgpack.encode(wide))
    assert not nests_deeper(b"\x90" * 100)  # a hundred empty arrays side by side


def test_bytes_that_stop_making_sense_end_the_reading() -> None:
    assert not nests_deeper(b"\x91" * 3 + b"\xc1" + b"\x91" * 100)


@given(
    st.recursive(
        st.none() | st.integers(-(2**63), 2**64 - 1) | st.text() | st.binary(),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
        ),
        max_leaves=40,
    )
)
def test_agrees_with_the_depth_of_any_encoded_value(value: object) -> None:
    def depth(v: object) -> int:
        if isinstance(v, list):
            return 1 + max((depth(x) for x in v), default=0)
        if isinstance(v, dict):
            return 1 + max((depth(x) for x in v.values()), default=0)
        return 0

    data = msgspec.msgpack.encode(value)
    for limit in (0, 1, 2, 3):
        assert nests_deeper(data, limit) == (depth(value) > limit)
