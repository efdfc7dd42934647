"""``MockAsyncLM``: a model-free ``AsyncLM`` over a real tokenizer's vocabulary, for tests.

Its rows are deterministic pseudo-random log-distributions keyed by the whole context (a CRC-32
of the ids seeds a ``torch.Generator``), computed through the same batcher and output cache as
the real backends.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from .base import AsyncLM, Query


class MockAsyncLM(AsyncLM):
    """Deterministic fake next-token distributions over ``tokenizer``'s vocabulary.

    Args:
        tokenizer: a Hugging Face tokenizer (its ``len`` is the row width unless ``vocab_size``).
        **kwargs: ``AsyncLM`` options (``vocab_size``, ``batch_size``, ``batch_window``, ...).
    """

    def __init__(self, tokenizer, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.forwards = 0

    @classmethod
    def from_name(cls, model_name: str = "smollm2-135m", **kwargs) -> "MockAsyncLM":
        """A mock over the tokenizer of ``model_name`` (embedded alias, folder or Hub id)."""
        from transformers import AutoTokenizer

        from ..registry import resolve

        return cls(AutoTokenizer.from_pretrained(resolve(model_name)), **kwargs)

    def _row(self, tokens: tuple[int, ...]) -> torch.Tensor:
        seed = zlib.crc32(np.asarray(tokens, dtype=np.int64).tobytes())
        logits = torch.randn(self.vocab_size, generator=torch.Generator().manual_seed(seed))
        return torch.log_softmax(logits * 3.0, dim=-1)

    def _compute(self, queries: list[Query]) -> list[torch.Tensor]:
        self.forwards += 1
        results = []
        for q in queries:
            if q.targets is None:
                results.append(self._row(q.tokens))
            else:
                start = len(q.tokens) - len(q.targets) + 1
                results.append(torch.stack([
                    self._row(q.tokens[: start + j])[t] for j, t in enumerate(q.targets)
                ]))
        return results

    def cache_info(self) -> dict:
        return {**super().cache_info(), "forwards": self.forwards}
