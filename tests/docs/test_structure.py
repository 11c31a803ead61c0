"""The shape of the package: layers, no import circles, small modules, one settings table.

Every import counts, those inside functions and under ``TYPE_CHECKING`` too: a circle a
type checker or a reader has to follow is a circle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import distckpt
from distckpt import settings

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "distckpt"

#: The layers, bottom up: a module may import from its own layer and those below.
LAYERS: list[set[str]] = [
    {"errors", "version"},
    {"settings", "dtypes", "slices", "naming", "numbering", "values", "terminal"},
    {"tiling", "items", "progress"},
    {"storage", "comm"},  # the stores; the communicators
    {"format", "signing"},  # what is on disk, over the store protocol; its signature
    {"commit", "planning"},  # how a save commits; what each rank writes and reads
    {"transfer"},  # a rank's data path
    {"engine"},
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


def _imports(name: str, path: Path) -> set[str]:
    """The package's modules ``name`` imports (``from p import m``: module ``p.m`` when it
    is one, else ``p``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
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
    assert not reached & {"storage", "commit", "transfer", "comm", "engine"}


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
