"""Read distckpt's docstrings as they are written (reStructuredText roles such as
``:func:`name``` and double-backquoted literals) for the API reference: each role becomes
the inline code it names, shortened as a ``~`` asks."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|mod|data|meth|attr|exc|obj|const):`(~?)([^`]+)`")


def plain(text: str) -> str:
    def one(match: re.Match[str]) -> str:
        short, target = match.groups()
        return f"`{target.rsplit('.', 1)[-1] if short else target}`"

    return ROLE.sub(one, text)


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring of the loaded package once it is read."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
