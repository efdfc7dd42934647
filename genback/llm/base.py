"""``AsyncLM``: the async next-token API shared by every backend.

``AsyncLM`` is one class that composes a :class:`~genback.batcher.Batcher` (*when*: the window and
the query count) with a backend runner (*what*: see :mod:`genback.runner`). Everything else —
input checks, the output cache, auto-batching, sync wrappers, sampling, statistics — lives here
once; the backends (``AsyncTransformer``, ``AsyncVirtualLM``, ``MockAsyncLM``) only build a
runner and add their own constructors.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Sequence

import torch

from ..batcher import BatchAbandoned, Batcher, BatcherClosed  # noqa: F401 (BatchAbandoned: genlm name)
from ..output_cache import OutputCache
from ..query import NextToken, Query, Score
from ..runner import Runner
from .decoding import Decoding
from .inputs import ContextChecker, check_lora, check_positive_int, check_token_ids
from .queue_api import QueueHooks


class AsyncLM(QueueHooks, Decoding):
    """Base class: auto-batched, cached next-token log-probs over a fixed vocabulary.

    Args:
        tokenizer: the Hugging Face tokenizer of the model.
        runner: the backend runner (:class:`genback.runner.Runner`) that computes batches.
        vocab_size: the logit width ``V`` (rows have ``V`` entries; ``byte_vocab`` is padded to it).
        batch_size: most distinct queries per batch (>= 1); settable later (``lm.batch_size = n``).
            How many of them share one forward is the runner's decision (by work and memory).
        batch_window: seconds a batch waits for more queries, from its first query (finite, >= 0).
        row_cache_size: most next-token rows kept in the output cache (0 disables it).
        max_context_length: most tokens a context may have (None: no limit).
        eos_token_ids: end-of-sequence ids besides the tokenizer's (e.g. the model's generation
            config's); see :attr:`eos_token_ids`.

    Raises:
        ValueError: an option out of range.
    """

    def __init__(
        self,
        tokenizer,
        runner: Runner,
        *,
        vocab_size: int | None = None,
        batch_size: int = 512,
        batch_window: float = 0.002,
        row_cache_size: int = 1024,
        max_context_length: int | None = None,
        eos_token_ids=(),
    ):
        self.tokenizer = tokenizer
        self.vocab_size = check_positive_int(
            len(tokenizer) if vocab_size is None else vocab_size, "vocab_size"
        )
        self.max_context_length = max_context_length
        eos = set(check_token_ids(list(eos_token_ids), self.vocab_size, "eos_token_ids",
                                  allow_empty=True))
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        self._eos_token_ids = frozenset(eos)
        self._contexts = ContextChecker(self.vocab_size)
        self._runner = runner
        self._output_cache = OutputCache(row_cache_size)
        self._batcher = Batcher(
            self._compute_locked,
            window=batch_window,
            max_batch_size=check_positive_int(batch_size, "batch_size"),
        )
        self._forward_lock = threading.RLock()
        self._vocab = None
        self._stats_lock = threading.Lock()
        self._queries = 0
        self._tokens_queried = 0

    @property
    def batch_size(self) -> int:
        """Most distinct queries per batch; setting it takes effect for the next batch."""
        return self._batcher.max_batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self._batcher.max_batch_size = check_positive_int(value, "batch_size")

    @property
    def batch_window(self) -> float:
        """Seconds a batch waits for more queries, from its first query; settable."""
        return self._batcher.window

    @batch_window.setter
    def batch_window(self, value: float) -> None:
        self._batcher.window = Batcher.check_window(value)

    @property
    def timeout(self) -> float:
        """genlm-backend's name of :attr:`batch_window`."""
        return self.batch_window

    @timeout.setter
    def timeout(self, value: float) -> None:
        self.batch_window = value

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end a generation: the tokenizer's EOS and the model's own (AsyncTransformer:
        ``generation_config.eos_token_id``; AsyncVirtualLM: the model folder's generation
        config)."""
        return self._eos_token_ids

    @property
    def cache_kind(self) -> str | None:
        """What model state the backend keeps between queries, in words (``"prefix tree"`` for
        AsyncTransformer's KV tree, ``"vLLM prefix cache"``), or None."""
        return getattr(self._runner, "cache_kind", None)

    @property
    def batching_kind(self) -> str:
        """Who batches concurrent queries, in words: genback's auto-batcher (one forward for the
        queries of a batch window), or on AsyncVirtualLM vLLM's own scheduler."""
        return getattr(self._runner, "batching_kind", "continuous (genback auto-batcher)")

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

    # -- computation (the runner's part) -----------------------------------------------------------

    def _compute_locked(self, queries: list[Query]) -> list:
        """One result per query: a row / value tensor, or the exception that fails only that
        query (its adapter was removed while it waited, or it cannot fit in memory)."""
        results: list = [None] * len(queries)
        todo = []
        for i, q in enumerate(queries):
            row = self._output_cache.get(q) if type(q) is NextToken else None
            if row is not None:  # computed by an earlier batch since this query was submitted
                results[i] = row
            else:
                todo.append(i)
        if todo:
            with self._forward_lock:
                self._check_open()
                for i in todo:
                    results[i] = self._adapter_error(queries[i].adapter)
                todo = [i for i in todo if results[i] is None]
                computed = self._runner.run([queries[i] for i in todo]) if todo else []
            for i, value in zip(todo, computed):
                results[i] = value
                if type(queries[i]) is NextToken and not isinstance(value, BaseException):
                    self._output_cache.put(queries[i], value)
        return results

    # -- adapters (backends that serve LoRA override these two) -------------------------------------

    def _lora_key(self, lora_name) -> int | None:
        """The runner's adapter key for ``lora_name`` (None: the base model).

        Raises:
            ValueError: ``lora_name`` is not None (this backend has no adapters).
        """
        check_lora(lora_name)
        return None

    def _adapter_error(self, adapter: int | None) -> Exception | None:
        """None when adapter key ``adapter`` can still be computed, else the error to give its
        callers (called with the forward lock held)."""
        return None

    # -- queries ----------------------------------------------------------------------------------

    def _check_ids(self, token_ids, name="token_ids") -> tuple[int, ...]:
        return self._check_context(token_ids, name)[0]

    def _check_context(self, token_ids, name="token_ids") -> tuple[tuple[int, ...], int]:
        """``(ids, hash(ids))`` of a checked context (see :class:`.inputs.ContextChecker`)."""
        ids, h = self._contexts.check(token_ids, name)
        if self.max_context_length and len(ids) > self.max_context_length:
            raise ValueError(
                f"{name} has {len(ids)} tokens, more than the model's context of "
                f"{self.max_context_length}"
            )
        return ids, h

    def _check_open(self) -> None:
        if self._batcher.closed:
            raise BatcherClosed("the model was closed (aclose); no more queries are served")

    def _count(self, n_tokens: int) -> None:
        with self._stats_lock:
            self._queries += 1
            self._tokens_queried += n_tokens

    async def next_token_logprobs(self, token_ids, lora_name=None) -> torch.Tensor:
        """Log-probs of the next token after ``token_ids``; concurrent calls are batched.

        Args:
            token_ids: the context, a non-empty list (or 1-D int array) of ids in ``[0, V)``.
            lora_name: None for the base model, or the name of a LoRA adapter registered with
                ``add_new_lora`` (backends that serve adapters).

        Returns:
            float32 CPU tensor ``[V]``, log-normalised (``logsumexp == 0``); the caller's own copy.

        Raises:
            TypeError / ValueError: bad ``token_ids`` or an unknown ``lora_name`` (only this
                caller fails); ValueError also when its adapter is removed while it waits.
            BatcherClosed: the model was closed or reset while the query waited.
        """
        adapter = self._lora_key(lora_name)
        ids, h = self._check_context(token_ids)
        query = NextToken(ids, adapter, h)
        self._check_open()
        self._count(len(query.tokens))
        row = self._output_cache.get(query)
        if row is None:
            row = await self._batcher.submit(query, query)
        return row.clone()  # the one copy: cached rows are shared, never handed out

    def next_token_logprobs_sync(self, token_ids, lora_name=None) -> torch.Tensor:
        """Blocking form of :meth:`next_token_logprobs`; works inside a running loop too.

        It computes on the calling thread (no batching) and shares the caches.
        """
        adapter = self._lora_key(lora_name)
        return self._rows_sync([self._check_ids(token_ids)], adapter)[0]

    async def batch_next_token_logprobs(self, token_ids_list, lora_name=None) -> torch.Tensor:
        """Rows for several contexts at once: float32 ``[N, V]`` (N >= 1)."""
        contexts = self._check_list(token_ids_list, "token_ids_list")
        self._lora_key(lora_name)
        rows = await asyncio.gather(*(self.next_token_logprobs(ids, lora_name=lora_name)
                                      for ids in contexts))
        return torch.stack(rows)

    def batch_next_token_logprobs_sync(self, token_ids_list, lora_name=None) -> torch.Tensor:
        """Blocking form of :meth:`batch_next_token_logprobs`: one batched computation."""
        contexts = self._check_list(token_ids_list, "token_ids_list")
        adapter = self._lora_key(lora_name)
        return self._rows_sync(
            [self._check_ids(ids, f"token_ids_list[{i}]") for i, ids in enumerate(contexts)],
            adapter,
        )

    def _rows_sync(self, contexts: list[tuple[int, ...]], adapter: int | None = None
                   ) -> torch.Tensor:
        """Rows for checked contexts under ``adapter``, computed on this thread in one batch:
        ``[len(contexts), V]``."""
        self._check_open()
        for tokens in contexts:
            self._count(len(tokens))
        queries = [NextToken(t, adapter) for t in contexts]
        cached = {q: self._output_cache.get(q) for q in queries}
        missing = [q for q, row in cached.items() if row is None]
        if missing:
            for q, row in zip(missing, self._compute_locked(missing)):
                if isinstance(row, BaseException):
                    raise row
                cached[q] = row
        # stack copies: callers own their rows
        return torch.stack([cached[q] for q in queries])

    @staticmethod
    def _check_list(token_ids_list, name: str) -> list:
        if isinstance(token_ids_list, (str, bytes)) or not isinstance(token_ids_list, Sequence):
            raise TypeError(
                f"{name} must be a list of token-id lists, got {type(token_ids_list).__name__}"
            )
        if len(token_ids_list) == 0:
            raise ValueError(f"{name} must hold at least one context, got an empty list")
        return list(token_ids_list)

    def _pair_query(self, context_ids, continuation_ids, greedy: bool,
                    adapter: int | None = None) -> Score:
        context = self._check_ids(context_ids, "context_ids")
        continuation = self._check_ids(continuation_ids, "continuation_ids")
        # the forward's inputs are context + continuation[:-1]: the last token is never an input
        inputs = len(context) + len(continuation) - 1
        if self.max_context_length and inputs > self.max_context_length:
            raise ValueError(
                f"context_ids + continuation_ids[:-1] has {inputs} tokens ({len(context)} + "
                f"{len(continuation) - 1}), more than the model's context of "
                f"{self.max_context_length}"
            )
        self._check_open()
        query = Score(context + continuation[:-1], continuation, adapter, greedy=greedy)
        self._count(len(query.tokens))
        return query

    async def token_logprobs(self, context_ids, continuation_ids, lora_name=None) -> torch.Tensor:
        """Log-prob of each continuation token given the context and the tokens before it.

        One forward over ``context_ids + continuation_ids[:-1]`` (reusing cached KV of the
        context). Returns float32 CPU ``[len(continuation_ids)]``; its sum is
        ``log p(continuation | context)``.

        Raises:
            TypeError / ValueError: bad or empty ``context_ids`` / ``continuation_ids``, or the
                two together longer than the model's context.
        """
        query = self._pair_query(context_ids, continuation_ids, greedy=False,
                                 adapter=self._lora_key(lora_name))
        result = await self._batcher.submit(query, query)
        return result.clone()

    async def score(self, context_ids, continuation_ids, lora_name=None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score a continuation: its log-probs and whether each token is the greedy choice.

        One query, answered by one forward over ``context_ids + continuation_ids[:-1]`` (only
        its uncached part on backends with a KV cache); the log-probs and the argmax flags are
        computed on the model's device at the continuation's positions only, and concurrent
        calls share forwards like every other query.

        Args:
            context_ids: non-empty ids in ``[0, V)``.
            continuation_ids: non-empty ids in ``[0, V)``.
            lora_name: must be None (no adapters).

        Returns:
            ``(logprobs, is_greedy)``: float32 CPU ``[n]`` (``logprobs[i] = log p(cont[i] | ctx +
            cont[:i])``, as :meth:`token_logprobs`) and bool CPU ``[n]`` (``cont[i]`` is the
            argmax of that distribution), ``n = len(continuation_ids)``.

        Raises:
            TypeError / ValueError: bad or empty ids, or the two together longer than the
                model's context (only this caller fails).
            BatcherClosed: the model was closed or reset while the query waited.
        """
        query = self._pair_query(context_ids, continuation_ids, greedy=True,
                                 adapter=self._lora_key(lora_name))
        logprobs, greedy = await self._batcher.submit(query, query)
        return logprobs.clone(), greedy.clone()

    # -- caches and lifecycle -------------------------------------------------------------------------

    def cache_info(self) -> dict:
        """Counters, read without waiting for a running forward: ``queries`` (calls answered),
        ``tokens_queried`` (their context lengths), ``row_hits`` (answered from the output
        cache), ``batches``, ``batched_queries`` (distinct queries those batches computed),
        ``rows_cached`` and ``rows_bytes`` (the output cache), plus the runner's own (``forwards``, ``tokens_forwarded``, and for
        AsyncTransformer ``kv_bytes``, ``kv_budget_bytes``, ``kv_nodes``, ``evictions``,
        ``attention``, ...)."""
        info = {
            "queries": self._queries,
            "tokens_queried": self._tokens_queried,
            "row_hits": self._output_cache.hits,
            "batches": self._batcher.batches,
            "batched_queries": self._batcher.queries,
            "rows_cached": len(self._output_cache),
            "rows_bytes": self._output_cache.bytes_held,
        }
        info.update(self._runner.stats())
        return info

    @property
    def forwards(self) -> int:
        """Model forwards the runner ran for batches, not counting uncached references
        (``cache_info()["forwards"]``; on vLLM its requests)."""
        return self._runner.stats()["forwards"]

    @property
    def tokens_forwarded(self) -> int:
        """Tokens the runner forwarded, padding excluded (``cache_info()["tokens_forwarded"]``)."""
        return self._runner.stats()["tokens_forwarded"]

    def clear_cache(self) -> None:
        """Drop every cached row and every unpinned cached KV state (pinned prompts stay)."""
        self._output_cache.clear()
        with self._forward_lock:
            self._runner.clear(keep_pinned=True)

    def clear_kv_cache(self) -> None:
        """Drop every cached KV state, pinned ones included (rows stay)."""
        with self._forward_lock:
            self._runner.clear(keep_pinned=False)

    def cache_kv(self, prompt_tokens, lora_name=None) -> None:
        """Compute ``prompt_tokens``' KV now and keep it (AsyncTransformer pins it: it is never
        evicted until ``clear_kv_cache``, so every query extending the prompt forwards only its
        new tokens).

        Raises:
            TypeError / ValueError: bad ``prompt_tokens``, an unknown ``lora_name``, or
                (AsyncTransformer) a prompt whose KV alone exceeds the KV budget.
        """
        adapter = self._lora_key(lora_name)
        tokens = self._check_ids(prompt_tokens, "prompt_tokens")
        self._check_open()
        with self._forward_lock:
            error = self._adapter_error(adapter)
            if error is not None:
                raise error
            if adapter is None:
                self._runner.pin(tokens)
            else:
                self._runner.pin(tokens, adapter=adapter)

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
            self._runner.close()
        self._output_cache.clear()

    def close(self) -> None:
        """Blocking form of :meth:`aclose`."""
        if self._batcher.closed:
            return
        self._batcher.close()
        with self._forward_lock:
            self._runner.close()
        self._output_cache.clear()
