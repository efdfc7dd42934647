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
    nodes, ks, parent = [], [], []
    ends = []
    for p in paths:
        node, k = holder_end(p.holder, p.cached)
        if node is None:
            ends.append(-1)
            continue
        key = node if k == len(node.edge) else (node, k)
        s = slot_of.get(key)
        if s is None:
            s = slot_of[key] = len(nodes)
            nodes.append(node)
            ks.append(k)
            parent.append(-1)
            child, up = s, node.parent
            while up.parent is not None:  # up to the first slot known already (or the root)
                t = slot_of.get(up)
                if t is not None:
                    parent[child] = t
                    break
                t = slot_of[up] = len(nodes)
                nodes.append(up)
                ks.append(len(up.edge))
                parent.append(-1)
                parent[child] = t
                child, up = t, up.parent
        ends.append(s)
    S = len(nodes)
    ends_np = np.array(ends, dtype=np.int64)
    k_np = np.array(ks, dtype=np.int64)
    parent_np = np.array(parent, dtype=np.int64)

    # -- paths through each slot: the ends below it, children before parents (by end position)
    shared_slots: list[int] = []
    if S:
        count = np.bincount(ends_np[ends_np >= 0], minlength=S).tolist()
        end_pos = [n.depth - len(n.edge) + k for n, k in zip(nodes, ks)]
        order = sorted(range(S), key=end_pos.__getitem__)  # root side first
        for s in reversed(order):
            if parent[s] >= 0:
                count[parent[s]] += count[s]
        shared_slots = [s for s in order if count[s] >= 2 and ks[s] >= min_shared_tokens]
    shared = []
    private_of = np.full(S + 1, -1, dtype=np.int64)  # slot -> index into kvs (last: no slot)
    if shared_slots:
        # each slot's shared ancestors (itself included), root side first; then their paths
        above: list = [()] * S
        is_shared = set(shared_slots)
        for s in order:
            up = above[parent[s]] if parent[s] >= 0 else ()
            above[s] = up + (s,) if s in is_shared else up
        users: dict[int, list[int]] = {s: [] for s in shared_slots}
        for i, e in enumerate(ends):
            if e >= 0:
                for s in above[e]:
                    users[s].append(i)
        shared = [(_kv(nodes[s], ks[s]), users[s]) for s in shared_slots]
        private_slots = [s for s in range(S) if s not in is_shared]
    else:
        private_slots = range(S)
    private_slots = list(private_slots)
    kvs = [_kv(nodes[s], ks[s]) for s in private_slots]
    private_of[private_slots] = np.arange(len(kvs))
    lengths = k_np[private_slots]

    # -- each path's private chain, root side first: a pointer chase over all paths at once
    parent_ext = np.append(parent_np, -1)  # (index -1: above the root)
    cur = ends_np
    levels = []
    while len(cur) and (cur >= 0).any():
        levels.append(private_of[cur])
        cur = parent_ext[cur]
    if levels:
        chains = np.stack(levels[::-1], axis=1)  # (a shared segment leaves a -1 hole)
    else:
        chains = np.full((len(paths), 0), -1, dtype=np.int64)
    return shared, PrivatePasts(kvs, lengths, chains)


def _kv(node, k: int):
    return node.kv if k == len(node.edge) else node.kv[:, :, :, :k]
