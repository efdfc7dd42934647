"""Walks up the KV tree from a node: where a cached prefix ends, and the segments it spans.

A prefix that :meth:`.kvtree.KVTree.match` ended in ``holder`` with ``cached`` tokens is the chain of
nodes from the root down to ``holder``; a later insertion may split the holder's edge, so both
walks find the node holding token ``cached - 1`` first. Nodes are :class:`.kvtree.KVTree`'s
(``parent``, ``edge``, ``depth``, ``slots``); no import of the tree is needed.
"""

from __future__ import annotations


def holder_end(holder, cached: int) -> tuple:
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


def prefix_segments(holder, cached: int) -> list:
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
