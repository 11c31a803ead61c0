"""The shape of the package: layers, no import circles, small modules, one settings table.

Every import counts, those inside functions and under ``TYPE_CHECKING`` too: a circle a
type checker or a reader has to follow is a circle.
"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import distckpt
from distckpt import settings

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "distckpt"

#: The layers, bottom up: a module may import from its own layer and those below.
LAYERS: list[set[str]] = [
    {"errors", "version", "moved", "exports"},
    {"settings", "dtypes", "slices", "naming", "numbering", "values", "terminal"},
    {"tiling", "items", "progress"},
    {"storage", "comm"},  # the stores; the communicators
    {"format", "signing"},  # what is on disk, over the store protocol; its signature
    {"commit", "planning"},  # how a save commits; what each rank writes and reads
    {"transfer"},  # a rank's data path
    {"pipeline"},  # the save and restore pipeline every kind runs on
    {"engine"},  # the checkpoint's own save and load
    {"hf", "local"},
    {"training"},
    {"tools"},
    {"distckpt", "integrations", "testing", "cli", "__main__"},
]
LIMIT = 500  # lines a module may have


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` in ``package`` names, relative ones resolved."""
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([node.module] if node.module else []))
    return base


def _imports(name: str, path: Path) -> set[str]:
    """The package's modules ``name`` imports (``from p import m``: module ``p.m`` when it
    is one, else ``p``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _layer(module: str) -> int:
    top = _top(module)
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{module}: its package {top!r} has no layer in LAYERS")


def _circles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(GRAPH):
        if root in index:
            continue
        work = [(root, iter(sorted(GRAPH[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(GRAPH[child]))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    top = stack.pop()
                    on.discard(top)
                    part.append(top)
                    if top == node:
                        break
                if len(part) > 1:
                    out.append(sorted(part))
    return out


def test_the_graph_is_read() -> None:
    assert "distckpt.format.index" in GRAPH["distckpt.engine.load"]
    assert "distckpt.storage.backend" in GRAPH["distckpt.format.shard_io"]


def test_no_import_circle() -> None:
    assert _circles() == []


def test_layers() -> None:
    upward = [
        f"{a} imports {b}" for a, targets in GRAPH.items() for b in targets if _layer(b) > _layer(a)
    ]
    assert upward == []


def test_planning_depends_on_the_format_not_on_io() -> None:
    reached = {_top(b) for a, bs in GRAPH.items() if _top(a) == "planning" for b in bs}
    assert "format" in reached
    assert not reached & {"storage", "commit", "transfer", "comm", "pipeline", "engine"}


def test_modules_are_small() -> None:
    big = {
        name: n
        for name, path in MODULES.items()
        if (n := len(path.read_text().splitlines())) > LIMIT
    }
    assert big == {}


def test_only_settings_reads_the_environment_variables() -> None:
    """A ``DISTCKPT_*`` name in code (not a docstring or comment) stands only in
    :mod:`distckpt.settings`; everywhere else asks it."""
    name = re.compile(r"DISTCKPT_[A-Z0-9_]+")
    offenders = []
    for module, path in MODULES.items():
        if module == "distckpt.settings":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and name.fullmatch(node.value)
            ):
                offenders.append(f"{module}:{node.lineno} {node.value}")
    assert offenders == []


def test_every_setting_is_in_the_table_and_the_docs_show_it() -> None:
    table = settings.table()
    for s in settings.ALL:
        assert f"`{s.name}`" in table
        assert s.meaning
    assert len({s.name for s in settings.ALL}) == len(settings.ALL)
    assert table in (ROOT / "docs" / "reference" / "settings.md").read_text()


def test_settings_parse_and_name_what_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTCKPT_IO_WORKERS", " 3 ")
    assert settings.IO_WORKERS.value() == 3
    monkeypatch.setenv("DISTCKPT_IO_WORKERS", "x")
    with pytest.raises(ValueError, match="DISTCKPT_IO_WORKERS='x' is not a whole number"):
        settings.IO_WORKERS.value()
    monkeypatch.setenv("DISTCKPT_S3_TIMEOUT", "1")
    with pytest.raises(ValueError, match="DISTCKPT_S3_TIMEOUT must be at least 2 seconds"):
        settings.S3_TIMEOUT.get()
    monkeypatch.delenv("DISTCKPT_TIMEOUT", raising=False)
    assert settings.TIMEOUT.value() == 300.0
    monkeypatch.setenv("DISTCKPT_EXCHANGE", "0")
    assert settings.EXCHANGE.value() is False
    monkeypatch.delenv("DISTCKPT_NODE", raising=False)
    assert settings.NODE.get() is None
    with pytest.raises(LookupError, match="DISTCKPT_NODE has no fixed default"):
        settings.NODE.value()


def test_packaging() -> None:
    assert (PACKAGE / "py.typed").is_file()
    main = ast.parse((PACKAGE / "__main__.py").read_text())
    guarded = [n for n in main.body if isinstance(n, ast.If) and "__name__" in ast.unparse(n.test)]
    calls = [n for n in main.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
    assert guarded and not calls, "python -m distckpt runs the CLI only as __main__"
    assert distckpt.__version__


# -- The API reference: every public name has its entry -------------------------------------

REFERENCE = [ROOT / "docs" / "reference" / "api.md", *sorted(ROOT.glob("docs/reference/api/*.md"))]
#: ``::: target`` and its indented ``options:`` block.
DIRECTIVE = re.compile(r"^::: *([\w.]+)[ \t]*\n((?:[ \t]+\S.*\n?)*)", re.MULTILINE)
#: Module attributes that are no API: loggers and type variables.
NOT_API = re.compile(r"(?:logging\.)?getLogger|TypeVar|ParamSpec")


def _top_level(body: list[ast.stmt]) -> Iterator[tuple[int, ast.stmt, list[ast.stmt]]]:
    """The statements of a module body, those of its ``if`` and ``try`` blocks included
    (with the block each stands in), as griffe reads them."""
    for i, node in enumerate(body):
        if isinstance(node, (ast.If, ast.Try)):
            for block in (node.body, node.orelse, getattr(node, "finalbody", [])):
                yield from _top_level(block)
        else:
            yield i, node, body


class _Module:
    """What a module defines and imports, read from its source as griffe reads it."""

    def __init__(self, name: str, path: Path) -> None:
        self.name, self.source = name, path.read_text()
        self.tree = ast.parse(self.source)
        self.lines = self.source.splitlines()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        self.defined: dict[str, tuple[ast.stmt, ast.stmt | None]] = {}  # node, next one
        self.imported: dict[str, str] = {}
        self.all: list[str] | None = None
        for i, node, block in _top_level(self.tree.body):
            after = block[i + 1] if i + 1 < len(block) else None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defined[node.name] = (node, after)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name) and target.id == "__all__":
                        self.all = list(ast.literal_eval(node.value))  # type: ignore[arg-type]
                    elif isinstance(target, ast.Name):
                        self.defined[target.id] = (node, after)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, package)
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = f"{base}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.imported[alias.asname] = alias.name

    def public(self) -> list[str]:
        """``__all__``, else what the module defines (not imports) without a leading ``_``,
        loggers and type variables aside."""
        if self.all is not None:
            return self.all
        return [
            name
            for name, (node, _) in self.defined.items()
            if not name.startswith("_")
            and not (
                isinstance(node, (ast.Assign, ast.AnnAssign))
                and isinstance(node.value, ast.Call)
                and NOT_API.fullmatch(ast.unparse(node.value.func))
            )
        ]

    def documented(self, name: str) -> bool:
        """Whether the reference shows ``name`` when it shows this module's members: it
        has a docstring, a ``#:`` comment (above or on its line, as Sphinx reads them and
        docs/roles.py gives them to the reference), or is a ``Setting`` (documented by its
        own meaning)."""
        node, after = self.defined[name]
        if not isinstance(node, (ast.Assign, ast.AnnAssign)):
            return ast.get_docstring(node) is not None  # type: ignore[arg-type]
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            return isinstance(after.value.value, str)
        if isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "Setting":
            return True
        above = self.lines[node.lineno - 2] if node.lineno > 1 else ""
        return above.lstrip().startswith("#:") or "  #: " in self.lines[node.lineno - 1]


READ: dict[str, _Module] = {}


def _module(name: str) -> _Module:
    if name not in READ:
        READ[name] = _Module(name, MODULES[name])
    return READ[name]


def _resolve(path: str) -> str | None:
    """The full name of what ``path`` is (a module, or a name where it is defined), imports
    followed; None for what distckpt does not define. A package's submodule wins over a
    name of the same that it imports, as in griffe (``distckpt.comm.auto`` is the module)."""
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        module = ".".join(parts[:n])
        if module in MODULES:
            break
    else:
        return None
    rest = parts[n:]
    if not rest:
        return module
    if len(rest) > 1:
        return None
    found = _module(module)
    if rest[0] in found.defined:
        return path
    if rest[0] in found.imported:
        return _resolve(found.imported[rest[0]])
    return None


def _is_documented(full: str) -> bool:
    if full in MODULES:
        return ast.get_docstring(_module(full).tree) is not None
    module, _, name = full.rpartition(".")
    return _module(module).documented(name)


def _reference() -> tuple[set[str], set[str]]:
    """What the API reference shows (full names, where defined), and the modules it
    documents (whose members it shows, unless ``members:`` says which or ``false``)."""
    shown: set[str] = set()
    modules: set[str] = set()
    for page in REFERENCE:
        for target, options in DIRECTIVE.findall(page.read_text()):
            full = _resolve(target)
            assert full is not None, f"{page.name}: ::: {target} names nothing in distckpt"
            shown.add(full)
            if full not in MODULES:
                continue
            modules.add(full)
            members = re.search(r"^\s*members:\s*(.+)$", options, re.MULTILINE)
            names = _module(full).public()
            if members and members[1].strip() == "false":
                names = []
            elif members:
                names = [m.strip(" '\"") for m in members[1].strip("[] ").split(",")]
            for name in names:
                member = _resolve(f"{full}.{name}")
                if member is not None and _is_documented(member):
                    shown.add(member)
    return shown, modules


def test_every_public_name_is_in_the_api_reference() -> None:
    """Every name of ``distckpt.__all__``, and every public name of a module the reference
    documents, has its entry in the reference (docs/reference/api/): a ``:::`` of its own
    or its module's, and a docstring, without which mkdocstrings leaves it out."""
    shown, modules = _reference()
    wanted = {f"distckpt.{name}" for name in distckpt.__all__}
    wanted |= {f"{module}.{name}" for module in modules for name in _module(module).public()}
    missing = []
    for name in sorted(wanted):
        full = _resolve(name)
        if full is None:
            missing.append(f"{name}: not found in the source")
        elif full not in shown:
            why = "no docstring" if not _is_documented(full) else "on no page"
            missing.append(f"{name} ({full}): {why}")
    assert missing == [], "not in the API reference:\n" + "\n".join(missing)


# -- The line between API and internals ----------------------------------------------------

#: The public modules: with ``distckpt.__all__``, what users may rely on (see "API and
#: internals" in docs/development.md). Every other module is internal.
PUBLIC_MODULES = frozenset(
    {
        "distckpt",
        "distckpt.comm",
        "distckpt.comm.auto",
        "distckpt.errors",
        "distckpt.storage",
        "distckpt.storage.backend",
        "distckpt.storage.object_store",
        "distckpt.storage.registry",
        "distckpt.testing",
        "distckpt.testing.hostile",
        *(
            f"distckpt.integrations.{m}"
            for m in ("accelerate", "dcp", "deepspeed", "hf_trainer", "lightning", "megatron")
        ),
        "distckpt.integrations.torchtitan",
        "distckpt.tools",
        *(
            f"distckpt.tools.{m}"
            for m in ("catalog", "diff", "export", "importer", "runs", "sign", "summary", "verify")
        ),
    }
)
#: Pages for contributors, whose blocks may import internals.
CONTRIBUTORS = {"docs/development.md"}


def _module_of(full: str) -> str:
    """The module ``full`` (a module, or a name defined in one) belongs to."""
    return full if full in MODULES else full.rpartition(".")[0]


def test_the_api_reference_documents_the_public_side_only() -> None:
    """The reference's ``:::`` entries are public modules, names of public modules, or
    names of ``distckpt.__all__``; and it documents every public module."""
    internal = []
    documented: set[str] = set()
    for page in REFERENCE:
        for target, _ in DIRECTIVE.findall(page.read_text()):
            module = _module_of(target)
            top = target.startswith("distckpt.") and target.split(".")[1] in distckpt.__all__
            if module in PUBLIC_MODULES:
                documented.add(module)
            if module not in PUBLIC_MODULES and not top:
                internal.append(f"{page.name}: ::: {target} (module {module} is internal)")
    assert internal == [], "the API reference documents internals:\n" + "\n".join(internal)
    undocumented = sorted(PUBLIC_MODULES - documented - {"distckpt"})
    assert undocumented == [], f"public modules with no page in the reference: {undocumented}"


def _user_code() -> Iterator[tuple[str, str]]:
    """(where, source) of the Python a user reads: the README's and the site's blocks (not
    their hidden setup, not the contributors' page) and the examples."""
    sys.path.insert(0, str(ROOT / "tests" / "docs"))
    try:
        import blocks
    finally:
        sys.path.pop(0)
    for page in blocks.pages():
        if page.relative_to(ROOT).as_posix() in CONTRIBUTORS:
            continue
        for block in blocks.read(page):
            if block.lang == "python":
                yield block.where, block.code
    for path in sorted((ROOT / "examples").rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_nothing_a_user_reads_imports_an_internal_module() -> None:
    """The README, the docs (but the contributors' page) and the examples import only
    public modules: what they show is what users may rely on."""
    found = []
    for where, code in _user_code():
        for node in ast.walk(ast.parse(code)):
            named: list[str] = []
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
                named = [n if n in MODULES else node.module for n in names]
            for module in named:
                if module.split(".")[0] == "distckpt" and module not in PUBLIC_MODULES:
                    found.append(f"{where}: imports {module}")
    assert found == [], "user-facing code imports internal modules:\n" + "\n".join(found)


# -- The troubleshooting page: one entry per error class -----------------------------------

TROUBLESHOOTING = ROOT / "docs" / "guide" / "troubleshooting.md"
#: A fenced block (whose ``#`` lines are no headings), a heading, a class name in backticks.
FENCED = re.compile(r"^ *(```+|~~~+).*?^ *\1 *$", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#{2,6} +(.+)$", re.MULTILINE)
CLASS_NAME = re.compile(r"`([A-Z][A-Za-z0-9]*)`")


def test_troubleshooting_has_one_entry_per_error_class() -> None:
    """docs/guide/troubleshooting.md has one heading for each public error class of
    :mod:`distckpt.errors` (its message, cause and fix), and its headings name no other
    class: a new error gets its entry, a removed one loses it."""
    classes = {
        name
        for name, cls in inspect.getmembers(distckpt.errors, inspect.isclass)
        if cls.__module__ == distckpt.errors.__name__
        and issubclass(cls, BaseException)
        and not name.startswith("_")
    }
    text = FENCED.sub("", TROUBLESHOOTING.read_text())
    named = [name for heading in HEADING.findall(text) for name in CLASS_NAME.findall(heading)]
    missing = sorted(classes - set(named))
    unknown = sorted(set(named) - classes)
    repeated = sorted({name for name in named if named.count(name) > 1})
    assert not (missing or unknown or repeated), (
        f"{TROUBLESHOOTING.relative_to(ROOT)}: no heading for {missing}; headings for classes "
        f"that distckpt.errors does not define: {unknown}; more than one heading for {repeated}"
    )


#: Import paths that moved, kept for one release: old module -> new module.
MOVED = {
    "distckpt.engine.pipeline": "distckpt.pipeline",
    **{f"distckpt.engine.pipeline.{m}": f"distckpt.pipeline.{m}" for m in ("restore", "save")},
    "distckpt.engine.pipeline.stage": "distckpt.pipeline.clock",
    **{
        f"distckpt.engine.{m}": f"distckpt.pipeline.{m}"
        for m in ("options", "results", "matching", "background", "snapshot")
    },
}


def test_moved_modules_still_import_with_a_warning() -> None:
    """Each old path gives the new module's objects and a DeprecationWarning naming the
    new path (in a fresh interpreter: nothing imported before)."""
    code = f"""
import importlib, warnings
moved = {MOVED!r}
for old, new in moved.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any(new in s for s in said), (old, said)
    target = importlib.import_module(new)
    name = next(n for n in vars(target) if not n.startswith("_"))
    assert getattr(module, name) is getattr(target, name), (old, name)
print("ok", len(moved))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0 and f"ok {len(MOVED)}" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("package", ["distckpt", "distckpt.training"])
def test_lazy_packages_hand_out_what_they_type(package: str) -> None:
    """A package that imports its names on first use (:mod:`distckpt.exports`) hands out,
    for every name of ``__all__``, the object its ``TYPE_CHECKING`` imports name: the
    type checkers and the users see the same thing, and the table lists nothing else."""
    import importlib

    module = importlib.import_module(package)
    source = (PACKAGE.parent / package.replace(".", "/") / "__init__.py").read_text()
    typed: dict[str, str] = {}
    tree = ast.parse(source)
    own = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imported in node.body:
                assert isinstance(imported, ast.ImportFrom) and imported.module, ast.dump(imported)
                for alias in imported.names:
                    typed[alias.asname or alias.name] = imported.module
    assert sorted(typed) == sorted(set(module.__all__) - own)
    assert set(module._WHERE) <= set(typed)
    for name, origin in typed.items():
        got = getattr(module, name)
        if isinstance(got, types.ModuleType):  # ``from distckpt import comm``
            want = importlib.import_module(f"{origin}.{name}")
        else:
            want = getattr(importlib.import_module(origin), name)
        assert got is want, name
    assert set(module.__all__) <= set(dir(module))


def test_import_distckpt_imports_no_torch_until_a_name_is_used() -> None:
    """In a fresh interpreter: ``import distckpt`` imports neither torch nor the engine; a
    subpackage is there when first read, as when the package imported its parts."""
    code = """
import sys
import distckpt
assert "torch" not in sys.modules and "distckpt.engine" not in sys.modules, sorted(sys.modules)
assert distckpt.training.RNGState.__name__ == "RNGState"
assert distckpt.comm.SingleComm.__name__ == "SingleComm"
assert callable(distckpt.save) and "torch" in sys.modules
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr[-2000:]
