"""``PastPool``: the private pasts of tree-attention forwards, kept between forwards.

A row's *private* past is the part of its cached KV that no other row of the forward shares
(:func:`.plan.split_segments`): a particle's own tokens, a context nobody else has. Attention
reads it batched, so each forward lays the rows' pasts side by side (left-padded) for every
layer. The pool is where they are laid out from: one tensor ``[layers, 2, kv_heads, capacity,
dim]`` holding each distinct private segment once, in columns, so that a layer's keys and values
for all rows are one ``index_select`` of it.

The pool outlives a forward. A decoding step extends every row by one token, so the next step's
private segments are the last step's plus one new node per row: only those new columns are
copied in, instead of every row's whole past each step (which cost ~11% of a generation step of
32 rows on SmolLM2, measured). Columns are found by segment identity: the KV tensor itself (a
node's ``kv``, held by a weak reference, so a freed tensor can never be mistaken for a new one
with the same id), which is sound because the KV tree never writes a stored tensor. A segment
that is part of a node's edge is a fresh view at each match: it is copied in each time.

Each forward also reserves ``R * m`` scratch columns after the used ones: a layer writes its new
keys and values there (:meth:`PastPool.layer`) and one ``index_select`` then lays out past and
new tokens together, with no concatenation.

Memory: the pool holds one copy of the private segments it has seen. When a forward's segments
and scratch do not fit, it is rebuilt with just that forward's segments and room to grow (twice
what they need); a pool larger than the runner's ``max_forward_bytes`` is dropped after the
forward (:meth:`PastPool.trim`).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from .segments import PrivatePasts


class PastPool:
    """Private-past columns shared by the tree-attention forwards of one runner.

    Args:
        layout: ``(layers, kv_heads, head_dim, dtype, device)`` of the model's KV.

    Not thread-safe: the runner's forward lock serialises its use.
    """

    def __init__(self, layout: tuple):
        self.layers, self.heads, self.dim, self.dtype, self.device = layout
        self.store: torch.Tensor | None = None  # [layers, 2, kv_heads, capacity, dim]
        self.used = 0
        self._scratch = 0  # first scratch column of the forward being laid out (place)
        self._where: dict[int, tuple[weakref.ref, int]] = {}  # id(kv) -> (ref, first column)
        self.columns_copied = 0  # statistics: segment columns copied in, all time
        self.rebuilds = 0

    @property
    def capacity(self) -> int:
        return 0 if self.store is None else self.store.shape[3]

    @property
    def nbytes(self) -> int:
        return 0 if self.store is None else self.store.numel() * self.store.element_size()

    def clear(self) -> None:
        """Free the pool."""
        self.store, self.used, self._where = None, 0, {}

    def trim(self, max_bytes: int) -> None:
        """Free the pool when it holds more than ``max_bytes``."""
        if self.nbytes > max_bytes:
            self.clear()

    def _rebuild(self, columns: int) -> None:
        # column 0 stays zero: the left padding of shorter pasts reads it (masked anyway)
        capacity = max(64, 2 * columns + 1)
        self.store = torch.empty((self.layers, 2, self.heads, capacity, self.dim),
                                 dtype=self.dtype, device=self.device)
        self.store[:, :, :, 0].zero_()  # (the rest is written before it is read)
        self.used, self._where = 1, {}
        self.rebuilds += 1

    def place(self, private: PrivatePasts, m: int
              ) -> tuple[torch.Tensor, int, np.ndarray] | None:
        """Make sure every row's private segments are in the pool; plan the layer layout.

        Args:
            private: the rows' private segments (:func:`.segments.split_segments`).
            m: new tokens per row (right-padded) of the forward.

        Returns:
            None when no row has a private past, else ``(index, P, pads)``: ``index`` long
            ``[R * (P + m)]`` on the device, the pool columns of each row's left-padded past
            then its ``m`` scratch columns; ``P`` the longest private past; ``pads`` (``int64
            [R]``) each row's left padding.

        Python work is per distinct segment (the union of the rows' paths), not per row and
        segment: the layout is computed by NumPy from ``private.chains``.
        """
        chains = private.chains
        R = chains.shape[0]
        lengths = private.path_lengths()
        P = int(lengths.max()) if R else 0
        if P == 0:
            return None
        kvs = private.kvs
        where = self._where
        # each segment's first column in the pool, or -1 when it is not there (yet)
        cols = []
        for kv in kvs:
            hit = where.get(id(kv))
            cols.append(hit[1] if hit is not None and hit[0]() is kv else -1)
        first_col = np.array(cols + [0], dtype=np.int64)
        missing = np.flatnonzero(first_col < 0)
        extra = int(private.lengths[missing].sum())
        if self.store is None or self.used + extra + R * m > self.capacity:
            self._rebuild(int(private.lengths.sum()) + R * m)
            missing = np.arange(len(kvs))
        where = self._where  # (a rebuild above replaced it)
        if len(missing):  # one copy for all of them
            new_len = private.lengths[missing]
            added = int(new_len.sum())
            first_col[missing] = self.used + np.cumsum(new_len) - new_len
            missing = missing.tolist()
            block = (kvs[missing[0]] if len(missing) == 1
                     else torch.cat([kvs[i] for i in missing], dim=3))
            self.store[:, :, :, self.used:self.used + added].copy_(block)
            for i, col in zip(missing, first_col[missing].tolist()):
                kv = kvs[i]
                where[id(kv)] = (weakref.ref(kv), col)
            self.used += added
            self.columns_copied += added
        scratch = self.used
        self._scratch = scratch
        # the index as runs of columns (start, length, step) per row: its left padding (column 0
        # repeated), its segments' columns, its scratch; expanded by numpy, so a long segment
        # costs no Python object per column
        seg_len = np.append(private.lengths, 0)  # (index -1: no segment)
        pads = P - lengths
        D = chains.shape[1]
        starts = np.empty((R, D + 2), dtype=np.int64)
        runs = np.empty((R, D + 2), dtype=np.int64)
        steps = np.ones((R, D + 2), dtype=np.int64)
        starts[:, 0], runs[:, 0], steps[:, 0] = 0, pads, 0
        starts[:, 1:D + 1], runs[:, 1:D + 1] = first_col[chains], seg_len[chains]
        starts[:, D + 1] = scratch + m * np.arange(R)
        runs[:, D + 1] = m
        starts, runs, steps = starts.ravel(), runs.ravel(), steps.ravel()
        first = np.cumsum(runs) - runs  # each run's first place in the index
        offset = np.arange(R * (P + m), dtype=np.int64) - np.repeat(first, runs)
        index = np.repeat(starts, runs) + offset * np.repeat(steps, runs)
        return torch.from_numpy(index).to(self.device), P, pads

    def layer(self, layer: int, key: torch.Tensor, value: torch.Tensor, index: torch.Tensor,
              P: int, out: torch.Tensor):
        """Layer ``layer``'s keys and values for every row: its private past, then its new tokens.

        Args:
            key / value: the new tokens' ``[R, kv_heads, m, dim]``.
            index: from :meth:`place`; ``out``: a ``[2, kv_heads, R * (P + m), dim]`` buffer
                (reused across layers).

        Returns:
            ``(k, v)``, each ``[R, kv_heads, P + m, dim]`` (views of ``out``).
        """
        R, H, m, D = key.shape
        s = self._scratch
        cols = self.store[layer, :, :, s:s + R * m]  # [2, H, R*m, D]
        cols[0].unflatten(1, (R, m)).copy_(key.transpose(0, 1))
        cols[1].unflatten(1, (R, m)).copy_(value.transpose(0, 1))
        torch.index_select(self.store[layer], 2, index, out=out)
        kv = out.view(2, H, R, P + m, D).transpose(1, 2)
        return kv[0], kv[1]
