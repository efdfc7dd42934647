"""``AsyncMlxLM``: the ``AsyncLM`` API over MLX (Apple silicon); absent on other machines."""

from __future__ import annotations

from .base import AsyncLM


class AsyncMlxLM(AsyncLM):
    """Placeholder type for MLX models: genback does not ship an MLX backend.

    It exists as its own class because clients branch on the model type; constructing it raises
    ``NotImplementedError``.
    """

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "AsyncMlxLM is not available: genback has no MLX backend; use AsyncTransformer"
        )

    @classmethod
    def from_name(cls, model_name, **kwargs):
        return cls(model_name, **kwargs)
