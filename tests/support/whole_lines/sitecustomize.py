"""Run at the start of every Python process a test launches (this folder is on the jobs'
``PYTHONPATH``, see ``tests/support/launch_util.py``): stdout writes whole lines.

The ranks of a job share one pipe. Unbuffered (``PYTHONUNBUFFERED=1``, or ``python -u``,
which torchrun runs its workers with), ``print`` writes its text and its newline in two
writes, so two ranks printing at once give ``OK 0OK 1`` and two empty lines. Line
buffered, and not written through, each line is one write, which a pipe keeps whole (up
to ``PIPE_BUF``, 4096 bytes on Linux); a rank that is killed loses at most the line it
was writing. stderr is line buffered already.
"""

import sys

if sys.stdout is not None and hasattr(sys.stdout, "reconfigure"):
    sys.stdout.reconfigure(line_buffering=True, write_through=False)
