"""Which genlm-backend client packages are installed (tests skip with the install command)."""

from __future__ import annotations

import importlib.metadata

INSTALL = "pip install --no-deps -r ci/clients.txt && pip install -r ci/clients-deps.txt"


def installed(dist: str) -> bool:
    """True when the distribution ``dist`` (e.g. ``"genlm-control"``) is installed."""
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False
