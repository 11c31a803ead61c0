"""Cutting a tensor into slabs: boxes of at most a given number of bytes, in C order.

Pure arithmetic. Concatenating the slabs' bytes in the order given yields the tensor's
C-order bytes, so a writer can stream a tensor a slab at a time::

    >>> [str(b) for b in slabs((4, 3), itemsize=4, max_bytes=24)]
    ['[0:2, 0:3]', '[2:4, 0:3]']
    >>> [str(b) for b in slabs((2, 5), itemsize=1, max_bytes=3)]
    ['[0:1, 0:3]', '[0:1, 3:5]', '[1:2, 0:3]', '[1:2, 3:5]']
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

from distckpt.slices import Box

DEFAULT_SLAB_BYTES = 64 * 1024 * 1024


def slabs(shape: Sequence[int], itemsize: int, max_bytes: int) -> Iterator[Box]:
    """Boxes covering ``shape`` once, each of at most ``max_bytes`` (or one element, if an
    element is larger), in C order.

    Runs of whole rows of the first dimension where a row fits; otherwise one index of the
    leading dimensions and runs along the first dimension whose remainder fits.
    """
    shape = tuple(int(n) for n in shape)
    if any(n == 0 for n in shape):
        return
    if not shape:
        yield Box((), ())
        return
    limit = max(1, max_bytes // max(1, itemsize))  # elements per slab
    for d in range(len(shape)):
        rest = math.prod(shape[d + 1 :])
        if rest <= limit or d == len(shape) - 1:
            run = max(1, limit // rest)
            break
    lead = shape[:d]
    for prefix in itertools.product(*(range(n) for n in lead)):
        for start in range(0, shape[d], run):
            length = min(run, shape[d] - start)
            yield Box(
                (*prefix, start, *(0,) * len(shape[d + 1 :])),
                ((1,) * d) + (length,) + shape[d + 1 :],
            )
