"""Reduction plan: all node values of a trie in O(nodes) vectorised work.

A chain of single-child nodes covers one slice ``[start, end)`` of the leaf order, so node values
are values of the distinct slices ("segments", ``U`` of them, at most ``2V``), gathered to the
nodes at the end. A segment's children segments tile it, so segments are computed bottom-up, one
``ufunc.reduceat`` per level of the segment tree: each level gathers its children's values
(contiguous per parent) and reduces them. Work is O(U) plus a few numpy calls per level (the
segment tree is as deep as the longest chain of branching prefixes, typically 10-30).

Segment ids: ``0..V-1`` are the single-word segments in leaf order (so the leaf weights are one
``np.take``), inner segments follow. Values are laid out ``(U, B)`` so every reduction runs over
contiguous rows of a batch.

The deepest levels hold few, small segments (runs of whitespace tokens make the segment tree up
to ~50 levels deep); they are computed directly from the leaf weights by one interleaved
``reduceat`` over their ``[start, end)`` bounds, which saves a few numpy calls per level.

Log-sum-exp combines children exactly: ``m + log(sum(exp(c - m)))`` with ``m`` the children's max
(the standard shift; no underflow at any level, ``-inf`` children contribute 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .build import TrieLayout

__all__ = ["ReductionPlan", "make_plan", "run_plan"]


@dataclass
class ReductionPlan:
    num_items: int
    num_segments: int
    order: np.ndarray  # (V,) item index of leaf-order word k (= segment k)
    node_segment: np.ndarray  # (N,) segment of each node
    levels: list  # all levels, deepest first: (parents (P,), children (C,), offsets (P,), counts (P,))
    fast_levels: list  # the levels left after the direct part
    direct_ids: np.ndarray  # (D,) segments computed straight from leaf weights
    direct_bounds: np.ndarray  # (2D,) interleaved start, end of those segments
    seg_start: np.ndarray  # (U,)
    seg_end: np.ndarray  # (U,)


def make_plan(lay: TrieLayout, direct_budget: float = 0.25) -> ReductionPlan:
    """Reduction plan of a layout. ``direct_budget``: the deepest levels are computed directly
    while their segments' total length stays below ``direct_budget * V``."""
    V = lay.num_items
    seg_start, seg_end, node_segment = _segments(lay)
    seg_parent = _segment_parents(lay.parent, node_segment, len(seg_start))
    levels = _levels(seg_parent, _segment_depths(seg_parent), seg_start)
    n_direct = _direct_levels(levels, seg_start, seg_end, direct_budget * V)
    direct_ids = np.concatenate([lv[0] for lv in levels[:n_direct]] or [np.zeros(0, np.int64)])
    direct_ids = direct_ids[np.argsort(seg_start[direct_ids] * (V + 1) + (V - seg_end[direct_ids]), kind="stable")]
    bounds = np.stack([seg_start[direct_ids], seg_end[direct_ids]], axis=1).reshape(-1)
    return ReductionPlan(V, len(seg_start), lay.order, node_segment, levels, levels[n_direct:], direct_ids,
                         bounds, seg_start, seg_end)


def _segments(lay: TrieLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct slices of a layout's nodes: ``(seg_start, seg_end, node_segment)``, int64
    ``(U,)``, ``(U,)`` and ``(N,)``. Single-word segments come first (segment ``k`` = leaf-order
    word ``k``), then the inner segments in pre-order."""
    V = lay.num_items
    stride = V + 1
    # pre-order key of a segment: start ascending, end descending (containing segments first)
    key = lay.start * stride + (V - lay.end)
    uniq, inv = np.unique(key, return_inverse=True)
    inv = inv.reshape(-1)
    s, rev = np.divmod(uniq, stride)
    e = V - rev
    single = (e - s) == 1
    new_id = np.empty(len(uniq), np.int64)
    new_id[np.flatnonzero(single)] = s[single]
    new_id[np.flatnonzero(~single)] = V + np.arange(int((~single).sum()))
    seg_start = np.empty(len(uniq), np.int64)
    seg_end = np.empty(len(uniq), np.int64)
    seg_start[new_id], seg_end[new_id] = s, e
    return seg_start, seg_end, new_id[inv]


def _segment_parents(parent: np.ndarray, node_segment: np.ndarray, U: int) -> np.ndarray:
    """(U,) int64 parent segment of every segment, -1 for the root's: the segment of the parent
    node of a node whose segment differs from its parent node's."""
    child_nodes = np.flatnonzero(parent >= 0)
    cs = node_segment[child_nodes]
    ps = node_segment[parent[child_nodes]]
    diff = cs != ps
    seg_parent = np.full(U, -1, np.int64)
    seg_parent[cs[diff]] = ps[diff]
    return seg_parent


def _segment_depths(seg_parent: np.ndarray) -> np.ndarray:
    """(U,) int64 depth of every segment in the segment tree: one climb step per round (rounds =
    tree height)."""
    depth = np.zeros(len(seg_parent), np.int64)
    anc = seg_parent.copy()
    active = np.flatnonzero(anc >= 0)
    while len(active):
        depth[active] += 1
        anc[active] = seg_parent[anc[active]]
        active = active[anc[active] >= 0]
    return depth


def _levels(seg_parent: np.ndarray, depth: np.ndarray, seg_start: np.ndarray) -> list:
    """The levels of the segment tree, deepest first: per depth of the parents ``(parents (P,),
    children (C,), offsets (P,), counts (P,))``, children grouped by parent and sorted by start."""
    levels = []
    kids = np.flatnonzero(seg_parent >= 0)
    if not len(kids):
        return levels
    parent_of = seg_parent[kids]
    o = np.lexsort((seg_start[kids], parent_of, -depth[parent_of]))
    kids, parent_of = kids[o], parent_of[o]
    cuts = np.flatnonzero(np.diff(depth[parent_of])) + 1
    for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(kids)]):
        ch, pa = kids[lo:hi], parent_of[lo:hi]
        first = np.r_[True, pa[1:] != pa[:-1]]
        offsets = np.flatnonzero(first)
        counts = np.diff(np.r_[offsets, len(pa)])
        levels.append((pa[first], ch, offsets, counts))
    return levels


def _direct_levels(levels: list, seg_start: np.ndarray, seg_end: np.ndarray, budget: float) -> int:
    """How many of the deepest levels are computed directly: as many as keep their parents'
    total length within ``budget`` (the root level always runs level-wise)."""
    n_direct, used = 0, 0
    for parents, _, _, _ in levels[:-1]:
        cost = int((seg_end[parents] - seg_start[parents]).sum())
        if used + cost > budget:
            break
        used += cost
        n_direct += 1
    return n_direct


def run_plan(plan: ReductionPlan, W: np.ndarray, op: str, out: np.ndarray | None = None) -> np.ndarray:
    """Node values for float64 weights ``W`` ``(B, V)`` -> float64 ``(B, N)`` (written to ``out``).

    ``op`` is ``"sum"``, ``"max"`` or ``"logsumexp"``. Rows are processed one at a time with one
    ``(U,)`` work buffer, so memory is O(U) beyond the output.
    """
    B, V = W.shape[0], plan.num_items
    if out is None:
        out = np.empty((B, len(plan.node_segment)), np.float64)
    vals = np.empty(max(plan.num_segments, V + 1), np.float64)
    lse = op == "logsumexp"
    ufunc = np.add if op == "sum" else np.maximum
    for b in range(B):
        np.take(W[b], plan.order, out=vals[:V], mode="clip")  # clip: ~2x faster than raise
        if lse:
            with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                for parents, children, offsets, counts in plan.levels:
                    cv = np.take(vals, children, mode="clip")
                    m = np.maximum.reduceat(cv, offsets)
                    m[~np.isfinite(m)] = 0.0  # all -inf (or a +inf) below: shift by 0
                    sh = np.exp(cv - np.repeat(m, counts))
                    vals[parents] = m + np.log(np.add.reduceat(sh, offsets))
        else:
            if len(plan.direct_ids):
                vals[plan.direct_ids] = ufunc.reduceat(vals[: V + 1], plan.direct_bounds)[::2]
            for parents, children, offsets, _ in plan.fast_levels:
                vals[parents] = ufunc.reduceat(vals[children], offsets)
        np.take(vals, plan.node_segment, out=out[b], mode="clip")
    return out
