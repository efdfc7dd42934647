"""The cached segments of a forward's paths: which it reads once for all paths below them
(*shared*) and, for every other one, where it lies in each path's *private* past.

A path's cached prefix is the chain of tree nodes from the root to its holder (the node its
match ended in; the last segment may be the first ``k`` tokens of that node's edge). After ``s``
SMC steps with resampling, each path's chain holds a node per branch point of the particles'
genealogy, about one per three steps at 256 particles (measured with ``bench_host.py``): work per
segment of each path would grow with the generation in Python. So the chains are merged into
their *union* (:class:`SegmentTable`: each node visited once per forward, by walking up from
each holder until a node already seen: O(distinct nodes), about two per path in a step) and everything per path and
segment is done by NumPy over the union: the count of paths through each segment, the pointer
chase that lists each path's segments, and the layout of the private pasts' pool slots
(:meth:`PrivatePasts.layout`).

The part of the union on *every* path (the particles' common ancestry, which grows by a node
per few steps over a whole run) is found from the walks themselves (:meth:`SegmentTable.common`)
and handled at once, not per path: long runs of slots read in place, the rest joined into one
segment. With :class:`Anchors` (kept by the tree forward), the next step walks only below the
last step's common node, so neither the walks nor the chains grow with the run.
"""

from __future__ import annotations

import numpy as np

from ..cache.kv_pool import run_start
from ..cache.nodes import holder_end
from .anchors import ANCHOR_STEP, Anchors, meeting


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


class SegmentTable:
    """The union of a forward's paths' cached prefixes: each distinct segment once, as columns
    (one entry per segment: the struct-of-arrays layout NumPy reads without a loop).

    Built by one walk (:meth:`of`): from each path's holder up to the first segment already in
    the table (or the root), so the work is per distinct segment, not per segment of each path.

    Attributes:
        slots: each segment's pool slots, ``int64 [length]`` (a node's ``slots``, or their first
            ``k`` where a path's prefix ends inside an edge).
        lengths: each segment's token count.
        ends: each segment's end position in its paths (tokens from the root to its end).
        parents: each segment's parent segment in the table, -1 at the root.
        last: each path's last segment, -1 for a path with nothing cached.
        first_walk: how many entries the first walk added (entries ``0 .. first_walk - 1``: a
            path's chain from its last segment up to the root, or to the ``stop`` of
            :meth:`of`, child first).
        joins: per entry, the deepest entry of that first chain on its path (itself on the first
            chain; -1 when its path meets the first chain nowhere): where the walk that added it
            joined the first chain, directly or through an earlier walk. The deepest segment
            on every path (:meth:`common`) is then one maximum, with no walk of its own.
    """

    __slots__ = ("slots", "lengths", "ends", "parents", "last", "joins", "first_walk", "nodes",
                 "off_stop")

    def __init__(self):
        self.slots: list = []
        self.lengths: list[int] = []
        self.ends: list[int] = []
        self.parents: list[int] = []
        self.last: list[int] = []
        self.joins: list[int] = []
        self.nodes: list = []
        self.first_walk = 0
        self.off_stop = False

    @classmethod
    def of(cls, paths: list, stop=None) -> "SegmentTable":
        """The table of matched paths (``holder`` and ``cached`` set). ``stop``: a node whose
        path is known (an :class:`Anchors` entry): the walks end there as at the root, so the
        table holds what lies below it; ``off_stop`` is then set when some path does not
        pass through ``stop`` (its walk reached the root, or its prefix ends at or inside
        ``stop``'s edge, or nothing of it is cached), and the table is not to be used."""
        table = cls()
        index: dict = {}  # a node (its whole edge) or (node, k) -> its entry
        slots, lengths, ends, parents = table.slots, table.lengths, table.ends, table.parents
        joins, nodes = table.joins, table.nodes

        def add(seg, length: int, end: int, node) -> int:  # a new entry (parent -1 until known)
            slots.append(seg)
            lengths.append(length)
            ends.append(end)
            parents.append(-1)
            nodes.append(node)
            return len(parents) - 1

        for p in paths:
            cached, node = p.cached, p.holder
            if node is not None and node.depth == cached and node.parent is not None:
                k = len(node.edge)  # (a decode step: the prefix ends at its holder's end)
            else:
                node, k = holder_end(node, cached)
            if node is None or node is stop:
                table.off_stop = stop is not None
                table.last.append(-1)
                continue
            key = node if k == len(node.edge) else (node, k)
            s = index.get(key)
            if s is None:
                first = len(parents)
                s = index[key] = add(node.slots if key is node else node.slots[:k], k, cached,
                                     node if key is node else None)
                child, up, joined = s, node.parent, -1
                while up is not stop:  # up to the first entry known already (or the stop)
                    if up.parent is None:  # the root
                        table.off_stop = stop is not None
                        break
                    t = index.get(up)
                    if t is not None:
                        parents[child] = t
                        joined = joins[t]
                        break
                    t = index[up] = add(up.slots, len(up.edge), up.depth, up)
                    parents[child] = t
                    child, up = t, up.parent
                if first == 0:  # the first walk: its own chain, up to the root
                    table.first_walk = len(parents)
                    joins.extend(range(len(parents)))
                else:
                    joins.extend([joined] * (len(parents) - first))
            table.last.append(s)
        return table

    def common(self) -> int:
        """The deepest entry on every path's chain, or -1 when no entry is on all of them (a
        path with nothing cached, or two paths that share no segment). The entries on every
        path are this one and its ancestors: ``common() .. first_walk - 1``."""
        last = self.last
        if not last or min(last) < 0:
            return -1
        joins = np.array(self.joins, dtype=np.int64)[np.array(last, dtype=np.int64)]
        return -1 if (joins < 0).any() else int(joins.max())

    def chains(self, below: int = -1) -> np.ndarray:
        """``int64 [R, D]``: each path's segments from the root down (entries of the table),
        right-aligned, -1 left of a shorter chain: one pointer chase over all paths at once.
        ``below`` (an entry of the first chain, :meth:`common`): only the segments below it,
        so the chase runs as deep as the paths' own branches, not the whole common chain."""
        parent = np.array(self.parents + [-1], dtype=np.int64)  # (index -1: above the root)
        cur = np.array(self.last, dtype=np.int64)
        if below >= 0:  # the common entries (below .. first_walk - 1) count as above the root
            top = self.first_walk
            parent[(parent >= below) & (parent < top)] = -1
            cur[(cur >= below) & (cur < top)] = -1
        levels = []
        while len(cur) and (cur >= 0).any():
            levels.append(cur)
            cur = parent[cur]
        if not levels:
            return np.full((len(self.last), 0), -1, dtype=np.int64)
        return np.stack(levels[::-1], axis=1)


def split_segments(paths: list, min_shared_tokens: int, shared_by_all: bool = False,
                   anchors: Anchors | None = None,
                   min_saved_tokens: int = 0) -> tuple[list, PrivatePasts]:
    """Decide which cached segments a forward attends to once for all paths below them.

    A segment (a node's first ``k`` tokens) used by ``n >= 2`` paths is shared when it is at
    least ``min_shared_tokens`` long (so it also saves at least that many token copies): a
    shorter one costs more as its own attention call and merge in every layer than laid out per
    path. (Counting only the copies saved, ``(n - 1) * k``, shared the short nodes that merged
    decoding steps leave among resampled particles: ~5 segments per forward instead of 1, 1.10x
    the decode time of 256 particles over a 100-token prompt on SmolLM2, measured.)

    The segments on *every* path (an SMC run's common ancestry: a branch point every few
    steps, each a short node whose dead siblings stay cached) are taken together: each one at
    least ``min_shared_tokens`` long and one run of pool slots is read in place by itself (a
    prompt), the others are joined into one segment, shared when it is long enough, else the
    first private segment of every path. Found from the table's walks (:meth:`SegmentTable.common`)
    and, with ``anchors``, walked only below the last call's common node, so neither the chains
    nor the walks grow with the run (measured: 16 particles, 600 steps, chains 130 deep before).

    Worked example: three paths a, b, c over ``root -[t0..t99]-> X -[t100]-> A`` and ``X
    -[t100']-> B -[t101]-> C`` (X's slots ``1..100``, A's ``[101]``, B's ``[102]``, C's
    ``[103]``), each matched to its leaf (a to A, b to B, c to C). The table (:class:`SegmentTable`)
    holds A, X, B, C (entries 0-3; X once), the chains are ``[[-1, 1, 0], [-1, 1, 2], [1, 2,
    3]]`` (a: X, A; b: X, B; c: X, B, C), so X is on three paths and B on two. With
    ``min_shared_tokens=64``, X (100 tokens) is shared: ``shared == [(X's slots, [0, 1, 2])]``,
    read once for all three; B (1 token) is not, so it is laid out in both b's and c's rows:
    the private chains are a: ``[A]``, b: ``[B]``, c: ``[B, C]`` and, with one new token each in
    slots 20, 21, 22, :meth:`PrivatePasts.layout` gives the slot rows ``[[0, 101, 20], [0, 102,
    21], [102, 103, 22]]`` (left-padded with the dummy slot 0).

    Args:
        paths: matched :class:`.batch.Path` s (``holder`` and ``cached`` set).
        shared_by_all: share only the segments on every path (the prefix all paths have in
            common: level 0 of a decode step's cascade, :mod:`..decode.step`), from one path on.
        anchors: the caller's :class:`Anchors` (kept from call to call), or None: every walk
            goes up to the root.
        min_saved_tokens: besides its length, a segment under ``n`` paths is shared only when
            the copies it saves, ``(n - 1) * k`` tokens, are at least this many (0: no such
            bound; the tree forward's packed CUDA kernel sets one, see
            :data:`..forward.tree.PACKED_MIN_SAVED_TOKENS`).

    Returns:
        ``(shared, private)``: ``shared`` a list of ``(slots, path indices)``, root side first;
        ``private`` the :class:`PrivatePasts` of the other segments.
    """
    R = len(paths)
    can_share = R >= (1 if shared_by_all else 2)
    min_every = min_shared_tokens
    if min_saved_tokens and R > 1:  # a segment on every path saves (R - 1) * its length
        min_every = max(min_shared_tokens, -(-min_saved_tokens // (R - 1)))
    key = (paths[0].adapter if paths else None, min_every, can_share)
    table, above, fell_back = _table(paths, anchors, key)
    top = table.common()
    chains = table.chains(below=top)  # (the segments on every path are handled below, at once)
    alone, joined = _on_every_path(table, top, above, fell_back, anchors, key,
                                   min_every if can_share else None)
    everyone = list(range(R))
    shared = [(seg, everyone) for seg in alone]
    if joined is not None and can_share and len(joined) >= min_every:
        shared.append((joined, everyone))
        joined = None
    return shared, _below(table, chains, shared, joined, min_shared_tokens, shared_by_all,
                          min_saved_tokens)


def _table(paths: list, anchors: Anchors | None, key) -> tuple:
    """``(table, anchor, fell_back)``: the paths' :class:`SegmentTable`, walked below the
    anchor of ``key`` when there is one on every path (``anchor`` its ``(node, alone,
    joined)``), else from the root (``fell_back`` when an anchor was tried: the paths left it)."""
    above = anchors.get(key) if anchors is not None else None
    if above is not None:
        table = SegmentTable.of(paths, stop=above[0])
        if not table.off_stop:
            return table, above, False
    return SegmentTable.of(paths), above, above is not None


def _on_every_path(table: SegmentTable, top: int, above, fell_back: bool, anchors, key,
                   min_alone: int | None) -> tuple[list, np.ndarray | None]:
    """``(alone, joined)``: the segments on every path (the anchor's, then the table's from its
    first walk's top down to entry ``top``), those of at least ``min_alone`` tokens that are
    one run of slots alone (root side first; none when ``min_alone`` is None), the others
    joined into one array (None for none). Notes the next anchor in ``anchors``."""
    base = None if fell_back else above
    alone = list(base[1]) if base else []
    joined = [base[2]] if base and base[2] is not None else []
    mark = -1  # the entry the next anchor is (its segments above are noted when passed)
    if anchors is not None and top >= 0:
        if base is None:  # a first walk, or the paths left the anchor's subtree
            mark = meeting(table, top, above[0]) if fell_back else top
        elif table.first_walk - top >= ANCHOR_STEP:
            mark = top
    noted = None
    for e in range(table.first_walk - 1, top - 1, -1) if top >= 0 else ():  # root side first
        seg = table.slots[e]
        if min_alone is not None and len(seg) >= min_alone and run_start(seg) >= 0:
            alone.append(seg)
        else:
            joined.append(seg)
        if e == mark:
            noted = (tuple(alone), len(joined))
    whole = _joined(joined)
    if noted is not None and table.nodes[mark] is not None:
        then, n = noted  # (the anchor's joined segment: all of it when the anchor is ``top``)
        anchors.put(key, table.nodes[mark], then, whole if n == len(joined)
                    else _joined(joined[:n]))
    elif fell_back:
        anchors.discard(key)
    return alone, whole


def _below(table: SegmentTable, chains: np.ndarray, shared: list, joined,
           min_shared_tokens: int, shared_by_all: bool, min_saved_tokens: int) -> PrivatePasts:
    """The segments below the common part: each used by >= 2 paths (all, with
    ``shared_by_all``) and long enough is appended to ``shared`` (root side first, by end);
    the others, with ``joined`` (what is on every path and not shared) first in every chain,
    are the :class:`PrivatePasts`."""
    R, S = len(chains), len(table.lengths)
    lengths = np.array(table.lengths, dtype=np.int64)
    count = np.bincount(chains[chains >= 0], minlength=S)
    enough = count == R if shared_by_all else count >= 2
    is_shared = enough & (lengths >= min_shared_tokens)
    if min_saved_tokens:
        is_shared &= (count - 1) * lengths >= min_saved_tokens
    is_private = count > 0  # (the common entries are on no chain: they are counted 0)
    if is_shared.any():
        shared_at = np.flatnonzero(is_shared)
        shared_at = shared_at[np.argsort(np.array(table.ends)[shared_at], kind="stable")]
        for e in shared_at.tolist():
            shared.append((table.slots[e], np.flatnonzero((chains == e).any(axis=1)).tolist()))
        is_private &= ~is_shared
    private_at = np.flatnonzero(is_private)
    # renumbered (a shared segment leaves a -1 hole in a chain); ``joined`` is entry 0
    first = 0 if joined is None else 1
    renumber = np.full(S + 1, -1, dtype=np.int64)  # (the last entry: -1 stays -1)
    renumber[private_at] = np.arange(first, first + len(private_at))
    segs = [table.slots[e] for e in private_at.tolist()]
    private_chains, private_lengths = renumber[chains], lengths[private_at]
    if joined is not None:
        segs.insert(0, joined)
        private_lengths = np.concatenate([[len(joined)], private_lengths])
        private_chains = np.concatenate([np.zeros((R, 1), dtype=np.int64), private_chains],
                                        axis=1)
    return PrivatePasts(segs, private_lengths, private_chains)


def _joined(segs: list):
    """``segs`` as one array of slots (None for none)."""
    return None if not segs else segs[0] if len(segs) == 1 else np.concatenate(segs)
