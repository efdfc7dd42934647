"""``GenbackEngine``: engine configuration that builds a :class:`GenbackSession` for one model."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ..llm.backends import BACKEND_NAMES, check_backend
from .base import BaseEngine
from .session import GenbackSession

__all__ = ["GenbackEngine", "BACKENDS", "model_name"]

#: the backend names (from the one table, :data:`genback.llm.backends.BACKENDS`)
BACKENDS = BACKEND_NAMES


def model_name(model: Any) -> str:
    """The model name of ``model``: a str, or an object with a ``path`` (Evalution's ``Model``).

    Raises:
        TypeError: anything else.
    """
    if isinstance(model, str):
        return model
    path = getattr(model, "path", None)
    if isinstance(path, str):
        return path
    raise TypeError(f"model must be a name / folder (str) or have a str .path, got "
                    f"{type(model).__name__}: {model!r}")


@dataclass
class GenbackEngine(BaseEngine):
    """Build sessions that run genback's async models.

    Args:
        backend: ``"hf"`` (``AsyncTransformer``), ``"vllm"`` (``AsyncVirtualLM``), ``"mlx"``
            (``AsyncMlxLM``) or ``"mock"`` (``MockAsyncLM``): the table
            :data:`genback.llm.backends.BACKENDS`; models are loaded with
            ``genback.llm.load_model_by_name``.
        llm_opts: keyword options for the backend's ``from_name`` (e.g. ``batch_size``,
            ``kv_budget_bytes``, ``hf_opts={"dtype": torch.bfloat16, "device_map": "cuda"}``).
        lm: an already loaded ``AsyncLM`` to use instead of loading one (``build`` then ignores
            the model name, and closing the session leaves this model open).
        max_length, max_in_flight, pair_encoding, seed, errors: session options, see
            :class:`GenbackSession`.

    Raises:
        ValueError: unknown backend (at construction).
    """

    backend: str = "hf"
    llm_opts: dict[str, Any] = field(default_factory=dict)
    lm: Any = None
    max_length: int | None = None
    max_in_flight: int = 256
    pair_encoding: str = "lm_eval"
    seed: int | None = 0
    errors: str = "record"

    def __post_init__(self):
        check_backend(self.backend)

    def build(self, model: Any = None) -> GenbackSession:
        """A session for ``model`` (embedded alias, local folder, Hub id, or an object with a
        ``path``; default ``"smollm2-135m"``), or for ``lm`` when one was given.

        Raises:
            TypeError: ``model`` is neither a str nor has a str ``path``.
            ValueError: the model cannot be loaded (see ``load_model_by_name``), or a session
                option is out of range (see :class:`GenbackSession`).
            ImportError: the backend's package is not installed (vLLM, mlx-lm).
        """
        if self.lm is not None:
            lm, owns = self.lm, False
        else:
            from ..llm import load_model_by_name
            from ..registry import DEFAULT_MODEL

            name = DEFAULT_MODEL if model is None else model_name(model)
            lm, owns = load_model_by_name(name, backend=self.backend, llm_opts=self.llm_opts), True
        return GenbackSession(
            lm, owns_lm=owns, backend=self.backend, max_length=self.max_length,
            max_in_flight=self.max_in_flight, pair_encoding=self.pair_encoding, seed=self.seed,
            errors=self.errors,
        )

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain data (a given ``lm`` appears as its class name); raises
        nothing."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lm"}
        out["llm_opts"] = {k: repr(v) if not isinstance(v, (str, int, float, bool, type(None)))
                           else v for k, v in self.llm_opts.items()}
        out["lm"] = None if self.lm is None else type(self.lm).__name__
        return out
