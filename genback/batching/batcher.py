"""Auto-batching of concurrent queries into one computation on a worker thread.

Callers on any event loop ``await batcher.submit(key, query)``. Queries join a pending batch;
the batch is dispatched when

* the *window* (seconds, measured from the first pending query and never reset by later ones)
  has expired, or
* the batch is full: ``max_batch_size`` queries, or
* the *cohort* is in: the event loop has run every callback that was ready when a query joined
  (each caller that could query by then has), and the batch has at least as many callers as
  the larger of that loop's last two batches had. Callers that step in lockstep (SMC particles,
  a decoding loop, a ``gather`` per step) come back as many as their last batch had, so their
  batch goes at once instead of idling for the rest of the window (2 ms per step by default:
  13 % of a 15 ms GPU forward). A batch with fewer callers waits for its window as before.
  (Callers, not distinct queries: resampled particles repeat contexts, and the number of
  distinct ones varies from step to step.)

and, in all cases, only once the previous batch of that loop has finished: while the worker
computes, new queries keep joining the next batch (so batches grow under load instead of queueing).

The computation runs on one worker thread, so the event loop keeps serving while the model runs;
but a batch that goes because its cohort is in runs on that event loop's own thread
(``inline_cohort``, on by default): every caller of the loop that asks in lockstep is waiting
for it, so the loop has nothing to serve meanwhile, and the two thread hand-offs (waking the
worker, then the loop) leave the step's critical path. Batches that go for their window or
because they are full still run on the worker.
Queries with an identical ``key`` in one pending batch are computed once and every caller gets the
result. A computation that raises fails exactly the callers of its batch; a result that is an
exception instance fails exactly the callers of that query. A caller cancelled before
its batch is dispatched is dropped and not computed. Each event loop that uses the batcher gets its
own pending batch, so one object serves ``asyncio.run`` after ``asyncio.run``.

The batcher decides only *when* a batch goes. How much work a batch is, and how it is split into
forwards that fit in memory, is the runner's decision (:mod:`genback.batching.runner`): only the runner
knows what is cached. Pending state is guarded by a lock, so ``reset`` is safe from any thread.
"""

from __future__ import annotations

import asyncio
import math
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Hashable, Sequence

from ..cpython import held_inline, hold_collections, release
from .pending import (Bulk, Entry, LoopState, fail_entries, fail_threadsafe,
                      release_closed_holds)
from .groups import Member, QueryGroup


class BatchAbandoned(RuntimeError):
    """A pending query's batch was given up before it was computed (genlm-backend's name; catch
    it to handle every such failure)."""


class BatcherClosed(BatchAbandoned):
    """Raised to callers of a batcher that was closed or reset (a :class:`BatchAbandoned`)."""


class Batcher:
    """Batch concurrent queries and compute them on a worker thread (a batch whose cohort is in:
    on the event loop's thread, when ``inline_cohort``; and with ``defer_collections``, which
    ``AsyncTransformer`` sets for a CUDA model, no young garbage collection while such a batch is
    pending: :mod:`genback.cpython`, trick 4).

    Args:
        compute: ``compute(queries) -> results``, called on the worker thread with a list of the
            distinct queries of one batch; returns one result per query, in order.
        window: seconds to wait, from the first pending query, for more queries (finite, >= 0).
        max_batch_size: most distinct queries per batch (>= 1).
        name: name of the worker thread.
        copy: ``copy(result) -> result`` for the second and later callers of one query (the
            same context asked twice in a batch is computed once): each gets its own copy, the
            first caller the result itself. None: every caller gets the same object.
        inline_cohort: run a batch that goes because its cohort is in on the event loop's
            thread (False: every batch on the worker thread).

    Raises:
        ValueError: a non-positive ``max_batch_size`` or a negative, infinite or NaN ``window``.
    """

    def __init__(
        self,
        compute: Callable[[list[Any]], Sequence[Any]],
        *,
        window: float,
        max_batch_size: int,
        name: str = "genback-batcher",
        copy: Callable[[Any], Any] | None = None,
        inline_cohort: bool = True,
    ):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) \
                or max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
        self._compute = compute
        self._copy = copy
        self.inline_cohort = bool(inline_cohort)
        self.defer_collections = False
        self.window = self.check_window(window)
        self.max_batch_size = max_batch_size
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._states: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopState]" = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self._last: tuple | None = None  # (loop, its state): the loop that enqueued last
        self.closed = False  # (set by close; read-only to everyone else)
        self.batches = 0  # dispatched batches
        self.inline_batches = 0  # of which run on the event loop's thread (inline_cohort)
        self.queries = 0  # distinct queries computed

    @staticmethod
    def check_window(window) -> float:
        """``window`` as a float, or ``ValueError`` unless it is a finite number >= 0."""
        if isinstance(window, bool) or not isinstance(window, (int, float)) \
                or not math.isfinite(window) or window < 0:
            raise ValueError(f"batch_window must be a finite number >= 0 seconds, got {window!r}")
        return float(window)

    # -- public ---------------------------------------------------------------------------------

    async def submit(self, key: Hashable, query: Any) -> Any:
        """Queue ``query`` and wait for its result.

        Raises:
            BatcherClosed: the batcher was closed, or reset while the query was pending.
            Exception: whatever ``compute`` raised for this query's batch.
        """
        return await self.enqueue(key, query)

    def enqueue(self, key: Hashable, query: Any) -> asyncio.Future:
        """Queue ``query`` now (call it on a running event loop's thread); return the future of
        its result (a plain :class:`asyncio.Future` of the loop: the caller's coroutine awaits
        it, :mod:`genback.batching.futures`), which fails as :meth:`submit` raises; cancelling it
        drops the query unless another caller waits for it."""
        loop, state = self._open_state()
        future = loop.create_future()
        with self._lock:
            self._add(state, loop, key, query, future)
            ready, check = self._decide(state)
        if ready or check:  # (mostly neither: the batch's first query queued its check)
            self._after_add(state, loop, ready, check)
        return future

    def enqueue_many(self, items: Sequence[tuple[Hashable, Any]]) -> asyncio.Future:
        """Queue the ``(key, query)`` pairs of ``items`` at once, as one caller
        of each: return one future of the list of their results, in order (no future, and no
        wake-up, per query). It fails with the first failure among them (the others are still
        computed); cancelling it drops those of its queries that nobody else waits for."""
        loop, state = self._open_state()
        group = QueryGroup(loop.create_future(), len(items))
        if not items:
            group.future.set_result([])
            return group.future
        with self._lock:
            if not state.pending and len(items) <= self.max_batch_size:  # (a step: one entry)
                state.add_bulk(Bulk(items, group), self.window == 0, loop.time(),
                               self.defer_collections and self.inline_cohort)
            else:
                for i, (key, query) in enumerate(items):
                    self._add(state, loop, key, query, Member(group, i))
            ready, check = self._decide(state)
        if ready or check:
            self._after_add(state, loop, ready, check)
        return group.future

    def _open_state(self) -> tuple[asyncio.AbstractEventLoop, LoopState]:
        if self.closed:
            raise BatcherClosed("the model was closed (aclose); no more queries are served")
        loop = asyncio.get_running_loop()
        last = self._last  # (one read: the pair is replaced whole, never mutated)
        return loop, (last[1] if last is not None and last[0] is loop else self._state(loop))

    def _add(self, state: LoopState, loop, key: Hashable, query: Any, sink) -> None:
        """Join ``query`` (its caller's ``sink``: a future or a group's member) to ``state``'s
        pending batch; under the lock."""
        state.callers += 1
        pending = state.pending
        if not pending:  # (its window's timer is armed only if no cohort check sends it: _arm)
            state.window_expired, state.opened = self.window == 0, loop.time()
            if self.defer_collections and self.inline_cohort and state.gc_hold is None:
                state.gc_hold = hold_collections()
        elif state.bulk is not None and state.bulk.join(key, sink):  # (asked by a step's call)
            return
        entry = pending.setdefault(key, new := Entry(query, sink))  # (one hash of a new key)
        if entry is not new and entry.live():
            entry.waiters.append(sink)
        elif entry is not new:  # a replaced entry had only cancelled callers
            pending[key] = new

    def _decide(self, state: LoopState) -> tuple[bool, bool]:
        """``(ready, check)`` after queries joined: the batch can go now; a cohort check is to
        be queued (then marked queued). Under the lock."""
        ready = state.window_expired or state.size() >= self.max_batch_size
        check = not ready and not state.check_queued and state.sizes[1] > 0
        if check:
            state.check_queued = True
        elif not ready and not state.check_queued:  # (no check will look at it: the window)
            self._arm(state)
        return ready, check

    def _arm(self, state: LoopState) -> None:
        """Start the pending batch's window timer (ending ``window`` after ``LoopState.opened``)
        unless it runs or the window is over; armed when no cohort check is queued or one found
        the cohort not in, so a lockstep step never makes one (``call_at`` and ``cancel``: ~1.5
        % of a 16-particle step's host time, ``bench_host.py``). Under the lock, loop thread."""
        if state.timer is None and not state.window_expired and state.pending:
            state.timer = state.loop.call_at(state.opened + self.window, self._on_window, state)

    def _after_add(self, state: LoopState, loop, ready: bool, check: bool) -> None:
        if ready:  # (otherwise the window's timer, the cohort check or the running batch's end)
            self._maybe_dispatch(state)
        elif check:  # runs once every callback ready now has run (each caller that could query)
            loop.call_soon(self._check_cohort, state)

    def reset(self, exc: BaseException | None = None) -> int:
        """Fail every pending (not yet dispatched) query with ``exc``; return how many callers.

        Batches already on the worker finish normally. Safe to call from any thread.
        """
        exc = exc or BatcherClosed("pending queries were reset (reset_async_queries)")
        failed = 0
        with self._lock:
            states = list(self._states.values())
            taken = []
            for state in states:
                entries = list(state.pending.values())
                state.pending.clear()
                state.bulk, state.extra = None, 0
                state.callers = 0
                release(state.take_hold())
                # a timer left running only dispatches an (empty or newer) batch early
                taken.append((state, [f for e in entries for f in e.waiters]))
        for state, futures in taken:
            failed += sum(not f.done() for f in futures)
            fail_threadsafe(state.loop, futures, exc)
        return failed

    def pending(self, loop: asyncio.AbstractEventLoop) -> list:
        """The queries waiting in ``loop``'s pending batch (not yet dispatched), oldest first."""
        with self._lock:
            state = self._states.get(loop)
            return [] if state is None else state.live_queries()

    def flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """Dispatch ``loop``'s pending batch now instead of at the end of its window (it still
        waits for that loop's running batch, if any). Call it on ``loop``'s thread."""
        with self._lock:
            state = self._states.get(loop)
            if state is None:
                return
            state.window_expired = True
        self._maybe_dispatch(state)

    def close(self) -> None:
        """Fail pending queries and stop the worker (waits for the running batch). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.reset(BatcherClosed("the model was closed (aclose) while this query was pending"))
        self._executor.shutdown(wait=True)

    # -- internals ------------------------------------------------------------------------------

    def _state(self, loop: asyncio.AbstractEventLoop) -> LoopState:
        with self._lock:
            state = self._states.get(loop)
            if state is None:
                state = self._states[loop] = LoopState(loop)
                release_closed_holds(self._states.values())
            self._last = (loop, state)
            return state

    def _check_cohort(self, state: LoopState) -> None:
        with self._lock:
            state.check_queued = False
            if not state.cohort_in():
                self._arm(state)  # (a later query queues another check; the window runs)
                return
            state.window_expired = True  # (its wait is over: dispatch now, or when not busy)
        self._maybe_dispatch(state, cohort=True)

    def _on_window(self, state: LoopState) -> None:
        with self._lock:
            state.timer = None
            state.window_expired = True
        self._maybe_dispatch(state)

    def _maybe_dispatch(self, state: LoopState, cohort: bool = False) -> None:
        """Dispatch ``state``'s pending batch if it may go now. ``cohort``: called on the
        loop's thread because the batch's cohort is in (then it runs there, when
        ``inline_cohort``)."""
        with self._lock:
            if state.busy or not state.pending:
                return
            if not (state.window_expired or state.size() >= self.max_batch_size):
                return
            batch = state.take_batch(self.max_batch_size)
            hold, state.gc_hold = state.gc_hold, None  # (take_hold inline: a call less a step)
            if not batch:
                return release(hold)
            state.busy = True
            callers = sum([len(e.waiters) for e in batch])
            state.callers = max(0, state.callers - callers) if state.pending else 0
            state.sizes = (state.sizes[1], callers)
        self.batches += 1
        self.queries += len(batch) if type(batch[0]) is not Bulk else (
            len(batch) - 1 + len(batch[0].queries))
        if cohort and self.inline_cohort:
            self.inline_batches += 1
            self._run_inline(state, batch, hold)
            return
        release(hold)  # (the worker's batch: the loop's thread is free again)
        try:
            self._executor.submit(self._work, state, batch)
        except RuntimeError as exc:  # executor shut down
            state.busy = False
            fail_entries(batch, BatcherClosed(str(exc)))

    def _outcome(self, batch: list[Entry]) -> tuple:
        """``(results, None)`` of computing ``batch``, or ``(None, error)``: what it raised, which
        fails exactly this batch's callers."""
        try:
            if type(batch[0]) is Bulk:  # (a step's call: its queries, then any other's)
                return self._compute(batch[0].queries + [e.query for e in batch[1:]]), None
            return self._compute([e.query for e in batch]), None
        except BaseException as e:
            return None, e

    def _work(self, state: LoopState, batch: list[Entry]) -> None:
        """The worker thread's part: compute the batch and hand the outcome to the loop's
        thread in one ``call_soon_threadsafe`` (``run_in_executor``'s future chained to an
        asyncio future took one more turn of the loop: ~15-25 µs more per batch, median of 600
        one-query steps on this project's CPU)."""
        results, exc = self._outcome(batch)
        try:
            state.loop.call_soon_threadsafe(self._finish, state, batch, results, exc)
        except RuntimeError:  # the loop was closed meanwhile: nobody is left to answer
            pass

    def _run_inline(self, state: LoopState, batch: list[Entry], hold=None) -> None:
        """Compute ``batch`` (``hold``: its hold on young collections) on the loop's thread and
        answer its callers (as :meth:`_work` and :meth:`_finish` do on the two threads). A
        ``KeyboardInterrupt`` or ``SystemExit`` fails the batch's callers, then goes on up."""
        if hold is None:
            results, exc = self._outcome(batch)
        else:
            with held_inline(hold):
                results, exc = self._outcome(batch)
        self._finish(state, batch, results, exc)
        if exc is not None and not isinstance(exc, Exception):
            raise exc

    def _finish(self, state: LoopState, batch: list[Entry], results, exc) -> None:
        if exc is not None:
            fail_entries(batch, exc)
        else:
            expected = len(batch) if type(batch[0]) is not Bulk else (
                len(batch) - 1 + len(batch[0].queries))
            if len(results) != expected:
                fail_entries(batch, RuntimeError(
                    f"batch computation returned {len(results)} results for {expected} queries"
                ))
            else:
                copy = self._copy
                if type(batch[0]) is Bulk:  # (a step's call: answered as one)
                    k = len(batch[0].queries)
                    batch[0].answer(results if k == len(results) else results[:k], copy)
                    batch, results = batch[1:], results[k:]
                for entry, result in zip(batch, results):
                    failed = isinstance(result, BaseException)  # fails this query only
                    first = True
                    for f in entry.waiters:
                        if f.done():  # (cancelled)
                            continue
                        if failed:
                            f.set_exception(result)
                        else:
                            f.set_result(result if first or copy is None else copy(result))
                            first = False
        # the batch stays "busy" until the callers just answered have run (their wake-ups were
        # queued first): their next queries join what is pending, so callers that step in
        # lockstep (decoding requests, particles) stay in one batch instead of two cohorts
        state.loop.call_soon(self._release, state)

    def _release(self, state: LoopState) -> None:
        with self._lock:
            state.busy = False
            cohort = state.cohort_in()
            if cohort:  # the callers just answered are back with their next queries
                state.window_expired = True
        self._maybe_dispatch(state, cohort)

