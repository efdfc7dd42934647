"""``AsyncTokenCharacterTrie``: concurrent ``await weight_sum(ws)`` calls batched on a worker thread.

Requests made in the same event-loop iteration are collected (up to ``max_batch`` per batch and
operation) and computed with one ``batch_weight_*`` call on a single worker thread, so the event
loop keeps running while the trie reduces. Each request's weights are validated (type, dtype,
shape) when it is submitted: a bad request raises at once in its caller and never joins a batch.
If a batch still fails (e.g. a NaN weight, detected during the reduction), its requests are
retried one by one, so only the offending caller gets the error; the trie keeps serving.

One object may serve several event loops in turn (clients call ``asyncio.run`` repeatedly): the
pending queue belongs to the loop that is running when a request arrives.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from .base import TokenCharacterTrie
from .parallel import ParallelTokenCharacterTrie
from .weights import as_weight_matrix

__all__ = ["AsyncTokenCharacterTrie"]

_OPS = ("sum", "max", "logsumexp")


class AsyncTokenCharacterTrie:
    """Batching asynchronous front end of a ``TokenCharacterTrie`` / ``ParallelTokenCharacterTrie``.

    Args:
        trie: the trie that computes (attribute ``.trie``).
        max_batch: most requests per ``batch_weight_*`` call (>= 1).

    ``await weight_sum(ws)`` / ``weight_max`` / ``weight_logsumexp`` take ``ws`` of shape ``(V,)``
    and return what ``trie.weight_*`` returns (a float64 numpy array for ``TokenCharacterTrie``;
    a tensor on the trie's device for ``ParallelTokenCharacterTrie``).
    """

    def __init__(self, trie, max_batch: int = 64):
        if not isinstance(trie, TokenCharacterTrie):
            raise TypeError(f"AsyncTokenCharacterTrie: trie must be a TokenCharacterTrie, got {type(trie).__name__}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"AsyncTokenCharacterTrie: max_batch must be a positive int, got {max_batch!r}")
        self.trie = trie
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list = []  # (op, prepared weights, future)
        self._flush_scheduled = False
        self._inflight: set = set()
        self.batches_run = 0  # number of batch_weight_* calls made (for monitoring / tests)

    @classmethod
    def from_vocab(cls, vocab, backend: str = "parallel", max_batch: int = 64, **kwargs):
        """Build the trie of ``vocab`` and wrap it.

        Args:
            vocab: vocabulary items (``list[Token]`` from ``decode_vocab``).
            backend: ``"parallel"`` (``ParallelTokenCharacterTrie``; ``kwargs`` such as ``device``
                go to it) or ``"sequential"`` (``TokenCharacterTrie``).

        Raises:
            ValueError: unknown ``backend``.
        """
        if backend == "sequential":
            trie = TokenCharacterTrie(vocab, **kwargs)
        elif backend == "parallel":
            trie = ParallelTokenCharacterTrie(vocab, **kwargs)
        else:
            raise ValueError(f"AsyncTokenCharacterTrie: backend must be 'sequential' or 'parallel', got {backend!r}")
        return cls(trie, max_batch=max_batch)

    # ----------------------------------------------------------------- requests
    def _prepare(self, ws):
        if isinstance(self.trie, ParallelTokenCharacterTrie):
            return self.trie._as_device_matrix(ws, "ws", batched=False)
        return as_weight_matrix(ws, self.trie.num_tokens, "ws", batched=False, where="AsyncTokenCharacterTrie")

    async def _submit(self, op: str, ws):
        prepared = self._prepare(ws)  # raises here, in the caller, for a bad request
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new event loop: requests of a finished loop are gone
            self._loop, self._pending, self._flush_scheduled = loop, [], False
        fut = loop.create_future()
        self._pending.append((op, prepared, fut))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return await fut

    async def weight_sum(self, ws):
        """Queued ``trie.weight_sum(ws)``: ``(V,)`` -> ``(num_nodes,)``. Raises as the trie does."""
        return await self._submit("sum", ws)

    async def weight_max(self, ws):
        """Queued ``trie.weight_max(ws)``: ``(V,)`` -> ``(num_nodes,)``."""
        return await self._submit("max", ws)

    async def weight_logsumexp(self, ws):
        """Queued ``trie.weight_logsumexp(ws)``: ``(V,)`` -> ``(num_nodes,)``."""
        return await self._submit("logsumexp", ws)

    # ----------------------------------------------------------------- batching
    def _get_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genback-trie")
            return self._executor

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = [r for r in self._pending if not r[2].done()], []
        for op in _OPS:
            group = [r for r in pending if r[0] == op]
            for lo in range(0, len(group), self.max_batch):
                task = asyncio.ensure_future(self._run_batch(op, group[lo : lo + self.max_batch]))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)

    def _compute(self, op: str, rows: list):
        if isinstance(self.trie, ParallelTokenCharacterTrie):
            import torch

            W = torch.cat(rows, dim=0)
        else:
            import numpy as np

            W = np.concatenate(rows, axis=0)
        self.batches_run += 1
        return getattr(self.trie, f"batch_weight_{op}")(W)

    async def _run_batch(self, op: str, batch: list) -> None:
        loop = asyncio.get_running_loop()
        rows = [w for _, w, _ in batch]
        try:
            result = await loop.run_in_executor(self._get_executor(), self._compute, op, rows)
        except Exception:
            if len(batch) == 1:
                result = None
            else:  # isolate the failing request(s): retry one by one
                await asyncio.gather(*(self._run_batch(op, [r]) for r in batch))
                return
            try:
                await loop.run_in_executor(self._get_executor(), self._compute, op, rows)
            except Exception as e:
                if not batch[0][2].done():
                    batch[0][2].set_exception(e)
            return
        for i, (_, _, fut) in enumerate(batch):
            if not fut.done():
                fut.set_result(result[i])

    # ----------------------------------------------------------------- lifecycle
    async def cleanup(self) -> None:
        """Finish the batches already started, then stop the worker thread. Idempotent; the
        object stays usable (a later request starts a new worker)."""
        if self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)

    def shutdown(self) -> None:
        """Stop the worker thread without waiting and cancel requests not yet started. Idempotent."""
        pending, self._pending = self._pending, []
        for _, _, fut in pending:
            loop = fut.get_loop()
            if not fut.done() and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(fut.cancel)
                except RuntimeError:  # loop closed meanwhile
                    pass
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"AsyncTokenCharacterTrie({self.trie!r}, max_batch={self.max_batch})"
