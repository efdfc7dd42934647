"""The prefix KV store of :class:`genback.llm.mlx.MlxRunner` (see its module notes).

Every evaluated context leaves per-layer keys and values (``[1, kv_heads, n, head_dim]`` mx
arrays) keyed by ``(adapter, tokens)``; a query reuses the entry of its adapter that shares the
longest common prefix with it. Bounded by a byte budget with LRU eviction; pinned entries stay.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D int arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n



class _Entry:
    __slots__ = ("key", "adapter", "tokens", "ids", "layers", "nbytes", "pinned")

    def __init__(self, tokens: tuple[int, ...], layers: list, nbytes: int, adapter=None):
        self.key = (adapter, tokens)
        self.adapter = adapter
        self.tokens = tokens
        self.ids = np.asarray(tokens, dtype=np.int64)
        self.layers = layers  # per layer (keys, values): mx [1, kv_heads, len(tokens), head_dim]
        self.nbytes = nbytes
        self.pinned = False


class PrefixKV:
    """LRU store of per-context KV, bounded by ``budget_bytes`` (pinned entries never evicted).

    Entries are keyed by ``(adapter, tokens)``: KV computed under one LoRA adapter (None: the
    base model) is never matched by a query under another."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()  # (adapter, tokens) -> entry
        self.bytes_held = 0
        self.evictions = 0

    def match(self, ids: np.ndarray, limit: int, adapter=None) -> tuple[_Entry | None, int]:
        """The entry (of ``adapter``) sharing the longest prefix with ``ids`` and that length,
        capped at ``limit``."""
        best, best_len = None, 0
        for entry in self.entries.values():
            if entry.adapter != adapter:
                continue
            n = _lcp(entry.ids, ids)
            if n > best_len:
                best, best_len = entry, n
                if n >= limit:
                    break
        return best, min(best_len, limit)

    def put(self, tokens: tuple[int, ...], layers: list, nbytes: int, adapter=None) -> _Entry:
        old = self.entries.pop((adapter, tokens), None)
        if old is not None:
            self.bytes_held -= old.nbytes
        entry = _Entry(tokens, layers, nbytes, adapter)
        entry.pinned = old is not None and old.pinned
        for other in list(self.entries.values()):  # strict prefixes are served by the new entry
            if not other.pinned and other.adapter == adapter and \
                    len(other.tokens) < len(tokens) and \
                    _lcp(other.ids, entry.ids) == len(other.tokens):
                self._drop(other)
        self.entries[entry.key] = entry
        self.bytes_held += nbytes
        return entry

    def touch(self, entry: _Entry) -> None:
        if entry.key in self.entries:
            self.entries.move_to_end(entry.key)

    def _drop(self, entry: _Entry) -> None:
        del self.entries[entry.key]
        self.bytes_held -= entry.nbytes

    def evict(self) -> None:
        for entry in list(self.entries.values()):
            if self.bytes_held <= self.budget_bytes:
                return
            if not entry.pinned:
                self._drop(entry)
                self.evictions += 1

    def pinned_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values() if e.pinned)

    def clear(self, keep_pinned: bool) -> None:
        for entry in list(self.entries.values()):
            if not (keep_pinned and entry.pinned):
                self._drop(entry)

    def drop_adapter(self, adapter) -> None:
        """Forget every entry computed under ``adapter`` (pinned ones too)."""
        for entry in list(self.entries.values()):
            if entry.adapter == adapter:
                self._drop(entry)
