"""Block plan: every node's sum or max from a few aligned power-of-two blocks of the leaf order.

Every node's tokens are one contiguous slice ``[start, end)`` of the words in leaf order
(``genback.trie.build``). A run of nodes with the same slice (a chain of single-child nodes) has
one value; slices of one word are the word's own weight, so only the ``S`` distinct slices with two
or more words ("segments") need a reduction.

Algorithm (the bottom-up segment tree's canonical range decomposition; e.g. de Berg et al.,
*Computational Geometry*, ch. 10.3, or any "iterative segment tree" range query):

1. ``tree`` level 0 is the weights permuted into leaf order; level ``j`` holds the reduction of
   the aligned blocks ``[i * 2**j, (i + 1) * 2**j)``, one vectorised ufunc call per level over
   the strided halves of level ``j - 1`` (about ``V`` element operations in all, ``log2 V`` calls).
2. A segment ``[l, r)`` is the disjoint union of at most ``2 log2(r - l)`` such blocks (about 2.3
   on average for real vocabularies). The block indices of all segments are precomputed and laid
   out row-major: row ``k`` holds the ``k``-th block of every segment that has more than ``k``
   (segments sorted by block count, descending, so row ``k`` is a prefix). One gather reads all
   blocks; one ufunc call per row folds row ``k`` into the first ``n_k`` accumulators.
3. One gather writes the ``N`` node values from the leaf-order weights and the segment values.

So a row costs two gathers of ``V`` and ``N`` elements, about ``2V`` further element operations and
about ``log2 V + max blocks`` (~35) numpy calls, with no per-segment Python or ufunc-loop overhead
(``np.add.reduceat`` pays ~10-40 ns per segment, which is why it is not used here). Sums are exact
float64 sums of the same terms in a different association (no cumulative-sum cancellation); maxes
are exact and right for ``-inf``; NaN propagates (``np.maximum``, not ``np.fmax``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from .build import TrieLayout

__all__ = ["BlockPlan", "make_block_plan", "run_block_plan"]


@dataclass
class BlockPlan:
    num_items: int  # V
    order: np.ndarray  # (V,) int64, item index of leaf-order word k
    levels: list  # [(src offset, blocks m, dst offset)] for tree levels 1, 2, ...
    tree_size: int  # total length of all tree levels (level 0 = the V leaf-order weights)
    num_segments: int  # S, multi-word segments
    terms: np.ndarray  # (T,) int64 tree indices of all blocks, row-major (row 0 = S entries)
    rows: list  # [(n_k, offset of row k in terms - S)] for rows k >= 1
    node_src: np.ndarray  # (N,) int64 index of each node's value in [tree | segment values]
    _local: threading.local = field(default_factory=threading.local, repr=False)

    def work(self):
        """This thread's work buffers and their views (made once per thread: calls from several
        threads never share a buffer)."""
        w = getattr(self._local, "work", None)
        if w is None:
            V, S, T0 = self.num_items, self.num_segments, self.tree_size
            e = np.empty(T0 + S, np.float64)
            x = np.empty(len(self.terms) - S, np.float64)
            levels = [(e[s : s + 2 * m : 2], e[s + 1 : s + 2 * m : 2], e[d : d + m]) for s, m, d in self.levels]
            rows = [(e[T0 : T0 + k], x[o : o + k]) for k, o in self.rows]
            w = self._local.work = (e, x, e[:V], e[T0:], levels, rows, self.terms[:S], self.terms[S:])
        return w


def make_block_plan(lay: TrieLayout) -> BlockPlan:
    """Block plan of a layout (vectorised; ~log2 V numpy passes over the segments)."""
    V = lay.num_items
    offs = _tree_offsets(V)
    levels = [(offs[j - 1], offs[j + 1] - offs[j], offs[j]) for j in range(1, len(offs) - 1)]
    multi, seg_of_multi, l, r = _segments(lay.start, lay.end)
    S = len(l)
    blocks = _decompose(l, r, offs)
    rank, terms, rows = _row_major(blocks, S)
    node_src = lay.start.copy()
    node_src[multi] = offs[-1] + rank[seg_of_multi]
    return BlockPlan(V, lay.order, levels, offs[-1], S, terms, rows, node_src)


def _tree_offsets(V: int) -> list:
    """Start of every tree level in the tree's columns, then its total size: level 0 holds ``V``
    columns, level ``j`` half of level ``j - 1`` (rounded down), down to the first level of
    fewer than 2."""
    sizes = [V]
    while sizes[-1] >= 2:
        sizes.append(sizes[-1] // 2)
    return np.cumsum([0] + sizes).tolist()


def _segments(start: np.ndarray, end: np.ndarray):
    """The slices of two or more words: ``(multi, seg_of_multi, l, r)``: ``multi`` the nodes
    with such a slice, ``seg_of_multi`` their segment, ``l``, ``r`` (S,) each segment's bounds
    (int64; nodes sharing a slice are consecutive in pre-order: a single-child chain)."""
    multi = np.flatnonzero(end - start >= 2)
    ms, me = start[multi], end[multi]
    new = np.ones(len(multi), bool)
    new[1:] = (ms[1:] != ms[:-1]) | (me[1:] != me[:-1])
    return multi, np.cumsum(new) - 1, ms[new].copy(), me[new].copy()


@dataclass
class _Blocks:
    """The canonical blocks of ``S`` segments, ``T`` blocks in all (int64 arrays)."""

    seg: np.ndarray  # (T,) segment of each block
    within: np.ndarray  # (T,) index of the block among its segment's blocks
    idx: np.ndarray  # (T,) tree column of the block
    count: np.ndarray  # (S,) blocks per segment


def _decompose(l: np.ndarray, r: np.ndarray, offs: list) -> _Blocks:
    """The canonical decomposition of every segment ``[l, r)`` into aligned tree blocks, one
    tree level at a time (``l`` and ``r`` are overwritten)."""
    S = len(l)
    seg_parts, within_parts, idx_parts = [], [], []
    count = np.zeros(S, np.int64)
    active = np.arange(S)
    for j in range(len(offs) - 1):
        if not len(active):
            break
        la, ra = l[active], r[active]
        left = (la & 1).astype(bool) & (la < ra)
        sel = active[left]
        seg_parts.append(sel), within_parts.append(count[sel]), idx_parts.append(offs[j] + la[left])
        count[sel] += 1
        la = la + left
        right = (ra & 1).astype(bool) & (la < ra)
        ra = ra - right
        sel = active[right]
        seg_parts.append(sel), within_parts.append(count[sel]), idx_parts.append(offs[j] + ra[right])
        count[sel] += 1
        l[active], r[active] = la >> 1, ra >> 1
        active = active[l[active] < r[active]]
    if not S:
        return _Blocks(*(np.zeros(0, np.int64),) * 3, count)
    return _Blocks(np.concatenate(seg_parts), np.concatenate(within_parts), np.concatenate(idx_parts), count)


def _row_major(blocks: _Blocks, S: int) -> tuple[np.ndarray, np.ndarray, list]:
    """``(rank, terms, rows)`` of ``BlockPlan``: ``rank`` (S,) each segment's position when sorted
    by block count (descending), ``terms`` the block columns row-major (row ``k`` = the ``k``-th
    block of the segments with more than ``k``), ``rows`` the length and offset of rows 1, 2, ..."""
    if not S:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), []
    count = blocks.count
    rank = np.empty(S, np.int64)
    rank[np.argsort(-count, kind="stable")] = np.arange(S)
    hist = np.bincount(count)
    rowlen = S - np.cumsum(hist)[:-1]  # rowlen[k] = segments with more than k blocks
    rowoff = np.concatenate([[0], np.cumsum(rowlen)])
    terms = np.empty(len(blocks.idx), np.int64)
    terms[rowoff[blocks.within] + rank[blocks.seg]] = blocks.idx
    rows = [(int(n), int(o) - S) for n, o in zip(rowlen[1:], rowoff[1:-1])]
    return rank, terms, rows


def run_block_plan(plan: BlockPlan, W: np.ndarray, op: str, out: np.ndarray | None = None) -> np.ndarray:
    """Node values for float64 weights ``W`` ``(B, V)`` -> float64 ``(B, N)`` (written to ``out``).

    ``op`` is ``"sum"`` or ``"max"``. Rows are reduced one at a time (1-D calls: least call
    overhead, and the ~1 MB work buffer stays in cache) in this thread's work buffer of
    ``tree_size + T`` floats (``tree_size < 2V``; ``T`` = blocks, about ``2.3 S``), so memory
    beyond the output is O(nodes) per thread.
    """
    ufunc = np.add if op == "sum" else np.maximum
    B = W.shape[0]
    if out is None:
        out = np.empty((B, len(plan.node_src)), np.float64)
    S = plan.num_segments
    e, x, leaves, seg, levels, rows, terms0, terms1 = plan.work()
    for b in range(B):
        np.take(W[b], plan.order, out=leaves, mode="clip")
        for even, odd, dst in levels:
            ufunc(even, odd, out=dst)
        if S:
            np.take(e, terms0, out=seg, mode="clip")
            np.take(e, terms1, out=x, mode="clip")
            for acc, part in rows:
                ufunc(acc, part, out=acc)
        np.take(e, plan.node_src, out=out[b], mode="clip")
    return out
