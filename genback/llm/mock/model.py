"""``MockAsyncLM``: a model-free ``AsyncLM`` over a real tokenizer's vocabulary, for tests.

Its rows are deterministic pseudo-random log-distributions keyed by the whole context (see
:mod:`genback.llm.mock.runner`), computed through the same batcher and output cache as the real
backends.
"""

from __future__ import annotations

from .runner import MockRunner
from ...core.lm import AsyncLM


class MockAsyncLM(AsyncLM):
    """Deterministic fake next-token distributions over ``tokenizer``'s vocabulary.

    Args:
        tokenizer: a Hugging Face tokenizer (its ``len`` is the row width unless ``vocab_size``).
        vocab_size: the row width ``V`` (default ``len(tokenizer)``).
        **kwargs: ``AsyncLM`` options (``batch_size``, ``batch_window``, ``row_cache_size``).
    """

    def __init__(self, tokenizer, vocab_size: int | None = None, **kwargs):
        width = len(tokenizer) if vocab_size is None else vocab_size
        super().__init__(tokenizer, MockRunner(width), vocab_size=width, **kwargs)

    @classmethod
    def from_name(cls, model_name: str = "smollm2-135m", **kwargs) -> "MockAsyncLM":
        """A mock over the tokenizer of ``model_name`` (embedded alias, folder or Hub id).

        Raises:
            genback.registry.ModelNotFoundError: (a ``ValueError`` and an ``OSError``) the model's
                tokenizer is not available (see :func:`genback.registry.resolve`).
        """
        from transformers import AutoTokenizer

        from ...registry import resolve, unavailable

        path = resolve(model_name)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except OSError as exc:
            raise unavailable(model_name, exc) from exc
        return cls(tokenizer, **kwargs)

    def _row(self, tokens):
        return self.runner.row(tuple(tokens))
