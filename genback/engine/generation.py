"""Text generation on any ``AsyncLM``: prompt preparation, sampling, stop strings, streaming.

Decoding asks ``lm.next_token_logprobs(prompt + generated)`` once per step, so every request in
flight joins the same auto-batches (continuous batching: a request that arrives mid-way joins
the next batch) and, on ``AsyncTransformer``, each step forwards one token on top of the KV the
previous step left in the prefix tree.

Sampling follows the usual logits-warper order of ``transformers.generate``: temperature, then
top-k, then top-p (nucleus sampling, Holtzman et al. 2020: keep the smallest set of most likely
tokens whose probability reaches ``top_p``), then one ``torch.multinomial`` draw with a CPU
``torch.Generator`` seeded per request, so a seeded request is reproducible whatever else runs
beside it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Callable

import torch

from .encoding import encode_text, prefix_token_id
from .types import GenerationOutput, GenerationRequest

__all__ = ["StreamEvent", "SamplingParams", "sampling_params", "prepare_prompt", "eos_token_ids",
           "decode", "next_token"]


@dataclass(slots=True)
class StreamEvent:
    """One step of a streamed generation.

    Attributes:
        text: new text since the previous event. Text that could still turn into a stop string,
            or that ends inside a UTF-8 character, is held back until it is settled, so the
            concatenated ``text`` of all events equals the final ``output.text``.
        token_ids: the tokens generated since the previous event (empty on a final event that
            only flushes held-back text).
        output: the finished ``GenerationOutput`` on the last event, None before.
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    output: GenerationOutput | None = None

    @property
    def finished(self) -> bool:
        return self.output is not None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Resolved decoding options of one request (``greedy`` when not sampling)."""

    greedy: bool
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


def _number(value, name: str, lo: float, hi: float = math.inf, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if value < lo or value > hi or (lo_open and value == lo):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value!r}")
    return float(value)


def sampling_params(request: GenerationRequest, default_seed: int | None = None) -> SamplingParams:
    """Decoding options from a request.

    Sampling happens when ``do_sample`` is true and ``temperature > 0``; otherwise decoding is
    greedy (``do_sample=True`` with ``temperature == 0`` is the greedy limit). ``top_k``,
    ``top_p`` and ``seed`` are read from ``request.metadata`` (Evalution's request has no such
    fields); ``default_seed`` is used when the request gives none.

    Raises:
        ValueError / TypeError: ``num_beams != 1``, a negative temperature, ``top_k < 0``,
            ``top_p`` outside ``(0, 1]``, a non-integer seed.
    """
    if request.num_beams != 1:
        raise ValueError(f"num_beams must be 1 (genback decodes a single beam), got "
                         f"{request.num_beams!r}")
    temperature = _number(request.temperature, "temperature", 0.0)
    meta = request.metadata or {}
    top_k = meta.get("top_k", 0) or 0
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"metadata['top_k'] must be an int >= 0 (0: off), got {top_k!r}")
    top_p = _number(meta.get("top_p", 1.0), "metadata['top_p']", 0.0, 1.0, lo_open=True)
    seed = meta.get("seed", default_seed)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise TypeError(f"metadata['seed'] must be an int, got {seed!r}")
    greedy = not (request.do_sample and temperature > 0)
    return SamplingParams(greedy, temperature if not greedy else 1.0, int(top_k), top_p,
                          None if seed is None else int(seed))


def prepare_prompt(tokenizer, request: GenerationRequest) -> tuple[str, list[int]]:
    """``(prompt text, prompt ids)`` of a generation request.

    Precedence: ``input_ids`` (used as given), ``rendered_prompt`` (encoded without special
    tokens: it is already rendered), ``messages`` (rendered by the tokenizer's chat template with
    ``add_generation_prompt``, ``chat_template_kwargs`` and ``tools``, then encoded without
    special tokens), ``prompt`` (encoded with the tokenizer's default special tokens, like a
    log-likelihood context). An empty prompt starts from the prefix token (BOS, else EOS).

    Raises:
        ValueError: the request has none of the four, or ``messages`` on a tokenizer without a
            chat template.
    """
    if request.input_ids is not None:
        ids = [int(t) for t in request.input_ids]
        text = request.rendered_prompt if request.rendered_prompt is not None else tokenizer.decode(ids)
    elif request.rendered_prompt is not None:
        text = request.rendered_prompt
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    elif request.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("messages were given but the tokenizer has no chat template; "
                             "pass prompt= instead")
        kwargs = dict(request.chat_template_kwargs or {})
        if request.tools:
            kwargs["tools"] = request.tools
        text = tokenizer.apply_chat_template(
            list(request.messages), tokenize=False,
            add_generation_prompt=request.add_generation_prompt, **kwargs)
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    elif request.prompt is not None:
        text = request.prompt
        ids = encode_text(tokenizer, text)
    else:
        raise ValueError("a GenerationRequest needs prompt, messages, rendered_prompt or "
                         "input_ids; all of them are None")
    if not ids:
        ids = [prefix_token_id(tokenizer)]
    return text, ids


def eos_token_ids(lm) -> set[int]:
    """The tokenizer's EOS plus the model's ``generation_config.eos_token_id`` (int or list)."""
    ids = set()
    if lm.tokenizer.eos_token_id is not None:
        ids.add(int(lm.tokenizer.eos_token_id))
    config = getattr(getattr(lm, "model", None), "generation_config", None)
    extra = getattr(config, "eos_token_id", None)
    if extra is not None:
        ids.update(int(t) for t in ([extra] if isinstance(extra, int) else extra))
    return ids


def next_token(logprobs: torch.Tensor, params: SamplingParams, generator) -> int:
    """The next token from a float32 ``[V]`` log-prob row: argmax, or a draw after the warpers."""
    if params.greedy:
        return int(logprobs.argmax())
    logits = logprobs.double() / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the tokens ranked above
        drop = before >= params.top_p
        drop[0] = False
        probs = probs.clone()
        probs[order[drop]] = 0.0
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _earliest_stop(text: str, stops: list[str]) -> int:
    cuts = [text.find(s) for s in stops if s and s in text]
    return min(cuts) if cuts else -1


async def decode(
    lm,
    prompt_text: str,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    max_new_tokens: int,
    stop: list[str],
    eos_ids: set[int],
    max_length: int | None = None,
    on_event: Callable[[StreamEvent], None] | None = None,
    metadata: dict | None = None,
) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``.

    Stops at an EOS token (not included; ``finish_reason="eos"``), when the text contains a stop
    string (the text is cut at the earliest one; ``"stop"``), or after ``max_new_tokens`` tokens
    or at the model's ``max_length`` (``"length"``). ``on_event`` receives the
    :class:`StreamEvent` of every step, the last carrying the output.

    Returns:
        ``GenerationOutput(prompt=prompt_text, text, metadata)`` with metadata ``finish_reason``,
        ``prompt_tokens``, ``completion_tokens`` (tokens generated, EOS excluded), ``token_ids``
        and, when a stop string cut the text, ``stop``; plus the request's ``metadata``.
    """
    tokenizer = lm.tokenizer
    generator = None
    if not params.greedy:
        generator = torch.Generator()
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
    stops = [s for s in stop if s]
    hold = max((len(s) for s in stops), default=1) - 1
    generated: list[int] = []
    text, emitted, pending_ids = "", 0, []
    finish, matched = "length", None
    while len(generated) < max_new_tokens:
        if max_length and len(prompt_ids) + len(generated) >= max_length:
            break
        row = await lm.next_token_logprobs(prompt_ids + generated)
        token = next_token(row, params, generator)
        if token in eos_ids:
            finish = "eos"
            break
        generated.append(token)
        pending_ids.append(token)
        text = tokenizer.decode(generated)
        cut = _earliest_stop(text, stops)
        if cut >= 0:
            matched = min((s for s in stops if s in text), key=lambda s: text.find(s))
            text, finish = text[:cut], "stop"
            break
        if on_event is not None:
            safe = len(text) - hold
            while safe > emitted and text[safe - 1] == "\ufffd":
                safe -= 1
            if safe > emitted:
                on_event(StreamEvent(text[emitted:safe], pending_ids))
                emitted, pending_ids = safe, []
    meta = dict(metadata or {})
    meta.update(finish_reason=finish, prompt_tokens=len(prompt_ids),
                completion_tokens=len(generated), token_ids=list(generated))
    if matched is not None:
        meta["stop"] = matched
    output = GenerationOutput(prompt=prompt_text, text=text, metadata=meta)
    if on_event is not None:
        on_event(StreamEvent(text[emitted:], pending_ids, output))
    return output
