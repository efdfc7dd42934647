"""``python -m genback ...``: the ``genback`` command line (what launchers such as ``torchrun -m
genback lm-eval ...`` and ``accelerate launch -m genback lm-eval ...`` start)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
