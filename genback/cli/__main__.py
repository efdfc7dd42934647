"""``python -m genback.cli ...``: the ``genback`` command line, as before ``genback/cli.py`` became this
package (the tests and the documentation run it this way; ``python -m genback ...`` is the same)."""

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
