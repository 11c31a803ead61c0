"""MkDocs hooks: the site names the distckpt version it documents."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_VERSION = re.compile(r'^VERSION\s*=\s*"([^"]+)"', re.M)


def version() -> str:
    """The version in ``distckpt/version.py``, read as text (the docs build imports no
    distckpt for it)."""
    text = (Path(__file__).resolve().parent.parent / "distckpt" / "version.py").read_text()
    found = _VERSION.search(text)
    if found is None:
        raise ValueError("distckpt/version.py has no VERSION")
    return found.group(1)


def on_config(config: Any) -> Any:
    config["site_name"] = f"distckpt {version()}"
    return config


def on_page_markdown(markdown: str, config: Any, **_: Any) -> str:
    markdown = markdown.replace("{{ distckpt_version }}", version())
    return link_repository_paths(markdown, config["extra"]["repository"])


#: Repository paths named in the text (in backticks) become links to them.
_REPO_PATH = re.compile(
    r"(?<![\[\w])`((?:examples|launch|benchmarks|tests|\.ci)/[^`\s]*)`(?![\]\(])"
)
ROOT = Path(__file__).resolve().parent.parent


def link_repository_paths(markdown: str, repo_url: str) -> str:
    """Each `examples/...`, `launch/...` (and benchmarks, tests, .ci) path in backticks
    that exists in the repository, outside code blocks and links, as a link to it."""

    def link(match: re.Match[str]) -> str:
        path = match[1].rstrip("/")
        found = ROOT / path
        if not found.exists():
            return match[0]
        kind = "tree" if found.is_dir() else "blob"
        return f"[`{match[1]}`]({repo_url.rstrip('/')}/{kind}/main/{path})"

    parts = re.split(r"(^(?:```|~~~).*?^(?:```|~~~)[^\n]*$)", markdown, flags=re.M | re.S)
    return "".join(p if i % 2 else _REPO_PATH.sub(link, p) for i, p in enumerate(parts))
