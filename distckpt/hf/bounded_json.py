"""Reading untrusted JSON of a known shape (safetensors headers, weights indexes) at a
bounded cost.

``json.loads`` builds every value before the caller can look at any: a 99 MB header of
1.7 million empty tensors takes gigabytes and a minute, and a shape of two million
dimensions is two million ints before anything can count them. :class:`Scanner` instead
walks the document where the caller leads it, one value at a time, so the caller checks
counts while it reads (the entries of an object, the items of an array) and keeps only
what it checked. Nothing recurses: a value the caller does not want is skipped with an
explicit stack of bounded depth and size. Strings are found and decoded by the C code of
:mod:`json` (``scanstring`` on a growing window, then ``json.loads`` of the string
alone), so a document costs time linear in its bytes and memory of one string at a
time beyond what the caller keeps.

Every problem is one :class:`~distckpt.errors.CorruptCheckpointError` that names the
document (``where``) and the byte where it was found.
"""

from __future__ import annotations

import json
import json.decoder
import re
from collections.abc import Callable, Iterator

from distckpt.errors import CorruptCheckpointError

#: Nesting of a skipped value (arrays and objects inside each other).
MAX_DEPTH = 64
#: Values inside one skipped value (its items, at any depth).
MAX_SKIPPED = 1 << 16
#: Bytes of a key as stored (a tensor's name, in a safetensors header).
MAX_KEY_BYTES = 1 << 16
#: Bytes of any other string as stored.
MAX_STRING_BYTES = 1 << 24
#: Decimal digits of a count: any 64-bit unsigned int fits in 20.
MAX_DIGITS = 20

_WS = re.compile(rb"[ \t\n\r]*")
_COUNT = re.compile(rb"(0|[1-9][0-9]*)(?![0-9.eE+-])")
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_LITERAL = re.compile(rb"true|false|null")
_FIRST_WINDOW = 256
# json's C scanner of one string (``json.decoder`` exports it; typeshed does not say so).
_scanstring: Callable[[str, int, bool], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]


class Scanner:
    """A cursor over the bytes ``raw`` of one JSON document (see the module doc); its
    methods read one value each at the cursor, after any whitespace."""

    def __init__(self, raw: bytes, where: str, doc: str = "the document") -> None:
        self.raw = raw
        self.where = where  # the file, in messages
        self.doc = doc  # what the file holds, in messages
        self.pos = 0

    def fail(self, what: str) -> CorruptCheckpointError:
        """An error about the document."""
        return CorruptCheckpointError(f"{self.where}: {what}")

    def bad(self, what: str) -> CorruptCheckpointError:
        """An error about the document's syntax at the cursor."""
        return self.fail(f"{self.doc} is not JSON: {what} at byte {self.pos}")

    def _skip_ws(self) -> int:
        match = _WS.match(self.raw, self.pos)
        assert match is not None  # [ \t\n\r]* matches the empty string
        self.pos = match.end()
        return self.raw[self.pos] if self.pos < len(self.raw) else -1

    def peek(self) -> str:
        """The next character after whitespace ("" at the end), not consumed."""
        c = self._skip_ws()
        return chr(c) if c >= 0 else ""

    def take(self, char: str) -> bool:
        """Consume ``char`` (after whitespace) if it is next."""
        if self.peek() == char:
            self.pos += 1
            return True
        return False

    def member_end(self, matched: bytes | None, what: str) -> bool:
        """After a member of an object: whether the object closed. ``matched`` is the
        ``}`` or ``,`` a caller's fast path already consumed (empty or None: none)."""
        if matched:
            return matched == b"}"
        if self.take("}"):
            return True
        if not self.take(","):
            raise self.bad(f"expected ',' or '}}' in {what}")
        return False

    def expect(self, char: str) -> None:
        if not self.take(char):
            raise self.bad(f"expected {char!r}")

    def end(self) -> None:
        """Only whitespace is left."""
        if self.peek():
            raise self.bad("unexpected data after the document")

    def string(self, limit: int, what: str = "a string") -> str:
        """A string of at most ``limit`` bytes as stored (escapes included)."""
        if self.peek() != '"':
            raise self.bad(f"expected {what}")
        start = self.pos + 1
        window = min(_FIRST_WINDOW, limit + 1)
        while True:
            # latin-1: one character per byte, so positions in the text are byte offsets.
            text = self.raw[start : start + window].decode("latin-1")
            try:
                _, stop = _scanstring(text, 0, True)
                break
            except json.JSONDecodeError as exc:
                cut = start + window < len(self.raw)  # the window ends inside the document
                if cut and window <= limit:  # the string may go on: look further
                    window = min(window * 4, limit + 1)
                    continue
                if cut and (exc.msg.startswith("Unterminated") or exc.pos >= window - 6):
                    raise self.fail(
                        f"{what} at byte {self.pos} is longer than {limit} bytes"
                    ) from None
                msg = exc.msg.removesuffix(" at").removesuffix(" starting").lower()
                raise self.bad(f"{msg} in {what}") from None
        try:
            value = json.loads(self.raw[self.pos : start + stop].decode("utf-8"))
        except UnicodeDecodeError:
            raise self.bad(f"{what} that is not UTF-8") from None
        self.pos = start + stop
        assert isinstance(value, str)
        return value

    def utf8(self, raw: bytes, what: str) -> str:
        """``raw``, the bytes of a string matched without escapes, decoded."""
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.bad(f"{what} that is not UTF-8") from None

    def count(self, what: str) -> int:
        """A non-negative integer of at most :data:`MAX_DIGITS` digits."""
        self._skip_ws()
        match = _COUNT.match(self.raw, self.pos)
        if match is None or len(match[1]) > MAX_DIGITS:
            raise self.fail(f"{what}: {self.snippet()} is not a count")
        self.pos = match.end()
        return int(match[1])

    def counts(self, most: int, what: str, items: str = "entries") -> list[int]:
        """An array of at most ``most`` counts (``items``, in a message)."""
        if self.peek() != "[":
            raise self.fail(f"{what}: {self.snippet()} is not a list of counts")
        self.pos += 1
        out: list[int] = []
        if self.take("]"):
            return out
        while True:
            if len(out) == most:
                raise self.fail(f"{what}: more than {most} {items}")
            out.append(self.count(what))
            if self.take(","):
                continue
            if self.take("]"):
                return out
            raise self.bad(f"expected ',' or ']' in {what}")

    def keys(self, most: int, what: str) -> Iterator[str]:
        """The keys (each at most :data:`MAX_KEY_BYTES`) of an object of at most ``most``
        entries; the caller reads (or :meth:`skip`\\ s) each key's value before asking for
        the next key."""
        if self.peek() != "{":
            raise self.fail(f"{what}: {self.snippet()} is not an object")
        self.pos += 1
        if self.take("}"):
            return
        seen = 0
        while True:
            seen += 1
            if seen > most:
                raise self.fail(f"{what}: more than {most} entries")
            key = self.string(MAX_KEY_BYTES, f"a key of {what}")
            self.expect(":")
            yield key
            if self.take(","):
                continue
            if self.take("}"):
                return
            raise self.bad(f"expected ',' or '}}' in {what}")

    def skip(self, what: str) -> str:
        """Skip one value of any kind: at most :data:`MAX_DEPTH` deep and
        :data:`MAX_SKIPPED` values in all, read without recursion. Returns its text,
        shortened, for a message."""
        self._skip_ws()
        start = self.pos
        closers: list[str] = []
        values = 0
        while True:
            values += 1
            if values > MAX_SKIPPED:
                raise self.fail(f"{what} holds more than {MAX_SKIPPED} values")
            c = self.peek()
            if c and c in "[{":
                if len(closers) == MAX_DEPTH:
                    raise self.fail(f"{what} nests deeper than {MAX_DEPTH}")
                self.pos += 1
                closers.append("]" if c == "[" else "}")
                if self.take(closers[-1]):
                    closers.pop()
                elif c == "{":
                    self.string(MAX_KEY_BYTES, f"a key in {what}")
                    self.expect(":")
                    continue
                else:
                    continue
            elif c == '"':
                self.string(MAX_STRING_BYTES, f"a string in {what}")
            else:
                number = c != "" and c in "-0123456789"
                match = (_NUMBER if number else _LITERAL).match(self.raw, self.pos)
                if match is None:
                    raise self.bad(f"expected a value in {what}")
                self.pos = match.end()
            # After a value: the next item of the container, or its end (any number).
            while closers:
                if self.take(","):
                    if closers[-1] == "}":
                        self.string(MAX_KEY_BYTES, f"a key in {what}")
                        self.expect(":")
                    break
                if not self.take(closers[-1]):
                    raise self.bad(f"expected ',' or {closers[-1]!r} in {what}")
                closers.pop()
            if not closers:
                return _short(self.raw[start : self.pos])

    def snippet(self) -> str:
        """The bytes at the cursor, shortened, for a message."""
        return _short(self.raw[self.pos : self.pos + 41])


def _short(raw: bytes) -> str:
    text = raw[:40].decode("utf-8", "replace")
    return text + "..." if len(raw) > 40 else text
