"""The table of serde_json's refusals: for each shape of a bad body, the text and the position.

Dynamo's slot tracker reads a body with axum's ``Json`` extractor: serde_json, through
serde_path_to_error, into a ``#[derive(Deserialize)]`` struct. Its refusal is one line,
``<prefix><path>: <text> at line L column C``; serve-http answers the same bytes
(docs/slot-tracker-api.md). :mod:`.serde_reader` walks a body as serde_json does and names,
at each refusal, a row of :data:`CASES`; everything else of the answer is formatting
(:meth:`Refusal.text`). Every row was observed on the 1.6.1 wheel
(tests/unit/test_serde_errors_text.py, and tests/dynamo/test_extractor_errors.py against the
wheel itself).

A row's position rule says which byte serde_json's position is computed from:

- ``READ``: the reader's index, just after the byte read last (serde's ``error``);
- ``PEEK``: one byte further, the byte peeked at (serde's ``peek_error``), the body's end at
  most;
- ``VALUE``: a data error has no position of its own: serde_json gives it the index the reader
  is at when the error leaves the value being read (``fix_position``).

A ``VALUE`` row is a 422 (``Failed to deserialize …``), every other a 400 (``Failed to parse
…``). The path (``sequence_hashes[2]: ``) is the innermost field or element the error left.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from seqstate.errors import SeqstateError

PARSE_PREFIX: Final = "Failed to parse the request body as JSON: "
DATA_PREFIX: Final = "Failed to deserialize the JSON body into the target type: "


class At(enum.Enum):
    READ = "read"
    PEEK = "peek"
    VALUE = "value"


@dataclass(frozen=True)
class Case:
    text: str  # serde's words; a VALUE row's may name {unexpected}, {expected}, {field}...
    at: At


R, P, V = At.READ, At.PEEK, At.VALUE
_LIST_EOF = "EOF while parsing a list"
_OBJECT_EOF = "EOF while parsing an object"
_STRING_EOF = "EOF while parsing a string"
_VALUE_EOF = "EOF while parsing a value"
_NUMBER = "invalid number"
_RANGE = "number out of range"
_ESCAPE = "invalid escape"
_CONTROL = "control character (\\u0000-\\u001F) found while parsing a string"
_SURROGATE = "lone leading surrogate in hex escape"
_COMMA_LIST = "expected `,` or `]`"

# name: (serde's text, position rule). The name says the shape of the input.
CASES: Final[dict[str, Case]] = {
    name: Case(text, at)
    for name, (text, at) in {
        # a value is due
        "value.eof": (_VALUE_EOF, P),  # nothing where a value starts
        "value.none": ("expected value", P),  # a byte no value starts with
        # literals: null, true, false
        "literal.eof": (_VALUE_EOF, R),  # `nu` at the end
        "literal.wrong": ("expected ident", R),  # `nux`: at the wrong letter
        # numbers
        "number.eof": (_VALUE_EOF, R),  # `-` at the end
        "number.first": (_NUMBER, R),  # `-x`: not a digit after the sign
        "number.leading_zero": (_NUMBER, P),  # `01`
        "number.fraction_eof": (_VALUE_EOF, P),  # `1.` at the end
        "number.fraction": (_NUMBER, P),  # `1.x`
        "number.exponent_eof": (_VALUE_EOF, R),  # `1e` or `1e+` at the end
        "number.exponent": (_NUMBER, R),  # `1ex`
        "number.range": (_RANGE, R),  # `1e400`, or an exponent past i32 (not of a zero)
        "skipped_number.first": (_NUMBER, R),  # an unknown field's `-` (EOF too: no EOF error)
        "skipped_number.leading_zero": (_NUMBER, P),
        "skipped_number.fraction": (_NUMBER, P),  # `1.` and `1.x` alike
        "skipped_number.exponent": (_NUMBER, R),  # `1e`, `1e+` and `1ex` alike
        # strings
        "string.eof": (_STRING_EOF, R),  # no closing quote, or a cut escape
        "string.control": (_CONTROL, R),  # a byte below 0x20: after it
        "skipped_string.control": (_CONTROL, R),  # an unknown field's: at it
        "string.utf8": ("invalid unicode code point", R),  # a string read whole, not UTF-8
        "string.escape": (_ESCAPE, R),  # `\q`, or `\u12g4` (after its 4 digits)
        "string.lone_trailing": (_SURROGATE, R),  # `\udc00`, or a high one then not a low one
        "string.hex_end": ("unexpected end of hex escape", R),  # `\ud800x`
        # arrays
        "list.eof": (_LIST_EOF, P),  # no `]`
        "list.comma": (_COMMA_LIST, P),  # `[1 2]`
        "list.trailing_comma": ("trailing comma", P),  # `[1,]`
        "list.after": ("trailing characters", P),  # more than the struct's fields, by position
        # objects
        "object.eof": (_OBJECT_EOF, P),  # no `}`, or a key cut before its colon
        "object.comma": ("expected `,` or `}`", P),  # `{"a":1 "b":2}`
        "object.trailing_comma": ("trailing comma", P),  # `{"a":1,}`
        "object.key": ("key must be a string", P),  # `{1:2}`
        "object.colon": ("expected `:`", P),  # `{"a" 1}`
        # data errors (422)
        "data.invalid_type": ("invalid type: {unexpected}, expected {expected}", V),
        "data.invalid_value": ("invalid value: {unexpected}, expected {expected}", V),
        "data.duplicate": ("duplicate field `{field}`", V),  # a known field twice
        "data.missing": ("missing field `{field}`", V),  # checked once the object ends
        "data.length": (
            "invalid length {read}, expected struct {struct} with {count} elements",
            V,
        ),
    }.items()
}


class Refusal(SeqstateError, ValueError):
    """serde_json's error, with what serde_path_to_error adds.

    ``at`` is the byte offset the position is computed from; None until ``fix_position``
    gives a data error the offset the reader is at when the error leaves the value being
    deserialized. ``path`` is set once, by the innermost value the error leaves
    (serde_path_to_error keeps the first path it is told about).
    """

    def __init__(self, case: str, message: str, *, data: bool, at: int | None) -> None:
        super().__init__(message)
        self.case = case  # its row of CASES
        self.message = message
        self.data = data
        self.at = at
        self.path: tuple[str | int, ...] | None = None

    @classmethod
    def of(cls, name: str, index: int, length: int, **words: object) -> Refusal:
        """The refusal of row ``name`` for a reader at ``index`` of a body of ``length``."""
        case = CASES[name]
        at = {At.READ: index, At.PEEK: min(length, index + 1), At.VALUE: None}[case.at]
        text = case.text.format(**words) if words else case.text
        return cls(name, text, data=case.at is At.VALUE, at=at)

    @property
    def status(self) -> int:
        return 422 if self.data else 400

    def text(self, body: bytes) -> str:
        assert self.at is not None
        start = body.rfind(b"\n", 0, self.at) + 1
        line = 1 + body.count(b"\n", 0, start)
        prefix = DATA_PREFIX if self.data else PARSE_PREFIX
        where = _path_text(self.path or ())
        return f"{prefix}{where}{self.message} at line {line} column {self.at - start}"


def _path_text(path: tuple[str | int, ...]) -> str:
    """serde_path_to_error's ``Display`` of a path, with the ``: `` that follows it (nothing
    for the root): keys joined by dots, indices as ``[i]`` with no dot before them."""
    if not path:
        return ""
    out = "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in path)
    return out.removeprefix(".") + ": "


# ---- the target structs ---------------------------------------------------------------------

_U64_MAX: Final = 2**64 - 1


@dataclass(frozen=True)
class Kind:
    """A field's Rust type: serde's ``expecting`` text, and an integer's bounds."""

    expected: str
    low: int = 0
    high: int = _U64_MAX


KINDS: Final[dict[str, Kind]] = {
    "string": Kind("a string"),
    "u64": Kind("u64"),
    "u32": Kind("u32", high=2**32 - 1),
    "usize": Kind("usize"),
    "i64": Kind("i64", low=-(2**63), high=2**63 - 1),
    # Dynamo's own deserializer for the hashes: a sequence of i64 under another name.
    "hashes": Kind("an array of signed 64-bit sequence hashes"),
}


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # a key of KINDS
    required: bool = True  # False: `#[serde(default)]` (a missing one is no error)


@dataclass(frozen=True)
class Struct:
    """One of Dynamo's request structs, as serde derives it: the name and the field order are
    the Rust declaration's (not slot_api's), because they show in the texts: the first missing
    field is named in declaration order, and a JSON array is read positionally into the fields
    (``invalid length N, expected struct X with M elements``)."""

    name: str
    fields: tuple[Field, ...]

    def field(self, key: str) -> Field | None:
        return next((f for f in self.fields if f.name == key), None)


_MODEL = Field("model_name", "string")
_GROUP = Field("routing_group", "string", required=False)  # a default, not an Option: no null
_ID = Field("request_id", "string")
_HASHES = Field("sequence_hashes", "hashes")
_ISL = Field("new_isl_tokens", "usize", required=False)
_LIFECYCLE = Struct("LifecycleRequest", (_MODEL, _GROUP, _ID))
_U32 = {name: Field(name, "u32") for name in ("block_size", "dp_start", "dp_size", "dp_rank")}
_WORKER = Field("worker_id", "u64")

# Every route's body, observed on the wheel (field order from `[]`, `[{}]`, ... and from which
# missing field `{}` names first).
STRUCTS: Final[dict[str, Struct]] = {
    "/register": Struct(
        "RegisterRequest",
        (_WORKER, _MODEL, _GROUP, _U32["block_size"], _U32["dp_start"], _U32["dp_size"]),
    ),
    "/unregister": Struct("UnregisterRequest", (_WORKER, _MODEL, _GROUP)),
    "/add": Struct("AddRequest", (_MODEL, _GROUP, _ID, _WORKER, _U32["dp_rank"], _HASHES, _ISL)),
    "/prefill_complete": _LIFECYCLE,
    "/free": _LIFECYCLE,
    "/potential_loads": Struct("PotentialLoadsRequest", (_MODEL, _GROUP, _HASHES, _ISL)),
}
