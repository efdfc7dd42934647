"""The ``genback`` command line: :mod:`.commands` (``genback ...``, the subcommands' dispatch),
:mod:`.parser` (the arguments), one module per subcommand (:mod:`.model`, :mod:`.sample`,
:mod:`.lm_eval`)."""

from .commands import main

__all__ = ["main"]
