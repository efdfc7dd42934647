"""``QueryFuture``: the awaitable a query's caller gets from genback's batcher, handed out as it is.

``await lm.next_token_logprobs(ids)`` needs an awaitable, not a coroutine. When
``next_token_logprobs`` was a coroutine function, a step of ``asyncio.gather(*(lm.next_token_logprobs(p)
for p in particles))`` wrapped each query's coroutine in a task of its own: created, stepped once to
queue the query, woken when its row was ready, stepped again to return it. A future needs none of
that: ``gather`` (``asyncio.ensure_future``), ``await``, ``asyncio.wait_for``, ``asyncio.wait`` and
``asyncio.shield`` take it directly, and the batcher's answer resolves it. Measured on this project's
CPU (Python 3.11, one core, 256 queries gathered per step, each answered by one callback): 5.5 µs a
query through a coroutine, 1.6 µs through the future itself (``benchmarks/RESULTS.md``, "Issue 38,
part 3 (CPU), fifth pass").

What still wants a coroutine is served too: :class:`QueryFuture` has the coroutine protocol
(``send``, ``throw``, ``close``; :class:`collections.abc.Coroutine` recognises it, so
``asyncio.iscoroutine`` is true), so ``asyncio.create_task(lm.next_token_logprobs(ids))`` works as
before: the task's first step yields the future (the protocol by which a task waits on a future,
``_asyncio_future_blocking``, as :meth:`asyncio.Future.__await__` does) and its next step returns the
future's result or raises its error. Cancelling such a task cancels the future, which the batcher
then leaves out of its batch (as it does a cancelled caller's future).
"""

from __future__ import annotations

import asyncio


class QueryFuture(asyncio.Future):
    """An :class:`asyncio.Future` of one caller's result that also runs as a coroutine (see the
    module's docstring): ``send(None)`` yields the future itself while it is pending and, once it
    is done, raises ``StopIteration(result)`` or the future's error."""

    __slots__ = ()

    def send(self, value):
        if not self.done():
            self._asyncio_future_blocking = True  # (a task waits on what its coroutine yields)
            return self
        raise StopIteration(self.result())  # (result() raises the error, or CancelledError)

    def throw(self, typ, val=None, tb=None):
        """Raise the error a task throws in (its cancellation, or the awaited future's error);
        a cancellation also cancels this future (a task cancelled before its first step never
        waited on it), so the batcher leaves the query out."""
        if val is None:
            val = typ() if isinstance(typ, type) else typ
        if isinstance(val, asyncio.CancelledError):
            self.cancel()
        raise val.with_traceback(tb) if tb is not None else val

    def close(self) -> None:
        """Nothing to release (a coroutine's ``close``)."""


def done_future(loop: asyncio.AbstractEventLoop, result) -> QueryFuture:
    """A :class:`QueryFuture` of ``loop`` done with ``result``."""
    future = QueryFuture(loop=loop)
    future.set_result(result)
    return future


def failed_future(loop: asyncio.AbstractEventLoop, error: BaseException) -> QueryFuture:
    """A :class:`QueryFuture` of ``loop`` failed with ``error`` (raised where it is awaited)."""
    future = QueryFuture(loop=loop)
    future.set_exception(error)
    return future
