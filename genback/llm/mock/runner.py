"""The mock runner: deterministic pseudo-random rows keyed by the whole context, no model.

Each row is ``log_softmax(3 * randn(V))`` drawn from a ``torch.Generator`` seeded with the CRC-32
of the context's ids (int64 bytes), so equal contexts get equal rows and any two different
contexts almost surely differ.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np
import torch

from ...queries.kinds import NextToken, Prefill, Query, Score, Step
from ...batching.runner import Capabilities
from ...queries.sampling import choose


class MockRunner:
    """Runner of :class:`~genback.llm.MockAsyncLM` over a vocabulary of ``vocab_size`` tokens."""

    capabilities = Capabilities(picks=True)  # answers decoding steps (Step) itself

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.forwards = 0
        self.tokens_forwarded = 0

    def row(self, tokens: tuple[int, ...]) -> torch.Tensor:
        """float32 CPU ``[V]``: the mock's next-token log-probs after ``tokens``."""
        seed = zlib.crc32(np.asarray(tokens, dtype=np.int64).tobytes())
        logits = torch.randn(self.vocab_size, generator=torch.Generator().manual_seed(seed))
        return torch.log_softmax(logits * 3.0, dim=-1)

    def run(self, queries: Sequence[Query]) -> list:
        self.forwards += 1
        results = []
        for q in queries:
            self.tokens_forwarded += len(q.tokens)
            match q:
                case Step():
                    results.append(choose(self.row(q.tokens), q.tokens, q.pick))
                case NextToken():
                    results.append(self.row(q.tokens))
                case Prefill():
                    results.append(None)
                case Score():
                    results.append(self._score(q))
        return results

    def _score(self, q: Score):
        start = len(q.tokens) - len(q.targets) + 1
        rows = [self.row(q.tokens[: start + j]) for j in range(len(q.targets))]
        lps = torch.stack([row[t] for row, t in zip(rows, q.targets)])
        if q.greedy:
            flags = torch.tensor([int(row.argmax()) == t for row, t in zip(rows, q.targets)])
            return lps, flags
        return lps

    def stats(self) -> dict:
        return {"forwards": self.forwards, "tokens_forwarded": self.tokens_forwarded}

    def clear(self, keep_pinned: bool) -> None:
        pass

    def pin(self, tokens: tuple[int, ...], adapter: int | None = None) -> None:
        pass

    def close(self) -> None:
        pass
