"""Bounded LRU cache of next-token log-prob rows, keyed by the whole query (its whole context
and its adapter: :class:`~genback.queries.kinds.NextToken`, equal by value).

Shared by every backend: a query whose context was already answered is served from here without
joining a batch. Keys are whole contexts, never suffixes, so two different contexts never share a
row. Thread-safe.

It also has genlm-backend's ``genlm.backend.cache.OutputCache`` API (``OutputCache(maxsize,
move_to_cpu=False)``, ``cache[key]`` / ``cache[key] = row`` / ``key in cache`` / ``len`` /
``clear``), so ``genback.compat`` can serve that module.

Rows arrive as views: a step's ``log_softmax`` is one block of ``[rows, V]`` float32 (one
kernel on a GPU: up to 128 MiB at 256 rows of a 128k vocabulary; blocks of about 1 MiB in host
memory), and each cached row is a view of it, which keeps the whole block alive (host rows of
the batcher arrive as :class:`genback.queries.rows.BlockRow` s of a block of copies, which do the same:
:mod:`genback.queries.rows`). Rows that are
never asked again leave the cache in the order they came, a block's rows together; a row that is
asked again (a hit) moves to the recent end and could keep its block alive long after its
siblings left. So a hit replaces a view by a compact copy of the row, once (one copy per hot
row, nothing per step): the memory the cache keeps alive stays within about twice
``bytes_held``.
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from itertools import repeat
from typing import Hashable

from ..queries.rows import compact


class OutputCache:
    """LRU map ``context -> row`` holding at most ``max_entries`` rows (0 disables caching).

    Args:
        maxsize: most rows kept (also the attribute ``max_entries``).
        move_to_cpu: keep tensors on the CPU and hand them back on the device they were
            stored from (``cache[key]``; ``get`` returns the stored CPU tensor).

    Raises:
        ValueError: ``max_entries`` is negative or not an int.
    """

    def __init__(self, maxsize: int, move_to_cpu: bool = False):
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
            raise ValueError(f"row_cache_size must be an int >= 0, got {maxsize!r}")
        self.max_entries = maxsize
        self.move_to_cpu = bool(move_to_cpu)
        self._devices: dict = {}  # key -> the device a tensor came from (move_to_cpu only)
        self._rows: OrderedDict[Hashable, object] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.bytes_held = 0  # bytes of the rows held (tensors: numel * element size)

    def get(self, key: Hashable):
        """The cached row for ``key`` (counted as a hit), or None. A row kept as a view of a
        larger tensor is replaced by a compact copy of it at its first hit (see the module's
        docstring), and that copy returned."""
        with self._lock:
            row = self._rows.get(key)
            return None if row is None else self._hit(key, row)

    def get_many(self, keys) -> list:
        """:meth:`get` of each key, under one lock (a key that is None: no lookup, None)."""
        rows, hit = self._rows, self._hit
        with self._lock:  # (every key looked up in C; a frame only for a hit: SMC steps miss)
            out = list(map(rows.get, keys))  # (None is never a key: its look-up misses)
            if any(map(_is_not, out, repeat(None))):
                for i, (key, row) in enumerate(zip(keys, out)):
                    if row is not None:
                        out[i] = hit(key, row)
        return out

    def _hit(self, key: Hashable, row):
        """``row``, found under ``key``: now the most recent, counted, and compact."""
        self._rows.move_to_end(key)
        self.hits += 1
        kept = compact(row)  # (genback.queries.rows: a view of a block becomes a compact copy)
        if kept is not row:
            self._rows[key] = kept
        return kept

    def put(self, key: Hashable, row) -> None:
        self.put_many(((key, row),))

    def put_many(self, items) -> None:
        """``put`` of each ``(key, row)`` of ``items``, in order, under one lock."""
        if self.max_entries == 0:
            return
        rows, devices, move = self._rows, self._devices, self.move_to_cpu
        with self._lock:
            held = self.bytes_held
            if not move:  # (mostly every key new: one update in C, their bytes summed)
                items = list(items)
                n = len(rows)
                rows.update(items)
                if len(rows) == n + len(items):
                    held += sum(map(_nbytes, map(_row, items)))
                else:  # (some were kept already: replaced, and now the most recent)
                    for key, _ in items:
                        rows.move_to_end(key)
                    held = sum(map(_nbytes, rows.values()))
            else:  # (rows kept on the CPU, their devices remembered: one by one)
                for key, row in items:
                    if hasattr(row, "device"):
                        devices[key] = row.device
                        row = row.cpu()
                    n = len(rows)
                    old = rows.setdefault(key, row)  # (a new key, mostly: hashed once)
                    if len(rows) == n:  # (kept already: replaced, and now the most recent)
                        held -= _nbytes(old)
                        del rows[key]
                        rows[key] = row
                    held += _nbytes(row)
            for _ in range(len(rows) - self.max_entries):  # the least recently used go
                gone, dropped = rows.popitem(last=False)
                if devices:
                    devices.pop(gone, None)
                held -= 0 if dropped is None else dropped.nbytes  # (_nbytes, inline)
            self.bytes_held = held

    def drop(self, predicate) -> int:
        """Remove every row whose key satisfies ``predicate(key)``; return how many."""
        with self._lock:
            keys = [k for k in self._rows if predicate(k)]
            for k in keys:
                self._devices.pop(k, None)
                self.bytes_held -= _nbytes(self._rows.pop(k))
            return len(keys)

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
            self._devices.clear()
            self.bytes_held = 0

    def __len__(self) -> int:
        return len(self._rows)

    # -- genlm-backend's OutputCache API ------------------------------------------------------------

    @property
    def maxsize(self) -> int:
        return self.max_entries

    def __getitem__(self, key: Hashable):
        """The row for ``key`` (on the device it was stored from); ``KeyError`` if absent."""
        row = self.get(key)
        if row is None:
            raise KeyError(key)
        device = self._devices.get(key)
        return row if device is None else row.to(device)

    def __setitem__(self, key: Hashable, row) -> None:
        self.put(key, row)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._rows


_is_not, _row = operator.is_not, operator.itemgetter(1)


def _nbytes(row) -> int:
    return 0 if row is None else row.nbytes
