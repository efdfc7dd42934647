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
chase that lists each path's segments, and the layout of the private pasts' pool slots
(:meth:`PrivatePasts.layout`).
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
    """The segments ``(node, k, slots)`` from the root down whose ``slots`` concatenate to the
    pool slots of a prefix of ``cached`` tokens that :meth:`.kvtree.KVTree.match` ended in
    ``holder``."""
    node, k = holder_end(holder, cached)
    segments = []
    while node is not None and node.parent is not None:
        segments.append((node, k, node.slots if k == len(node.edge) else node.slots[:k]))
        node = node.parent
        k = len(node.edge)
    segments.reverse()
    return segments


class PrivatePasts:
    """The private segments of a forward's paths, each distinct one once.

    Attributes:
        segs: the distinct private segments' pool slots, each ``int64 [L]`` (a node's
            ``slots``, or their first ``k`` for part of an edge).
        lengths: ``int64 [len(segs)]``, each segment's token count ``L``.
        chains: ``int64 [R, D]``, each path's private segments (indices into ``segs``) from the
            root down; ``-1`` where there is none (left of a shorter path's root, and in place
            of its shared segments).
    """

    __slots__ = ("segs", "lengths", "chains")

    def __init__(self, segs: list, lengths: np.ndarray, chains: np.ndarray):
        self.segs, self.lengths, self.chains = segs, lengths, chains

    def path_lengths(self) -> np.ndarray:
        """``int64 [R]``: each path's private past in tokens."""
        ext = np.append(self.lengths, 0)  # (index -1: no segment)
        return ext[self.chains].sum(axis=1)

    def layout(self, tail: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Each path's private past as one row of pool slots, left-padded with the dummy slot 0
        to the longest, then ``tail``'s row (e.g. the slots of its new tokens).

        Worked example: paths a, b, c over a tree ``root -[t0..t2]-> X -[t3]-> A`` and
        ``X -[t3']-> B -[t4]-> C`` where only X is shared (X's slots ``[5, 6, 7]`` are read
        once for all three; A's ``[8]``, B's ``[9]``, C's ``[12]``): the private chains are
        a: ``[A]``, b: ``[B]``, c: ``[B, C]``, so with one new token each (tail ``[[20], [21],
        [22]]``) the layout is ``[[0, 8, 20], [0, 9, 21], [9, 12, 22]]`` and the pads ``[1, 1,
        0]``.

        Args:
            tail: ``int64 [R, m]`` or None (nothing after the past).

        Returns:
            ``(slots, pads)``: ``int64 [R, P + m]`` (``P`` the longest private past) and each
            path's left padding ``int64 [R]``. Python work is per distinct segment: the rows are
            expanded by NumPy from ``chains`` (runs of slots per (path, segment)).
        """
        chains = self.chains
        R, D = chains.shape
        lengths = self.path_lengths()
        P = int(lengths.max()) if R else 0
        pads = P - lengths
        # runs of slots per (path, segment) into the segments' slots laid end to end, then
        # slot 0 (the padding: a run of step 0 over it); expanded by NumPy
        flat = np.concatenate(self.segs + [np.zeros(1, dtype=np.int64)])
        first = np.append(np.cumsum(self.lengths) - self.lengths, 0)  # (index -1: no segment)
        seg_len = np.append(self.lengths, 0)
        starts = np.empty((R, D + 1), dtype=np.int64)
        runs = np.empty((R, D + 1), dtype=np.int64)
        steps = np.ones((R, D + 1), dtype=np.int64)
        starts[:, 0], runs[:, 0], steps[:, 0] = len(flat) - 1, pads, 0
        starts[:, 1:], runs[:, 1:] = first[chains], seg_len[chains]
        starts, runs, steps = starts.ravel(), runs.ravel(), steps.ravel()
        offset = np.arange(R * P, dtype=np.int64) - np.repeat(np.cumsum(runs) - runs, runs)
        slots = flat[np.repeat(starts, runs) + offset * np.repeat(steps, runs)].reshape(R, P)
        if tail is not None:
            slots = np.concatenate([slots, tail], axis=1)
        return slots, pads


def split_segments(paths: list, min_shared_tokens: int, shared_by_all: bool = False
                   ) -> tuple[list, PrivatePasts]:
    """Decide which cached segments a forward attends to once for all paths below them.

    A segment (a node's first ``k`` tokens) used by ``n >= 2`` paths is shared when it is at
    least ``min_shared_tokens`` long (so it also saves at least that many token copies): a
    shorter one costs more as its own attention call and merge in every layer than laid out per
    path. (Counting only the copies saved, ``(n - 1) * k``, shared the short nodes that merged
    decoding steps leave among resampled particles: ~5 segments per forward instead of 1, 1.10x
    the decode time of 256 particles over a 100-token prompt on SmolLM2, measured.)

    Args:
        paths: matched :class:`.plan.Path` s (``holder`` and ``cached`` set).
        shared_by_all: share only the segments on every path (the prefix all paths have in
            common: level 0 of a decode step's cascade, :mod:`.decode_step`), from one path on.

    Returns:
        ``(shared, private)``: ``shared`` a list of ``(slots, path indices)``, root side first;
        ``private`` the :class:`PrivatePasts` of the other segments.
    """
    # -- the union of the paths' chains: one slot per distinct segment ------------------------
    slot_of: dict = {}  # a node (its whole edge) or (node, k) -> slot
    seg_slots, ks, end_pos, parent = [], [], [], []
    ends = []
    for p in paths:
        cached, node = p.cached, p.holder
        if node is not None and node.depth == cached and node.parent is not None:
            k = len(node.edge)  # (a decode step: the prefix ends at its holder's end)
        else:
            node, k = holder_end(node, cached)
        if node is None:
            ends.append(-1)
            continue
        key = node if k == len(node.edge) else (node, k)
        s = slot_of.get(key)
        if s is None:
            s = slot_of[key] = len(ks)
            seg_slots.append(node.slots if key is node else node.slots[:k])
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
                seg_slots.append(up.slots)
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
    if shared_by_all:
        is_shared = (count == len(paths)) & (k_np >= min_shared_tokens)
    else:
        is_shared = (count >= 2) & (k_np >= min_shared_tokens)
    shared = []
    if is_shared.any():
        shared_slots = np.flatnonzero(is_shared)
        shared_slots = shared_slots[np.argsort(np.array(end_pos)[shared_slots], kind="stable")]
        for s in shared_slots.tolist():
            shared.append((seg_slots[s], np.flatnonzero((slots == s).any(axis=1)).tolist()))
        private_slots = np.flatnonzero(~is_shared).tolist()
    else:
        private_slots = list(range(S))
    segs = [seg_slots[s] for s in private_slots] if len(private_slots) < S else seg_slots
    private_of = np.full(S + 1, -1, dtype=np.int64)  # slot -> index into segs (last: no slot)
    private_of[private_slots] = np.arange(len(segs))
    chains = private_of[slots]  # (a shared segment leaves a -1 hole)
    return shared, PrivatePasts(segs, k_np[private_slots], chains)
