"""The cached segments of a forward's paths: which it reads once for all paths below them
(*shared*) and, for every other one, where it lies in each path's *private* past.

A path's cached prefix is the chain of tree nodes from the root to its holder (the node its
match ended in; the last segment may be the first ``k`` tokens of that node's edge). After ``s``
SMC steps with resampling, each path's chain holds a node per branch point of the particles'
genealogy, about one per three steps at 256 particles (measured with ``bench_host.py``): work per
segment of each path would grow with the generation in Python. So the chains are merged into
their *union* (each node visited once per forward, by walking up from each holder until a node
already seen: O(distinct nodes), about two per path in a step) and everything per path and
segment is done by NumPy over the union: the count of paths through each segment, the pointer
chase that lists each path's segments, the pool columns (:class:`.past_pool.PastPool`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .kvtree import _Node


def holder_end(holder: _Node | None, cached: int) -> tuple[_Node | None, int]:
    """``(node, k)``: the node whose edge holds token ``cached - 1`` of a cached prefix that
    :meth:`.kvtree.KVTree.match` ended in ``holder``, and how many tokens of that edge the prefix
    uses; ``(None, 0)`` when nothing is cached. Still right after a later insertion split the
    holder's edge (the holder keeps the lower part; the prefix may now end in the upper one)."""
    if holder is None or cached <= 0:
        return None, 0
    node = holder
    while node.parent is not None and node.depth - len(node.edge) >= cached:
        node = node.parent
    if node.parent is None:
        return None, 0
    return node, cached - (node.depth - len(node.edge))


def prefix_segments(holder: _Node | None, cached: int) -> list:
    """The segments ``(node, k, kv)`` from the root down whose ``kv`` concatenate to the KV of
    a prefix of ``cached`` tokens that :meth:`.kvtree.KVTree.match` ended in ``holder``."""
    node, k = holder_end(holder, cached)
    segments = []
    while node is not None and node.parent is not None:
        segments.append((node, k, node.kv if k == len(node.edge) else node.kv[:, :, :, :k]))
        node = node.parent
        k = len(node.edge)
    segments.reverse()
    return segments


class PrivatePasts:
    """The private segments of a forward's paths, each distinct one once.

    Attributes:
        kvs: the distinct private segments' KV, each ``[layers, 2, kv_heads, L, dim]`` (a node's
            own ``kv`` for a whole edge, so that its identity lasts across forwards; a view for
            part of an edge).
        lengths: ``int64 [len(kvs)]``, each segment's token count ``L``.
        chains: ``int64 [R, D]``, each path's private segments (indices into ``kvs``) from the
            root down; ``-1`` where there is none (left of a shorter path's root, and in place
            of its shared segments).
    """

    __slots__ = ("kvs", "lengths", "chains")

    def __init__(self, kvs: list, lengths: np.ndarray, chains: np.ndarray):
        self.kvs, self.lengths, self.chains = kvs, lengths, chains

    def path_lengths(self) -> np.ndarray:
        """``int64 [R]``: each path's private past in tokens."""
        ext = np.append(self.lengths, 0)  # (index -1: no segment)
        return ext[self.chains].sum(axis=1)


def split_segments(paths: list, min_shared_tokens: int) -> tuple[list, PrivatePasts]:
    """Decide which cached segments a forward attends to once for all paths below them.

    A segment (a node's first ``k`` tokens) used by ``n >= 2`` paths is shared when it is at
    least ``min_shared_tokens`` long (so it also saves at least that many token copies): a
    shorter one costs more as its own attention call and merge in every layer than laid out per
    path. (Counting only the copies saved, ``(n - 1) * k``, shared the short nodes that merged
    decoding steps leave among resampled particles: ~5 segments per forward instead of 1, 1.10x
    the decode time of 256 particles over a 100-token prompt on SmolLM2, measured.)

    Args:
        paths: matched :class:`.plan.Path` s (``holder`` and ``cached`` set).

    Returns:
        ``(shared, private)``: ``shared`` a list of ``(kv, path indices)``, root side first;
        ``private`` the :class:`PrivatePasts` of the other segments.
    """
    # -- the union of the paths' chains: one slot per distinct segment ------------------------
    slot_of: dict = {}  # a node (its whole edge) or (node, k) -> slot
    kv_of, ks, end_pos, parent = [], [], [], []
    ends = []
    for p in paths:
        cached = p.cached
        node, k = holder_end(p.holder, cached)
        if node is None:
            ends.append(-1)
            continue
        key = node if k == len(node.edge) else (node, k)
        s = slot_of.get(key)
        if s is None:
            s = slot_of[key] = len(ks)
            kv_of.append(node.kv if key is node else node.kv[:, :, :, :k])
            ks.append(k)
            end_pos.append(cached)
            parent.append(-1)
            child, up = s, node.parent
            while up.parent is not None:  # up to the first slot known already (or the root)
                t = slot_of.get(up)
                if t is not None:
                    parent[child] = t
                    break
                t = slot_of[up] = len(ks)
                kv_of.append(up.kv)
                ks.append(len(up.edge))
                end_pos.append(up.depth)
                parent.append(-1)
                parent[child] = t
                child, up = t, up.parent
        ends.append(s)
    S = len(ks)
    k_np = np.array(ks, dtype=np.int64)

    # -- each path's slots, root side first: a pointer chase over all paths at once ----------
    parent_ext = np.array(parent + [-1], dtype=np.int64)  # (index -1: above the root)
    cur = np.array(ends, dtype=np.int64)
    levels = []
    while len(cur) and (cur >= 0).any():
        levels.append(cur)
        cur = parent_ext[cur]
    slots = (np.stack(levels[::-1], axis=1) if levels  # -1 left of a shorter path's root
             else np.full((len(paths), 0), -1, dtype=np.int64))

    # -- shared: used by >= 2 paths and long enough; root side first (by end position) --------
    count = np.bincount(slots[slots >= 0], minlength=S)
    is_shared = (count >= 2) & (k_np >= min_shared_tokens)
    shared = []
    if is_shared.any():
        shared_slots = np.flatnonzero(is_shared)
        shared_slots = shared_slots[np.argsort(np.array(end_pos)[shared_slots], kind="stable")]
        for s in shared_slots.tolist():
            shared.append((kv_of[s], np.flatnonzero((slots == s).any(axis=1)).tolist()))
        private_slots = np.flatnonzero(~is_shared).tolist()
    else:
        private_slots = list(range(S))
    kvs = [kv_of[s] for s in private_slots] if len(private_slots) < S else kv_of
    private_of = np.full(S + 1, -1, dtype=np.int64)  # slot -> index into kvs (last: no slot)
    private_of[private_slots] = np.arange(len(kvs))
    chains = private_of[slots]  # (a shared segment leaves a -1 hole)
    return shared, PrivatePasts(kvs, k_np[private_slots], chains)
