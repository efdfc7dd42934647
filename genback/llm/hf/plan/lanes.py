"""``Lanes``: a forward's rows of pool slots, kept so that the next decode step's layout is a
gather.

A forward of one new token per row (the decode step, :mod:`..decode.step`, or the tree forward,
:mod:`..forward.tree`) lays each row's private past out as a row of pool slots (left-padded
with the dummy slot 0, the slot of its new token last) after what the rows read in place (level
0 of the decode step's cascade; the tree forward's shared segments). The next SMC or decoding
step asks for each of those contexts plus one token, so its row is the same row plus one slot.
Listing the tree's segments of every path again (:func:`.segments.split_segments`: a walk up
from each holder, the union's columns, the chains, the expansion) costs ~2.6 µs per row at 256
rows on this project's CPU (``bench_host.py --decode eager``, measured); instead a step keeps its
table, and which row each context has by the identity of the context object (as
:class:`..cache.ends.Ends` does; a parent that is another object equal to a row's context, a
particle's twin whose query was answered, takes that row), and the next step's table is
``table[rows]`` plus a column: one dictionary look-up per row, the rest NumPy.

When a step's rows are still right: the slots of a cached context's KV never change while it is
cached (splits and merges of tree nodes join or split index arrays; KV never moves), so a row is
right as long as no slot it names was freed and handed out again. A step's lanes are therefore
used only while the pool has freed nothing since (the ``frees`` count of the
:class:`..cache.kv_pool.KVPool`: an eviction, a duplicate's slots, a failed step, a cleared
cache), and only by the next step of the same forward and adapter (each step replaces the last
one's lanes). A full layout runs at least every :data:`REFRESH` steps: resampling can make
every row share more of its past, which a full layout reads once (level 0, a shared segment)
instead of once per row.
"""

from __future__ import annotations

import operator

import numpy as np

from ....queries.context import last_ids

# most steps laid out from lanes in a row before a full layout (which can find a longer shared
# prefix); a full layout costs ~2.6 µs per row, a step from lanes ~1.1 (DecodeStep.layout at 256
# rows, measured), so one in 17 adds ~0.1 µs per row
REFRESH = 16

_min = np.minimum.reduce
_is = operator.is_
path_tokens = operator.attrgetter("tokens")  # (a path's context: the lanes' row keys)
_first, _second = operator.itemgetter(0), operator.itemgetter(1)  # (ndarray.min without its Python wrapper)


class Lanes:
    """One step's table, for the next step's :meth:`rows` and :meth:`gather`.

    Args:
        contexts: the step's rows' contexts (each answered query's, one new token each; a
            path's ``tokens``).
        adapter: the step's adapter key.
        table: ``int64 [R, W]``: each row's private past's pool slots, left-padded with slot 0,
            the row's new slot last.
        pads: ``int64 [R]``: each row's padding columns.
        prefix: what every row reads before its row, as the forward that made the table keeps
            it (the decode step: level 0's slots ``int64 [P]``; the tree forward: its shared
            segments).
        frees: the pool's ``frees`` (:class:`..cache.kv_pool.KVPool`) when the table was made.
        age: steps laid out from lanes since the last full layout (0 for a full layout's).
    """

    __slots__ = ("keys", "adapter", "table", "pads", "prefix", "frees", "age", "_twins")

    def __init__(self, contexts: list, adapter, table: np.ndarray, pads: np.ndarray, prefix,
                 frees: int, age: int):
        # (the entries made in C: no frame a row)
        self.keys = dict(zip(map(id, contexts), zip(contexts, range(len(contexts)))))
        self.adapter = adapter
        self.table, self.pads, self.prefix = table, pads, prefix
        self.frees, self.age = frees, age
        self._twins: dict | None = None  # (length, last id) -> [(context, row)], on a miss

    def rows(self, parents: list, adapter, frees: int) -> np.ndarray | None:
        """``int64 [len(parents)]``: the row of each parent context in this step's table
        (a step's paths' parents: each path's one query's ``parent``):
        the row of that very object (its query's ``parent``), else of a context equal to it
        (particles that held equal contexts as other objects asked one query, answered once:
        the row of the one answered holds the same slots, as the pool freed none since); None
        when one has none, when ``adapter`` is another, when the pool freed slots since
        (``frees`` differs) or when a full layout is due."""
        if frees != self.frees or self.age >= REFRESH or not parents or adapter != self.adapter:
            return None
        keys = self.keys
        entries = list(map(keys.get, map(id, parents)))  # (in C; a miss or a twin: below)
        if None not in entries and all(map(_is, map(_first, entries), parents)):
            return np.fromiter(map(_second, entries), dtype=np.int64, count=len(entries))
        out = []
        for parent in parents:
            entry = keys.get(id(parent))
            if entry is None or entry[0] is not parent:
                row = self._twin(parent)
                if row is None:
                    return None
                out.append(row)
                continue
            out.append(entry[1])
        return np.array(out, dtype=np.int64)

    def _twin(self, context) -> int | None:
        """The row of a context of this step equal to ``context`` (another object), or None;
        the rows are indexed by length and last id at the first call, and compared only there
        (an equal context is never flattened for it: :class:`~genback.queries.context.Context`
        compares a shared base by identity)."""
        if context is None or not len(context):
            return None
        if self._twins is None:
            entries = list(self.keys.values())
            self._twins = {}
            for (t, row), last in zip(entries, last_ids([t for t, _ in entries])):
                self._twins.setdefault((len(t), last), []).append((t, row))
        for t, row in self._twins.get((len(context), last_ids((context,))[0]), ()):
            if t == context:
                return row
        return None

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(past, pads)`` of the step whose paths extend the contexts of ``rows`` by one
        token each: those rows less the padding columns they all have (``int64 [R, W']``) and
        each one's padding; the new slots go after them as the last column."""
        pads = self.pads[rows]
        trim = int(_min(pads)) if len(pads) else 0
        return self.table[rows, trim:], (pads - trim if trim else pads)
