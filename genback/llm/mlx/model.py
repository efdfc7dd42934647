"""``AsyncMlxLM``: the ``AsyncLM`` API over an mlx-lm model (Apple silicon; MLX's CPU on Linux).

The computation is :class:`genback.llm.mlx.MlxRunner`'s: a prefix KV store reused across
queries that share a prefix, and one forward per group of queries with equal cached and total
lengths. Batching, the output cache, sync forms and sampling are ``AsyncLM``'s, shared with
every backend. Install with ``pip install "genback[mlx]"`` (``mlx[cpu]`` on Linux).
"""

from __future__ import annotations

import os

from ...core.lm import AsyncLM

_DTYPES = ("float32", "bfloat16", "float16")


def _require_mlx():
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            'AsyncMlxLM needs mlx and mlx-lm: pip install "genback[mlx]" (on Linux: '
            'pip install "mlx[cpu]==0.32.4" mlx-lm==0.32.2)') from exc


def _config_overrides(config: dict) -> dict:
    """mlx-lm settings for a transformers >= 5 config: its ``rope_parameters`` hold the RoPE base
    (``rope_theta``) that mlx-lm's Llama-family models read only from the top level (without this
    they silently use 10,000: SmolLM2's rows would be off by ~0.03)."""
    rope = config.get("rope_parameters")
    if "rope_theta" in config or not isinstance(rope, dict) or "rope_theta" not in rope:
        return {}
    out = {"rope_theta": rope["rope_theta"]}
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def _runner(model, **options):
    """An :class:`~genback.llm.mlx.runner.MlxRunner` over ``model``, whose parameters are
    evaluated first: a model built lazily on this thread (e.g. fused adapters) is materialised
    here, as MLX cannot evaluate this thread's pending graphs on the runner's thread."""
    import mlx.core as mx

    from .runner import MlxRunner

    mx.eval(model.parameters())
    return MlxRunner(model, **options)


def _hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer that ``AsyncLM`` needs: the one inside mlx-lm's
    ``TokenizerWrapper`` (what ``mlx_lm.load`` gives), else ``tokenizer`` itself."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


def _local_folder(model_name: str) -> str:
    """The local folder of ``model_name`` (an embedded alias, a folder, or a Hub id: its snapshot
    folder, downloaded when online). Raises :class:`genback.registry.ModelNotFoundError` as
    :func:`genback.registry.resolve` does, or when the snapshot cannot be had."""
    from ...registry import resolve, unavailable

    path = resolve(model_name)
    if not os.path.isdir(path):  # a Hub id (online): its snapshot folder, downloaded
        from huggingface_hub import snapshot_download

        try:
            path = snapshot_download(path)
        except (OSError, ValueError) as exc:
            raise unavailable(model_name, exc) from exc
    return path


def _load_model(path: str, model_name: str):
    """mlx-lm's model from folder ``path`` (its config's RoPE settings fixed by
    :func:`_config_overrides`). Raises :class:`genback.registry.ModelNotFoundError` when mlx-lm
    cannot load it."""
    from pathlib import Path

    from mlx_lm.utils import load_config, load_model

    from ...registry import unavailable

    folder = Path(path)
    try:
        model, _ = load_model(folder, model_config=_config_overrides(load_config(folder)))
    except (OSError, ValueError) as exc:
        raise unavailable(model_name, exc) from exc
    return model


def _with_adapters(model, adapter_path: str):
    """``model`` with the mlx-lm LoRA adapters of folder ``adapter_path`` applied
    (``mlx_lm.utils.load_adapters``). Raises ValueError unless the folder exists."""
    from mlx_lm.utils import load_adapters

    if not os.path.isdir(adapter_path):
        raise ValueError(f"adapter_path must be an existing folder, got {adapter_path!r}")
    return load_adapters(model, adapter_path)


class AsyncMlxLM(AsyncLM):
    """Async, auto-batched next-token log-probs from an mlx-lm model, with prefix KV reuse.

    Args:
        mlx_lm_model: an mlx-lm model (``mlx_lm.load(path)[0]``).
        tokenizer: its tokenizer: a Hugging Face tokenizer or mlx-lm's ``TokenizerWrapper``.
        timeout: genlm-backend's name of ``batch_window`` (seconds).
        prefill_step_size: tokens per chunk of a long prefill (>= 1).
        cache_size: genlm-backend's name of ``row_cache_size``.
        cache_opts: genlm-backend's output-cache options; only None or ``{}`` (genback's row
            cache has no options).
        batch_size: most distinct queries per batch (>= 1); settable later.
        batch_window: seconds a batch waits for more queries, from its first query.
        row_cache_size: most next-token rows kept (float32 ``[V]`` each).
        kv_budget_bytes: most bytes of KV kept for reuse (default 1 GiB); LRU beyond it.
        max_batch_tokens: most new tokens (rows x tokens) one forward computes.

    Rows are float32 CPU torch tensors ``[V]`` (``V`` = the model's logit width, the length of
    ``byte_vocab``), whatever the model's dtype.

    LoRA: ``add_new_lora(path, name)`` loads an mlx-lm adapter folder (``adapter_config.json`` +
    ``adapters.safetensors``, as ``mlx_lm.lora`` saves it; see :mod:`genback.llm.mlx.lora`),
    ``remove_lora(name)`` drops it, and every query method takes ``lora_name=``. KV and rows are
    kept per adapter. All adapters of one model must wrap the same modules (``num_layers`` and
    ``keys``; rank and scale may differ); the base model's rows are unchanged by their presence.

    Raises:
        ValueError: an option out of range. ImportError: mlx / mlx-lm are not installed.
    """

    def __init__(
        self,
        mlx_lm_model,
        tokenizer,
        timeout: float | None = None,
        prefill_step_size: int = 512,
        cache_size: int | None = None,
        cache_opts: dict | None = None,
        *,
        batch_size: int = 512,
        batch_window: float = 0.002,
        row_cache_size: int = 1024,
        kv_budget_bytes: int = 1 << 30,
        max_batch_tokens: int = 2048,
    ):
        _require_mlx()
        if cache_opts:
            raise ValueError(f"cache_opts must be None or empty for genback's row cache, got "
                             f"{cache_opts!r}")
        self.mlx_lm_model = mlx_lm_model
        self.prefill_step_size = prefill_step_size
        runner = _runner(mlx_lm_model, kv_budget_bytes=kv_budget_bytes,
                         max_batch_tokens=max_batch_tokens, prefill_step_size=prefill_step_size)
        args = getattr(mlx_lm_model, "args", None)
        try:
            super().__init__(
                _hf_tokenizer(tokenizer),
                runner,
                vocab_size=runner.vocab_size,
                batch_size=batch_size,
                batch_window=batch_window if timeout is None else timeout,
                row_cache_size=row_cache_size if cache_size is None else cache_size,
                max_context_length=getattr(args, "max_position_embeddings", None),
            )
        except BaseException:
            runner.close()
            raise

    @classmethod
    def from_name(cls, model_name: str = "smollm2-135m", dtype: str | None = "float32",
                  adapter_path: str | None = None, **kwargs) -> "AsyncMlxLM":
        """Load a model by embedded alias, local Hugging Face / MLX folder or Hub id.

        Args:
            model_name: ``"smollm2-135m"`` (default), a local folder of safetensors weights, or
                a Hub id (read from the local Hugging Face cache when ``HF_HUB_OFFLINE=1``).
            dtype: ``"float32"`` (default: the rows then match AsyncTransformer's fp32 rows within
                1e-4), ``"bfloat16"``, ``"float16"``, or None for the checkpoint's own dtype.
            adapter_path: a folder of mlx-lm LoRA adapters applied to the model.
            **kwargs: passed to the constructor (``batch_size``, ``timeout``, ``cache_size``, ...).

        Raises:
            genback.registry.ModelNotFoundError: (a ``ValueError`` and an ``OSError``) the model
                is not available or mlx-lm cannot load it (see :func:`genback.registry.resolve`).
            ValueError: a bad ``dtype``.
            ImportError: mlx / mlx-lm are not installed.
        """
        _require_mlx()
        import mlx.core as mx
        from transformers import AutoTokenizer

        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES} or None, got {dtype!r}")
        path = _local_folder(model_name)
        model = _load_model(path, model_name)
        if dtype is not None:
            model.set_dtype(getattr(mx, dtype))
        if adapter_path is not None:
            model = _with_adapters(model, adapter_path)
        model.eval()
        return cls(model, AutoTokenizer.from_pretrained(path), **kwargs)

    def next_token_logprobs_uncached(self, token_ids, lora_name=None):
        """Reference: one forward of ``token_ids`` alone under ``lora_name`` (None: the base
        model), no cache, no batching.

        Returns float32 CPU ``[V]``.

        Raises:
            TypeError / ValueError: bad ``token_ids`` or an unknown ``lora_name``.
        """
        adapter = self._lora_key(lora_name)
        ids = self._check_ids(token_ids)
        self.front.check_open()
        with self.front.lock:
            return self.runner.uncached_row(ids, adapter)
