"""``Immediate``: the scheduler of runners whose engine batches by itself (vLLM): no window and no
batch of genback's; each query goes to the engine at once (the engine batches, prefix-caches and
schedules). :class:`genback.batching.batcher.Batcher` is the scheduler of every other runner."""

from __future__ import annotations

import asyncio
from typing import Any, Hashable

from .batcher import BatcherClosed


class Immediate:
    """The scheduler of runners whose engine batches by itself (``Capabilities.batching ==
    "engine"``, vLLM): each query goes at once to ``answer(query)`` (a coroutine function, safe
    to call from any event loop), with no window and no batch of genback's.

    Args:
        answer: ``async answer(query) -> result``.
        reset: ``reset(message) -> callers failed``: abort everything in flight.
        count: ``count() -> int``, the queries the engine has been sent (reported as batches).
    """

    def __init__(self, answer, reset, *, count=lambda: 0):
        self._answer = answer
        self._reset = reset
        self._count = count
        self.closed = False  # (set by close; read-only to everyone else)

    @property
    def batches(self) -> int:
        return self._count()

    @property
    def queries(self) -> int:
        return self._count()

    async def submit(self, key: Hashable, query: Any) -> Any:
        """The result of ``query`` (identical queries in flight are joined by the engine).

        Raises:
            BatcherClosed: closed, or reset while the query ran.
            Exception: whatever ``answer`` raised.
        """
        if self.closed:
            raise BatcherClosed("the model was closed (aclose); no more queries are served")
        return await self._answer(query)

    def enqueue(self, key: Hashable, query: Any) -> asyncio.Future:
        """Send ``query`` now; return the future of its result (call it on a running loop)."""
        if self.closed:
            raise BatcherClosed("the model was closed (aclose); no more queries are served")
        return asyncio.ensure_future(self._answer(query))

    def pending(self, loop) -> list:
        return []  # nothing waits: every query is in flight at once

    def flush(self, loop) -> None:
        pass

    def reset(self, exc: BaseException | None = None) -> int:
        """Abort every query in flight; its callers get ``BatcherClosed``."""
        return self._reset(str(exc) if exc is not None
                           else "pending queries were reset (reset_async_queries)")

    def close(self) -> None:
        self.closed = True
