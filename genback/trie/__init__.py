"""Token-character tries: per-prefix sums, maxes and log-sum-exps over a vocabulary."""

from .base import TokenCharacterTrie

__all__ = ["TokenCharacterTrie"]
