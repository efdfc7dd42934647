"""Recency of the KV tree's nodes, and the heap of eviction candidates
(:class:`.kvtree.KVTree`'s least-recently-used eviction).

A node's ``stamp`` is the tick of the tree's clock at which a path ending in it was last used.
An ancestor is not stamped with its descendants: a node with children is never evicted, and it
takes over a removed child's stamp when that is newer than its own, so by the time it is a leaf
its stamp is the last use of anything below it. That is the order of a least-recently-used list
that moves every ancestor with its descendants, without walking up at each use: a step's use of
its paths is one stamp per held node, not a walk of the union of their ancestries (which grows
with an SMC run whose particles do not coalesce: 256 particles, 300 steps, the walk was a sixth
of the worker's host time, sampled with py-spy).

The candidates are a heap by stamp kept lazily (:class:`Candidates`): a node goes in when it
becomes a leaf, not when it is used; an entry popped with an older stamp than its node's (used
since) goes back in with the new one, and an entry of a node removed, merged away or with
children now is dropped. Using a node costs one store, an eviction ``O(log n)`` per entry popped.
"""

from __future__ import annotations

import heapq


class Candidates:
    """The heap of eviction candidates ``(stamp, -depth, seq, node)``: least recent first, the
    deeper first among one tick (as a list that moves a parent after its children)."""

    __slots__ = ("heap", "seq")

    def __init__(self):
        self.heap: list = []
        self.seq = 0

    def push(self, node, nodes: dict) -> None:
        """Put leaf ``node`` in at its stamp. ``nodes``: the tree's nodes; the heap is built
        anew from its leaves when stale entries make up more than half of it."""
        heap = self.heap
        if len(heap) > 2 * len(nodes) + 256:
            heap[:] = [(n.stamp, -n.depth, i, n) for i, n in enumerate(nodes) if not n.children]
            heapq.heapify(heap)
            self.seq = len(heap)
            if node in nodes and not node.children:
                return  # (in the new heap already)
        heapq.heappush(heap, (node.stamp, -node.depth, self.seq, node))
        self.seq += 1

    def pop(self, nodes: dict):
        """The next leaf to evict, or None when there is none: stale entries are dropped or put
        back at their node's stamp on the way (held and pinned leaves are the caller's to put
        back)."""
        heap = self.heap
        while heap:
            stamp, _, _, node = heapq.heappop(heap)
            if node.slots is None or node.children:
                continue  # (removed or merged away; or not a leaf: back in once it is one)
            if stamp != node.stamp:
                self.push(node, nodes)  # (used since: in again at its last use)
                continue
            return node
        return None

    def clear(self) -> None:
        self.heap.clear()
