"""``AsyncVirtualLM``: the ``AsyncLM`` API over vLLM (see the vLLM issue; not implemented yet)."""

from __future__ import annotations

from .base import AsyncLM


class AsyncVirtualLM(AsyncLM):
    """The genback API over a vLLM engine.

    Not available in this release: constructing it raises ``NotImplementedError`` with the
    alternative. The class exists so that clients can name it and branch on types.
    """

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "AsyncVirtualLM (vLLM backend) is not available in this genback release; "
            "use AsyncTransformer or load_model_by_name(name, backend='hf')"
        )

    @classmethod
    def from_name(cls, model_name, engine_opts=None, **kwargs):
        return cls(model_name, engine_opts, **kwargs)
