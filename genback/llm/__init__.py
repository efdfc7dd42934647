"""Async language models: ``AsyncLM``, its backends' classes, and ``load_model_by_name``.

Public exports only. ``AsyncLM`` is :mod:`genback.core.lm`'s; each backend's class
(``AsyncTransformer``, ``AsyncVirtualLM``, ``AsyncMlxLM``, ``MockAsyncLM``) is imported from its
folder ``genback.llm.<name>.model`` the first time it is asked for (:mod:`genback.llm.backends`,
the one table), so ``from genback.llm import AsyncTransformer`` does not import vLLM's or MLX's
facade.
"""

from __future__ import annotations

from .backends import BACKEND_NAMES as _BACKENDS  # the one table of backends
from .backends import backend_class, class_backend
from ..batching.batcher import BatcherClosed
from ..core.lm import AsyncLM
from ..queries.kinds import Query

__all__ = [
    "AsyncLM",
    "AsyncTransformer",
    "AsyncVirtualLM",
    "AsyncMlxLM",
    "MockAsyncLM",
    "BatcherClosed",
    "Query",
    "load_model_by_name",
]


def __getattr__(name: str):
    """A backend's class, imported from its folder on first use (``genback.llm.AsyncTransformer``)."""
    backend = class_backend(name)
    if backend is None:
        raise AttributeError(f"module 'genback.llm' has no attribute {name!r}")
    cls = backend_class(backend.name)
    globals()[name] = cls
    return cls


def _default_backend() -> str:
    """``"vllm"`` when a CUDA device and vLLM are both available, else ``"hf"``."""
    import importlib.util

    import torch

    if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None:
        return "vllm"
    return "hf"


def load_model_by_name(name: str = "smollm2-135m", backend: str | None = None,
                       llm_opts: dict | None = None) -> AsyncLM:
    """Load a model by embedded alias, local folder or Hub id.

    Args:
        name: ``"smollm2-135m"`` (default), a local Hugging Face folder, or a Hub id.
        backend: ``"vllm"`` (AsyncVirtualLM), ``"hf"`` (AsyncTransformer), ``"mlx"``
            (AsyncMlxLM, needs ``genback[mlx]``) or ``"mock"`` (MockAsyncLM); None picks ``"vllm"`` when CUDA and vLLM are available, else ``"hf"``.
        llm_opts: keyword options for the backend's ``from_name`` (for ``"vllm"``, e.g.
            ``{"engine_opts": {"tensor_parallel_size": 2}}``).

    Raises:
        ValueError: an unknown backend.
        genback.registry.ModelNotFoundError: (a ``ValueError`` and an ``OSError``) the model is
            not available (see :func:`genback.registry.resolve`).
        ImportError: ``backend="vllm"`` without vLLM, or ``"mlx"`` without mlx / mlx-lm.
    """
    if backend is None:
        backend = _default_backend()
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS} or None, got {backend!r}")
    return backend_class(backend).from_name(name, **dict(llm_opts or {}))
