"""serde_json's walk over a request body into one of Dynamo's structs, to its refusal.

On top of :class:`.serde_scan.Scanner`: a field's value read as its Rust type wants it (the
value it did not want named in Rust's words), arrays and objects with serde's checks between
their items and at their end, the struct by field name or by position, and the path of the
field or element a refusal leaves. It runs only on the error path (and on the rare bodies
msgspec and serde read differently).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from projector.http.rust_text import rust_debug
from projector.http.serde_cases import KINDS, Refusal, Struct
from projector.http.serde_scan import CLOSES, DIGITS, LITERALS, Scanner

_T = TypeVar("_T")
Path = tuple[str | int, ...]


def _tracked(path: Path, run: Callable[[], _T]) -> _T:
    """Runs a step whose errors belong to ``path`` unless a deeper step claimed them first."""
    try:
        return run()
    except Refusal as error:
        if error.path is None:
            error.path = path
        raise


class Reader(Scanner):
    """A body read into a struct. ``fields``: each known field's value, as the bytes it was
    read from (for a body serde accepts)."""

    def __init__(self, body: bytes) -> None:
        super().__init__(body)
        self.fields: dict[str, bytes] = {}

    # -- a value of a given type

    def invalid_type(self, expected: str) -> Refusal:
        """serde_json's ``peek_invalid_type``: reads the value that is not what ``expected``
        wants (a syntax error in it wins) to name it; a bracket is named unread."""
        peeked = self.peek_or_null()
        if peeked in LITERALS:
            self.eat()
            rest, unexpected = LITERALS[peeked]
            self.ident(rest)
        elif peeked == 0x2D:
            self.eat()
            unexpected = self.integer(False).unexpected()
        elif peeked in DIGITS:
            unexpected = self.integer(True).unexpected()
        elif peeked == 0x22:
            self.eat()
            unexpected = f"string {rust_debug(self.string())}"
        elif peeked in b"[{":
            unexpected = "sequence" if peeked == 0x5B else "map"
        else:
            return self.fix_position(self.fail("value.none"))
        return self.fix_position(
            self.fail("data.invalid_type", unexpected=unexpected, expected=expected)
        )

    def value(self, kind: str, path: Path) -> None:
        """Deserializes one value of a field's type (its errors are ``path``'s)."""
        _tracked(path, lambda: self._value(kind, path))

    def _value(self, kind: str, path: Path) -> None:
        spec = KINDS[kind]
        peeked = self.whitespace()
        if peeked is None:
            raise self.fail("value.eof")
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
                self.sequence(lambda: self.elements(path, lambda i: self.value("i64", (*path, i))))
            else:
                if peeked == 0x2D:
                    self.eat()
                    number = self.integer(False)
                elif peeked in DIGITS:
                    number = self.integer(True)
                else:
                    raise self.invalid_type(spec.expected)
                words = {"unexpected": number.unexpected(), "expected": spec.expected}
                if isinstance(number.value, float):
                    raise self.fail("data.invalid_type", **words)
                if not spec.low <= number.value <= spec.high:
                    raise self.fail("data.invalid_value", **words)
        except Refusal as error:
            raise self.fix_position(error) from None

    # -- sequences and maps

    def sequence(self, visit: Callable[[], object]) -> None:
        """A sequence whose ``[`` was eaten: ``visit`` reads its elements, then its end is
        checked; serde_json checks it after a failed visit too, and then only where that
        leaves the index matters (for the failure's position)."""
        try:
            visit()
        except Refusal:
            self.end("list", quiet=True)
            raise
        self.end("list")

    def elements(self, path: Path, element: Callable[[int], None], count: int | None = None) -> int:
        """Reads up to ``count`` elements (all of them if None) of a sequence whose ``[`` was
        eaten, and returns how many there were; errors between elements are ``path``'s."""
        index = 0
        while count is None or index < count:
            peeked = _tracked(path, functools.partial(self.next_item, "list", index == 0))
            if peeked is None:
                return index
            element(index)
            index += 1
        return index

    def next_item(self, kind: str, first: bool) -> int | None:
        """serde_json's ``next_element_seed`` / ``next_key_seed`` up to the item: the byte that
        starts the next element or member, None at the closing bracket."""
        close = CLOSES[0x5B if kind == "list" else 0x7B][0]
        peeked = self.whitespace()
        if peeked == close:
            return None
        if peeked == 0x2C and not first:
            self.eat()
            peeked = self.whitespace()
        elif peeked is None:
            raise self.fail(f"{kind}.eof")
        elif not first:
            raise self.fail(f"{kind}.comma")
        if peeked == close:
            raise self.fail(f"{kind}.trailing_comma")
        if peeked is None:
            raise self.fail("value.eof")
        return peeked

    def end(self, kind: str, *, quiet: bool = False) -> None:
        """serde_json's ``end_seq`` / ``end_map``: the closing bracket, or the error there.
        ``quiet``: after a failed visit, when only where it leaves the index matters (a list
        eats a comma there). An object's members were read up to its ``}`` unless they
        failed, so an object has no error of its own here."""
        close = CLOSES[0x5B if kind == "list" else 0x7B][0]
        peeked = self.whitespace()
        if peeked == close:
            self.eat()
            return
        if kind == "object":
            return
        if peeked == 0x2C:  # a list looks past the comma
            self.eat()
            after = self.whitespace()
            error = self.fail("list.trailing_comma" if after == close else "list.after")
        else:
            error = self.fail("list.eof" if peeked is None else "list.after")
        if not quiet:
            raise error

    def next_key(self, first: bool) -> str | None:
        """The next member's key, None at the closing brace."""
        peeked = self.next_item("object", first)
        if peeked is None:
            return None
        if peeked != 0x22:
            raise self.fail("object.key")
        self.eat()
        return self.string()

    # -- the request struct

    def request(self, struct: Struct) -> None:
        """serde_json's ``deserialize_struct`` with serde's derived visitor: an object by
        field name, or an array by field position."""
        peeked = self.whitespace()
        if peeked is None:
            raise self.fail("value.eof")
        try:
            if peeked == 0x7B:
                self.eat()
                try:
                    self.members(struct)
                except Refusal:
                    self.end("object", quiet=True)
                    raise
                self.end("object")
            elif peeked == 0x5B:
                self.eat()
                self.sequence(lambda: self.positional(struct))
            else:
                raise self.invalid_type(f"struct {struct.name}")
        except Refusal as error:
            raise self.fix_position(error) from None

    def known(self, name: str, kind: str, path: Path) -> None:
        """A known field's value, kept as the bytes it was read from."""
        start = self.index
        self.value(kind, path)
        self.fields[name] = self.body[start : self.index]

    def members(self, struct: Struct) -> None:
        first = True
        while (key := self.next_key(first)) is not None:
            first = False
            field = struct.field(key)
            if field is not None and key in self.fields:
                raise self.fail("data.duplicate", field=key)  # before its colon
            self.colon()  # a missing colon is the object's error, not the field's
            if field is None:
                _tracked((key,), self.ignore_value)
            else:
                self.known(key, field.kind, (key,))
        for field in struct.fields:
            if field.required and field.name not in self.fields:
                raise self.fail("data.missing", field=field.name)

    def positional(self, struct: Struct) -> None:
        fields = struct.fields

        def element(index: int) -> None:
            self.known(fields[index].name, fields[index].kind, (index,))

        read = self.elements((), element, count=len(fields))
        for index in range(read, len(fields)):
            if fields[index].required:
                raise self.fail("data.length", read=index, struct=struct.name, count=len(fields))
