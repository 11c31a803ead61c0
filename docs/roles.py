"""Read distckpt's docstrings as they are written (reStructuredText, for Sphinx and
``help()``) for the API reference, where mkdocstrings renders them as Markdown.

Once the package is loaded, every docstring is rewritten:

* a role (``:func:`name```, ``:class:`~distckpt.Shard```, ``:mod:`.cursor```,
  ``:meth:`title <target>```) becomes a cross-reference to the object it names, resolved
  as Sphinx does: in the scope of the documented object, then of its class and module,
  then as a full name. The reference is optional: where the target is documented the
  page links to it, elsewhere (a private module, a name outside distckpt, a name that
  does not resolve) it stays inline code, without a warning;
* a literal block (a paragraph ending in ``::``, then an indented block) becomes a fenced
  code block, highlighted as Python when it parses as Python; a doctest block
  (``>>>`` lines) becomes a ``pycon`` block;
* a ``#:`` comment above an attribute (or after it, on its line) becomes the attribute's
  docstring, as Sphinx's autodoc reads it;
* a method or attribute without a docstring takes the one of the same name in a base class
  (autodoc's ``autodoc_inherit_docstrings``): a store's ``read`` shows what
  :class:`~distckpt.storage.backend.Store` says ``read`` does;
* a :class:`~distckpt.settings.Setting` is documented by its own ``meaning`` and default,
  as the settings table is.
"""

from __future__ import annotations

import ast
import html
import json
import re
import textwrap
from collections.abc import Iterator
from typing import Any

import griffe

ROLE = re.compile(
    r":(?:py:)?(?P<role>func|class|mod|data|meth|attr|exc|obj|const):`(?P<body>[^`]+)`(?:\\ )?"
)
TITLED = re.compile(r"(?P<title>.*?)\s*<(?P<target>[^<>]+)>$", re.DOTALL)
COMMENT = re.compile(r"^\s*#:\s?(?P<text>.*)$")
TRAILING = re.compile(r"\S.*\s#:\s?(?P<text>.*)$")
PYTHONIC = re.compile(r"^\s*(?:from|import|def|class|for|with|if)\b|\w\(", re.MULTILINE)
LINK = re.compile(r"\[([^\]]+)\]\([^)]+\)")
FENCE = "```"


def _walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    """``obj`` and every object defined in it (not the names it imports)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)  # type: ignore[arg-type]


def _target(obj: griffe.Object | griffe.Alias) -> griffe.Object | None:
    """What ``obj`` is, through any chain of imports; None outside what is loaded."""
    try:
        return obj.final_target if obj.is_alias else obj  # type: ignore[return-value]
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _members(obj: griffe.Object) -> dict[str, Any]:
    """``obj``'s members; a class's inherited ones too."""
    if obj.is_class:
        try:
            return obj.all_members
        except Exception:  # a base that does not resolve statically
            pass
    return obj.members


def _member(obj: griffe.Object | None, dotted: str, module: bool = True) -> griffe.Object | None:
    """The object ``dotted`` names inside ``obj``, imports followed. Where a package
    imports a name from its submodule of the same name (``from .auto import auto``), the
    name is the submodule's object, as in Python, unless ``module`` asks for the module
    (griffe keeps the submodule)."""
    for name in dotted.split("."):
        if obj is None or name not in _members(obj):
            return None
        obj = _target(_members(obj)[name])
    if obj is not None and obj.is_module and not module and obj.name in obj.members:
        return _target(obj.members[obj.name])
    return obj


def _by_suffix(root: griffe.Object, dotted: str) -> griffe.Object | None:
    """The one object of the package whose full name ends in ``.dotted``, if just one."""
    matches = [o for o in _walk(root) if o.path.endswith(f".{dotted}")]
    return matches[0] if len(matches) == 1 else None


def _scopes(obj: griffe.Object) -> Iterator[griffe.Object]:
    """Where a short name is looked for: the object itself when it holds members, then
    each enclosing class and module, innermost first."""
    scope: griffe.Object | None = obj if (obj.is_class or obj.is_module) else obj.parent
    while scope is not None:
        yield scope
        scope = scope.parent


def resolve(obj: griffe.Object, name: str, module: bool = True) -> griffe.Object | None:
    """The object a role in ``obj``'s docstring names, as Sphinx's Python domain finds it:
    ``.name`` relative to the current module, a short name in the enclosing scopes (a
    class's inherited members included), else a full dotted name; last, a dotted name
    that ends the full name of just one object of the package (``Store.read``)."""
    name = name.strip().removesuffix("()")
    root = obj.package
    if name.startswith("."):
        name = name.lstrip(".")
        for scope in _scopes(obj):
            if scope.is_module and (found := _member(scope, name, module)) is not None:
                return found
        return _by_suffix(root, name)
    for scope in _scopes(obj):
        if name.split(".")[0] in _members(scope):
            found = _member(scope, name, module)
            if found is not None:
                return found
    first, _, rest = name.partition(".")
    if first == root.name:
        return _member(root, rest, module) if rest else root
    return _by_suffix(root, name) if "." in name else None


def _role(obj: griffe.Object, match: re.Match[str]) -> str:
    """One role as an optional cross-reference (mkdocs-autorefs' own markup, as
    mkdocstrings writes for the types of a signature): a link where the target has an
    entry in the reference, its inline code elsewhere."""
    body = match["body"].strip()
    if titled := TITLED.match(body):
        title, target = titled["title"], titled["target"].strip()
    else:
        target = body.lstrip("!")
        title = target.lstrip("~.")
        if target.startswith("~"):
            target = target[1:]
            title = title.rsplit(".", 1)[-1]
    found = None
    if not body.startswith("!"):  # "!name": no link, as in Sphinx
        found = resolve(obj, target.lstrip("~"), module=match["role"] == "mod")
    if found is None:
        return f"`{title}`"
    return f'<autoref identifier="{html.escape(found.path)}" optional>`{title}`</autoref>'


def roles(obj: griffe.Object, text: str) -> str:
    """Every role in ``text`` (prose, not code) as a cross-reference."""
    return ROLE.sub(lambda m: _role(obj, m), text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _language(code: str) -> str:
    """Python when the block parses as Python or reads like it (code with its output, an
    elided argument), a doctest session, JSON, else plain text."""
    if code.lstrip().startswith(">>>"):
        return "pycon"
    try:
        ast.parse(code)
    except SyntaxError:
        pass
    else:
        return "python"
    try:
        json.loads(code)
    except ValueError:
        pass
    else:
        return "json"
    return "python" if PYTHONIC.search(code) else "text"


def _fenced(code_lines: list[str], indent: int, language: str | None = None) -> list[str]:
    code = textwrap.dedent("\n".join(code_lines)).strip("\n")
    pad = " " * indent
    body = [f"{pad}{line}" if line.strip() else "" for line in code.splitlines()]
    return [f"{pad}{FENCE}{language or _language(code)}", *body, f"{pad}{FENCE}"]


def markdown(obj: griffe.Object, text: str) -> str:
    """``text`` (one reStructuredText docstring) as the Markdown mkdocstrings renders."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    after_blank = True
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if after_blank and stripped.startswith(">>>"):  # a doctest block, to a blank line
            end = i
            while end < len(lines) and lines[end].strip():
                end += 1
            out += _fenced(lines[i:end], _indent(line), "pycon")
            i = end
            continue
        if stripped.endswith("::") and _literal_follows(lines, i):
            base = _indent(line)
            end = i + 1
            while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > base):
                end += 1
            while not lines[end - 1].strip():
                end -= 1
            lead = stripped[:-2].rstrip()
            if lead:  # "text::" reads "text:", "text ::" reads "text"
                tail = ":" if not stripped[:-2].endswith((" ", "\t")) else ""
                out.append(roles(obj, line.rstrip()[:-2].rstrip() + tail))
            out.append("")
            out += _fenced(lines[i + 1 : end], base)
            i = end
            after_blank = False
            continue
        out.append(roles(obj, line))
        after_blank = not stripped
        i += 1
    return "\n".join(out)


def _literal_follows(lines: list[str], i: int) -> bool:
    """Whether an indented block follows line ``i`` after at least one blank line."""
    j = i + 1
    if j >= len(lines) or lines[j].strip():
        return False
    while j < len(lines) and not lines[j].strip():
        j += 1
    return j < len(lines) and _indent(lines[j]) > _indent(lines[i])


def _comment_docstring(obj: griffe.Object) -> str | None:
    """The ``#:`` comment lines above the attribute ``obj``, or the one after it."""
    try:
        lines = obj.lines_collection[obj.filepath]  # type: ignore[index]
    except (KeyError, ValueError):
        return None
    if not lines or not obj.lineno:
        return None
    found: list[str] = []
    n = obj.lineno - 2  # type: ignore[operator]
    while n >= 0 and (match := COMMENT.match(lines[n])):
        found.insert(0, match["text"])
        n -= 1
    if not found and (match := TRAILING.search(lines[obj.lineno - 1])):
        found = [match["text"]]
    return "\n".join(found).strip() or None


def _setting_docstring(obj: griffe.Object) -> str | None:
    """What a ``Setting(name, parse, default, meaning, default_text)`` of
    :mod:`distckpt.settings` says of itself (the settings table is made of the same)."""
    value = getattr(obj, "value", None)
    if not isinstance(value, griffe.ExprCall) or str(value.function) != "Setting":
        return None
    try:
        name, _, default, meaning, *rest = (str(a) for a in value.arguments)
        name, meaning = ast.literal_eval(name), ast.literal_eval(meaning)
        default = ast.literal_eval(rest[0]) if rest else default
    except (ValueError, SyntaxError):
        return None
    # as the table shows a default: on/off, whole seconds, MiB
    default = {"True": "on", "False": "off"}.get(default, default)
    default = re.sub(r"^(\d+)\.0$", r"\1", default).replace(" * MiB", " MiB")
    meaning = LINK.sub(r"\1", meaning)  # its links are relative to the settings page
    return f"``${name}``: {meaning} Default: {default}."


def _inherited(obj: griffe.Object) -> griffe.Docstring | None:
    """The docstring of the member of the same name in a base class of ``obj``'s class."""
    cls = obj.parent
    if cls is None or not cls.is_class:
        return None
    try:
        bases = cls.mro()  # type: ignore[attr-defined]
    except Exception:  # a base that does not resolve statically: no inheritance
        return None
    for base in bases:
        member = base.members.get(obj.name)
        if member is not None and (found := _target(member)) is not None and found.docstring:
            return found.docstring
    return None


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring of a package once the whole package is loaded (so that
    a role may name anything in it)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        objects = list(_walk(pkg))

        def new(obj: griffe.Object, value: str) -> griffe.Docstring:
            return griffe.Docstring(
                value,
                lineno=obj.lineno,
                endlineno=obj.lineno,
                parent=obj,
                parser=loader.docstring_parser,
                parser_options=loader.docstring_options,
            )

        for obj in objects:
            if obj.is_attribute and obj.docstring is None:
                found = _comment_docstring(obj) or _setting_docstring(obj)
                if found is not None:
                    obj.docstring = new(obj, found)
        for obj in objects:
            if obj.docstring is not None:
                obj.docstring.value = markdown(obj, obj.docstring.value)
        for obj in objects:
            if obj.docstring is None and not obj.is_module and not obj.is_class:
                inherited = _inherited(obj)
                if inherited is not None:
                    obj.docstring = new(obj, inherited.value)
