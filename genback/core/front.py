"""``Front``: the one path every query of an ``AsyncLM`` takes, whatever its kind and backend.

It holds, as explicit parts: the input checks (:class:`.inputs.ContextChecker`: a context that
extends a validated one is checked in work independent of its length; the model's window); the
output cache of next-token rows (:class:`~genback.core.output_cache.OutputCache`); the adapters
(:class:`~genback.core.adapters.Adapters`, when the runner declares them); the counters; the
forward lock, which serialises the runner's use; and the scheduler, built from what the runner
declares (:class:`~genback.batching.runner.Capabilities`): genback's :class:`~genback.batching.batcher.Batcher`, or
:class:`~genback.batching.immediate.Immediate` for a runner whose engine batches by itself.

Four ways in, and the path each takes:

* :meth:`Front.ask` (``await``): :meth:`Front.lookup` (counted; a cached row is answered at
  once), else :meth:`Front.submit`: the scheduler's future. The batcher runs its batches on its
  worker thread (a lockstep step on the event loop's thread) through the front's compute step:
  rows cached meanwhile are taken, the rest go to ``runner.run`` under the forward lock and
  without the calling thread's autocast (:func:`no_autocast`), next-token rows are stored in
  the output cache, and each caller gets a row of its own (:mod:`genback.queries.rows`). With
  ``Immediate``, each query goes to the runner's ``answer_shared`` and its row is stored.
* :meth:`Front.next_token_lookup` (``next_token_logprobs``, :mod:`genback.batching.futures`) or
  :meth:`Front.lookup`, then :meth:`Front.submit`: for callers that await the future themselves.
* :meth:`Front.ask_sync`: distinct queries computed on the calling thread in one batch, by the
  same compute step.
Queries are built by :meth:`Front.next_token` and :meth:`Front.score` from checked ids.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from ..batching.batcher import Batcher, BatcherClosed
from ..batching.immediate import Immediate
from ..queries.context import Context
from .output_cache import OutputCache
from ..queries.kinds import NextToken, Query, Score
from ..batching.runner import Capabilities
from ..queries.window import check_pair, context_too_long
from .adapters import Adapters
from .autocast import no_autocast
from .batch_options import BatchOptions
from .compute import ComputeStep
from .inputs import ContextChecker, check_lora, check_positive_int
from ..queries.rows import copy_result, own


class Front(BatchOptions, ComputeStep):
    """Checks, output cache, counters, forward lock and scheduler in front of one runner.

    Args:
        runner: the backend runner (:class:`genback.batching.runner.Runner`).
        vocab_size: the logit width ``V`` (ids must lie in ``[0, V)``).
        max_context_length: most tokens a forward's inputs may have (None: no limit).
        row_cache_size: most next-token rows kept (0 disables the output cache).
        batch_size: most distinct queries per batch (>= 1).
        batch_window: seconds a batch waits for more queries, from its first (finite, >= 0).

    Raises:
        ValueError: an option out of range.
    """

    def __init__(self, runner, *, vocab_size: int, max_context_length: int | None,
                 row_cache_size: int, batch_size: int, batch_window: float):
        self.runner = runner
        self.capabilities: Capabilities = getattr(runner, "capabilities", Capabilities())
        self.vocab_size = vocab_size
        self.max_context_length = max_context_length
        self.contexts = ContextChecker(vocab_size)
        self.cache = OutputCache(row_cache_size)
        self.lock = threading.RLock()  # the forward lock: one runner call at a time
        self.adapters = Adapters(runner, self) if self.capabilities.adapters else None
        size = check_positive_int(batch_size, "batch_size")
        if self.capabilities.batching == "engine":
            Batcher.check_window(batch_window)  # (validated, unused: the engine sizes batches)
            self.scheduler = Immediate(self._answer_one, runner.reset, count=runner.requests)
        else:
            self.scheduler = Batcher(self._compute_owned, window=batch_window,
                                     max_batch_size=size, copy=copy_result)
        self.batched = isinstance(self.scheduler, Batcher)
        # enqueue(key, query): the batcher's future of a counted query's result (what ask
        # awaits), or the engine's coroutine of it (the caller copies a next-token row: owned)
        self.enqueue = self._submit = (self.scheduler.enqueue if self.batched
                                       else self.scheduler.submit)
        self._stats_lock = threading.Lock()
        self.queries = 0
        self.tokens_queried = 0

    # -- checks ---------------------------------------------------------------------------------

    def tokens(self, token_ids, name: str = "token_ids") -> tuple[int, ...]:
        """The checked ids ``token_ids`` as a flat tuple (see :meth:`checked`).

        Raises:
            TypeError / ValueError: bad ids (the message names ``name``), or more tokens than
                ``max_context_length``.
        """
        return self.checked(token_ids, name)[0].tokens

    def checked(self, token_ids, name: str = "token_ids"
                ) -> tuple[Context, int, Context | None]:
        """``(context, context_hash(ids), parent)`` of a checked context, as a
        :class:`~genback.queries.context.Context` (see :meth:`.inputs.ContextChecker.check_context`).

        Raises:
            TypeError / ValueError: as :meth:`tokens`.
        """
        ctx, h, parent = self.contexts.check_context(token_ids, name)
        if self.max_context_length and ctx._n > self.max_context_length:
            raise context_too_long(ctx._n, self.max_context_length, name)
        return ctx, h, parent

    def next_token(self, token_ids, adapter: int | None, name: str = "token_ids") -> NextToken:
        """The :class:`~genback.queries.kinds.NextToken` query of a checked context (its ``context``
        the front's :class:`~genback.queries.context.Context`: no flat tuple is built for it).

        Raises:
            TypeError / ValueError: as :meth:`tokens`.
        """
        ctx, h, parent = self.checked(token_ids, name)
        return NextToken(ctx, adapter, tokens_hash=h, parent=parent, n_tokens=ctx._n)

    def score(self, context_ids, continuation_ids, greedy: bool, adapter: int | None) -> Score:
        """The :class:`~genback.queries.kinds.Score` of a continuation after a context. The window counts
        the forward's inputs, ``context + continuation[:-1]`` (the last token is never an input).

        Raises:
            TypeError / ValueError: bad or empty ids, or inputs longer than the window.
        """
        context = self.tokens(context_ids, "context_ids")
        continuation = self.contexts(continuation_ids, "continuation_ids")
        check_pair(len(context), len(continuation), self.max_context_length)  # (the session's too)
        return Score(context + continuation[:-1], continuation, adapter, greedy=greedy)

    def adapter_key(self, lora_name) -> int | None:
        """The runner's adapter key for ``lora_name`` (None: the base model).

        Raises:
            ValueError: ``lora_name`` is not a registered adapter (or this backend has none).
        """
        if self.adapters is None:
            check_lora(lora_name)
            return None
        return self.adapters.key(lora_name)

    def adapter_error(self, adapter: int | None) -> Exception | None:
        """None when adapter key ``adapter`` can still be computed, else the error for its
        callers (the adapter was removed or replaced: :meth:`.adapters.Adapters.error`)."""
        return None if self.adapters is None else self.adapters.error(adapter)

    def check_adapter(self, adapter: int | None) -> None:
        """Raise :meth:`adapter_error`'s error, if any."""
        error = self.adapter_error(adapter)
        if error is not None:
            raise error

    def check_open(self) -> None:
        """Raises ``BatcherClosed`` once the model is closed."""
        if self.scheduler.closed:
            raise BatcherClosed("the model was closed (aclose); no more queries are served")

    def count(self, n_tokens: int, n_queries: int = 1) -> None:
        with self._stats_lock:
            self.queries += n_queries
            self.tokens_queried += n_tokens

    # -- the path -------------------------------------------------------------------------------

    async def ask(self, query: Query):
        """The result of a checked ``query`` (shared: callers copy what they hand out).

        Raises:
            BatcherClosed: the model was closed or reset while the query waited.
            Exception: the error that fails this query (e.g. its adapter was removed).
        """
        row = self.lookup(query)
        return row if row is not None else await self._submit(query, query)

    def lookup(self, query: Query):
        """The first half of :meth:`ask`, for callers that await the second themselves (no
        coroutine of its own per query): counts ``query`` and returns its cached row, or None
        when it must be computed (then ``await front.submit(query)``).

        Raises:
            BatcherClosed: the model was closed.
        """
        self.check_open()
        self.count(query.n_tokens)
        return self.cache.get(query) if query.cacheable else None

    def next_token_lookup(self, token_ids, lora_name) -> tuple[NextToken, object]:
        """``(query, cached row or None)`` of a next-token query, checked and counted:
        :meth:`next_token` then :meth:`lookup`, in one frame (an SMC step's hot path: each
        call of a query's way in is host work the step's forward waits for, issue 38).

        Raises:
            TypeError / ValueError: as :meth:`next_token`, or an unknown ``lora_name``.
            BatcherClosed: the model was closed.
        """
        adapter = None if lora_name is None else self.adapter_key(lora_name)
        ctx, h, parent = self.contexts.check_context(token_ids, "token_ids")
        n = ctx._n
        if self.max_context_length and n > self.max_context_length:
            raise context_too_long(n, self.max_context_length, "token_ids")
        query = NextToken(ctx, adapter, tokens_hash=h, parent=parent, n_tokens=n)
        if self.scheduler.closed:
            self.check_open()
        with self._stats_lock:  # (count)
            self.queries += 1
            self.tokens_queried += n
        return query, self.cache.get(query)

    def next_token_many(self, contexts: list, lora_name) -> tuple[list[NextToken], list]:
        """``(queries, cached rows or None)`` of ``batch_next_token_logprobs(contexts)``: each
        context checked (as :meth:`next_token_lookup`, one frame for all), then all counted and
        looked up in the output cache, each under one lock.

        Raises:
            TypeError / ValueError: a bad context (the message names ``token_ids_list[i]``), or
                an unknown ``lora_name``.
            BatcherClosed: the model was closed.
        """
        adapter = None if lora_name is None else self.adapter_key(lora_name)
        check, limit = self.contexts.check_context, self.max_context_length
        step = self.contexts.check_step(contexts)
        if step is not None and not (limit and max(step[3]) > limit):  # (an SMC step's)
            checked, hashes, parents, lengths = step
            queries = NextToken.many(checked, adapter, hashes, parents, lengths)
            self.check_open()
            self.count(sum(lengths), len(queries))
            return queries, self.cache.get_many(queries)
        queries = []
        tokens = 0
        try:
            for ids in contexts:
                ctx, h, parent = check(ids)
                n = ctx._n
                if limit and n > limit:
                    raise context_too_long(n, limit, "token_ids")
                queries.append(NextToken(ctx, adapter, tokens_hash=h, parent=parent, n_tokens=n))
                tokens += n
        except (TypeError, ValueError):  # (named again by the context that failed)
            i = len(queries)
            self.checked(contexts[i], f"token_ids_list[{i}]")
            raise
        self.check_open()
        self.count(tokens, len(queries))
        return queries, self.cache.get_many(queries)

    def submit(self, query: Query):
        """The awaitable result of a counted ``query`` that :meth:`lookup` did not find (the
        scheduler's future, or its coroutine for an engine that schedules itself)."""
        return self._submit(query, query)

    def submit_many(self, queries: list[Query]):
        """The awaitable list of results of counted ``queries`` that :meth:`lookup` did not
        find: one future for all (:meth:`genback.batching.batcher.Batcher.enqueue_many`), or a gather of
        :meth:`submit`'s coroutines for an engine that schedules itself. Fails with the first
        failure."""
        if isinstance(self.scheduler, Batcher):
            return self.scheduler.enqueue_many([(q, q) for q in queries])
        return asyncio.gather(*(self.submit(q) for q in queries))

    def ask_sync(self, queries: list[Query]) -> list:
        """Results of checked queries, computed on the calling thread in one batch (a query
        asked twice is computed once; shared, as :meth:`ask`'s: callers copy what they hand
        out).

        Raises:
            Exception: the first query's error, if any failed.
        """
        self.check_open()
        distinct = list(dict.fromkeys(queries))
        for q in distinct:
            self.count(q.n_tokens)
        results = self._compute(distinct)
        for value in results:
            if isinstance(value, BaseException):
                raise value
        if len(distinct) == len(queries):
            return results
        by_query = dict(zip(distinct, results))
        return [by_query[q] for q in queries]

    def pin(self, tokens: tuple[int, ...], adapter: int | None) -> None:
        """Compute and keep the KV of checked ``tokens`` under ``adapter`` (``runner.pin``).

        Raises:
            BatcherClosed: the model is closed. ValueError: the adapter was removed, or as
                the runner's ``pin``.
        """
        self.check_open()
        with self.lock, no_autocast():
            self.check_adapter(adapter)
            self.runner.pin(tokens, adapter)

    def clear(self, rows: bool, keep_pinned: bool) -> None:
        """Drop the cached rows (when ``rows``) and the runner's KV (pinned prompts kept when
        ``keep_pinned``)."""
        if rows:
            self.cache.clear()
        with self.lock:
            self.runner.clear(keep_pinned=keep_pinned)

    def owned(self, row: torch.Tensor) -> torch.Tensor:
        """``row`` as the caller's own tensor, from :meth:`submit`'s result for a next-token
        query: rows from the batcher are copies already (made in its compute step), rows from a
        runner that schedules itself are cloned."""
        if isinstance(self.scheduler, Batcher):
            return row
        return own(row)

    def info(self) -> dict:
        """``cache_info()``: the front's counters, then the runner's ``stats()``."""
        return {
            "queries": self.queries,
            "tokens_queried": self.tokens_queried,
            "row_hits": self.cache.hits,
            "batches": self.scheduler.batches,
            "batched_queries": self.scheduler.queries,
            "rows_cached": len(self.cache),
            "rows_bytes": self.cache.bytes_held,
            **self.runner.stats(),
        }

    def close(self) -> None:
        """Stop the scheduler (pending queries fail), close the runner, drop the rows."""
        self.scheduler.close()
        with self.lock:
            self.runner.close()
        self.cache.clear()
