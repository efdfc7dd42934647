"""``StepChain``: a chain of uniform steps run from the last step's rows, committed to the KV tree
once, when something else reads the tree.

An SMC or decoding step whose every query asks for a row of the last step's contexts plus one
token needs nothing of the KV tree: its layout is the last step's rows plus a column of new
slots (:class:`.plan.lanes.Lanes`, kept by the forward that ran it), and its new KV is that column. Committing
each such step to the tree anyway (a :class:`.plan.batch.Path` and an ``Output`` a row to plan
it, :meth:`.cache.kvtree.KVTree.grow` and :meth:`.cache.ends.Ends.note_many` to commit it, a
compaction a row after it) cost ~12 µs a row of a step's ~40 µs of host time at 256 rows x 100
tokens on this project's CPU (``benchmarks/history/issue-67.md``, "Session 68"). So a chain of
such steps is kept as rows: for each row of the last step its context, and the tree node where
its context's KV ended when the chain began (its *base*, which holds the tokens before the
chain's); the tokens the chain added are the contexts' own, and their slots are the last
columns of the lanes' table. :meth:`StepChain.commit` puts them into the tree, a row at a time
(:meth:`.cache.kvtree.KVTree.extend` of a base under one row, which is mostly a leaf, else a
leaf of the row's own, :meth:`.cache.kvtree.KVTree.attach`), and notes where each context ends.

The runner (:class:`.runner.HFRunner`) commits a chain before anything else uses the tree (any
other batch, a pin, a walk, a picture, ``clear``, an adapter's removal, the ``tree`` attribute
itself) and before an eviction that the chain's uncommitted KV would pass; its statistics, read
without the forward lock, count the uncommitted KV in ``kv_bytes`` and commit nothing.
While a chain has uncommitted steps its bases are held (:meth:`.cache.kvtree.KVTree.acquire`),
so no eviction frees the KV its rows read. A step continues a chain only from the lanes the
chain's last step made, while the pool has freed nothing since, at most
:data:`.plan.lanes.REFRESH` steps from a full layout (the same rules as the lanes'); and only
when its rows are a permutation of the last step's, unless the chain was just committed (a
resampling step repeats some rows and drops others: a row's uncommitted tokens must reach the
tree once, and two rows may not share uncommitted slots). The answers are the forward's, laid
out as the lanes path lays out a planned step: the same rows, bit for bit.

A chain continues the forward that ran the step it began at, through that forward's ``step``:
the tree forward (:meth:`.forward.tree.TreeForward.step`) or the decode step
(:meth:`.decode.step.DecodeStep.step`, on a GPU a captured graph's replay: its host work before
the launch is what bounds a large step there, ``benchmarks/RESULTS.md``, "Issue 38, part 1 on
an H200"), the latter while its step runs as one forward (not in chunks of rows) and no LoRA
adapter is loaded (as the runner's planned steps use it).
"""

from __future__ import annotations

import operator
from collections import Counter
from itertools import repeat

import numpy as np

from ...queries.kinds import Query
from .cache.nodes import descend
from .forward.base import ForwardOut

_parent, _context, _at_end, _hash = (operator.attrgetter(a) for a in
                                     ("parent", "context", "at_end", "tokens_hash"))


class StepChain:
    """The runner's chain of uniform steps not committed to the tree yet (see the module's doc).

    Args:
        tree: the runner's :class:`.cache.kvtree.KVTree`.
        fits: ``fits(rows, longest) -> bool``: whether a step of ``rows`` one-token rows, the
            longest context ``longest`` tokens, is one forward within the runner's budgets.

    Not thread-safe: the runner's lock serialises it with every other use of the tree.
    """

    __slots__ = ("tree", "source", "fits", "lanes", "adapter", "bases", "depths", "contexts",
                 "lengths", "held", "retired", "pending_tokens", "steps", "steps_run")

    def __init__(self, tree, fits):
        self.tree, self.fits = tree, fits
        self.source = None  # the forward whose lanes the chain continues (its step runs them)
        self.lanes = None  # the lanes of the chain's last step (None: no chain)
        self.adapter = None
        self.bases: list = []  # each row's base: where its context ended as the chain began
        self.depths: np.ndarray | None = None  # int64 [R]: the bases' depths then
        self.contexts: list = []  # each row's context now
        self.lengths: np.ndarray | None = None  # int64 [R]: their lengths
        self.held: list = []  # the bases held while steps are uncommitted
        self.retired: list = []  # (base, depth, context, slots) of rows a step dropped
        self.pending_tokens = 0  # KV slots the steps took that the tree does not hold yet
        self.steps = 0  # steps run since the chain began (the tokens a row has uncommitted)
        self.steps_run = 0  # steps this chain object ran in all (statistics)

    def begin(self, source, nodes: list, contexts: list, lengths: list, adapter) -> None:
        """Start a chain at a step committed to the tree, run by ``source`` (the forward that
        ran it: its ``lanes``, None when it kept none, and ``step``): its rows' ``contexts``
        (the lanes' rows, in order; ``lengths`` their lengths) end at ``nodes``. Any
        uncommitted chain must have been committed first."""
        assert not self.steps, "a chain with uncommitted steps is replaced"
        self.source, self.lanes = source, source.lanes
        self.adapter, self.bases, self.contexts = adapter, nodes, contexts
        self.depths = self.lengths = np.array(lengths, dtype=np.int64)

    def drop(self) -> None:
        """Forget the chain (committed, or its KV freed with the tree's)."""
        assert not self.steps, "a chain with uncommitted steps is dropped"
        self.source, self.lanes, self.bases, self.contexts = None, None, [], []

    def step(self, queries: list[Query]) -> ForwardOut | None:
        """Answer ``queries`` (distinct, of one adapter) as the chain's next step, or None
        (nothing done) when they are not one: see the module's doc. A forward's error
        propagates with the chain unchanged (its new slots freed: the lanes are then gone, and
        the chain is committed as it was)."""
        lanes, source = self.lanes, self.source
        if lanes is None or lanes is not source.lanes or not queries \
                or queries[0].adapter != self.adapter or not all(map(_at_end, queries)):
            return None
        rows = lanes.rows(list(map(_parent, queries)), self.adapter, source.pool.frees)
        if rows is None:
            return None
        R, last = len(rows), len(self.bases)
        per_row = np.bincount(rows, minlength=last)  # (queries a row of the last step has)
        # a row asked twice (resampling): two queries of one parent are distinct contexts only
        # if their hashes differ (a row and a decoding step of one context, or two picks, are
        # answered by one path: planned)
        if R > last - np.count_nonzero(per_row == 0) and len(set(map(_hash, queries))) < R:
            return None
        lengths = self.lengths[rows] + 1
        if not self.fits(R, int(lengths.max())):
            return None
        if self.steps == 0 and not _alive(self.bases, self.depths):
            return None  # (a base merged away or evicted since the chain began: planned)
        contexts = list(map(_context, queries))
        out = source.step(queries, contexts, rows, lengths, self.adapter)
        if out is None:  # (the forward's own limits: nothing was taken)
            return None
        if self.steps == 0:
            self.held = self.bases
            self.tree.acquire(*self.held)  # (released by commit)
        elif per_row.min() == 0:  # (rows dropped: resampling)
            self._retire(np.flatnonzero(per_row == 0))
        bases = self.bases
        self.bases = list(map(bases.__getitem__, rows.tolist()))
        self.depths = self.depths[rows]
        self.contexts, self.lengths, self.lanes = contexts, lengths, source.lanes
        self.steps += 1
        self.steps_run += 1
        self.pending_tokens += R  # (a new slot a row: copied rows share the ones before)
        return out

    def _retire(self, dropped: np.ndarray) -> None:
        """Keep what the last step's rows ``dropped`` (asked by no query of this step) have
        uncommitted, for :meth:`commit` (their slots leave the lanes' table with them)."""
        k = self.steps
        slots = self.lanes.table[dropped, -k:]  # (a copy: fancy indexing)
        bases, contexts, depths = self.bases, self.contexts, self.depths
        for i, r in enumerate(dropped.tolist()):
            self.retired.append((bases[r], int(depths[r]), contexts[r], slots[i]))

    def commit(self) -> list:
        """Put the chain's uncommitted KV into the tree and note where each row's context ends
        (:meth:`.cache.ends.Ends.note_many`); the chain then begins again at those nodes.
        Returns the nodes (to be compacted and touched by the runner), ``[]`` when nothing was
        uncommitted.

        Rows that resampling copied share the slots (and tokens) of the steps before the copy:
        the rows are taken in the order of their slots (a lexicographic sort), so a row's
        shared slots are those it has in common with the row before it, which stored them;
        it stores what follows. A row whose base is under no other row grows it in place
        (:meth:`.cache.kvtree.KVTree.extend`: a leaf, mostly); otherwise its tokens are a leaf
        of their own (:meth:`.cache.kvtree.KVTree.attach`), or follow what a row before it
        stored (:meth:`.cache.kvtree.KVTree.insert`, from where those end)."""
        if not self.steps:
            return []
        tree, k, R = self.tree, self.steps, len(self.bases)
        tree.release(*self.held)
        retired = self.retired
        block = self.lanes.table[:, -k:]
        bases, depths, contexts = list(self.bases), self.depths.tolist(), list(self.contexts)
        counts = [k] * R
        if retired:  # (padded with distinct negative numbers: equal to no slot)
            pad = -1 - np.arange(len(retired) * k, dtype=np.int64).reshape(-1, k)
            for i, (base, depth, context, slots) in enumerate(retired):
                pad[i, :len(slots)] = slots
                bases.append(base)
                depths.append(depth)
                contexts.append(context)
                counts.append(len(slots))
            block = np.concatenate([block, pad])
        order = np.lexsort(block.T[::-1])
        ordered = block[order]
        shared = np.zeros(len(block), dtype=np.int64)  # slots stored by an earlier row
        shared[order[1:]] = np.cumprod(ordered[1:] == ordered[:-1], axis=1).sum(axis=1)
        rows_of = Counter(map(id, bases))  # (a base under several rows: resampled since)
        nodes = [None] * len(block)
        for i, c in zip(order.tolist(), shared[order].tolist()):
            node, depth, context, n = bases[i], depths[i], contexts[i], counts[i]
            if c == 0:
                if rows_of[id(node)] > 1 or not tree.extend(node, context, block[i, :n]):
                    # (a copy: a node must not keep the whole table alive)
                    node = tree.attach(node, context, depth, block[i, :n].copy(), self.adapter)
            elif c < n:  # (tokens[:depth + c] stored by the row before it, in this sort)
                near, _ = descend(node, depth, context, depth + c)
                node = tree.insert(context, depth + c, block[i, c:n].copy(), self.adapter,
                                   near=near, touch=False)
            nodes[i] = node  # (c == n: a dropped row's context, all stored: no note)
        nodes = nodes[:R]
        tree.ends.note_many(self.contexts, nodes, self.lengths.tolist(), self.adapter)
        self.steps, self.retired, self.pending_tokens, self.held = 0, [], 0, []
        self.bases, self.depths = nodes, self.lengths
        return nodes


_slots, _node_parent, _depth = (operator.attrgetter(a) for a in ("slots", "parent", "depth"))
_is_not = operator.is_not


def _alive(nodes: list, depths: np.ndarray) -> bool:
    """Whether every one of ``nodes`` is still in the tree and ends at its depth in ``depths``
    (not evicted, nor merged into a child since: :func:`.cache.nodes.merge_up`), checked in C."""
    return (all(map(_is_not, map(_slots, nodes), repeat(None)))
            and all(map(_is_not, map(_node_parent, nodes), repeat(None)))
            and np.array_equal(np.fromiter(map(_depth, nodes), dtype=np.int64,
                                           count=len(nodes)), depths))
