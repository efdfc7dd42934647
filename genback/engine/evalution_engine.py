"""Evalution engine over genback (needs ``evalution``, the ``[eval]`` extra).

``GenbackEvalutionEngine(...).model(path="smollm2-135m").run(suite)`` runs any Evalution suite
on a genback model. Evalution checks that ``build`` returns its own ``BaseInferenceSession``, so
the session here subclasses Evalution's class and delegates every call to a
:class:`~genback.engine.session.GenbackSession`, converting the outputs into Evalution's
dataclasses (same field names and values).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

from . import _missing_extra

try:
    from evalution.engines import base as ev
except ImportError as _exc:
    raise _missing_extra("genback.engine.GenbackEvalutionEngine", "Evalution (PyPI: evalution)",
                        "evalution", _exc) from _exc

from .engine import GenbackEngine, model_name
from .session import GenbackSession

__all__ = ["GenbackEvalutionEngine", "GenbackEvalutionSession"]


def _convert(output, cls):
    return cls(**{f.name: getattr(output, f.name) for f in fields(cls)})


class GenbackEvalutionSession(ev.BaseInferenceSession):
    """Evalution's session contract, answered by a :class:`GenbackSession`."""

    def __init__(self, session: GenbackSession):
        self.session = session

    def generate(self, requests, *, batch_size=None):
        """Evalution ``GenerationOutput`` objects, one per request, in order.

        Raises:
            ValueError / TypeError / SessionClosed: as :meth:`GenbackSession.generate
                <genback.engine.session.GenbackSession.generate>`.
        """
        return [_convert(o, ev.GenerationOutput)
                for o in self.session.generate(requests, batch_size=batch_size)]

    def generate_continuous(self, requests: Iterable, *, batch_size=None) -> Iterator:
        """``(request_id, GenerationOutput)`` in completion order.

        Raises:
            ValueError / TypeError / SessionClosed: as :meth:`GenbackSession.generate_continuous
                <genback.engine.session.GenbackSession.generate_continuous>`.
        """
        for request_id, o in self.session.generate_continuous(requests, batch_size=batch_size):
            yield request_id, _convert(o, ev.GenerationOutput)

    def loglikelihood(self, requests, *, batch_size=None):
        """Evalution ``LoglikelihoodOutput`` objects, one per request, in order.

        Raises:
            ValueError / TypeError / SessionClosed: as :meth:`GenbackSession.loglikelihood
                <genback.engine.session.GenbackSession.loglikelihood>`.
        """
        return [_convert(o, ev.LoglikelihoodOutput)
                for o in self.session.loglikelihood(requests, batch_size=batch_size)]

    def loglikelihood_continuous(self, requests: Iterable, *, batch_size=None) -> Iterator:
        """``(request_id, LoglikelihoodOutput)`` in completion order.

        Raises:
            ValueError / TypeError / SessionClosed: as :meth:`GenbackSession.loglikelihood_continuous
                <genback.engine.session.GenbackSession.loglikelihood_continuous>`.
        """
        for request_id, o in self.session.loglikelihood_continuous(requests, batch_size=batch_size):
            yield request_id, _convert(o, ev.LoglikelihoodOutput)

    def loglikelihood_rolling(self, requests, *, batch_size=None):
        """Evalution ``RollingLoglikelihoodOutput`` objects, one per request.

        Raises:
            ValueError / TypeError / SessionClosed: as :meth:`GenbackSession.loglikelihood_rolling
                <genback.engine.session.GenbackSession.loglikelihood_rolling>`.
        """
        return [_convert(o, ev.RollingLoglikelihoodOutput)
                for o in self.session.loglikelihood_rolling(requests, batch_size=batch_size)]

    def gc(self) -> None:
        """Drop the model's caches (:meth:`GenbackSession.gc
        <genback.engine.session.GenbackSession.gc>`); raises nothing."""
        self.session.gc()

    def close(self) -> None:
        """Close the session (idempotent).

        Raises:
            RuntimeError: called from the session's own loop thread.
        """
        self.session.close()

    def describe_execution(self) -> dict[str, Any]:
        """:meth:`GenbackSession.describe_execution
        <genback.engine.session.GenbackSession.describe_execution>`; raises nothing."""
        return self.session.describe_execution()


@dataclass
class GenbackEvalutionEngine(GenbackEngine, ev.BaseEngine):
    """Evalution engine with :class:`~genback.engine.engine.GenbackEngine`'s options.

    ``build(model)`` loads ``model.path`` (alias, folder or Hub id) with ``backend`` unless an
    ``lm`` was given; Evalution's ``.model(path=...)`` comes from Evalution's ``BaseEngine``.
    """

    def build(self, model) -> GenbackEvalutionSession:
        """A session for Evalution's ``model`` (an object with a ``path``, or a name).

        Raises:
            TypeError: ``model`` is neither a str nor has a str ``path``.
            ValueError / ImportError: the model or its backend cannot be loaded (see
                ``genback.llm.load_model_by_name``).
        """
        return GenbackEvalutionSession(GenbackEngine.build(self, model_name(model)))

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain data, with ``"engine": "genback"``; raises nothing."""
        return {"engine": "genback", **GenbackEngine.to_dict(self)}
