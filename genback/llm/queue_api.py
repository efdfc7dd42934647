"""genlm-backend 0.3.1's queue hooks on ``AsyncLM``: ``add_query``, ``queries``,
``batch_evaluate_queries``.

genlm-backend exposes its batching queue; clients and its tests drive it by hand. genback's queue
is the front's scheduler (:class:`~genback.batcher.Batcher`), so these hooks are thin views of it: a query
added here joins the same pending batch as ``await next_token_logprobs`` (same row cache, same
dispatch rules), and ``reset_async_queries`` / ``aclose`` fail it like any other.
"""

from __future__ import annotations

import asyncio


class QueueHooks:
    """Mixed into :class:`~genback.llm.AsyncLM`."""

    def add_query(self, query, future: asyncio.Future, past=None, lora_name=None) -> None:
        """Queue the next-token query ``query`` (token ids) and resolve ``future`` with its row
        (float32 CPU ``[V]``) or its error. Call it on the thread of ``future``'s running loop.

        ``past`` (genlm-backend's precomputed KV) is ignored: the runner finds cached KV itself.

        Raises:
            TypeError / ValueError: bad ``query`` or ``lora_name`` (``future`` is left alone).
            RuntimeError: no running event loop on this thread.
        """
        adapter = self._lora_key(lora_name)
        q = self.front.next_token(query, adapter, "query")
        self.front.check_open()
        asyncio.get_running_loop()  # RuntimeError outside a running loop
        row = self.front.cache.get(q)
        if row is not None:
            self.front.count(len(q.tokens))
            if not future.done():
                future.set_result(row.clone())
            return
        inner = self.front.enqueue(q)

        def relay(done: asyncio.Future) -> None:
            if future.done():
                return
            if done.cancelled():
                future.cancel()
            elif done.exception() is not None:
                future.set_exception(done.exception())
            else:
                future.set_result(done.result().clone())

        inner.add_done_callback(relay)

    @property
    def queries(self) -> list:
        """The queries (:class:`~genback.query.Query`) waiting in the running loop's pending
        batch; ``[]`` outside a running loop. Assigning ``[]`` fails them (as
        :meth:`reset_async_queries`); other values are a ``ValueError``."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return []
        return self.front.scheduler.pending(loop)

    @queries.setter
    def queries(self, value) -> None:
        if not isinstance(value, (list, tuple)) or len(value) != 0:
            raise ValueError(f"queries can only be set to [] (failing pending queries), got "
                             f"{value!r}")
        self.reset_async_queries()

    def batch_evaluate_queries(self) -> None:
        """Dispatch the running loop's pending batch now rather than at the end of its window;
        a no-op outside a running loop (nothing can be pending there)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self.front.scheduler.flush(loop)
