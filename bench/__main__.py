"""``python -m bench SUITE [flags]`` from the repository root (see :mod:`bench.cli` and bench/README.md)."""
import sys

from bench.cli import main

sys.exit(main())
