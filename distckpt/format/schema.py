"""The index's JSON Schema (``index.schema.json``, shipped beside this module), and the
check every reader makes against it.

The schema is the published statement of the index's structure (draft 2020-12): another
implementation can validate with any JSON Schema library. distckpt checks with the small
validator below instead, for the keywords the schema uses and no others (a keyword it
does not know is an error when the schema is loaded, not a rule silently skipped): it
needs no dependency and compiles the schema once into closures, so a reader pays
tens of microseconds per index entry. The suite checks that it agrees with the reference
implementation (``jsonschema``) on valid and damaged indexes.

What a schema cannot say (pieces tile their tensor exactly once, boxes lie inside the
shape, sizes are backed by stored bytes, the seal matches) is checked by
:mod:`distckpt.format.wellformed` and :mod:`distckpt.format.seal`.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Sized
from importlib import resources
from typing import Any

#: A failure: the path to the value (innermost first, so that each level appends its
#: key on the way out and a value that passes builds no path) and what is wrong.
Failure = tuple[list[Any], str]
#: A check of one value: None when it follows its schema, else its failure.
Check = Callable[[Any], "Failure | None"]

#: Keywords that state nothing to check.
ANNOTATIONS = {"$schema", "$id", "$defs", "title", "description", "$comment"}

SCHEMA_FILE = "index.schema.json"
#: Where the index's entries are, in the root document.
VARIABLES = ["attributes", "distckpt", "variables"]


@functools.cache
def index_schema() -> dict[str, Any]:
    """The index's JSON Schema, as shipped."""
    text = resources.files("distckpt.format").joinpath(SCHEMA_FILE).read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


@functools.cache
def index_check() -> Check:
    """The compiled check of a root ``zarr.json`` document against :func:`index_schema`."""
    return Compiler(index_schema()).compile(index_schema())


def problem(doc: Any) -> str | None:
    """What is wrong with ``doc`` (a root ``zarr.json`` document, parsed) by the index
    schema, naming where (a JSON pointer); None when it follows it."""
    try:
        found = index_check()(doc)
    except RecursionError:
        return "it nests deeper than a reader follows"
    if found is None:
        return None
    path, what = found
    path.reverse()
    where = "".join("/" + str(k).replace("~", "~0").replace("/", "~1") for k in path)
    if path[:3] == VARIABLES and len(path) > 3:  # inside an entry: name its variable
        return f"at {where}: {what} (variable {path[3]!r:.200})"
    return f"at {where or '/'}: {what}"


def _is_integer(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


TYPES: dict[str, Callable[[Any], bool]] = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": _is_integer,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(what: str) -> Failure:
    return [], what


def _within(found: Failure, key: Any) -> Failure:
    found[0].append(key)
    return found


class Compiler:
    """Turns a schema into a :data:`Check`; ``$ref`` is local (``#/$defs/...``) and
    resolved lazily, so a recursive definition compiles once."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.refs: dict[str, Check] = {}

    def at(self, target: str) -> Any:
        """The part of the schema a local reference (``#/$defs/name``) names."""
        if not target.startswith("#/"):
            raise ValueError(f"schema: only local references are read, not {target!r}")
        node: Any = self.root
        for part in target[2:].split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
        return node

    def ref(self, target: str) -> Check:
        if target not in self.refs:
            compiled: list[Check] = []
            self.refs[target] = lambda value: compiled[0](value)  # for a recursive one
            compiled.append(self.compile(self.at(target)))
            self.refs[target] = compiled[0]  # later references skip the indirection
        return self.refs[target]

    def compile(self, schema: Any) -> Check:
        if schema is True:
            return lambda value: None
        if schema is False:
            return lambda value: _fail("nothing is allowed here")
        unknown = set(schema) - ANNOTATIONS - set(KEYWORDS) - {"then", "else"}
        if unknown:
            raise ValueError(f"schema: keywords {sorted(unknown)} are not read")
        checks = [KEYWORDS[k](self, schema[k], schema) for k in KEYWORDS if k in schema]
        fast = _fused(self, schema)
        general = _first(checks)
        if fast is None:
            return general

        def fused(value: Any) -> Failure | None:
            return None if fast(value) else general(value)

        return fused


def _fused(c: Compiler, schema: dict[str, Any]) -> Callable[[Any], bool] | None:
    """One test for the schemas an index has most of (a count, a list of counts, a
    patterned string), so that a value that passes costs one call: True when the value
    follows ``schema``; False sends it to the keyword checks, which decide and explain."""
    keys = set(schema) - ANNOTATIONS
    if schema.get("type") == "integer" and keys <= {"type", "minimum", "maximum"}:
        low, high = schema.get("minimum", -math.inf), schema.get("maximum", math.inf)
        return lambda v: type(v) is int and low <= v <= high
    if schema.get("type") == "string" and keys <= {"type", "pattern"}:
        search = re.compile(schema.get("pattern", "")).search
        return lambda v: type(v) is str and search(v) is not None
    if (
        schema.get("type") == "array"
        and keys <= {"type", "items", "maxItems"}
        and "items" in schema
    ):
        item = _fused(c, _resolved(c, schema["items"]))
        most = schema.get("maxItems", math.inf)
        if item is not None:
            return lambda v: type(v) is list and len(v) <= most and all(map(item, v))
    return None


def _resolved(c: Compiler, schema: Any) -> Any:
    """``schema``, or what its lone ``$ref`` names."""
    while isinstance(schema, dict) and set(schema) - ANNOTATIONS == {"$ref"}:
        schema = c.at(schema["$ref"])
    return schema


Keyword = Callable[[Compiler, Any, dict[str, Any]], Check]


def _type(c: Compiler, names: Any, schema: dict[str, Any]) -> Check:
    tests = [TYPES[n] for n in ([names] if isinstance(names, str) else names)]
    wanted = names if isinstance(names, str) else " or ".join(names)
    test = tests[0] if len(tests) == 1 else lambda v: any(t(v) for t in tests)

    def check(value: Any) -> Failure | None:
        if test(value):
            return None
        return _fail(f"{_short(value)} is not of type {wanted}")

    return check


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def _const(c: Compiler, expected: Any, schema: dict[str, Any]) -> Check:
    def check(value: Any) -> Failure | None:
        return None if _same(value, expected) else _fail(f"{_short(value)} is not {expected!r}")

    return check


def _enum(c: Compiler, allowed: list[Any], schema: dict[str, Any]) -> Check:
    def check(value: Any) -> Failure | None:
        if any(_same(value, a) for a in allowed):
            return None
        return _fail(f"{_short(value)} is not one of {allowed}")

    return check


def _bound(test: Callable[[float, float], bool], words: str) -> Keyword:
    def keyword(c: Compiler, limit: float, schema: dict[str, Any]) -> Check:
        def check(value: Any) -> Failure | None:
            if not TYPES["number"](value) or test(value, limit):
                return None
            return _fail(f"{_short(value)} is {words} {limit}")

        return check

    return keyword


def _length(test: Callable[[int, int], bool], kind: type[Sized], words: str) -> Keyword:
    def keyword(c: Compiler, limit: int, schema: dict[str, Any]) -> Check:
        def check(value: Any) -> Failure | None:
            if not isinstance(value, kind) or test(len(value), limit):
                return None
            return _fail(f"{_short(value)} has {words} {limit}")

        return check

    return keyword


def _pattern(c: Compiler, pattern: str, schema: dict[str, Any]) -> Check:
    search = re.compile(pattern).search

    def check(value: Any) -> Failure | None:
        if not isinstance(value, str) or search(value):
            return None
        return _fail(f"{_short(value)} does not match {pattern!r}")

    return check


def _items(c: Compiler, items: Any, schema: dict[str, Any]) -> Check:
    each = c.compile(items)

    def check(value: Any) -> Failure | None:
        if not isinstance(value, list):
            return None
        for i, item in enumerate(value):
            found = each(item)
            if found is not None:
                return _within(found, i)
        return None

    return check


def _members(
    value: Any, checks: Callable[[str], Check | None], closed: bool = False
) -> Failure | None:
    """The first failure of a member of the object ``value`` by the check ``checks``
    gives its name (None: not checked); ``closed``: a failing member is one not allowed."""
    if not isinstance(value, dict):
        return None
    for name, item in value.items():
        one = checks(name)
        found = None if one is None else one(item)
        if found is not None:
            return _fail(f"{_short(name)} is not allowed here") if closed else _within(found, name)
    return None


def _properties(c: Compiler, properties: dict[str, Any], schema: dict[str, Any]) -> Check:
    named = {name: c.compile(sub) for name, sub in properties.items()}
    return lambda value: _members(value, named.get)


def _required(c: Compiler, names: list[str], schema: dict[str, Any]) -> Check:
    def check(value: Any) -> Failure | None:
        if not isinstance(value, dict):
            return None
        missing = [n for n in names if n not in value]
        return _fail(f"{missing[0]!r} is missing") if missing else None

    return check


def _additional(c: Compiler, extra: Any, schema: dict[str, Any]) -> Check:
    known = set(schema.get("properties", ()))
    each = c.compile(extra)

    def checks(name: str) -> Check | None:
        return None if name in known else each

    return lambda value: _members(value, checks, closed=extra is False)


def _property_names(c: Compiler, names: Any, schema: dict[str, Any]) -> Check:
    each = c.compile(names)

    def check(value: Any) -> Failure | None:
        if not isinstance(value, dict):
            return None
        for name in value:
            found = each(name)
            if found is not None:
                return _fail(f"the name {found[1]}")
        return None

    return check


def _any_of(c: Compiler, options: list[Any], schema: dict[str, Any]) -> Check:
    branches = [c.compile(o) for o in options]

    def check(value: Any) -> Failure | None:
        first = None
        for branch in branches:
            found = branch(value)
            if found is None:
                return None
            # The deepest failure says most: the branch that got furthest.
            if first is None or len(found[0]) > len(first[0]):
                first = found
        return first

    return check


def _first(checks: list[Check]) -> Check:
    """All of ``checks``: the first failure."""
    if len(checks) == 1:
        return checks[0]

    def check(value: Any) -> Failure | None:
        for one in checks:
            found = one(value)
            if found is not None:
                return found
        return None

    return check


def _all_of(c: Compiler, parts: list[Any], schema: dict[str, Any]) -> Check:
    return _first([c.compile(p) for p in parts])


def _if(c: Compiler, condition: Any, schema: dict[str, Any]) -> Check:
    test = c.compile(condition)
    then = c.compile(schema.get("then", True))
    otherwise = c.compile(schema.get("else", True))

    def check(value: Any) -> Failure | None:
        return (then if test(value) is None else otherwise)(value)

    return check


def _ref(c: Compiler, target: str, schema: dict[str, Any]) -> Check:
    return c.ref(target)


KEYWORDS: dict[str, Keyword] = {
    "$ref": _ref,
    "type": _type,
    "const": _const,
    "enum": _enum,
    "minimum": _bound(lambda v, m: v >= m, "less than the minimum of"),
    "maximum": _bound(lambda v, m: v <= m, "more than the maximum of"),
    "exclusiveMaximum": _bound(lambda v, m: v < m, "not less than"),
    "minLength": _length(lambda n, m: n >= m, str, "fewer characters than"),
    "maxLength": _length(lambda n, m: n <= m, str, "more characters than"),
    "minItems": _length(lambda n, m: n >= m, list, "fewer items than"),
    "maxItems": _length(lambda n, m: n <= m, list, "more items than"),
    "minProperties": _length(lambda n, m: n >= m, dict, "fewer members than"),
    "maxProperties": _length(lambda n, m: n <= m, dict, "more members than"),
    "pattern": _pattern,
    "required": _required,
    "properties": _properties,
    "additionalProperties": _additional,
    "propertyNames": _property_names,
    "items": _items,
    "anyOf": _any_of,
    "allOf": _all_of,
    "if": _if,
}


__all__ = ["index_check", "index_schema", "problem"]
