"""Text generation on any ``AsyncLM``: prompt preparation, the generation config, stop strings,
streaming.

Decoding consumes ``lm.generate_stream(prompt, params, ...)``, the public streaming method of
every ``AsyncLM``. Its base form asks ``lm.choose_next(prompt + generated, pick)`` once per step:
the token is chosen by :mod:`genback.sampling` where the logits are (on ``AsyncTransformer`` on
the model's device, only the token and the asked-for log-probs come back), and every request in
flight joins the same auto-batches (continuous batching: a finished request leaves, a request
that arrives mid-way joins the next step's forward); on ``AsyncTransformer`` each step forwards
one token per request on top of the KV the previous step left in the prefix tree.
``AsyncVirtualLM`` streams each generation as one vLLM request sampled by vLLM's own sampler
(``RequestOutputKind.DELTA``), so tokens arrive as vLLM makes them. Stop strings are checked
here, on the new text only; a match closes the stream (the vLLM request is aborted).

The generation config of a request (:func:`generation_config`): ``temperature`` / ``do_sample``
and ``max_new_tokens`` from the request's fields, the rest from ``request.metadata``: ``top_k``,
``top_p``, ``min_p``, ``seed``, ``min_new_tokens``, ``stop_token_ids``, ``repetition_penalty``,
``presence_penalty``, ``frequency_penalty``, ``no_repeat_ngram_size``, ``logprobs`` (bool) and
``top_logprobs`` (int).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Callable

from ..sampling import SamplingParams
from .encoding import encode_text, prefix_token_id
from .types import GenerationOutput, GenerationRequest

__all__ = ["StreamEvent", "GenerationConfig", "generation_config", "prepare_prompt",
           "eos_token_ids", "decode"]


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


# metadata keys that are SamplingParams fields (besides seed)
_PARAM_KEYS = ("top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "no_repeat_ngram_size", "logprobs", "top_logprobs")


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    """A request's checked decoding options: the :class:`~genback.sampling.SamplingParams`, the
    least number of new tokens before EOS / stop ids may end it, and extra stop token ids."""

    params: SamplingParams
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()


def generation_config(request: GenerationRequest, default_seed: int | None = None
                      ) -> GenerationConfig:
    """The generation config of a request (see the module docstring for where each option is).

    Sampling happens when ``do_sample`` is true and ``temperature > 0``; otherwise decoding is
    greedy (``do_sample=True`` with ``temperature == 0`` is the greedy limit). ``default_seed``
    is used when a sampled request gives no seed.

    Raises:
        ValueError / TypeError: ``num_beams != 1``, ``metadata`` not a dict, or an option of
            the wrong type or out of range (the message names it and the value).
    """
    if request.num_beams != 1:
        raise ValueError(f"num_beams must be 1 (genback decodes a single beam), got "
                         f"{request.num_beams!r}")
    meta = request.metadata if request.metadata is not None else {}
    if not isinstance(meta, dict):
        raise TypeError(f"metadata must be a dict, got {type(meta).__name__}: {meta!r}")
    temperature = request.temperature
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
            or math.isnan(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if not isinstance(request.do_sample, bool):
        raise TypeError(f"do_sample must be a bool, got {request.do_sample!r}")
    greedy = not (request.do_sample and temperature > 0)
    opts = {}
    for key in _PARAM_KEYS:
        if meta.get(key) is not None:
            opts[key] = meta[key]
    seed = meta.get("seed", default_seed)
    try:
        params = SamplingParams(greedy=greedy, temperature=1.0 if greedy else float(temperature),
                                seed=seed, **opts)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"metadata: {exc}") from None
    min_new = meta.get("min_new_tokens", 0) or 0
    if isinstance(min_new, bool) or not isinstance(min_new, numbers.Integral) or min_new < 0:
        raise ValueError(f"metadata['min_new_tokens'] must be an int >= 0, got {min_new!r}")
    stop_ids = meta.get("stop_token_ids") or ()
    if isinstance(stop_ids, (str, bytes)) or not isinstance(stop_ids, (list, tuple)) or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0
            for t in stop_ids):
        raise TypeError(f"metadata['stop_token_ids'] must be a list of int token ids, got "
                        f"{stop_ids!r}")
    return GenerationConfig(params, int(min_new), tuple(int(t) for t in stop_ids))


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
    """The ids that end a generation on ``lm``: ``lm.eos_token_ids`` (the tokenizer's EOS and the
    model's own, on every backend)."""
    return set(lm.eos_token_ids)


def _earliest_stop(text: str, stops: list[str], start: int = 0) -> tuple[int, str | None]:
    """``(index, stop string)`` of the stop string that occurs first in ``text[start:]``
    (``(-1, None)`` when none does)."""
    best, found = -1, None
    for stop in stops:
        i = text.find(stop, start)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, stop
    return best, found


async def decode(
    lm,
    prompt_text: str,
    prompt_ids: list[int],
    config: GenerationConfig,
    *,
    max_new_tokens: int,
    stop: list[str],
    eos_ids: set[int],
    max_length: int | None = None,
    on_event: Callable[[StreamEvent], None] | None = None,
    metadata: dict | None = None,
) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``.

    The tokens come from ``lm.generate_stream`` (one ``choose_next`` step per token on
    ``AsyncTransformer``; one streamed request sampled by vLLM on ``AsyncVirtualLM``). Stops
    at an EOS token or one of ``config.stop_token_ids`` (not included; ``finish_reason="eos"`` /
    ``"stop"``; neither can end it before ``config.min_new_tokens``: they are banned until then),
    when the text contains a stop string (checked on the new text of each step; the text is cut
    at the earliest one; ``"stop"``; the stream is closed then, so the backend stops
    generating), or after ``max_new_tokens`` tokens or at the model's
    ``max_length`` (``"length"``). ``on_event`` receives the :class:`StreamEvent` of every step,
    the last carrying the output.

    Returns:
        ``GenerationOutput(prompt=prompt_text, text, metadata)`` with metadata ``finish_reason``,
        ``prompt_tokens``, ``completion_tokens`` (tokens generated, EOS excluded), ``token_ids``,
        ``stop`` when a stop string or stop id ended it, and with ``logprobs`` / ``top_logprobs``
        asked for, ``logprobs`` (one float per generated token) / ``top_logprobs`` (one list of
        ``[token id, log-prob]`` pairs per generated token); plus the request's ``metadata``.
    """
    tokenizer = lm.tokenizer
    params = config.params
    stops = [s for s in stop if s]
    hold = max((len(s) for s in stops), default=1) - 1
    limit = max_new_tokens
    if max_length:
        limit = max(0, min(limit, max_length - len(prompt_ids)))
    generated: list[int] = []
    logprobs: list[float] = []
    tops: list[list[list]] = []
    text, emitted, pending_ids = "", 0, []
    finish, matched = "length", None
    stream = lm.generate_stream(prompt_ids, params, limit, sorted(eos_ids),
                                min_new_tokens=config.min_new_tokens,
                                stop_token_ids=config.stop_token_ids)
    try:
        async for choice in stream:
            token = choice.token
            if token in eos_ids or token in config.stop_token_ids:
                finish = "eos" if token in eos_ids else "stop"
                if finish == "stop":
                    matched = token
                break
            generated.append(token)
            pending_ids.append(token)
            if params.logprobs:
                logprobs.append(choice.logprob)
            if params.top_logprobs:
                tops.append([[t, lp] for t, lp in choice.top_logprobs])
            before = len(text)
            text = tokenizer.decode(generated)
            # only the new text can complete a stop string (back up for one that straddles,
            # and for a partial UTF-8 character the new token completed)
            cut, found = _earliest_stop(text, stops, max(0, before - hold - 2))
            if cut >= 0:
                matched, text, finish = found, text[:cut], "stop"
                break
            if on_event is not None:
                safe = len(text) - hold
                while safe > emitted and text[safe - 1] == "\ufffd":
                    safe -= 1
                if safe > emitted:
                    on_event(StreamEvent(text[emitted:safe], pending_ids))
                    emitted, pending_ids = safe, []
    finally:
        await stream.aclose()  # a stop string ended it early: the backend stops generating
    meta = dict(metadata or {})
    meta.update(finish_reason=finish, prompt_tokens=len(prompt_ids),
                completion_tokens=len(generated), token_ids=list(generated))
    if matched is not None:
        meta["stop"] = matched
    if params.logprobs:
        meta["logprobs"] = logprobs
    if params.top_logprobs:
        meta["top_logprobs"] = tops
    output = GenerationOutput(prompt=prompt_text, text=text, metadata=meta)
    if on_event is not None:
        on_event(StreamEvent(text[emitted:], pending_ids, output))
    return output
