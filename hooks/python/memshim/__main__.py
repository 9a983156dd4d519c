"""`python -m memshim`: the `memshim` command (memshim/cli.py)."""
import sys

from .cli import main

sys.exit(main())
