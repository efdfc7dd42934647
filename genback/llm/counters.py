"""``RunnerCounters``: the work counters an ``AsyncLM`` backend reads off its runner."""

from __future__ import annotations


class RunnerCounters:
    """``forwards`` / ``tokens_forwarded`` of a backend whose runner (``self._runner``) counts
    them (mixed into :class:`~genback.llm.AsyncLM` subclasses)."""

    @property
    def forwards(self) -> int:
        """Model forwards run by batches (not counting the uncached reference)."""
        return self._runner.forwards

    @property
    def tokens_forwarded(self) -> int:
        """Tokens the model computed for batches (each query's tokens beyond its reused KV)."""
        return self._runner.tokens_forwarded
