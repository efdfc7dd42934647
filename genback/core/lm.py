"""``AsyncLM``: the async next-token API shared by every backend.

``AsyncLM`` has no base classes; it composes parts: ``front`` (:class:`~genback.core.front.Front`:
input checks, the output cache, counters, the forward lock, the adapters
(:class:`~genback.core.adapters.Adapters`) and the scheduler, *when*), ``runner`` (*what*:
:mod:`genback.batching.runner`; its ``capabilities`` choose the scheduler and who streams generations),
``decoding`` (:class:`~genback.core.decoding.Decoding`: steps, generation, sampling) and ``queue``
(:class:`~genback.core.queue_api.QueueAPI`: genlm-backend's queue hooks), which use the front's
public methods only. Every public method takes the front's one path; the backends
(``AsyncTransformer``, ``AsyncVirtualLM``, ``AsyncMlxLM``, ``MockAsyncLM``) only construct.
"""

from __future__ import annotations

import asyncio

import torch

from ..batching.batcher import BatchAbandoned, Batcher, BatcherClosed  # noqa: F401 (BatchAbandoned: genlm name)
from ..queries.context import Context
from ..cpython import freeze_startup_heap
from ..queries.kinds import Query  # noqa: F401 (genback.llm's name of the base kind)
from ..queries.rows import StepRows, own
from ..batching.runner import Runner
from ..queries.sampling import Choice, Pick, SamplingParams
from .decoding import Decoding
from .front import Front
from .inputs import check_list, check_positive_int, model_eos_ids
from .queue_api import QueueAPI


class AsyncLM:
    """Auto-batched, cached next-token log-probs over a fixed vocabulary (every backend's API).

    Args:
        tokenizer: the Hugging Face tokenizer of the model.
        runner: the backend runner (:class:`genback.batching.runner.Runner`) that computes batches.
        vocab_size: the logit width ``V`` (rows have ``V`` entries; ``byte_vocab`` is padded to it).
        batch_size: most distinct queries per batch (>= 1); settable later (``lm.batch_size = n``).
            How many of them share one forward is the runner's decision (by work and memory).
        batch_window: seconds a batch waits for more queries, from its first query (finite, >= 0);
            a batch with as many callers as the loop's last batches goes at once
            (:mod:`genback.batching.batcher`).
        row_cache_size: most next-token rows kept in the output cache (0 disables it).
        max_context_length: the window: most tokens a forward's inputs may have (None: no
            limit; :mod:`genback.queries.window`).
        eos_token_ids: end-of-sequence ids besides the tokenizer's (e.g. the model's generation
            config's); see :attr:`eos_token_ids`.

    The first model built in a process freezes the Python heap that exists then
    (:func:`genback.cpython.freeze_startup_heap`; ``GENBACK_CPYTHON_SPEEDUPS=0`` turns that off).

    Raises:
        ValueError: an option out of range.
    """

    def __init__(self, tokenizer, runner: Runner, *, vocab_size: int | None = None,
                 batch_size: int = 512, batch_window: float = 0.002, row_cache_size: int = 1024,
                 max_context_length: int | None = None, eos_token_ids=()):
        self.tokenizer = tokenizer
        self.vocab_size = check_positive_int(
            len(tokenizer) if vocab_size is None else vocab_size, "vocab_size"
        )
        self._eos_token_ids = model_eos_ids(tokenizer, eos_token_ids, self.vocab_size)
        self.runner = runner
        self.capabilities = runner.capabilities
        self.front = Front(runner, vocab_size=self.vocab_size,
                           max_context_length=max_context_length,
                           row_cache_size=row_cache_size, batch_size=batch_size,
                           batch_window=batch_window)
        self.decoding = Decoding(self.front, self._eos_token_ids)
        self.queue = QueueAPI(self.front)
        self._vocab = None
        freeze_startup_heap()  # the loaded libraries and model: no longer rescanned by the GC

    @property
    def adapters(self):
        """The front's :class:`~genback.core.adapters.Adapters` (None: the runner loads none)."""
        return self.front.adapters

    @property
    def scheduler(self):
        """The front's scheduler (:class:`~genback.batching.batcher.Batcher` or ``Immediate``)."""
        return self.front.scheduler

    @property
    def max_context_length(self) -> int | None:
        """Most tokens a forward's inputs may have (the model's window); None: no limit."""
        return self.front.max_context_length

    batch_size = property(lambda self: self.front.batch_size,
                          lambda self, value: setattr(self.front, "batch_size", value),
                          doc=":attr:`.batch_options.BatchOptions.batch_size` (settable).")
    batch_window = property(lambda self: self.front.batch_window,
                            lambda self, value: setattr(self.front, "batch_window", value),
                            doc=":attr:`.batch_options.BatchOptions.batch_window` (settable).")
    timeout = property(batch_window.fget, batch_window.fset,
                       doc="genlm-backend's name of :attr:`batch_window`.")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end a generation: the tokenizer's EOS and the model's own (AsyncTransformer:
        ``generation_config.eos_token_id``; AsyncVirtualLM: the model folder's generation
        config)."""
        return self._eos_token_ids

    @property
    def cache_kind(self) -> str | None:
        """The model state kept between queries, in words (``"prefix tree"``), or None."""
        return self.capabilities.cache_kind

    @property
    def batching_kind(self) -> str:
        """Who batches concurrent queries, in words (genback's auto-batcher, vLLM's scheduler)."""
        return self.capabilities.batching_kind

    # -- vocabulary (decoded on first use) ------------------------------------------------------

    @property
    def byte_vocab(self):
        """``list[Token]`` of length ``vocab_size``: ``byte_vocab[i]`` is token ``i``'s exact bytes."""
        return self._vocabs()[0]

    @property
    def str_vocab(self) -> list[str]:
        """``list[str]`` of length ``vocab_size``: token ``i`` as text (lossy for partial UTF-8)."""
        return self._vocabs()[1]

    def _vocabs(self):
        if self._vocab is None:
            from ..tokenization import decode_vocab

            self._vocab = decode_vocab(self.tokenizer, vocab_size=self.vocab_size)
        return self._vocab

    # -- adapters (the front's Adapters part, when the runner loads them) --------------------------

    def _lora_key(self, lora_name) -> int | None:
        """:meth:`Front.adapter_key` (for the backends' own methods)."""
        return self.front.adapter_key(lora_name)

    def add_new_lora(self, lora_path, lora_name: str) -> None:
        """Load the LoRA adapter at ``lora_path`` under ``lora_name``
        (:meth:`.adapters.Adapters.add`, which gives the errors; ValueError also when this
        backend serves no adapters)."""
        self._adapters().add(lora_path, lora_name)

    def remove_lora(self, lora_name: str) -> None:
        """Unload adapter ``lora_name`` (:meth:`.adapters.Adapters.remove`; ValueError when no
        adapter is registered under it)."""
        self._adapters().remove(lora_name)

    def _adapters(self):
        if self.adapters is None:
            raise ValueError(f"{type(self).__name__} serves no LoRA adapters")
        self.front.check_open()
        return self.adapters

    @property
    def lora_names(self) -> list[str]:
        """Names of the registered adapters."""
        return [] if self.adapters is None else self.adapters.names

    # -- queries ----------------------------------------------------------------------------------

    def _check_ids(self, token_ids, name="token_ids") -> tuple[int, ...]:
        """Checked context ids (:meth:`.front.Front.tokens`, for the backends' own methods)."""
        return self.front.tokens(token_ids, name)

    def context(self, token_ids) -> Context:
        """``token_ids`` checked, as a :class:`~genback.queries.context.Context` to extend (``ctx +
        [token]``) and ask with (``next_token_logprobs(ctx)``): each step checks only the ids
        added, where a list is compared with its parent item by item (:mod:`genback.queries.context`).
        Raises TypeError / ValueError on bad ``token_ids`` (as :meth:`next_token_logprobs`)."""
        return self.front.checked(token_ids)[0]

    async def next_token_logprobs(self, token_ids, lora_name=None) -> torch.Tensor:
        """Log-probs of the next token after ``token_ids``; concurrent calls are batched.
        A coroutine function, as genlm-backend's: every asyncio idiom works, and cancelling
        the caller drops its query from the pending batch (:mod:`genback.batching.futures`); a
        whole step costs less as one :meth:`batch_next_token_logprobs` call.

        Args:
            token_ids: the context, a non-empty list (or 1-D int array) of ids in ``[0, V)``,
                or an :meth:`context` object.
            lora_name: None for the base model, or the name of a LoRA adapter registered with
                ``add_new_lora`` (backends that serve adapters).

        Returns:
            float32 tensor ``[V]``, log-normalised (``logsumexp == 0``); the caller's own copy,
            on the model's device on AsyncTransformer (``row_device``), else on the CPU.

        Raises:
            TypeError / ValueError: bad ``token_ids`` or an unknown ``lora_name`` (only this
                caller fails); ValueError also when its adapter is removed meanwhile.
            BatcherClosed: the model was closed or reset while the query waited.
        """
        front = self.front
        query, row = front.next_token_lookup(token_ids, lora_name)
        if row is not None:
            return own(row)
        if front.batched:  # (the batcher's rows are the callers' own already)
            return await front.enqueue(query, query)
        return own(await front.enqueue(query, query))

    def next_token_logprobs_sync(self, token_ids, lora_name=None) -> torch.Tensor:
        """Blocking form of :meth:`next_token_logprobs`; works inside a running loop too.
        It computes on the calling thread (no batching) and shares the caches."""
        front = self.front
        return own(front.ask_sync([front.next_token(token_ids, front.adapter_key(lora_name))])[0])

    async def batch_next_token_logprobs(self, token_ids_list, lora_name=None) -> torch.Tensor:
        """Rows for several contexts at once: float32 ``[N, V]`` (N >= 1), row ``i`` that of
        ``token_ids_list[i]``. Contexts that nest (every prefix of one sequence) are answered by
        one forward over the longest.

        Raises:
            TypeError / ValueError: ``token_ids_list`` is not a non-empty list of contexts, a
                context is bad (as :meth:`next_token_logprobs`), or ``lora_name`` is unknown.
            BatcherClosed: the model was closed or reset while the queries waited.
        """
        front = self.front  # (all checked and counted, then queued: one future for the new rows)
        queries, rows = front.next_token_many(check_list(token_ids_list, "token_ids_list"),
                                              lora_name)
        todo = [i for i, row in enumerate(rows) if row is None]
        if len(todo) == len(rows):  # (an SMC step: every row new; its block, when it is one)
            rows = await front.submit_many(queries)
        elif todo:
            for i, row in zip(todo, await front.submit_many([queries[i] for i in todo])):
                rows[i] = row
        return rows.stacked() if type(rows) is StepRows else torch.stack(rows)

    def batch_next_token_logprobs_sync(self, token_ids_list, lora_name=None) -> torch.Tensor:
        """Blocking form of :meth:`batch_next_token_logprobs`: one batched computation."""
        front = self.front
        contexts = check_list(token_ids_list, "token_ids_list")
        adapter = front.adapter_key(lora_name)
        return torch.stack(front.ask_sync([front.next_token(ids, adapter, f"token_ids_list[{i}]")
                                           for i, ids in enumerate(contexts)]))

    async def token_logprobs(self, context_ids, continuation_ids, lora_name=None) -> torch.Tensor:
        """Log-prob of each continuation token given the context and the tokens before it.

        One forward over ``context_ids + continuation_ids[:-1]`` (reusing cached KV of the
        context). Returns float32 CPU ``[len(continuation_ids)]``; its sum is
        ``log p(continuation | context)``.

        Raises:
            TypeError / ValueError: bad or empty ``context_ids`` / ``continuation_ids``, or the
                two together longer than the model's context.
        """
        query = self.front.score(context_ids, continuation_ids, False,
                                 self.front.adapter_key(lora_name))
        return (await self.front.ask(query)).clone()

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
            lora_name: None or a registered adapter's name.

        Returns:
            The pair `(logprobs, is_greedy)` of CPU tensors of length `n = len(continuation_ids)`:
                float32 `logprobs[i] = log p(cont[i] | ctx + cont[:i])` (as
                [token_logprobs][genback.llm.AsyncLM.token_logprobs] gives) and bool
                `is_greedy[i]`, whether `cont[i]` is the argmax of that distribution.

        Raises:
            TypeError / ValueError: bad or empty ids, or the two together longer than the
                model's context (only this caller fails).
            BatcherClosed: the model was closed or reset while the query waited.
        """
        query = self.front.score(context_ids, continuation_ids, True,
                                 self.front.adapter_key(lora_name))
        logprobs, greedy = await self.front.ask(query)
        return logprobs.clone(), greedy.clone()

    # -- caches and lifecycle ----------------------------------------------------------------------

    def cache_info(self) -> dict:
        """Counters, read without waiting for a running forward: ``queries`` (calls answered),
        ``tokens_queried`` (their context lengths), ``row_hits`` (answered from the output
        cache), ``batches``, ``batched_queries`` (distinct queries those batches computed),
        ``rows_cached`` and ``rows_bytes`` (the output cache), then the runner's ``stats()``
        (``forwards``, ``tokens_forwarded``; AsyncTransformer's KV tree: ``kv_bytes``,
        ``kv_nodes``, ``evictions``, ``attention``, ...; AsyncVirtualLM's:
        :meth:`genback.llm.vllm.runner.VLLMRunner.stats`)."""
        return self.front.info()

    @property
    def forwards(self) -> int:
        """Forwards the runner ran (``cache_info()["forwards"]``; on vLLM its requests)."""
        return self.runner.stats()["forwards"]

    @property
    def tokens_forwarded(self) -> int:
        """Tokens the runner forwarded, padding excluded (``cache_info()["tokens_forwarded"]``)."""
        return self.runner.stats()["tokens_forwarded"]

    def clear_cache(self) -> None:
        """Drop every cached row and every unpinned cached KV state (pinned prompts stay)."""
        self.front.clear(rows=True, keep_pinned=True)

    def clear_kv_cache(self) -> None:
        """Drop every cached KV state, pinned ones included (rows stay)."""
        self.front.clear(rows=False, keep_pinned=False)

    def cache_kv(self, prompt_tokens, lora_name=None) -> None:
        """Compute ``prompt_tokens``' KV now and keep it (AsyncTransformer pins it: it is never
        evicted until ``clear_kv_cache``, so every query extending the prompt forwards only its
        new tokens; on AsyncVirtualLM its full KV blocks enter vLLM's prefix cache, which evicts
        them by its own LRU policy: no pinning).

        Raises:
            TypeError / ValueError: bad ``prompt_tokens``, an unknown ``lora_name``, or
                (AsyncTransformer) a prompt whose KV alone exceeds the KV budget.
        """
        adapter = self.front.adapter_key(lora_name)
        self.front.pin(self.front.tokens(prompt_tokens, "prompt_tokens"), adapter)

    def reset_async_queries(self) -> int:
        """Fail every pending query with ``BatcherClosed``; return how many callers were failed.

        Use it when an exception left an inference algorithm's queries pending. Batches already
        computing finish normally (on AsyncVirtualLM every vLLM request in flight is aborted:
        rows, scores and samples). Safe from any thread.
        """
        return self.scheduler.reset()

    async def aclose(self) -> None:
        """Stop serving: pending queries fail, the worker finishes its batch, the runner is
        closed (AsyncVirtualLM: every request aborted, the engine shut down, its processes
        exit; works after an engine failure). Idempotent."""
        if self.scheduler.closed:
            return
        await asyncio.to_thread(self.front.close)

    def close(self) -> None:
        """Blocking form of :meth:`aclose`."""
        if self.scheduler.closed:
            return
        self.front.close()

    # -- the parts' methods: decoding (lm.decoding), genlm-backend's queue (lm.queue) -------------

    async def choose_next(self, token_ids, pick: Pick, lora_name=None) -> Choice:
        """One decoding step: :meth:`.decoding.Decoding.choose_next`."""
        return await self.decoding.choose_next(token_ids, pick, lora_name)

    def generate_stream(self, prompt_token_ids, params: SamplingParams, max_new_tokens: int,
                        eos_token_ids=None, *, min_new_tokens: int = 0, stop_token_ids=(),
                        lora_name=None):
        """Stream one generation's choices: :meth:`.decoding.Decoding.generate_stream`."""
        return self.decoding.generate_stream(
            prompt_token_ids, params, max_new_tokens, eos_token_ids,
            min_new_tokens=min_new_tokens, stop_token_ids=stop_token_ids, lora_name=lora_name)

    def sample_stream(self, prompt_token_ids, max_tokens, eos_token_ids, temperature=1.0,
                      seed=None, lora_name=None):
        """Stream :meth:`sample`'s ids: :meth:`.decoding.Decoding.sample_stream`."""
        return self.decoding.sample_stream(prompt_token_ids, max_tokens, eos_token_ids,
                                           temperature, seed, lora_name)

    async def sample(self, prompt_token_ids, max_tokens, eos_token_ids, temperature=1.0,
                     seed=None, lora_name=None) -> list[int]:
        """Ancestral sampling: :meth:`.decoding.Decoding.sample`."""
        return await self.decoding.sample(prompt_token_ids, max_tokens, eos_token_ids,
                                          temperature, seed, lora_name)

    async def batch_sample(self, prompt_token_ids_list, max_tokens, eos_token_ids,
                           temperature=1.0, seed=None, lora_name=None) -> list[list[int]]:
        """:meth:`sample` for every prompt at once: :meth:`.decoding.Decoding.batch_sample`."""
        return await self.decoding.batch_sample(prompt_token_ids_list, max_tokens,
                                                eos_token_ids, temperature, seed, lora_name)

    def add_query(self, query, future: asyncio.Future, past=None, lora_name=None) -> None:
        """Queue a next-token query for ``future``: :meth:`.queue_api.QueueAPI.add_query`."""
        self.queue.add_query(query, future, past, lora_name)

    @property
    def queries(self) -> list:
        """The running loop's pending queries (:meth:`.queue_api.QueueAPI.pending`); assigning
        ``[]`` fails them (:meth:`.queue_api.QueueAPI.set_pending`)."""
        return self.queue.pending()

    @queries.setter
    def queries(self, value) -> None:
        self.queue.set_pending(value)

    def batch_evaluate_queries(self) -> None:
        """Dispatch the pending batch now: :meth:`.queue_api.QueueAPI.batch_evaluate_queries`."""
        self.queue.batch_evaluate_queries()
