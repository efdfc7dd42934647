"""``QueueAPI``: genlm-backend 0.3.1's queue hooks, a part of ``AsyncLM`` (``lm.queue``):
``add_query``, ``queries``, ``batch_evaluate_queries``.

genlm-backend exposes its batching queue; clients and its tests drive it by hand. genback's queue
is the front's scheduler (:class:`~genback.batching.batcher.Batcher`), so these hooks are thin views of it: a query
added here joins the same pending batch as ``await next_token_logprobs`` (same row cache, same
dispatch rules), and ``reset_async_queries`` / ``aclose`` fail it like any other.
"""

from __future__ import annotations

import asyncio

from ..queries.rows import own


class QueueAPI:
    """The queue hooks of :class:`~genback.llm.AsyncLM` over its front's public methods.

    Args:
        front: the model's :class:`~genback.core.front.Front`.
    """

    def __init__(self, front):
        self.front = front

    def add_query(self, query, future: asyncio.Future, past=None, lora_name=None) -> None:
        """Queue the next-token query ``query`` (token ids) and resolve ``future`` with its row
        (float32 ``[V]``, where :meth:`~genback.core.lm.AsyncLM.next_token_logprobs` puts it)
        or its error. Call it on the thread of ``future``'s running loop.

        ``past`` (genlm-backend's precomputed KV) is ignored: the runner finds cached KV itself.

        Raises:
            TypeError / ValueError: bad ``query`` or ``lora_name`` (``future`` is left alone).
            RuntimeError: no running event loop on this thread.
        """
        front = self.front
        q = front.next_token(query, front.adapter_key(lora_name), "query")
        front.check_open()
        asyncio.get_running_loop()  # RuntimeError outside a running loop
        row = front.lookup(q)
        if row is not None:
            if not future.done():
                future.set_result(own(row))
            return
        inner = asyncio.ensure_future(front.submit(q))

        def relay(done: asyncio.Future) -> None:
            if future.done():
                return
            if done.cancelled():
                future.cancel()
            elif done.exception() is not None:
                future.set_exception(done.exception())
            else:
                future.set_result(front.owned(done.result()))

        inner.add_done_callback(relay)

    def pending(self) -> list:
        """The queries (:class:`~genback.queries.kinds.Query`) waiting in the running loop's pending
        batch; ``[]`` outside a running loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return []
        return self.front.scheduler.pending(loop)

    def set_pending(self, value) -> None:
        """Assigning ``[]`` to ``lm.queries``: fail every pending query (as
        ``reset_async_queries``).

        Raises:
            ValueError: any other value.
        """
        if not isinstance(value, (list, tuple)) or len(value) != 0:
            raise ValueError(f"queries can only be set to [] (failing pending queries), got "
                             f"{value!r}")
        self.front.scheduler.reset()

    def batch_evaluate_queries(self) -> None:
        """Dispatch the running loop's pending batch now rather than at the end of its window;
        a no-op outside a running loop (nothing can be pending there)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self.front.scheduler.flush(loop)
