"""Numbers read out of stored names: the step of ``ckpt-12`` (a manager's checkpoints,
``checkpoint-12`` of the Hugging Face trainer, ``step-12`` of torchtitan and of the
node-local tier), the rank of a per-rank entry or of a local-tier file.

A name is read by one rule, here, everywhere: a number is ASCII digits only, in the
form distckpt writes them (``str(n)``): ``0``, or a digit 1-9 followed by at most 17
more digits. ``str.isdigit``, the ``\\d`` of regular expressions and ``int`` also take
other scripts' digits (the Arabic-Indic ``٤`` is 4 to them), signs, spaces and
underscores; a name like that was not written by distckpt or the trainers, and is not
read as a number. A leading zero (``ckpt-05``) does not make a step either: ``ckpt-5``
may exist beside it, and one step would have two names. Whoever lists a directory
skips a name that does not parse (``distckpt gc`` reports it), never fails on it.
"""

from __future__ import annotations

#: The most digits read: a step of up to 10**18 - 1, far beyond any run.
MAX_DIGITS = 18


def number(text: str) -> int | None:
    """The number ``text`` spells as distckpt writes numbers, or None.

    >>> number("12"), number("0"), number("05"), number("٤"), number("+5"), number("1e3")
    (12, 0, None, None, None, None)
    """
    if not text or len(text) > MAX_DIGITS or not text.isascii() or not text.isdigit():
        return None
    if text[0] == "0" and len(text) > 1:
        return None
    return int(text)


def numbered(name: str, prefix: str, suffix: str = "") -> int | None:
    """N of a name ``<prefix>N<suffix>`` (N as :func:`number` reads it), or None.

    >>> numbered("ckpt-7", "ckpt-"), numbered("r3.json", "r", ".json"), numbered("ckpt-", "ckpt-")
    (7, 3, None)
    """
    if len(name) <= len(prefix) + len(suffix) or not name.startswith(prefix):
        return None
    if suffix and not name.endswith(suffix):
        return None
    return number(name[len(prefix) : len(name) - len(suffix)])


def signed(text: str) -> int | None:
    """:func:`number`, or its negative after a ``-`` (an integer key of a stored dict)."""
    if text.startswith("-"):
        found = number(text[1:])
        return None if found is None or found == 0 else -found
    return number(text)
