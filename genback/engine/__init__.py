"""Evaluation facade: Evalution's engine contract over genback's async models.

``GenbackEngine(backend="hf").build("smollm2-135m")`` gives a :class:`GenbackSession` with
``generate``, ``generate_continuous``, ``loglikelihood``, ``loglikelihood_continuous``,
``loglikelihood_rolling``, ``gc``, ``close`` and ``describe_execution`` (plus ``stream`` and
``agenerate`` for async callers). The harness adapters are imported lazily, so genback does not
need the harnesses: ``GenbackLM`` (lm-eval model ``"genback"``, needs ``lm_eval``) and
``GenbackEvalutionEngine`` (needs ``evalution``); both come with the ``[eval]`` extra
(``pip install "genback[eval]"``), and without it importing them raises an ``ImportError`` that
says so.
"""

from __future__ import annotations

from .base import BaseEngine, BaseInferenceSession
from .engine import BACKENDS, GenbackEngine
from .generation import StreamEvent
from .loop_thread import SessionClosed
from .session import GenbackSession
from .types import (GenerationOutput, GenerationRequest, LoglikelihoodOutput,
                    LoglikelihoodRequest, RollingLoglikelihoodOutput, RollingLoglikelihoodRequest)

__all__ = [
    "BACKENDS",
    "BaseEngine",
    "BaseInferenceSession",
    "GenbackEngine",
    "GenbackSession",
    "SessionClosed",
    "StreamEvent",
    "GenerationRequest",
    "GenerationOutput",
    "LoglikelihoodRequest",
    "LoglikelihoodOutput",
    "RollingLoglikelihoodRequest",
    "RollingLoglikelihoodOutput",
    # lazily imported (not in ``import *``): GenbackLM, register_lm_eval, GenbackEvalutionEngine
]

_EVAL_EXTRA = 'pip install "genback[eval]"'


def _missing_extra(part: str, package: str, module: str, exc: ImportError) -> ImportError:
    """The ``ImportError`` for a harness adapter whose package (from the ``[eval]`` extra) is missing.

    Names the part, the package, the extra and the pip command; ``name`` is the missing module.
    """
    err = ImportError(f"{part} needs {package}, which the [eval] extra installs: {_EVAL_EXTRA} "
                      f"(importing {module!r} failed: {exc})")
    err.name = module
    return err


def __getattr__(name):  # the harness adapters import their harness: only on demand
    if name in ("GenbackLM", "register_lm_eval"):
        from . import lm_eval_model

        return getattr(lm_eval_model, name)
    if name == "GenbackEvalutionEngine":
        from .evalution_engine import GenbackEvalutionEngine

        return GenbackEvalutionEngine
    raise AttributeError(f"module 'genback.engine' has no attribute {name!r}")
