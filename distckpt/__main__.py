import sys

from distckpt.cli import main

sys.exit(main())
