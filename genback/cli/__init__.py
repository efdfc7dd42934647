"""The ``genback`` command line: :mod:`.main` (``genback ...``, the subcommands' dispatch),
:mod:`.parser` (the arguments), one module per subcommand (:mod:`.model`, :mod:`.sample`,
:mod:`.lm_eval`)."""

from .main import main

__all__ = ["main"]
