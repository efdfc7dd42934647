"""``AsyncLM``: the async next-token API shared by every backend.

A backend only says how to compute a batch of :class:`Query` objects (``_compute``, called on
the batcher's worker thread or, for sync calls, on the caller's thread). Everything else — input
checks, the output cache, auto-batching, sync wrappers, sampling, statistics — lives here once.
"""

from __future__ import annotations

import asyncio
import numbers
import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from ..batcher import Batcher
from ..output_cache import OutputCache
from .inputs import check_lora, check_positive_int, check_token_ids


@dataclass(frozen=True)
class Query:
    """One question to the model.

    ``targets is None``: the next-token log-prob row after ``tokens`` (float32 ``[V]``).
    Otherwise: the log-probs of ``targets`` at the last ``len(targets)`` positions of
    ``tokens + targets[-1:]``, i.e. ``tokens = context + continuation[:-1]`` and
    ``targets = continuation`` (float32 ``[len(targets)]``). ``targets == ()``: only compute and
    keep the KV of ``tokens`` (backends with a KV cache; the result is None).
    """

    tokens: tuple[int, ...]
    targets: tuple[int, ...] | None = None

    @property
    def n_outputs(self) -> int:
        return 1 if self.targets is None else len(self.targets)


class AsyncLM:
    """Base class: auto-batched, cached next-token log-probs over a fixed vocabulary.

    Args:
        tokenizer: the Hugging Face tokenizer of the model.
        vocab_size: the logit width ``V`` (rows have ``V`` entries; ``byte_vocab`` is padded to it).
        batch_size: most distinct queries per batch (>= 1).
        batch_window: seconds a batch waits for more queries, from its first query (>= 0).
        max_batch_tokens: most tokens a batch forwards (>= 1); it is dispatched when full.
        row_cache_size: most next-token rows kept in the output cache (0 disables it).

    Raises:
        ValueError: an option out of range.
    """

    def __init__(
        self,
        tokenizer,
        *,
        vocab_size: int | None = None,
        batch_size: int = 32,
        batch_window: float = 0.002,
        max_batch_tokens: int = 4096,
        row_cache_size: int = 1024,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = check_positive_int(
            len(tokenizer) if vocab_size is None else vocab_size, "vocab_size"
        )
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.max_batch_tokens = check_positive_int(max_batch_tokens, "max_batch_tokens")
        self._output_cache = OutputCache(row_cache_size)
        self._batcher = Batcher(
            self._compute_locked,
            window=batch_window,
            max_batch_size=self.batch_size,
            max_batch_tokens=self.max_batch_tokens,
        )
        self._forward_lock = threading.RLock()
        self._vocab = None
        self._stats_lock = threading.Lock()
        self._queries = 0
        self._tokens_queried = 0

    # -- vocabulary -----------------------------------------------------------------------------

    def _vocabs(self):
        if self._vocab is None:
            from ..tokenization import decode_vocab

            self._vocab = decode_vocab(self.tokenizer, vocab_size=self.vocab_size)
        return self._vocab

    @property
    def byte_vocab(self):
        """``list[Token]`` of length ``vocab_size``: ``byte_vocab[i]`` is token ``i``'s exact bytes."""
        return self._vocabs()[0]

    @property
    def str_vocab(self) -> list[str]:
        """``list[str]`` of length ``vocab_size``: token ``i`` as text (lossy for partial UTF-8)."""
        return self._vocabs()[1]

    # -- the backend's part -------------------------------------------------------------------------

    def _compute(self, queries: list[Query]) -> list[torch.Tensor]:
        """Answer distinct queries (see :class:`Query`); called with the forward lock held."""
        raise NotImplementedError

    def _cost(self, query: Query) -> int:
        """Tokens a query will forward (for the batch token budget); backends may refine it."""
        return len(query.tokens)

    def _clear_backend_cache(self) -> None:
        """Drop backend-side caches (KV); the output cache is dropped by ``clear_cache``."""

    def _close_backend(self) -> None:
        """Release backend resources after the batcher has stopped."""

    def _compute_locked(self, queries: list[Query]) -> list[torch.Tensor]:
        results: list = [None] * len(queries)
        todo = []
        for i, q in enumerate(queries):
            row = self._output_cache.get(q.tokens) if q.targets is None else None
            if row is not None:  # computed by an earlier batch since this query was submitted
                results[i] = row
            else:
                todo.append(i)
        if todo:
            with self._forward_lock:
                computed = self._compute([queries[i] for i in todo])
            for i, value in zip(todo, computed):
                results[i] = value
                if queries[i].targets is None:
                    self._output_cache.put(queries[i].tokens, value)
        return results

    # -- queries ----------------------------------------------------------------------------------

    def _check_ids(self, token_ids, name="token_ids") -> tuple[int, ...]:
        return check_token_ids(token_ids, self.vocab_size, name)

    def _count(self, n_tokens: int) -> None:
        with self._stats_lock:
            self._queries += 1
            self._tokens_queried += n_tokens

    async def next_token_logprobs(self, token_ids, lora_name=None) -> torch.Tensor:
        """Log-probs of the next token after ``token_ids``; concurrent calls are batched.

        Args:
            token_ids: the context, a non-empty list (or 1-D int array) of ids in ``[0, V)``.
            lora_name: must be None (no adapters).

        Returns:
            float32 CPU tensor ``[V]``, log-normalised (``logsumexp == 0``); the caller's own copy.

        Raises:
            TypeError / ValueError: bad ``token_ids`` (only this caller fails).
            BatcherClosed: the model was closed or reset while the query waited.
        """
        check_lora(lora_name)
        key = self._check_ids(token_ids)
        self._count(len(key))
        row = self._output_cache.get(key)
        if row is None:
            query = Query(key)
            row = await self._batcher.submit(key, query, self._cost(query))
        return row.clone()

    def next_token_logprobs_sync(self, token_ids, lora_name=None) -> torch.Tensor:
        """Blocking form of :meth:`next_token_logprobs`; works inside a running loop too.

        It computes on the calling thread (no batching) and shares the caches.
        """
        check_lora(lora_name)
        return self._rows_sync([self._check_ids(token_ids)])[0]

    async def batch_next_token_logprobs(self, token_ids_list, lora_name=None) -> torch.Tensor:
        """Rows for several contexts at once: float32 ``[N, V]`` (N >= 1)."""
        contexts = self._check_list(token_ids_list, "token_ids_list")
        check_lora(lora_name)
        rows = await asyncio.gather(*(self.next_token_logprobs(ids) for ids in contexts))
        return torch.stack(rows)

    def batch_next_token_logprobs_sync(self, token_ids_list, lora_name=None) -> torch.Tensor:
        """Blocking form of :meth:`batch_next_token_logprobs`: one batched computation."""
        contexts = self._check_list(token_ids_list, "token_ids_list")
        check_lora(lora_name)
        return self._rows_sync(
            [self._check_ids(ids, f"token_ids_list[{i}]") for i, ids in enumerate(contexts)]
        )

    def _rows_sync(self, keys: list[tuple[int, ...]]) -> torch.Tensor:
        """Rows for checked contexts, computed on this thread in one batch: ``[len(keys), V]``."""
        if self._batcher.closed:
            raise RuntimeError("the model was closed (aclose); no more queries are served")
        for key in keys:
            self._count(len(key))
        cached = {k: self._output_cache.get(k) for k in dict.fromkeys(keys)}
        missing = [k for k, row in cached.items() if row is None]
        if missing:
            for k, row in zip(missing, self._compute_locked([Query(k) for k in missing])):
                cached[k] = row
        return torch.stack([cached[k] for k in keys])  # stack copies: callers own their rows

    @staticmethod
    def _check_list(token_ids_list, name: str) -> list:
        if isinstance(token_ids_list, (str, bytes)) or not isinstance(token_ids_list, Sequence):
            raise TypeError(
                f"{name} must be a list of token-id lists, got {type(token_ids_list).__name__}"
            )
        if len(token_ids_list) == 0:
            raise ValueError(f"{name} must hold at least one context, got an empty list")
        return list(token_ids_list)

    async def token_logprobs(self, context_ids, continuation_ids, lora_name=None) -> torch.Tensor:
        """Log-prob of each continuation token given the context and the tokens before it.

        One forward over ``context_ids + continuation_ids[:-1]`` (reusing cached KV of the
        context). Returns float32 CPU ``[len(continuation_ids)]``; its sum is
        ``log p(continuation | context)``.

        Raises:
            TypeError / ValueError: bad or empty ``context_ids`` / ``continuation_ids``.
        """
        check_lora(lora_name)
        context = self._check_ids(context_ids, "context_ids")
        continuation = self._check_ids(continuation_ids, "continuation_ids")
        query = Query(context + continuation[:-1], continuation)
        self._count(len(query.tokens))
        result = await self._batcher.submit(query, query, self._cost(query))
        return result.clone()

    # -- sampling ---------------------------------------------------------------------------------

    async def sample(
        self, prompt_token_ids, max_tokens, eos_token_ids, temperature=1.0, seed=None,
        lora_name=None,
    ) -> list[int]:
        """Ancestral sampling, one token per step through :meth:`next_token_logprobs`.

        Each step draws from ``softmax(logprobs / temperature)`` with ``torch.multinomial`` and a
        CPU ``torch.Generator`` seeded with ``seed`` (reproducible when given). Stops after
        ``max_tokens`` tokens or at a token in ``eos_token_ids`` (not included).

        Returns:
            the generated token ids (without the prompt).

        Raises:
            ValueError: ``max_tokens`` < 0, ``temperature`` <= 0, bad ids.
        """
        prompt, eos = self._check_sample_args(prompt_token_ids, max_tokens, eos_token_ids,
                                              temperature)
        generator = None
        if seed is not None:
            generator = torch.Generator().manual_seed(int(seed))
        generated: list[int] = []
        for _ in range(max_tokens):
            logprobs = await self.next_token_logprobs(prompt + generated, lora_name=lora_name)
            probs = torch.softmax(logprobs / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator).item())
            if token in eos:
                break
            generated.append(token)
        return generated

    def _check_sample_args(self, prompt_token_ids, max_tokens, eos_token_ids, temperature):
        """Checked ``(prompt ids as a list, eos ids as a set)`` of a ``sample`` call (shared by
        every backend's ``sample``); raises as :meth:`sample` documents."""
        prompt = list(self._check_ids(prompt_token_ids, "prompt_token_ids"))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
        if not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
        eos = set(check_token_ids(eos_token_ids, self.vocab_size, "eos_token_ids", allow_empty=True))
        return prompt, eos

    async def batch_sample(
        self, prompt_token_ids_list, max_tokens, eos_token_ids, temperature=1.0, seed=None,
        lora_name=None,
    ) -> list[list[int]]:
        """Sample every prompt concurrently (their steps share batches).

        ``seed``: None, one int (prompt ``i`` uses ``seed + i``), or a list with one seed per prompt.
        """
        prompts = self._check_list(prompt_token_ids_list, "prompt_token_ids_list")
        if seed is None or isinstance(seed, numbers.Integral):
            seeds = [None if seed is None else int(seed) + i for i in range(len(prompts))]
        else:
            seeds = list(seed)
            if len(seeds) != len(prompts):
                raise ValueError(f"seed has {len(seeds)} entries for {len(prompts)} prompts")
        return list(await asyncio.gather(*(
            self.sample(p, max_tokens, eos_token_ids, temperature, s, lora_name)
            for p, s in zip(prompts, seeds)
        )))

    # -- caches and lifecycle -------------------------------------------------------------------------

    def cache_info(self) -> dict:
        """Counters: ``queries`` (calls answered), ``tokens_queried`` (their context lengths),
        ``row_hits`` (answered from the output cache), ``batches``, ``batched_queries`` (distinct
        queries those batches computed), ``rows_cached``; backends add
        ``forwards``, ``tokens_forwarded``, ``kv_bytes``, ``kv_nodes``, ``evictions`` (AsyncTransformer
        also ``padded_tokens_forwarded``, ``kv_budget_bytes`` and ``hot_kv_bytes``: the previous
        forward's KV, kept outside the budget for the next lockstep batch)."""
        return {
            "queries": self._queries,
            "tokens_queried": self._tokens_queried,
            "row_hits": self._output_cache.hits,
            "batches": self._batcher.batches,
            "batched_queries": self._batcher.queries,
            "rows_cached": len(self._output_cache),
        }

    def clear_cache(self) -> None:
        """Drop every cached row and every unpinned cached KV state."""
        self._output_cache.clear()
        with self._forward_lock:
            self._clear_backend_cache()

    def clear_kv_cache(self) -> None:
        """Drop every cached KV state, pinned ones included (rows stay)."""

    def cache_kv(self, prompt_tokens, lora_name=None) -> None:
        """Compute and keep the KV of ``prompt_tokens``; backends without a KV tree ignore it."""

    def reset_async_queries(self) -> int:
        """Fail every pending query with ``BatcherClosed``; return how many callers were failed.

        Use it when an exception left an inference algorithm's queries pending. Batches already
        computing finish normally. Safe from any thread.
        """
        return self._batcher.reset()

    async def aclose(self) -> None:
        """Stop serving: pending queries fail, the worker finishes its batch. Idempotent."""
        if self._batcher.closed:
            return
        await asyncio.to_thread(self._batcher.close)
        with self._forward_lock:
            self._close_backend()

    def close(self) -> None:
        """Blocking form of :meth:`aclose`."""
        if self._batcher.closed:
            return
        self._batcher.close()
        with self._forward_lock:
            self._close_backend()
