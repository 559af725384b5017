"""`python -m shoal ...` is the `shoal` command."""

import sys

from shoal.cli import main

if __name__ == "__main__":
    sys.exit(main())
