"""``BaseEngine`` / ``BaseInferenceSession``: the engine contract (Evalution 0.0.17's shape).

An engine holds configuration and builds a session for one model; a session serves the inference
calls of the suites and owns the live runtime state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import asdict, is_dataclass
from typing import Any

from .types import (
    GenerationOutput,
    GenerationRequest,
    LoglikelihoodOutput,
    LoglikelihoodRequest,
    RollingLoglikelihoodOutput,
    RollingLoglikelihoodRequest,
)

__all__ = ["BaseEngine", "BaseInferenceSession"]


class BaseInferenceSession(ABC):
    """A live model session: every method takes ``requests, *, batch_size=None``."""

    @property
    def request_executor_requires_non_main_thread(self) -> bool:
        return True

    @abstractmethod
    def generate(self, requests: list[GenerationRequest], *,
                 batch_size: int | None = None) -> list[GenerationOutput]:
        """One output per request, in request order."""

    @abstractmethod
    def loglikelihood(self, requests: list[LoglikelihoodRequest], *,
                      batch_size: int | None = None) -> list[LoglikelihoodOutput]:
        """One output per request, in request order."""

    def loglikelihood_continuous(
        self, requests: Iterable[tuple[Any, LoglikelihoodRequest]], *,
        batch_size: int | None = None,
    ) -> Iterator[tuple[Any, LoglikelihoodOutput]]:
        """``(request_id, output)`` pairs; this default scores everything in one call."""
        items = list(requests)
        outputs = self.loglikelihood([r for _, r in items], batch_size=batch_size)
        for (item_id, _), output in zip(items, outputs, strict=True):
            yield item_id, output

    @abstractmethod
    def loglikelihood_rolling(self, requests: list[RollingLoglikelihoodRequest], *,
                              batch_size: int | None = None) -> list[RollingLoglikelihoodOutput]:
        """One output per request, in request order."""

    @abstractmethod
    def generate_continuous(
        self, requests: Iterable[tuple[Any, GenerationRequest]], *,
        batch_size: int | None = None,
    ) -> Iterator[tuple[Any, GenerationOutput]]:
        """``(request_id, output)`` pairs in completion order."""

    @abstractmethod
    def gc(self) -> None:
        """Release reusable caches (between suites); the model stays loaded."""

    @abstractmethod
    def close(self) -> None:
        """Release everything; idempotent."""

    def describe_execution(self) -> dict[str, Any] | None:
        return None


class BaseEngine(ABC):
    """Engine configuration; ``build(model)`` makes a session for one model."""

    @abstractmethod
    def build(self, model: Any) -> BaseInferenceSession:
        """A session for ``model`` (a name / folder, or an object with a ``path``)."""

    def to_dict(self) -> dict[str, Any]:
        if is_dataclass(self):
            return asdict(self)
        return {}
