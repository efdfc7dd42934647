"""The decode step's buckets: a step's shape rounded up to the shape of the static buffers (and
the CUDA graph) that run it (:mod:`.step`: one graph per bucket, captured lazily)."""

from __future__ import annotations


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# the table's narrowest bucket: an SMC run's rows grow by a token a step, and each new width bucket
# is a capture (45-70 ms on a 1B model, measured); 32 columns cover a run's first 31 steps
MIN_WIDTH = 32


def bucket(rows: int, width: int, prefix: int) -> tuple[int, int, int]:
    """``(rows, width, prefix)`` rounded up to their bucket: rows to a power of two, the table's
    width to a power of two of at least :data:`MIN_WIDTH`, the prefix to a multiple of 256 (0
    stays 0)."""
    return _pow2(rows), max(MIN_WIDTH, _pow2(width)), -(-prefix // 256) * 256
