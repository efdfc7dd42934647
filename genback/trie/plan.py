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

Log-sum-exp combines children exactly: ``m + log(sum(exp(c - m)))`` with ``m`` the children's max
(the standard shift; no underflow at any level, ``-inf`` children contribute 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .build import TrieLayout

__all__ = ["ReductionPlan", "make_plan"]


@dataclass
class ReductionPlan:
    num_items: int
    num_segments: int
    order: np.ndarray  # (V,) item index of leaf-order word k (segment k)
    node_segment: np.ndarray  # (N,) segment of each node
    levels: list  # deepest first: (parents (P,), children (C,), group offsets (P,), counts (P,))
    seg_start: np.ndarray  # (U,)
    seg_end: np.ndarray  # (U,)


def make_plan(lay: TrieLayout) -> ReductionPlan:
    V, N = lay.num_items, lay.num_nodes
    stride = V + 1
    # pre-order key of a segment: start ascending, end descending (containing segments first)
    key = lay.start * stride + (V - lay.end)
    uniq, inv = np.unique(key, return_inverse=True)
    inv = inv.reshape(-1)
    s, rev = np.divmod(uniq, stride)
    e = V - rev
    single = (e - s) == 1
    # renumber: single-word segments first (by start), then inner segments in pre-order
    new_id = np.empty(len(uniq), np.int64)
    new_id[np.flatnonzero(single)] = s[single]
    new_id[np.flatnonzero(~single)] = V + np.arange(int((~single).sum()))
    U = len(uniq)
    seg_start = np.empty(U, np.int64)
    seg_end = np.empty(U, np.int64)
    seg_start[new_id], seg_end[new_id] = s, e
    node_segment = new_id[inv]
    # parent segment: where a node's segment differs from its parent node's segment
    child_nodes = np.flatnonzero(lay.parent >= 0)
    cs = node_segment[child_nodes]
    ps = node_segment[lay.parent[child_nodes]]
    diff = cs != ps
    seg_parent = np.full(U, -1, np.int64)
    seg_parent[cs[diff]] = ps[diff]
    # depth in the segment tree, by pointer jumping (O(U log depth))
    depth = np.zeros(U, np.int64)
    anc = seg_parent.copy()
    hop = np.ones(U, np.int64)
    has = anc >= 0
    depth[has] = 1
    while True:
        more = has & (anc >= 0)
        more[more] = seg_parent[anc[more]] >= 0
        if not more.any():
            break
        # jump: depth += depth-so-far of ancestor chain (simple iterative climb, one hop per round)
        idx = np.flatnonzero(more)
        anc[idx] = seg_parent[anc[idx]]
        depth[idx] += 1
    levels = []
    kids = np.flatnonzero(seg_parent >= 0)
    if len(kids):
        # group children by parent, parents by depth (deepest first), children by start
        parent_of = seg_parent[kids]
        o = np.lexsort((seg_start[kids], parent_of, -depth[parent_of]))
        kids, parent_of = kids[o], parent_of[o]
        pdepth = depth[parent_of]
        cuts = np.flatnonzero(np.diff(pdepth)) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(kids)]):
            ch, pa = kids[lo:hi], parent_of[lo:hi]
            first = np.r_[True, pa[1:] != pa[:-1]]
            offsets = np.flatnonzero(first)
            counts = np.diff(np.r_[offsets, len(pa)])
            levels.append((pa[first], ch, offsets, counts))
    return ReductionPlan(V, U, lay.order, node_segment, levels, seg_start, seg_end)


def run_plan(plan: ReductionPlan, W: np.ndarray, op: str) -> np.ndarray:
    """Node values for weights ``W`` of shape ``(B, V)`` float64 -> ``(B, N)`` float64.

    ``op`` is ``"sum"``, ``"max"`` or ``"logsumexp"``.
    """
    B = W.shape[0]
    vals = np.empty((plan.num_segments, B), np.float64)
    if B == 1:
        np.take(W[0], plan.order, out=vals[: plan.num_items, 0])
    else:
        vals[: plan.num_items] = np.take(W, plan.order, axis=1).T
    if op == "sum" or op == "max":
        ufunc = np.add if op == "sum" else np.maximum
        for parents, children, offsets, _ in plan.levels:
            vals[parents] = ufunc.reduceat(vals[children], offsets, axis=0)
    else:
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            for parents, children, offsets, counts in plan.levels:
                cv = vals[children]
                m = np.maximum.reduceat(cv, offsets, axis=0)
                m[~np.isfinite(m)] = 0.0  # all -inf (or +inf) children: shift by 0
                sh = np.exp(cv - np.repeat(m, counts, axis=0))
                vals[parents] = m + np.log(np.add.reduceat(sh, offsets, axis=0))
    out = np.take(vals, plan.node_segment, axis=0)
    return out.T if B == 1 else np.ascontiguousarray(out.T)
