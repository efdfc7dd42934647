"""The KV tree's nodes, and the walks along them: down the edges that continue a context
(:func:`descend`), up from where a cached prefix ended (:func:`holder_end`,
:func:`prefix_segments`), and up a chain that a node takes over (:func:`merge_up`). The tree
itself (insertion, its merges' bookkeeping, LRU, eviction) is :class:`.kvtree.KVTree`.

A cached prefix that :meth:`.kvtree.KVTree.match` ended in ``holder`` with ``cached`` tokens is
the chain of nodes from the root down to ``holder``; a later insertion may split the holder's
edge, so the walks up find the node holding token ``cached - 1`` first.
"""

from __future__ import annotations

import numpy as np

from ....cpython import untrack_ids


class Node:
    """One node of the tree: ``edge`` a tuple of token ids (``()`` for a root), ``slots`` the
    pool slots of exactly those tokens (``int64 [len(edge)]``; None for a root and once
    removed), ``depth`` the tokens from the root to the end of its edge, ``refs`` the forwards
    holding it, ``pinned``, ``bytes`` of KV it holds, ``stamp`` the tick of its last use (see
    :mod:`.kvtree`, "Recency"), ``spare`` the buffer a growing leaf's ``slots`` are a view of
    (:func:`append_slots`)."""

    __slots__ = ("parent", "edge", "slots", "children", "refs", "pinned", "depth", "bytes",
                 "stamp", "spare")

    def __init__(self, parent, edge: tuple, slots, depth: int, token_bytes: int = 0):
        self.parent = parent
        self.edge = edge
        self.slots = slots  # int64 [len(edge)] pool slots; None for a root and once removed
        self.children: dict[int, Node] = {}
        self.refs = 0
        self.pinned = False
        self.depth = depth  # tokens from the root to the end of this node's edge
        self.bytes = 0 if slots is None else len(slots) * token_bytes
        self.stamp = 0
        self.spare = None  # (buffer, the view of it that slots was set to): append_slots


def append_slots(node: Node, slots, capacity: int) -> None:
    """Set ``node.slots`` to itself followed by ``slots`` (``int64``): written in place after
    its end when ``node.slots`` is still the view of a buffer with room that the last call made
    (a leaf growing a token a step: no concatenation, no allocation), else into a new buffer of
    at least ``capacity`` slots. Nothing ever written is overwritten, so every earlier view of
    the buffer (another node's after a split, a forward's segment) keeps its slots; a node whose
    ``slots`` were set otherwise since (a split, a merge) gets a new buffer."""
    old, n, k = node.slots, len(node.slots), len(slots)
    spare = node.spare
    if spare is not None and spare[1] is old and n + k <= len(spare[0]):
        buf = spare[0]
    else:
        buf = np.empty(max(capacity, n + k), dtype=np.int64)
        buf[:n] = old
    buf[n:n + k] = slots
    view = buf[:n + k]
    node.slots, node.spare = view, (buf, view)
def append_slot(node: Node, slot: int, capacity: int) -> None:
    """:func:`append_slots` of one slot given as an int (a uniform step's commit): a scalar
    write into the buffer instead of an array's copy, and no array per row before it."""
    old, n = node.slots, len(node.slots)
    spare = node.spare
    if spare is not None and spare[1] is old and n < len(spare[0]):
        buf = spare[0]
    else:
        buf = np.empty(max(capacity, n + 1), dtype=np.int64)
        buf[:n] = old
    buf[n] = slot
    view = buf[:n + 1]
    node.slots, node.spare = view, (buf, view)


def common_prefix_length(a, b, start: int = 0) -> int:
    """Length of the common prefix of sequences ``a`` and ``b``, given that it is at least
    ``start``: slice comparisons in C, halving the unresolved range (about ``2 * len`` element
    comparisons in all, no per-token Python loop)."""
    n = min(len(a), len(b))
    if a[start:n] == b[start:n]:
        return n
    lo, hi = start, n  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def descend(node: Node, pos: int, tokens: tuple, limit: int) -> tuple[Node, int]:
    """From ``node``, which holds ``tokens[:pos]``, down the edges that continue
    ``tokens[:limit]``: ``(the deepest node reached, tokens matched)`` (the last edge may
    match in part)."""
    while pos < limit:
        child = node.children.get(tokens[pos])
        if child is None:
            break
        edge = child.edge
        n = min(len(edge), limit - pos)
        k = common_prefix_length(edge[:n], tokens[pos:pos + n])
        if k == 0:
            break
        node, pos = child, pos + k
        if k < len(edge):
            break
    return node, pos


def end_node(root: Node, tokens: tuple) -> Node | None:
    """The node under ``root`` where ``tokens`` (a flat tuple) end exactly, found by a walk that
    compares them (:func:`descend`); None when they are not all cached or end inside an edge."""
    node, pos = descend(root, 0, tokens, len(tokens))
    return node if pos == len(tokens) and node.depth == pos and node.parent is not None else None


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


def merge_up(node: Node, token_bytes: int) -> list[Node]:
    """Merge ``node`` with its ancestors that have no other child, while the merged edges stay
    geometric: a parent's edge joins when it is at most twice as long as what is merged below
    it. ``node`` takes over their edges and KV (its depth and path tokens are unchanged); the
    merged-away nodes are emptied and returned, root side first (the tree forgets them:
    :meth:`.kvtree.KVTree.compact`).

    Why: each decoding step or SMC extension inserts a one-token leaf, so without merging a
    path after ``s`` steps has ``s`` nodes and every query's walk, touch and attention layout
    does Python work per generated token. With the geometric rule a chain of ``s`` one-token
    steps keeps O(log s) nodes, and each token's slot index is copied O(log s) times in all
    (amortised; the rule of size-balanced merging, as in log-structured merge trees). Merging
    joins index arrays only: no KV moves. Nodes that are pinned, held (``refs``) or that branch
    are never merged away. A chain is merged at every chance (waiting for 3 ancestors made the
    per-query walk cost more than the joins it saved: 256 particles after 100 steps, measured).
    """
    if node.parent is None or node.refs:
        return []
    taken, length, up = [], len(node.edge), node.parent
    while (up.parent is not None and len(up.children) == 1 and not up.refs
           and not up.pinned and len(up.edge) <= 2 * length):
        taken.append(up)
        length += len(up.edge)
        up = up.parent
    if not taken:
        return taken
    taken.reverse()  # root side first
    node.slots = np.concatenate([n.slots for n in taken] + [node.slots])
    edge = node.edge
    for n in reversed(taken):
        edge = n.edge + edge
    node.edge = untrack_ids(edge)  # (ints only: no collection need walk it)
    node.bytes = len(node.slots) * token_bytes
    node.parent = up
    up.children[node.edge[0]] = node
    for n in taken:
        node.stamp = max(node.stamp, n.stamp)
        n.slots, n.children, n.parent = None, {}, None
    return taken


def pinned_paths(nodes) -> set:
    """The pinned nodes among ``nodes`` and their ancestors, roots excluded."""
    seen = set()
    for node in nodes:
        if node.pinned:
            while node.parent is not None and node not in seen:
                seen.add(node)
                node = node.parent
    return seen
