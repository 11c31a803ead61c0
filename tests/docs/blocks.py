"""The code blocks of the README and the documentation site, read as the suite runs them.

Every fenced block is one of:

- ``python``: run. By default in the page's interpreter: the page's Python blocks run in
  order in one interpreter, sharing their globals, as a reader types them in. A
  directive on the line just before the fence says otherwise:
  ``<!-- run: torchrun N -->`` (a whole script, on N ranks under torchrun),
  ``<!-- run: mpiexec N -->`` (on N ranks under MPI) or ``<!-- run: python -->`` (a
  script in a process of its own).
- ``bash``: run with ``bash -euo pipefail``, in the page's directory (where the earlier
  blocks left their files), with distckpt's interpreter and console script first on
  ``PATH``.
- ``text``: output, shown as a run prints it; not code.
- anything else, or a block that cannot run here, carries a directive:
  ``<!-- file: NAME -->`` (written to NAME in the page's directory, for the blocks after
  it: a plug-in module, a batch script, a configuration) or
  ``<!-- not run: REASON -->`` (the reason is required: say why, and what runs instead).

Code a reader need not see but a block needs (a model to save, a checkpoint to list) sits
in a comment just before it, invisible on the site::

    <!-- setup:
    model = torch.nn.Linear(4, 4)
    -->

A ``setup`` comment runs in the page's interpreter before the block after it, or starts the script
of a block that runs on its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

#: Languages run without a directive, and the one that is output.
RUN = {"python", "bash"}
OUTPUT = "text"

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<info>[^`\n]*)$")
DIRECTIVE = re.compile(r"^\s*<!--\s*(?P<kind>run|file|not run)\s*:\s*(?P<arg>.*?)\s*-->\s*$")
SETUP = re.compile(r"^\s*<!--\s*setup:\s*$")
RUNNERS = re.compile(r"(?:(?P<launcher>torchrun|mpiexec)\s+(?P<ranks>[1-9]\d*)|(?P<python>python))")


@dataclass
class Block:
    """One fenced block of a page: where it is, its language, its code, and how it runs."""

    page: str  # relative to the repository root
    line: int  # of the opening fence, counted from 1
    lang: str
    code: str
    kind: str = "page"  # page, script, torchrun, mpiexec, bash, file, skip, output
    arg: str = ""  # a launcher's rank count, a file's name, a reason
    setup: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """The README and every page of the site."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def read(path: Path) -> list[Block]:
    """The fenced blocks of ``path``, with their directives; a block whose directive is
    malformed or missing raises ``ValueError`` naming its line."""
    lines = path.read_text().splitlines()
    page = path.relative_to(ROOT).as_posix()
    blocks: list[Block] = []
    setup: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if SETUP.match(line):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->"), None)
            if end is None:
                raise ValueError(f"{page}:{i + 1}: a setup comment that does not end")
            setup.append("\n".join(lines[i + 1 : end]) + "\n")
            i = end + 1
            continue
        fence = FENCE.match(line)
        if not fence:
            i += 1
            continue
        marker, indent = fence["fence"], fence["indent"]
        lang = fence["info"].strip().split(" ")[0].lower()
        end = next(
            (j for j in range(i + 1, len(lines)) if lines[j].strip() == marker),
            None,
        )
        if end is None:
            raise ValueError(f"{page}:{i + 1}: a code block that does not end")
        body = [
            text[len(indent) :] if text.startswith(indent) else text for text in lines[i + 1 : end]
        ]
        block = Block(page, i + 1, lang, "\n".join(body) + "\n", setup=setup)
        setup = []
        previous = lines[i - 1] if i else ""
        directive = DIRECTIVE.match(previous)
        classify(block, directive)
        blocks.append(block)
        i = end + 1
    if setup:
        raise ValueError(f"{page}: a setup comment with no block after it")
    return blocks


def classify(block: Block, directive: re.Match[str] | None) -> None:
    where = block.where
    if directive is None:
        if block.lang == "python":
            block.kind = "page"
        elif block.lang == "bash":
            block.kind = "bash"
        elif block.lang == OUTPUT:
            block.kind = "output"
        else:
            raise ValueError(
                f"{where}: a {block.lang or 'plain'} block must say how it is used "
                "(<!-- file: NAME --> or <!-- not run: REASON -->), or be python, bash or text"
            )
        return
    kind, arg = directive["kind"], directive["arg"]
    if kind == "not run":
        if len(arg) < 10:
            raise ValueError(f"{where}: 'not run' needs its reason")
        block.kind, block.arg = "skip", arg
    elif kind == "file":
        if not re.fullmatch(r"[\w.-]+(/[\w.-]+)*", arg) or ".." in arg.split("/"):
            raise ValueError(f"{where}: a file name inside the page's directory: {arg!r}")
        block.kind, block.arg = "file", arg
    else:
        runner = RUNNERS.fullmatch(arg)
        if runner is None or block.lang != "python":
            raise ValueError(f"{where}: run: torchrun N, mpiexec N or python, on a python block")
        if runner["python"]:
            block.kind = "script"
        else:
            block.kind, block.arg = runner["launcher"], runner["ranks"]
    if block.setup and block.kind in ("skip", "file", "output", "bash"):
        raise ValueError(f"{where}: a setup comment before a block that does not run Python")
