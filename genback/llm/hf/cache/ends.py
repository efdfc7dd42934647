"""``Ends``: where the KV of recent contexts ends in the KV tree, by the identity of the context
object (the front's :class:`~genback.queries.context.Context`, or a tuple).

An SMC step or a decoding step asks for a context that is its parent's plus one token; the
front hands the runner the parent's validated context (:attr:`genback.queries.kinds.Query.parent`). When
that very object was a recent query's context, the runner noted the tree node where its KV ends
(:meth:`Ends.note`), so :meth:`.kvtree.KVTree.match` starts its walk there instead of at the root:
no token of the context is compared, and a step costs the same at 100 tokens as at 16,000.

Notes are keyed by ``id(context)`` and keep the object itself, so a key can never be mistaken for
a new object at a reused address; a note is trusted only while its node still ends at that depth
(not evicted or merged away since). Notes live in two generations: once the current one holds
:attr:`Ends.keep` notes, :meth:`Ends.rotate` makes it the previous one and forgets the one before.
"""

from __future__ import annotations

import operator
from itertools import repeat

_is, _is_not, _eq = operator.is_, operator.is_not, operator.eq
_tokens, _node, _adapter, _length = (operator.itemgetter(i) for i in range(4))
_slots, _parent, _depth = (operator.attrgetter(a) for a in ("slots", "parent", "depth"))


class Ends:
    """Recent contexts' end nodes, by the identity of the context object, in two generations.

    Args:
        keep: notes a generation holds before :meth:`rotate` retires it (> 0).

    Not thread-safe: the KV tree's owner serialises access.
    """

    __slots__ = ("keep", "_current", "_before")

    def __init__(self, keep: int = 2048):
        self.keep = keep
        self._current: dict[int, tuple] = {}
        self._before: dict[int, tuple] = {}

    def get(self, tokens, adapter=None):
        """The node where the KV of ``tokens`` (this very object, under ``adapter``) ends, if a
        recent :meth:`note` said so and that node still ends there; else None. O(1)."""
        found = self.nodes((tokens,), adapter)
        return None if found is None else found[0]

    def nodes(self, contexts, adapter=None, resolve=None) -> list | None:
        """:meth:`get` of each of ``contexts`` (a step's parents), in one call; None as soon as
        one has no node (or is None).

        ``resolve(tokens, adapter)``: asked for a context with no valid note, the node where its
        KV ends found by its tokens (:meth:`.kvtree.KVTree.end_node`), or None. Particles whose
        contexts were equal asked one query (the batcher answers equal queries once), so only
        that query's context object was noted, and the others' children find their parents
        this way."""
        current, before = self._current, self._before
        if type(contexts) is list:
            # (an SMC step's parents, each noted by the step before: one look-up each in C,
            # the notes' objects, adapters, nodes and depths compared in C; any miss: below)
            notes = list(map(current.get, map(id, contexts)))
            if None not in notes and all(map(_is, map(_tokens, notes), contexts)) \
                    and all(map(_eq, map(_adapter, notes), repeat(adapter))):
                nodes = list(map(_node, notes))
                if (all(map(_is_not, map(_slots, nodes), repeat(None)))
                        and all(map(_is_not, map(_parent, nodes), repeat(None)))
                        and list(map(_depth, nodes)) == list(map(_length, notes))):
                    return nodes
        out = []
        for tokens in contexts:
            end = current.get(id(tokens)) or before.get(id(tokens))
            if end is None or end[0] is not tokens or end[2] != adapter:
                node = None  # (None itself is never noted: a query without a parent)
            else:
                node = end[1]
                if node.slots is None or node.parent is None or node.depth != end[3]:
                    node = None  # evicted or merged away since (end[3]: len(tokens), noted)
            if node is None:
                if resolve is None or tokens is None:
                    return None
                node = resolve(tokens, adapter)
                if node is None:
                    return None
            out.append(node)
        return out

    def note(self, tokens, node, adapter=None) -> None:
        """Remember that the KV of ``tokens`` (this very object: a tuple or a
        :class:`~genback.queries.context.Context`) ends exactly at ``node``, for a later :meth:`get`.
        The objects are the contexts of recent queries, which the front's
        memory of validated contexts (4,096) holds anyway."""
        self._current[id(tokens)] = (tokens, node, adapter, len(tokens))

    def note_many(self, contexts: list, nodes: list, lengths: list[int], adapter=None) -> None:
        """:meth:`note` of each context, its node and its length (``len(context)``, which the
        caller knows: a step's commit), in one call: the entries are built in C, no frame and
        no ``len`` of a context per row."""
        self._current.update(zip(map(id, contexts),
                                 zip(contexts, nodes, repeat(adapter), lengths)))

    def rotate(self) -> None:
        """End a runner call: once the current generation holds :attr:`keep` notes, it becomes
        the previous one and the one before is forgotten. (Rotating at every call lost the
        parents of a step that the batcher split: 1,024 particles in batches of 512 never found
        their parents, and every query of 16,000 tokens was walked from the root, twice: ~160 µs
        per query, measured with ``bench_host.py``.)"""
        if len(self._current) >= self.keep:
            self._before, self._current = self._current, {}

    def entries(self):
        """Every remembered ``(tokens, node, adapter)``, each context once (for pictures and
        statistics; :func:`.picture.live_counts` checks which still hold)."""
        seen = set()
        for table in (self._current, self._before):
            for key, entry in table.items():
                if key not in seen:
                    seen.add(key)
                    yield entry[:3]

    def clear(self) -> None:
        """Forget every note."""
        self._current, self._before = {}, {}
