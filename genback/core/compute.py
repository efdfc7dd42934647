"""``ComputeStep``: the front's compute step, the one place where a batch of checked queries is
answered: by the batcher's worker (or, for a lockstep step, on the event loop's thread), by a sync
caller (``ask_sync``), or one query at a time for a runner whose engine schedules itself.

Rows cached since a query was submitted are taken; the rest go to ``runner.run`` under the
forward lock and without the calling thread's autocast (:func:`.autocast.no_autocast`); next-token
rows are stored in the output cache (the only place it is written), and each caller gets a row of
its own (:mod:`genback.queries.rows`). A mixin of :class:`.front.Front`, whose fields it reads
(``runner``, ``cache``, ``lock``, ``adapters``, ``check_open``, ``adapter_error``,
``check_adapter``).
"""

from __future__ import annotations

import torch

from ..queries.kinds import Query
from ..queries.rows import StepRows, kept_copies, made_blocks, owned_copies
from .autocast import no_autocast


class ComputeStep:
    """The compute step of :class:`.front.Front` (see the module's docstring)."""

    def _store(self, queries, values) -> None:
        """Keep the computed next-token rows (the only place the output cache is written), under
        one lock of the cache. The key is the query without its lineage hint
        (:meth:`genback.queries.kinds.NextToken.without_parent`): the hint served the runner's match, and
        a cached key would otherwise keep its parent context alive too (queries are immutable,
        so the hint is left out of a copy rather than cleared)."""
        rows = [(q.without_parent(), v) for q, v in zip(queries, values)
                if q.cacheable and not isinstance(v, BaseException)]
        if rows:
            self.cache.put_many(rows)

    def _compute(self, queries: list[Query]) -> list:
        """One result per query: a row cached since the query was submitted, else the runner's
        result, or the exception that fails only that query (its adapter was removed while it
        waited, or it cannot fit)."""
        results, todo, computed = self._run(queries)
        if todo:
            self._store([queries[i] for i in todo], computed)
        return results

    def _run(self, queries: list[Query]) -> tuple[list, list[int], list]:
        """:meth:`_compute`'s results before any is stored, the indices of the queries the
        runner answered, and its results for them."""
        results = self.cache.get_many([q if q.cacheable else None for q in queries])
        todo = [i for i, row in enumerate(results) if row is None]
        computed: list = []
        if todo:
            with self.lock:
                self.check_open()
                adapters = self.adapters  # (tested once per adapter: mostly None)
                if adapters and any(map(adapters.error, {queries[i].adapter for i in todo})):
                    for i in todo:
                        results[i] = adapters.error(queries[i].adapter)
                    todo = [i for i in todo if results[i] is None]
                with no_autocast():
                    computed = (self.runner.run(queries if len(todo) == len(queries)
                                                else [queries[i] for i in todo]) if todo else [])
            for i, value in zip(todo, computed):
                results[i] = value
        return results, todo, computed

    def _compute_owned(self, queries: list[Query]) -> list:
        """:meth:`_compute` for the batcher, whose callers get rows of their own
        (:mod:`genback.queries.rows`): fresh host rows as they are, the cache keeping copies
        (:func:`~genback.queries.rows.kept_copies`); others copied (:func:`~genback.queries.rows.owned_copies`)."""
        results, todo, computed = self._run(queries)
        fresh = [i for i in todo if queries[i].cacheable and type(results[i]) is torch.Tensor]
        mine = set(fresh) if fresh and results[fresh[0]].is_cpu else ()  # (handed as they are)
        if len(mine) < len(todo):  # (all of them, or the failures and uncacheable results)
            rest = [i for i in todo if i not in mine]
            self._store([queries[i] for i in rest], [results[i] for i in rest])
        blocks = None
        if mine and self.cache.max_entries:  # (the cache's copies: none when it keeps none)
            every = len(fresh) == len(queries)  # (mostly: the lists as they are)
            # (before copy_blocks takes them; one row: its stack is a copy as cheap)
            blocks = made_blocks(results) if every and len(results) > 1 else None
            self.cache.put_many(zip([queries[i].without_parent() for i in fresh],
                                    kept_copies(results if every else [results[i] for i in fresh])))
            if blocks is not None:  # (the callers' rows as they are: a step's blocks, held
                return StepRows(results, blocks)  # by nothing else now)
        at = [i for i, (q, r) in enumerate(zip(queries, results)) if q.cacheable and
              isinstance(r, torch.Tensor) and i not in mine] if len(mine) < len(queries) else ()
        for i, row in zip(at, owned_copies([results[i] for i in at]) if at else ()):
            results[i] = row
        return results

    async def _answer_one(self, query: Query):
        """One query through a runner that schedules by itself (``Immediate``).

        Raises:
            ValueError: its adapter was removed or replaced (before or while it ran).
            Exception: the runner's error for this query.
        """
        self.check_adapter(query.adapter)
        value = await self.runner.answer_shared(query)
        if self.adapter_error(query.adapter) is None:
            self._store((query,), (value,))
        return value
