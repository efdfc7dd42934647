"""The runner protocol: *what* a backend computes, separated from *when* (the scheduler).

``AsyncLM`` composes a front (input checks, the output cache, counters: :mod:`genback.llm.front`),
a scheduler and one runner. A runner owns its model state (for AsyncTransformer the KV prefix
tree), plans each batch against it (so the token and memory budgets live where the cache is, as
the scheduler of nano-vllm owns its block manager), runs the forwards and returns the results.
It declares what it can do in a :class:`Capabilities` record, from which ``AsyncLM`` builds its
parts: a runner that batches by itself (vLLM's engine) gets each query at once
(:class:`genback.batcher.Immediate`), the others genback's :class:`genback.batcher.Batcher`.

Every method except ``stats`` (and, for ``batching="engine"`` runners, ``answer`` and ``reset``)
is called with the front's forward lock held, from the batcher's worker thread or from a sync
caller's thread; ``stats`` is called without it and must never wait for a forward (plain counters
read as they are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

from .query import Query


@dataclass(frozen=True)
class Capabilities:
    """What a runner declares about itself.

    Attributes:
        picks: answers :class:`~genback.query.Step` queries (a token chosen on its device);
            otherwise decoding steps ask for a :class:`~genback.query.NextToken` row and choose
            on the host.
        cache_kind: the model state kept between queries, in words (``"prefix tree"``), or None.
        batching: ``"genback"`` (``run`` takes batches from genback's :class:`Batcher`) or
            ``"engine"`` (the runner's engine batches and schedules: each query goes at once to
            ``async answer(query)``, and ``reset(message)`` aborts what is in flight).
        batching_kind: who batches, in words (``describe_execution`` shows it).
        adapters: loads LoRA adapters (``add_adapter(path) -> key``, ``remove_adapter(key,
            error)``); queries carry the key.
    """

    picks: bool = False
    cache_kind: str | None = None
    batching: str = "genback"
    batching_kind: str = "continuous (genback auto-batcher)"
    adapters: bool = False


@runtime_checkable
class Runner(Protocol):
    """What a backend implements (HF, vLLM, MLX and the mock are runners)."""

    capabilities: Capabilities

    def run(self, queries: Sequence[Query]) -> list:
        """Answer distinct queries, one result per query in order (see :mod:`genback.query`);
        a result may be the exception that fails only its query."""

    def stats(self) -> dict:
        """Counters for ``cache_info()`` (``forwards``, ``tokens_forwarded``, KV bytes, ...)."""

    def clear(self, keep_pinned: bool) -> None:
        """Drop cached model state (KV), keeping pinned prompts when ``keep_pinned``."""

    def pin(self, tokens: tuple[int, ...], adapter: int | None = None) -> None:
        """Compute and keep the KV of ``tokens`` under ``adapter`` until
        ``clear(keep_pinned=False)`` (runners without a KV cache may only compute it). Raises
        ``ValueError`` if it cannot be kept."""

    def close(self) -> None:
        """Release resources; no call follows."""
