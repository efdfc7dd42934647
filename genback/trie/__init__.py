"""Token-character tries: per-prefix sums, maxes and log-sum-exps over a vocabulary.

``TokenCharacterTrie`` (numpy, float64, CPU), ``ParallelTokenCharacterTrie`` (torch, any device)
and ``AsyncTokenCharacterTrie`` (batches concurrent requests on a worker thread).
"""

from .async_impl import AsyncTokenCharacterTrie
from .base import TokenCharacterTrie
from .parallel import ParallelTokenCharacterTrie

__all__ = ["TokenCharacterTrie", "ParallelTokenCharacterTrie", "AsyncTokenCharacterTrie"]
