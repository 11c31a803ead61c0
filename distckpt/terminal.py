"""Text from storage made safe to show on a terminal.

Names, paths and messages that the command line prints come from storage: a variable
named with ESC, BEL or CR, or with a bidirectional override (U+202E), could rewrite what
a terminal shows or hide a line. :func:`printable` escapes every character that is not
printable (``str.isprintable``: C0 and C1 controls, DEL, format characters such as the
bidi overrides, line and paragraph separators, lone surrogates, unassigned code points)
as Python writes it in a string literal (``\\x1b``, ``\\u202e``), and keeps the rest,
spaces included. ``repr`` does the same for one value with quotes around it; every line
the ``distckpt`` command prints goes through :func:`printable`.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (see the module doc):

    >>> printable("a\\x1b[31mb\\u202ec")
    'a\\\\x1b[31mb\\\\u202ec'
    """
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
        for c in text
    )
