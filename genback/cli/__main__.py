"""``python -m genback.cli ...``: the same command line as ``genback ...`` and ``python -m genback``."""

import sys

from .commands import main

if __name__ == "__main__":
    sys.exit(main())
