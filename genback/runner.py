"""The runner protocol: *what* a backend computes, separated from *when* (the batcher).

``AsyncLM`` composes a :class:`~genback.batcher.Batcher` (the window and the query count, nothing
else) with one runner. A runner owns its model state (for AsyncTransformer the KV prefix tree),
plans each batch against it (so the token and memory budgets live where the cache is, as the
scheduler of nano-vllm owns its block manager), runs the forwards and commits the results.

Every method except ``stats`` is called with ``AsyncLM``'s forward lock held, from the batcher's
worker thread or from a sync caller's thread; ``stats`` is called without it and must never wait
for a forward (plain counters read as they are).
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from .query import Query


@runtime_checkable
class Runner(Protocol):
    """What a backend implements (HF, vLLM, MLX and the mock are runners)."""

    def run(self, queries: Sequence[Query]) -> list:
        """Answer distinct queries, one result per query in order (see :class:`Query`)."""

    def stats(self) -> dict:
        """Counters for ``cache_info()`` (``forwards``, ``tokens_forwarded``, KV bytes, ...)."""

    def clear(self, keep_pinned: bool) -> None:
        """Drop cached model state (KV), keeping pinned prompts when ``keep_pinned``."""

    def pin(self, tokens: tuple[int, ...]) -> None:
        """Compute and keep the KV of ``tokens`` until ``clear(keep_pinned=False)``
        (runners without a KV cache may only compute it). Raises ``ValueError`` if it cannot be
        kept."""

    def close(self) -> None:
        """Release resources; no call follows."""
