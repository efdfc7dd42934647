"""Bounded LRU cache of next-token log-prob rows, keyed by the whole context (a tuple of ids).

Shared by every backend: a query whose context was already answered is served from here without
joining a batch. Keys are whole contexts, never suffixes, so two different contexts never share a
row. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable


class OutputCache:
    """LRU map ``context -> row`` holding at most ``max_entries`` rows (0 disables caching).

    Raises:
        ValueError: ``max_entries`` is negative or not an int.
    """

    def __init__(self, max_entries: int):
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 0:
            raise ValueError(f"row_cache_size must be an int >= 0, got {max_entries!r}")
        self.max_entries = max_entries
        self._rows: OrderedDict[Hashable, object] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.bytes_held = 0  # bytes of the rows held (tensors: numel * element size)

    def get(self, key: Hashable):
        """The cached row for ``key`` (counted as a hit), or None."""
        with self._lock:
            row = self._rows.get(key)
            if row is not None:
                self._rows.move_to_end(key)
                self.hits += 1
            return row

    def put(self, key: Hashable, row) -> None:
        if self.max_entries == 0:
            return
        with self._lock:
            old = self._rows.pop(key, None)
            self.bytes_held += _nbytes(row) - _nbytes(old)
            self._rows[key] = row
            while len(self._rows) > self.max_entries:
                self.bytes_held -= _nbytes(self._rows.popitem(last=False)[1])

    def drop(self, predicate) -> int:
        """Remove every row whose key satisfies ``predicate(key)``; return how many."""
        with self._lock:
            keys = [k for k in self._rows if predicate(k)]
            for k in keys:
                self.bytes_held -= _nbytes(self._rows.pop(k))
            return len(keys)

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
            self.bytes_held = 0

    def __len__(self) -> int:
        return len(self._rows)


def _nbytes(row) -> int:
    return 0 if row is None else row.numel() * row.element_size()
