"""How ``HFRunner`` answers one adapter's batch (:class:`Execution`, a mixin of
:class:`.runner.HFRunner`). A batch takes three steps, and nothing here knows a forward's insides:

1. **plan** (:mod:`.plan`): a uniform decode step is one level of one path per query
   (:func:`.plan.batch.plan_step`); anything else is levels of paths against the KV tree
   (:func:`.plan.batch.plan_batch`: the work of a query is the tokens it forwards beyond its
   cached prefix), and a query too large for one forward is pieces
   (:meth:`.plan.budget.ForwardBudget.piece_paths`).
2. **execute**: each level's paths are held, grouped into forwards that fit
   (:func:`.plan.batch.group_paths`) and run by one forward of the one contract
   (:class:`.forward.base.ForwardOut`): the decode step (:mod:`.decode.step`) when the group is
   a uniform step it can run, else the tree forward (the dense one for models without the
   attention interface); after the first, young garbage collections may run
   (:func:`genback.cpython.forward_issued`: on a GPU, while it computes).
3. **commit**: each forward's new KV slots go into the tree (:mod:`.cache.kvtree`: a leaf that
   ends where the path's cached prefix does grows in place), the contexts' ends are noted, and
   after the batch the new nodes are compacted and the tree evicted to its budget.

A uniform step whose queries extend the rows of the step before it skips all three: it runs
from that step's rows and is committed with the steps after it, when something else reads
the tree (:class:`.chain.StepChain`).
"""

from __future__ import annotations

import operator

from ...cpython import forward_issued, inline as inline_hold
from ...queries.context import last_ids
from ...queries.kinds import Query
from .forward.base import ForwardOut
from .memory import trim_host_memory
from .plan.batch import Output, Path, group_paths, is_uniform, plan_batch, plan_step

_tokens, _holder, _cached = (operator.attrgetter("tokens"), operator.attrgetter("holder"),
                             operator.attrgetter("cached"))


class Execution:
    """The plan, the forwards and the commit of :class:`.runner.HFRunner` (its ``_answer`` and
    what it calls; the runner holds the state they use: ``_tree``, ``forward``, ``decode_step``,
    ``chain``, ``budget``, ``pool``, the counters)."""

    def _settle(self, drop: bool = False) -> None:
        """Commit the step chain's uncommitted KV to the tree (:meth:`.chain.StepChain.commit`;
        its nodes compacted: :meth:`.cache.kvtree.KVTree.compact`); ``drop``: then forget the
        chain (the tree is about to lose nodes)."""
        chain = self.chain
        if chain is not None:
            nodes = chain.commit()
            if nodes:  # (compacted now: a chain that goes on holds them from its next step)
                tree = self._tree
                tree.touch_all(nodes)
                for node in nodes:
                    if node.slots is not None and node.parent is not None:
                        tree.compact(node)
            if drop:
                chain.drop()

    def _chain_step(self, queries: list[Query]) -> list | None:
        """The results of ``queries`` as the step chain's next step
        (:meth:`.chain.StepChain.step`), or None: when they are not one as the chain stands,
        it is committed and they are tried again (a resampling step repeats and drops rows)."""
        chain = self.chain
        if chain.source is not None and chain.source is self.decode_step and self.lora.loaded:
            self._settle(drop=True)  # (the decode step runs the base model only: planned)
            return None
        out = chain.step(queries)
        if out is None and chain.steps:
            self._settle()
            out = chain.step(queries)
        if out is None:
            return None
        if inline_hold.hold is not None:  # (as _execute's forwards)
            forward_issued()
        self.forwards += 1  # (one token a row: nothing padded)
        self.tokens_forwarded += len(queries)
        self.padded_tokens_forwarded += len(queries)
        self.kv_bytes_read += out.bytes_read
        return out.values

    def _step_fits(self, rows: int, longest: int) -> bool:
        """Whether a uniform step of ``rows`` rows (the longest context ``longest`` tokens) is
        one forward within the budgets, as :func:`.plan.batch.group_paths` and
        :func:`.plan.batch.plan_step` would plan it."""
        budget = self.budget
        one = budget.working_set(1, longest, 1)
        if one > budget.max_bytes or rows > self.max_batch_tokens:
            return False
        if budget.packed:
            return rows * one <= budget.max_bytes
        return rows * longest * budget.score_bytes <= self.max_forward_bytes

    def _answer(self, queries: list[Query]) -> list:
        """Results of one adapter's queries: a uniform decode step as one level
        (:func:`.plan.batch.plan_step`); otherwise those too large for one forward in pieces, the
        rest planned together (:func:`.plan.batch.plan_batch`) and executed level by level."""
        if self.chain is not None:  # (a step of the chain: from the last step's rows)
            values = self._chain_step(queries)
            if values is not None:
                return values
        results: list = [None] * len(queries)
        step = plan_step(queries, self._tree.ends, queries[0].adapter, self.budget,
                         self._tree.end_node)
        if step is not None:  # an SMC or decoding step
            for output, value in self._execute(step, uniform=True):
                results[output.index] = value
            return results
        fit = []
        for i, q in enumerate(queries):
            try:  # (planned just before they run: a later query may reuse their KV)
                pieces = self.budget.piece_paths(q, self._cached)
            except ValueError as exc:  # fails alone; the others go on
                results[i] = exc
                continue
            if pieces is None:
                fit.append(i)
            else:
                results[i] = self._run_pieces(q, pieces)
        if fit:
            match = self._matcher(queries[fit[0]].adapter)
            for level in plan_batch([queries[i] for i in fit], match):
                for output, value in self._execute(level):
                    results[fit[output.index]] = value
        return results

    def _matcher(self, adapter):
        tree = self._tree
        # (no touch: _execute touches the union of a level's paths once, KVTree.touch_all)
        return lambda q, limit: tree.match(q.tokens, limit, adapter=adapter, parent=q.parent,
                                           touch=False, segments=False)

    def _cached(self, q: Query, limit: int) -> int:
        """Tokens of ``q``'s context cached now, at most ``limit`` (a probe: no LRU change)."""
        return self._tree.match(q.tokens, limit, touch=False, adapter=q.adapter,
                               parent=q.parent, segments=False)[1]

    def _run_pieces(self, q: Query, paths: list[Path]):
        """Run the paths of ``q``'s pieces (:meth:`.plan.budget.ForwardBudget.piece_paths`) one
        forward each, in order; return ``q``'s result (the target slices' log-probs, and greedy
        flags, joined in order)."""
        parts = []
        for path in paths:
            (_, value), = self._execute([path])
            parts.append(value)
        return q.join([v for v in parts if v is not None])  # (prefill pieces: None)

    def _execute(self, level: list[Path], uniform: bool = False) -> list[tuple[Output, object]]:
        """Run one level of a plan: match its paths that are not matched yet, hold their cached
        nodes, forward them in groups (:func:`.plan.batch.group_paths`) and commit each forward's new
        KV to the tree at once (a batch's new KV is never all held at one time). Returns
        ``(output, result)`` pairs. ``uniform``: the level is a uniform decode step
        (:func:`.plan.batch.plan_step`'s), not checked again."""
        answered: list[tuple[Output, object]] = []
        held, new, tree = [], [], self._tree
        try:
            for p in () if uniform else level:
                if p.holder is None:  # (planned paths were matched, and touched, by the plan)
                    _, cached, holder = tree.match(
                        p.tokens, p.limit, touch=False, adapter=p.adapter, segments=False)
                    p.matched(cached, holder)
            held = [p.holder for p in level]
            tree.acquire(*held)
            todo = [p for p in level if p.n_new > 0]  # a prefill may be cached already
            for group in group_paths(todo, self.max_batch_tokens, self.max_forward_bytes,
                                     self.budget.score_bytes, self.budget):
                out = self._forward(group, uniform)
                if inline_hold.hold is not None:  # (no call per forward otherwise)
                    forward_issued()
                answered.extend(zip([o for p in group for o in p.outputs], out.values))
                (self._commit_step if uniform else self._commit)(group, out.new_slots, new)
            answered.extend((o, None) for p in level if p.n_new == 0 for o in p.outputs)
        finally:
            # the LRU order of everything this level used or inserted, each node once (also
            # after an error: an inserted node must be in the LRU)
            tree.touch_all(held + new)
            tree.release(*held)
        return answered

    def _commit(self, group: list[Path], new_slots: list, new: list) -> None:
        """Put each path's new KV (its ``new_slots``) into the tree at once, and note where its
        context ends: a leaf that ends where the path's cached prefix does (held by the path
        alone) grows in place; otherwise a node is inserted (appended to ``new``, to be
        touched with the level's nodes)."""
        tree = self._tree
        for p, slots in zip(group, new_slots):
            holder = p.holder
            if holder.depth == p.cached and tree.extend(holder, p.tokens, slots):
                node = holder  # (touched with the held nodes)
            else:
                node = tree.insert(p.tokens, p.cached, slots, p.adapter, near=holder,
                                   touch=False)
                new.append(node)
            self._inserted.append(node)
            tree.ends.note(p.tokens, node, p.adapter)

    def _commit_step(self, group: list[Path], new_slots: list, new: list) -> None:
        """:meth:`_commit` of a uniform step's paths (one new token each, one adapter) in
        bulk: :meth:`.cache.kvtree.KVTree.grow` and :meth:`.cache.ends.Ends.note_many`, the
        rows' fields read by C-level getters (no call chain per row)."""
        contexts, cached = list(map(_tokens, group)), list(map(_cached, group))
        adapter = group[0].adapter
        nodes, inserted = self._tree.grow(list(map(_holder, group)), contexts, cached,
                                         last_ids(contexts), new_slots, adapter)
        new.extend(inserted)
        self._inserted.extend(nodes)
        lengths = [n + 1 for n in cached]
        self._tree.ends.note_many(contexts, nodes, lengths, adapter)
        if self.chain is not None:  # (the forward that ran this group made its lanes)
            self.chain.begin(self._stepped, nodes, contexts, lengths, adapter)

    def _evict(self) -> None:
        """Merge the nodes this call inserted with their single-child ancestors
        (:meth:`.cache.kvtree.KVTree.compact`: nothing is held any more), then evict to the budget;
        every 64 MiB freed, hand the freed heap back to the OS (the tree's many small node
        tensors live on the heap, which glibc does not shrink itself). A step chain's uncommitted
        KV that would pass the budget is committed first."""
        chain = self.chain
        if chain is not None and chain.steps and (self._tree.bytes_held + chain.pending_tokens
                                                  * self.kv_token_bytes > self._tree.budget_bytes):
            self._settle()
        for node in self._inserted:
            if node.slots is not None and node.parent is not None:  # (not evicted or merged away)
                self._tree.compact(node)
        self._inserted.clear()
        self._tree.ends.rotate()
        self._freed_since_trim += self._tree.evict()
        if self._freed_since_trim >= 64 << 20 and self.device.type == "cpu":
            trim_host_memory()
            self._freed_since_trim = 0

    def _forward(self, group: list[Path], uniform: bool = False) -> ForwardOut:
        """Forward ``group`` (:class:`.forward.base.ForwardOut`): a uniform decode step of the
        base model through the decode step when it is on and the step fits
        (:meth:`.decode.step.DecodeStep.run`), anything else through the tree (or dense)
        forward."""
        out = None
        uniform = uniform or is_uniform(group)
        if self.decode_step is not None and not self.lora.loaded and uniform:
            out = self.decode_step.run(group)
            self._stepped = self.decode_step
        if out is None:  # (a uniform step may be laid out from the last one's rows)
            out = self.forward.run(group, uniform)
            self._stepped = self.forward
        n_new = [r.n_new for r in group]
        self.forwards += out.forwards
        self.tokens_forwarded += sum(n_new)
        self.padded_tokens_forwarded += (sum(n_new) if self.budget.packed  # (no padding)
                                         else len(group) * max(n_new))
        self.kv_bytes_read += out.bytes_read
        return out
