"""``Anchors``: where the last forward's paths all met in the KV tree, so the next forward's
walks (:func:`.segments.split_segments`) stop there instead of at the root."""

from __future__ import annotations

# an anchor moves down to the paths' common node once that many segments on every path lie
# below it: the walks stay short, and forwards of one step over different particles (a batch
# split into groups) keep meeting at one anchor instead of moving it back and forth
ANCHOR_STEP = 8


class Anchors:
    """Per adapter (and sharing rule), the deepest node found on every path of the last
    :func:`.segments.split_segments` call, with what lies above it already split into the segments
    read in place and one joined segment: the next call's walks stop there.

    An SMC run's particles all descend from the last step's common ancestor, so that node
    stays on every path; above it each step would walk (in Python) and lay out again a chain
    that grows with the run (a branch point per three to five steps). The slots above a node
    never change while the node is cached (an edge split or merge only cuts or joins index
    arrays: no KV moves, and an ancestor of a cached node is never evicted), so an anchor is
    used while its node is cached at the same depth; a call whose paths do not all pass
    through it walks again from the root (and finds the next anchor).
    """

    __slots__ = ("_by_key",)

    def __init__(self):
        self._by_key: dict = {}

    def get(self, key):
        """``(node, alone, joined)`` for ``key`` while its node still ends at the depth it had,
        else None."""
        entry = self._by_key.get(key)
        if entry is None:
            return None
        node, depth, alone, joined = entry
        if node.slots is None or node.parent is None or node.depth != depth:
            del self._by_key[key]
            return None
        return node, alone, joined

    def put(self, key, node, alone: tuple, joined) -> None:
        """Remember ``node`` (on every path) with the segments above it and below the root:
        ``alone`` (read in place, root side first) and ``joined`` (the others, one array or
        None)."""
        self._by_key[key] = (node, node.depth, alone, joined)

    def discard(self, key) -> None:
        """Forget the anchor of ``key`` (its node is no longer on every path)."""
        self._by_key.pop(key, None)


def meeting(table, top: int, node) -> int:
    """The entry of ``table`` (a :class:`.segments.SegmentTable`) on every path (``top ..
    first_walk - 1``) that is ``node`` or its deepest ancestor, or -1: where an anchor the
    paths left meets them again (a step split into forwards over different particles)."""
    on = {id(table.nodes[e]): e for e in range(top, table.first_walk)
          if table.nodes[e] is not None}
    while node is not None and node.parent is not None:
        e = on.get(id(node))
        if e is not None:
            return e
        node = node.parent
    return -1
