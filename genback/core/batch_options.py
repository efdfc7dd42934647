"""``BatchOptions``: the batcher's two settings, ``batch_size`` and ``batch_window``, as a model
exposes them (:class:`genback.core.front.Front` has them; ``AsyncLM`` forwards them): read and set
on genback's :class:`~genback.batching.batcher.Batcher`, None on a backend whose engine sizes its own
batches (vLLM, :class:`~genback.batching.immediate.Immediate`)."""

from __future__ import annotations

from ..batching.batcher import Batcher
from .inputs import check_positive_int


class BatchOptions:
    """``batch_size`` and ``batch_window`` of ``self.scheduler`` (a mixin of the front)."""

    scheduler: object

    @property
    def batch_size(self) -> int | None:
        """Most distinct queries per batch of genback's batcher (settable: from the next batch);
        None on a backend whose engine sizes its own batches (vLLM).

        Raises:
            ValueError: set to a non-positive int, or on a backend without genback's batcher.
        """
        return self.scheduler.max_batch_size if isinstance(self.scheduler, Batcher) else None

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self._batcher("batch_size").max_batch_size = check_positive_int(value, "batch_size")

    @property
    def batch_window(self) -> float | None:
        """Seconds a batch of genback's batcher waits for more queries, from its first query
        (settable); None on a backend whose engine sizes its own batches (vLLM).

        Raises:
            ValueError: set to a negative or non-finite number, or on a backend without
                genback's batcher.
        """
        return self.scheduler.window if isinstance(self.scheduler, Batcher) else None

    @batch_window.setter
    def batch_window(self, value: float) -> None:
        self._batcher("batch_window").window = Batcher.check_window(value)

    def _batcher(self, name: str) -> Batcher:
        if not isinstance(self.scheduler, Batcher):
            raise ValueError(f"{name} is a setting of genback's batcher; this backend's engine "
                             f"sizes its own batches")
        return self.scheduler
