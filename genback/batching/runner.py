"""The runner protocol: *what* a backend computes, separated from *when* (the scheduler).

``AsyncLM`` composes a front (input checks, the output cache, counters: :mod:`genback.core.front`),
a scheduler and one runner. A runner owns its model state (for AsyncTransformer the KV prefix
tree), plans each batch against it (so the token and memory budgets live where the cache is, as
the scheduler of nano-vllm owns its block manager), runs the forwards and returns the results.
It declares what it can do in a :class:`Capabilities` record, from which ``AsyncLM`` builds its
parts: a runner that batches by itself (vLLM's engine) gets each query at once
(:class:`genback.batching.immediate.Immediate`), the others genback's :class:`genback.batching.batcher.Batcher`.

What ``AsyncLM`` (its front and parts) calls on a runner, by what the runner declares:

| declared | methods | protocol |
|---|---|---|
| always | ``run``, ``stats``, ``clear``, ``pin``, ``close`` | :class:`Runner` |
| ``batching="engine"`` | ``async answer_shared(query)``, ``reset(message)``, ``requests()`` | :class:`EngineRunner` |
| ``adapters`` | ``add_adapter(path)``, ``remove_adapter(key, error)`` | :class:`AdapterRunner` |
| ``streams`` | ``can_stream(...)``, ``stream(...)`` | :class:`StreamingRunner` |
| ``cache_kind="prefix tree"`` | ``walk(tokens, adapter)``, ``uncached_row(tokens, adapter)``, ``picture(decode, max_nodes, adapter)`` | :class:`TreeRunner` |

Nothing else of a runner is read by the front, the parts or the facade. Every method except
``stats``, the engine runner's and the streaming runner's is called with the front's forward
lock held, from the batcher's worker thread, from the event loop's thread (a lockstep step: the
batcher's ``inline_cohort``) or from a sync caller's thread; ``stats`` is called
without it and must never wait for a forward (plain counters read as they are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Protocol, Sequence, runtime_checkable

from ..queries.kinds import Query
from ..queries.sampling import Choice, SamplingParams


@dataclass(frozen=True)
class Capabilities:
    """What a runner declares about itself.

    Attributes:
        picks: answers :class:`~genback.queries.kinds.Step` queries (a token chosen on its device);
            otherwise decoding steps ask for a :class:`~genback.queries.kinds.NextToken` row and choose
            on the host.
        cache_kind: the model state kept between queries, in words (``"prefix tree"``), or None.
        batching: ``"genback"`` (``run`` takes batches from genback's
            :class:`~genback.batching.batcher.Batcher`) or ``"engine"`` (the runner's engine batches and
            schedules: each query goes at once to ``async answer_shared(query)``, and
            ``reset(message)`` aborts what is in flight; :class:`EngineRunner`).
        batching_kind: who batches, in words (``describe_execution`` shows it).
        adapters: loads LoRA adapters (``add_adapter(path) -> key``, ``remove_adapter(key,
            error)``); queries carry the key.
        streams: makes whole generations itself (vLLM's engine and sampler): ``generate_stream``
            hands it each generation it ``can_stream``; otherwise (and for the others) a
            generation is the facade's next-token loop.
    """

    picks: bool = False
    cache_kind: str | None = None
    batching: str = "genback"
    batching_kind: str = "continuous (genback auto-batcher)"
    adapters: bool = False
    streams: bool = False


@runtime_checkable
class Runner(Protocol):
    """What a backend implements (HF, vLLM, MLX and the mock are runners)."""

    capabilities: Capabilities

    def run(self, queries: Sequence[Query]) -> list:
        """Answer distinct queries, one result per query in order (see :mod:`genback.queries.kinds`);
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


@runtime_checkable
class EngineRunner(Runner, Protocol):
    """A runner whose engine batches and schedules (``batching="engine"``): the front's
    :class:`~genback.batching.immediate.Immediate` sends it each query at once."""

    async def answer_shared(self, query: Query):
        """The result of one query, from any event loop, sharing a request with identical
        queries in flight; cancelling the caller aborts it once no other caller shares it."""

    def reset(self, message: str) -> int:
        """Abort everything in flight (callers get ``BatcherClosed(message)``); how many callers
        were failed."""

    def requests(self) -> int:
        """Requests sent to the engine so far (reported as batches)."""


@runtime_checkable
class AdapterRunner(Runner, Protocol):
    """A runner that loads LoRA adapters (``adapters=True``; :mod:`genback.core.adapters`)."""

    def add_adapter(self, path: str) -> int:
        """Load the adapter folder ``path``; return its new key (never reused)."""

    def remove_adapter(self, key: int, error: BaseException) -> None:
        """Free adapter ``key`` and every state computed under it; its queries in flight fail
        with ``error``."""


@runtime_checkable
class StreamingRunner(Runner, Protocol):
    """A runner that makes whole generations (``streams=True``)."""

    def can_stream(self, params: SamplingParams, min_new_tokens: int, enders: frozenset[int],
                   eos_token_ids: frozenset[int]) -> bool:
        """Whether it takes a generation with these options."""

    def stream(self, prompt: list[int], params: SamplingParams, max_new_tokens: int,
               min_new_tokens: int, enders: frozenset[int], adapter: int | None
               ) -> AsyncIterator[Choice]:
        """The choices of one generation up to ``max_new_tokens`` or the first ender (yielded
        last); closing the iterator stops it. Raises ``ValueError`` for a request it cannot
        take."""


@runtime_checkable
class TreeRunner(Runner, Protocol):
    """A runner over a KV prefix tree (``cache_kind="prefix tree"``: AsyncTransformer's), for
    genlm-backend's ``walk_cache`` and the uncached reference row."""

    def walk(self, tokens: tuple[int, ...], adapter: int | None = None) -> tuple:
        """``(node, n, past)``: how many leading ``tokens`` have cached KV, the deepest node on
        that path and their KV (see :meth:`genback.llm.hf.runner.HFRunner.walk`)."""

    def uncached_row(self, tokens: tuple[int, ...], adapter: int | None = None):
        """One full forward of ``tokens`` alone, no cache: float32 ``[V]`` log-probs."""

    def picture(self, decode, max_nodes: int = 200, adapter: int | None = None):
        """The tree as a ``graphviz.Digraph`` (:func:`genback.llm.hf.cache.picture.draw`)."""


def check_pin_budget(n_tokens: int, token_bytes: int, pinned: int, budget: int) -> None:
    """The rule of every runner's ``pin``: a prompt of ``n_tokens`` (``token_bytes`` of KV
    each) may be pinned only while everything pinned fits in the KV budget.

    Raises:
        ValueError: ``pinned`` bytes plus the prompt's exceed ``budget``; names both and the
            way out.
    """
    need = n_tokens * token_bytes
    if pinned + need > budget:
        raise ValueError(
            f"prompt_tokens ({n_tokens} tokens) need {need:,} bytes of KV; with {pinned:,} "
            f"bytes pinned already that exceeds kv_budget_bytes={budget:,}: raise the budget "
            f"or pin a shorter prompt")
