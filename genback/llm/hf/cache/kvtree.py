"""KV-cache prefix tree: a radix tree over token ids whose nodes hold key/value states.

Every evaluated context leaves its KV in the tree, so a later query that shares a prefix with it
only forwards the tokens after the longest cached prefix (extending a particle by one token costs
one token of forward). This is the radix-tree prefix sharing of SGLang's RadixAttention
(Zheng et al., 2024, "SGLang: Efficient Execution of Structured Language Model Programs"), kept
on the Python side over a pool of token slots (:class:`.kv_pool.KVPool`).

Layout. A node's edge is a run of tokens; its ``slots`` (``int64 [len(edge)]``, host memory) are
the pool slots that hold exactly those tokens' keys and values. The states of a context are the
pool's slots along its path, in order; tree attention (:mod:`..forward.attention`) reads a shared
node's slots once for all the rows of a batch below it. Splitting or merging nodes splits or
joins index arrays: KV never moves.

Adapters. The same tokens under two LoRA adapters have different KV: each adapter (``None`` for
the base model) has its own root; the byte budget and the recency order are shared by all.

Invariants. A slot is owned by one node and never written after its forward (forwards write only
the slots they took for their new tokens). Node ``bytes`` sum to ``bytes_held``; evicting a node
returns its slots to the pool. Only leaves that are neither pinned (``pin``) nor referenced by a
running forward (``acquire``) are evicted, least recently used first (by each node's stamp of
its last use: :mod:`.recency`; using a node does not walk its ancestors). Not thread-safe: the
owner serialises access with a lock.
"""

from __future__ import annotations

import operator
from typing import Sequence

import numpy as np

from ....queries.context import Context, flat
from ....cpython import untrack_ids
from .ends import Ends
from .nodes import (Node as _Node, append_slot, append_slots, common_prefix_length, descend,
                    end_node, merge_up, pinned_paths, prefix_segments)
from .recency import Candidates


class KVTree:
    """Radix tree of cached KV states with a byte budget and least-recently-used eviction.

    Args:
        budget_bytes: most bytes of KV to hold (> 0). Exceeding it after an insertion evicts
            least-recently-used unreferenced leaves until back under budget.
        pool: the :class:`.kv_pool.KVPool` whose slots the nodes hold (evicted nodes' slots go
            back to it); None: the tree only indexes (slots are freed nowhere).
        token_bytes: bytes of KV per token (the pool's, when given).

    Raises:
        ValueError: ``budget_bytes`` is not a positive int.
    """

    def __init__(self, budget_bytes: int, pool=None, token_bytes: int | None = None):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"kv_budget_bytes must be a positive int, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.pool = pool
        self.token_bytes = (token_bytes if token_bytes is not None
                            else pool.token_bytes if pool is not None else 1)
        self.root = _Node(None, (), None, 0)  # the base model's root (adapter None)
        self._roots: dict = {None: self.root}
        self._nodes: dict[_Node, None] = {}  # every node but the roots (insertion-ordered)
        self._candidates = Candidates()  # the leaves, least recent first (see .recency)
        self.clock = 0  # ticks of use: a node's ``stamp`` is the tick of its last use
        self.bytes_held = 0
        self.evictions = 0  # nodes evicted
        self.merges = 0  # nodes merged into their one child (compact)
        self.ends = Ends()  # where noted contexts' KV ends (match's ``parent``; the runner's)

    def __len__(self) -> int:
        return len(self._nodes)

    def root_of(self, adapter=None) -> _Node:
        """The root of ``adapter``'s tree (an empty stand-in when nothing is cached under it)."""
        return self._roots.get(adapter) or _Node(None, (), None, 0)

    def _root(self, adapter) -> _Node:
        root = self._roots.get(adapter)
        if root is None:
            root = self._roots[adapter] = _Node(None, (), None, 0)
        return root

    # -- lookup ---------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], limit: int | None = None, touch: bool = True,
              adapter=None, parent: tuple | None = None, segments: bool = True):
        """Longest cached prefix of ``tokens`` (under ``adapter``), at most ``limit`` tokens long.

        Args:
            touch: mark the matched path as recently used (False for probes that must not
                change the recency order, e.g. planning and statistics).
            adapter: the adapter key whose tree is searched (None: the base model).
            parent: a tuple the caller knows to equal ``tokens[:len(parent)]`` (a query's
                :attr:`~genback.queries.kinds.Query.parent`). When it is the very object a recent call
                noted (:meth:`.ends.Ends.note`) and its node is still in the tree, the walk
                starts at that node: no token of the context is compared (an SMC step or a
                decoding step costs the same for 100 tokens as for 16,000).
            segments: False: return None for the segments (the runner lists them for all the
                paths of a forward at once, :mod:`..plan.segments`); a walk from ``parent``'s node is
                then O(1).

        Returns:
            ``(segments, length, holder)``: ``segments`` is the list of ``(node, k, slots)``
            whose ``slots`` (the node's first ``k`` slots, ``int64 [k]``) concatenate to the
            pool slots of ``tokens[:length]``; ``holder`` is the deepest node those segments come from
            (``acquire`` it to keep them from eviction while they are in use), or the root.
        """
        tokens = flat(tokens)
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        node = None if parent is None or len(parent) > limit else self.ends.get(parent, adapter)
        if node is None:
            node, pos = descend(self.root_of(adapter), 0, tokens, limit)
        else:
            node, pos = descend(node, node.depth, tokens, limit)
        if touch:
            self._touch(node)
        return (prefix_segments(node, pos) if segments else None), pos, node

    def end_node(self, tokens: Sequence[int], adapter=None) -> _Node | None:
        """:func:`.nodes.end_node` of ``tokens`` under ``adapter`` (:meth:`.ends.Ends.nodes`)."""
        return end_node(self.root_of(adapter), flat(tokens))

    def acquire(self, *nodes: _Node) -> None:
        """Protect each of ``nodes`` (and so its ancestors) from eviction until ``release``."""
        for node in nodes:  # (one call for a step's paths)
            node.refs += 1

    def release(self, *nodes: _Node) -> None:
        for node in nodes:
            node.refs -= 1

    # -- insertion ------------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], start: int, slots: np.ndarray, adapter=None,
               near: _Node | None = None, touch: bool = True) -> _Node:
        """Store the pool slots of ``tokens[start:]`` (``slots``: ``int64 [len(tokens) -
        start]``, whose KV a forward wrote) under ``adapter`` (None: the base model).

        ``tokens[:start]`` must be cached already (hold it with ``acquire`` between ``match`` and
        ``insert``). Parts that another insertion already stored are kept, and the slots of the
        duplicate tokens go back to the pool.
        ``near``: the holder ``match`` returned for ``tokens[:start]`` (held since): the walk
        starts there instead of comparing the whole cached prefix again from the root (still
        right when an insertion meanwhile split that node's edge). ``touch=False``: leave its
        stamp to a later :meth:`touch_all`. Returns the node that ends at ``len(tokens)``;
        call ``evict`` afterwards.
        """
        if type(tokens) is not tuple and type(tokens) is not Context:
            tokens = tuple(tokens)  # (a Context is read where the walk goes: mostly its tail)
        if len(slots) != len(tokens) - start:
            raise ValueError(
                f"slots cover {len(slots)} tokens but tokens[start:] has {len(tokens) - start}")
        node = None
        if near is not None and near.parent is not None:
            edge_start = near.depth - len(near.edge)
            if start == near.depth:  # the cached prefix ends at the end of its edge
                node, pos = near, start
            elif edge_start <= start < near.depth:  # ... inside its edge: compare that edge only
                node, pos = near.parent, edge_start
        if node is None:
            node, pos = self._root(adapter), 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                if pos < start:
                    raise KeyError(f"prefix tokens[:{start}] is not cached (evicted?)")
                if pos > start:  # tokens[start:pos] were stored by another insertion
                    self._free(slots[:pos - start])
                node = self._leaf(node, untrack_ids(tokens[pos:]), slots[pos - start:],
                                  len(tokens))
                break
            edge = child.edge
            n = min(len(edge), len(tokens) - pos)
            k = common_prefix_length(edge[:n], tokens[pos:pos + n])
            if k < len(edge):
                child = self._split(child, k)
            node, pos = child, pos + k
        else:  # every token was stored already (by another insertion): its slots go back
            self._free(slots)
        if touch:
            self._touch(node)
        return node

    def attach(self, node: _Node, tokens, start: int, slots: np.ndarray, adapter=None) -> _Node:
        """:meth:`insert` of ``tokens[start:]`` below ``node`` (its ``near``; not stamped): a new
        leaf, no walk, when ``node`` ends at ``start`` and no child of it begins there."""
        if node.depth == start and node.parent is not None and tokens[start] not in node.children:
            return self._leaf(node, untrack_ids(tokens[start:]), slots, len(tokens))
        return self.insert(tokens, start, slots, adapter, near=node, touch=False)

    def _leaf(self, node: _Node, edge: tuple, slots, depth: int) -> _Node:
        """A new leaf under ``node``: ``edge`` (ending at ``depth``) and its ``slots``."""
        leaf = _Node(node, edge, slots, depth, self.token_bytes)
        node.children[edge[0]] = leaf
        leaf.stamp = self.clock  # (used now; ``touch`` stamps it anew)
        self._nodes[leaf] = None
        self._candidates.push(leaf, self._nodes)
        self.bytes_held += leaf.bytes
        return leaf

    def grow(self, holders: list, contexts: list, cached: list, last: list, slots,
             adapter=None) -> tuple[list, list]:
        """A uniform step's commit in one call: context ``contexts[i]`` is ``cached[i]`` cached
        tokens (held in ``holders[i]``, :meth:`insert`'s ``near``) plus ``last[i]``, its KV in
        pool slot ``slots[i]`` (``int64 [R, 1]``, or ``R`` arrays ``int64 [1]``): :meth:`extend`
        of the holder where it can grow in place (its slot written as an int), else :meth:`insert`
        (a one-token leaf made here), no call per row for either. Returns ``(nodes, inserted)``:
        where each context ends now, and the new nodes (not stamped: ``touch=False``)."""
        nodes, inserted, cap, added = [], [], self.EXTEND_MAX, self.token_bytes
        ids = (slots if isinstance(slots, np.ndarray) else np.concatenate(slots)).ravel().tolist()
        for i, (holder, ctx, n, token, s) in enumerate(zip(holders, contexts, cached, last, ids)):
            if holder.depth == n and not (holder.children or holder.pinned or holder.refs > 1
                                          or holder.parent is None or len(holder.edge) >= cap):
                holder.edge += (token,)  # (as extend)
                append_slot(holder, s, cap)
                holder.depth += 1
                holder.bytes += added
                nodes.append(holder)
                continue
            if holder.depth == n and token not in holder.children:  # (as insert's new leaf)
                node = self._leaf(holder, (token,), slots[i], n + 1)
            else:
                node = self.insert(ctx, n, slots[i], adapter, near=holder, touch=False)
            nodes.append(node)
            inserted.append(node)
        self.bytes_held += added * (len(nodes) - len(inserted))  # (the grown ones)
        return nodes, inserted

    # a leaf grows in place (extend) while its edge stays this short: an extension copies the edge's
    # tuple (its slots: a buffer of this many, nodes.append_slots); a longer one gets a child
    EXTEND_MAX = 64

    def extend(self, node: _Node, tokens: tuple, slots: np.ndarray) -> bool:
        """Append ``tokens[node.depth:]`` (their pool slots ``slots``) to ``node``'s own edge,
        in place, when ``node`` is a leaf that nothing else holds, pins or shares: the path's
        one-token extension of a decoding or SMC step then costs no new node, no walk and no
        later merge. ``tokens[:node.depth]`` must be ``node``'s path. Returns False (nothing
        changed) when ``node`` has children, is pinned, is held more than once (``acquire``:
        the caller's own hold counts) or its edge would grow past :attr:`EXTEND_MAX`; then
        :meth:`insert` it."""
        n = len(slots)
        if (node.children or node.pinned or node.refs > 1 or node.parent is None
                or n == 0 or len(tokens) - node.depth != n
                or len(node.edge) + n > self.EXTEND_MAX):
            return False
        # (not untracked: replaced at the leaf's next step; the collector untracks <= 64 ints)
        node.edge = (node.edge + (tokens[-1],) if n == 1
                     else node.edge + tuple(tokens[node.depth:]))
        append_slots(node, slots, self.EXTEND_MAX)
        node.depth += n  # (= len(tokens))
        added = n * self.token_bytes
        node.bytes += added
        self.bytes_held += added
        return True

    def _free(self, slots) -> None:
        if self.pool is not None and len(slots):
            self.pool.free(slots)

    def _split(self, node: _Node, k: int) -> _Node:
        """Split ``node``'s edge after ``k`` tokens; return the new upper node."""
        parent = node.parent
        upper = _Node(parent, untrack_ids(node.edge[:k]), node.slots[:k],
                      node.depth - len(node.edge) + k, self.token_bytes)
        node.slots = node.slots[k:]
        node.bytes -= upper.bytes
        node.edge = untrack_ids(node.edge[k:])
        node.parent = upper
        upper.children[node.edge[0]] = node
        parent.children[upper.edge[0]] = upper
        upper.stamp = node.stamp  # (its recency: the last use of what lies below it)
        self._nodes[upper] = None
        return upper

    def compact(self, node: _Node) -> _Node:
        """Merge ``node`` with its ancestors that have no other child, while the merged edges
        stay geometric (:func:`.nodes.merge_up`, which says why). Returns the node now ending
        where ``node`` ended (``node`` itself: it takes over its parents' edges and KV, so its
        depth and path tokens are unchanged)."""
        taken = merge_up(node, self.token_bytes)
        for n in taken:
            del self._nodes[n]
        self.merges += len(taken)
        return node

    # -- pinning, LRU, eviction ------------------------------------------------------------------

    def pin(self, tokens: Sequence[int], adapter=None) -> bool:
        """Pin the node that ends exactly at ``tokens`` so it is never evicted; False if absent."""
        node = self.find(tokens, adapter)
        if node is None:
            return False
        node.pinned = True
        return True

    def pinned_bytes(self) -> int:
        """Bytes held by pinned nodes and their ancestors (what eviction can never free)."""
        return sum(node.bytes for node in pinned_paths(self._nodes))

    def find(self, tokens: Sequence[int], adapter=None) -> _Node | None:
        """The node ending exactly at ``len(tokens)`` under ``adapter``, or None."""
        node, pos = self._roots.get(adapter), 0
        if node is None:
            return None
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or tuple(tokens[pos:pos + len(child.edge)]) != child.edge:
                return None
            node, pos = child, pos + len(child.edge)
        return node

    def touch_all(self, nodes) -> None:
        """Mark ``nodes`` (and so what lies above them, :mod:`.recency`) as used now: one tick,
        one stamp per node; their ancestors are not walked."""
        self.clock += 1
        clock = self.clock
        for node in nodes:
            node.stamp = clock

    def _touch(self, node: _Node) -> None:
        self.clock += 1
        node.stamp = self.clock

    def evict(self) -> int:
        """Evict least recently used leaves neither held nor pinned until within budget (a
        parent is a candidate once its last child is gone, :mod:`.recency`); return bytes freed."""
        if self.bytes_held <= self.budget_bytes:
            return 0
        freed, held = 0, []
        while self.bytes_held > self.budget_bytes and (
                node := self._candidates.pop(self._nodes)) is not None:
            if node.refs or node.pinned:
                held.append(node)
            else:
                freed += self._remove(node)
        for node in held:
            self._candidates.push(node, self._nodes)
        return freed

    def _remove(self, node: _Node) -> int:
        parent = node.parent
        del parent.children[node.edge[0]]
        del self._nodes[node]
        if node.stamp > parent.stamp:  # (the parent's recency: the last use below it)
            parent.stamp = node.stamp
        if parent.parent is not None and not parent.children:  # a leaf now
            self._candidates.push(parent, self._nodes)
        self.bytes_held -= node.bytes
        self.evictions += 1
        self._free(node.slots)
        node.slots = None
        return node.bytes

    def clear(self, keep_pinned: bool = False) -> None:
        """Drop every node (or every node not on the path of a pinned node)."""
        self.ends.clear()
        if not keep_pinned:
            for root in self._roots.values():
                root.children.clear()
            self._roots = {None: self.root}
            for node in self._nodes:
                node.slots = None
            self._nodes.clear()
            self._candidates.clear()
            self.bytes_held = 0
            if self.pool is not None:
                self.pool.clear()
            return
        keep = pinned_paths(self._nodes)
        for node in sorted(self._nodes, key=_depth, reverse=True):  # (children first)
            if node not in keep and not node.children:
                self._remove(node)

    def drop_adapter(self, adapter) -> int:
        """Drop every node under ``adapter``'s root (pinned ones too); return bytes freed.
        Call it only while no forward holds nodes of that adapter."""
        root = self._roots.pop(adapter, None) if adapter is not None else None
        if root is None:
            return 0
        self.ends.clear()
        freed, stack = 0, list(root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            del self._nodes[node]
            self.bytes_held -= node.bytes
            freed += node.bytes
            self._free(node.slots)
            node.slots = None
        root.children.clear()
        return freed


_depth = operator.attrgetter("depth")
