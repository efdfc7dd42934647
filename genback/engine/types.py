"""Request and output dataclasses of the engine facade.

Field names, order and defaults follow Evalution 0.0.17's ``evalution.engines.base`` so that
suites written against Evalution can hand their objects to a genback session unchanged (the
session only reads attributes, so Evalution's own dataclasses work too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "GenerationRequest",
    "GenerationOutput",
    "LoglikelihoodRequest",
    "LoglikelihoodOutput",
    "RollingLoglikelihoodRequest",
    "RollingLoglikelihoodOutput",
]


@dataclass(slots=True)
class GenerationRequest:
    """One generation: ``prompt`` text, or chat ``messages``, or ``rendered_prompt`` /
    ``input_ids`` already prepared. ``temperature == 0`` or ``do_sample=False`` is greedy.
    genback also reads ``metadata["seed"]``, ``metadata["top_k"]`` and ``metadata["top_p"]``."""

    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    rendered_prompt: str | None = None
    input_ids: list[int] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    stop: list[str] = field(default_factory=list)
    max_new_tokens: int = 256
    num_beams: int = 1
    do_sample: bool = False
    temperature: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class GenerationOutput:
    """The text generated for one request. genback's metadata: ``finish_reason`` ("stop", "eos",
    "length"), ``prompt_tokens``, ``completion_tokens``, ``token_ids``; ``error`` on a bad request."""

    prompt: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class LoglikelihoodRequest:
    """Score ``continuation`` given ``context`` (or the pre-tokenized ids when given)."""

    context: str = ""
    continuation: str = ""
    context_input_ids: list[int] | None = None
    continuation_input_ids: list[int] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class LoglikelihoodOutput:
    """Summed continuation log-prob, whether every continuation token is the argmax, and how
    many tokens were scored. A bad request gives ``logprob=-inf``, ``token_count=0`` and
    ``metadata["error"]``."""

    logprob: float
    is_greedy: bool
    token_count: int
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RollingLoglikelihoodRequest:
    """Score all of ``text`` token by token (perplexity)."""

    text: str
    input_ids: list[int] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RollingLoglikelihoodOutput:
    """Total log-prob of every token of the text and the number of tokens scored."""

    logprob: float
    token_count: int
    metadata: dict[str, Any] = field(default_factory=dict)


# -- the documented outputs of a failed request (errors="record") ------------------------------------


def _error_metadata(request, message: str) -> dict[str, Any]:
    return {**(getattr(request, "metadata", None) or {}), "error": message}


def loglikelihood_error(request, message: str) -> LoglikelihoodOutput:
    """A failed scoring request's output: ``-inf``, not greedy, ``token_count=0``, and
    ``metadata["error"] = message``."""
    return LoglikelihoodOutput(float("-inf"), False, 0, _error_metadata(request, message))


def rolling_error(request, message: str) -> RollingLoglikelihoodOutput:
    """A failed rolling request's output: ``-inf``, ``token_count=0``, ``metadata["error"]``."""
    return RollingLoglikelihoodOutput(float("-inf"), 0, _error_metadata(request, message))


def generation_error(request, message: str) -> GenerationOutput:
    """A failed generation's output: ``text=""``, ``finish_reason="error"``, no tokens, and
    ``metadata["error"] = message``."""
    prompt = getattr(request, "prompt", None) or getattr(request, "rendered_prompt", None) or ""
    meta = {**_error_metadata(request, message), "finish_reason": "error", "prompt_tokens": 0,
            "completion_tokens": 0, "token_ids": []}
    return GenerationOutput(prompt=prompt, text="", metadata=meta)
