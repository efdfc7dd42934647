"""A caller's several queries awaited as one: :meth:`genback.batching.batcher.Batcher.enqueue_many`.

A step submitted as one call (``batch_next_token_logprobs``: N contexts, one ``[N, V]`` tensor)
needs no future, no task and no wake-up per query: each query's list of callers in the batcher
holds a :class:`Member` of the call's :class:`QueryGroup`, which answers as a future does, and the
group's one future resolves when its last result is in.
"""

from __future__ import annotations

import asyncio


class QueryGroup:
    """One caller's ``n`` queries: one ``future`` of the list of their results, in order,
    resolved when the last arrives; failed at the first failure (the rest are computed and
    dropped)."""

    __slots__ = ("future", "results", "left")

    def __init__(self, future: asyncio.Future, n: int):
        self.future = future
        self.results: list = [None] * n
        self.left = n


class Member:
    """A group's place in a query's list of callers: answers as a future does (``done``,
    ``set_result``, ``set_exception``), into its group."""

    __slots__ = ("group", "index")

    def __init__(self, group: QueryGroup, index: int):
        self.group = group
        self.index = index

    def done(self) -> bool:
        return self.group.future.done()

    def set_result(self, value) -> None:
        group = self.group
        group.results[self.index] = value
        group.left -= 1
        if group.left == 0 and not group.future.done():
            group.future.set_result(group.results)

    def set_exception(self, exc: BaseException) -> None:
        if not self.group.future.done():
            self.group.future.set_exception(exc)
