"""``AsyncTokenCharacterTrie``: concurrent ``await weight_sum(ws)`` calls batched on a worker thread.

Requests are batched by genback's shared :class:`~genback.batching.batcher.Batcher` (the one every
``AsyncLM`` uses): requests made in the same event-loop iteration join one batch (up to
``max_batch``), computed with one ``batch_weight_*`` call per operation on the batcher's worker
thread, so the event loop keeps running while the trie reduces (a lockstep batch, whose callers
are all waiting for it, on the loop's own thread: the batcher's ``inline_cohort``). Each
request's weights are validated (type, dtype, shape) when it is submitted: a bad request raises at once in its caller
and never joins a batch. If a batch still fails (e.g. a NaN weight, detected during the
reduction), its requests are computed one by one and exactly the offending callers get the
error; every caller's future is resolved (the batcher fails exactly the callers of a failed
computation), and the trie keeps serving.

One object may serve several event loops in turn (clients call ``asyncio.run`` repeatedly).
"""

from __future__ import annotations

import itertools
import threading

from ..batching.batcher import Batcher
from .base import TokenCharacterTrie
from .parallel import ParallelTokenCharacterTrie
from .weights import as_weight_matrix

__all__ = ["AsyncTokenCharacterTrie"]

_OPS = ("sum", "max", "logsumexp")
_WINDOW = 0.001  # seconds: lets the requests of one event-loop iteration join one batch


class AsyncTokenCharacterTrie:
    """Batching asynchronous front end of a ``TokenCharacterTrie`` / ``ParallelTokenCharacterTrie``.

    Args:
        trie: the trie that computes (attribute ``.trie``).
        max_batch: most requests per batch and ``batch_weight_*`` call (>= 1).

    ``await weight_sum(ws)`` / ``weight_max`` / ``weight_logsumexp`` take ``ws`` of shape ``(V,)``
    and return what ``trie.weight_*`` returns (a float64 numpy array for ``TokenCharacterTrie``;
    a tensor on the trie's device for ``ParallelTokenCharacterTrie``).

    Raises:
        TypeError: ``trie`` is not a trie. ValueError: ``max_batch`` is not a positive int.
    """

    def __init__(self, trie, max_batch: int = 64):
        if not isinstance(trie, TokenCharacterTrie):
            raise TypeError(f"AsyncTokenCharacterTrie: trie must be a TokenCharacterTrie, got {type(trie).__name__}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"AsyncTokenCharacterTrie: max_batch must be a positive int, got {max_batch!r}")
        self.trie = trie
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._batcher: Batcher | None = None
        self._ids = itertools.count()  # every request is its own batch entry (weights differ)
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
        return await self.start().submit(next(self._ids), (op, prepared))

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
    def start(self) -> Batcher:
        """Start the worker (the batcher and its thread) if it is not running; return it.
        Requests start it themselves; calling it is never required. Idempotent."""
        with self._lock:
            if self._batcher is None or self._batcher.closed:
                self._batcher = Batcher(self._compute_batch, window=_WINDOW,
                                        max_batch_size=self.max_batch, name="genback-trie")
            return self._batcher

    def _compute(self, op: str, rows: list):
        if isinstance(self.trie, ParallelTokenCharacterTrie):
            import torch

            W = torch.cat(rows, dim=0)
        else:
            import numpy as np

            W = np.concatenate(rows, axis=0)
        self.batches_run += 1
        return getattr(self.trie, f"batch_weight_{op}")(W)

    def _compute_batch(self, requests: list) -> list:
        """Worker thread: one ``batch_weight_*`` call per operation; a failing call is redone
        request by request, and a request that fails alone gets its exception as its result
        (the batcher raises it to that caller only)."""
        results: list = [None] * len(requests)
        for op in _OPS:
            idx = [i for i, (o, _) in enumerate(requests) if o == op]
            if not idx:
                continue
            try:
                out = self._compute(op, [requests[i][1] for i in idx])
                for k, i in enumerate(idx):
                    results[i] = out[k]
            except Exception:
                for i in idx:
                    try:
                        results[i] = self._compute(op, [requests[i][1]])[0]
                    except Exception as exc:  # noqa: BLE001 - handed to its caller
                        results[i] = exc
        return results

    # ----------------------------------------------------------------- lifecycle
    async def cleanup(self) -> None:
        """Finish the batch already computing, then stop the worker thread (requests still
        pending fail with ``BatcherClosed``). Idempotent; the object stays usable (a later
        request starts a new worker)."""
        import asyncio

        with self._lock:
            batcher, self._batcher = self._batcher, None
        if batcher is not None:
            await asyncio.to_thread(batcher.close)

    def shutdown(self) -> None:
        """Stop the worker: pending requests fail with ``BatcherClosed``; waits for a batch
        already computing. Idempotent; a later request starts a new worker."""
        with self._lock:
            batcher, self._batcher = self._batcher, None
        if batcher is not None:
            batcher.close()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"AsyncTokenCharacterTrie({self.trie!r}, max_batch={self.max_batch})"
