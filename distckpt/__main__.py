"""``python -m distckpt``: the command line (:mod:`distckpt.cli`)."""

import sys

from distckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
