"""Text generation on any ``AsyncLM``: prompt preparation, the generation config, stop strings,
streaming.

Decoding consumes ``lm.generate_stream(prompt, params, ...)``, the public streaming method of
every ``AsyncLM``. Its base form asks ``lm.choose_next(prompt + generated, pick)`` once per step:
the token is chosen by :mod:`genback.queries.sampling` where the logits are (on ``AsyncTransformer`` on
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

from ..queries.sampling import SamplingParams
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
    """A request's checked decoding options: the :class:`~genback.queries.sampling.SamplingParams`, the
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
    meta, temperature = _checked_request(request)
    greedy = not (request.do_sample and temperature > 0)
    opts = {key: meta[key] for key in _PARAM_KEYS if meta.get(key) is not None}
    try:
        params = SamplingParams(greedy=greedy, temperature=1.0 if greedy else float(temperature),
                                seed=meta.get("seed", default_seed), **opts)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"metadata: {exc}") from None
    return GenerationConfig(params, _min_new_tokens(meta), _stop_token_ids(meta))


def _checked_request(request: GenerationRequest) -> tuple[dict, numbers.Real]:
    """``(metadata, temperature)`` of a request whose ``num_beams``, ``metadata``, ``temperature``
    and ``do_sample`` are checked (``metadata`` None is ``{}``)."""
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
    return meta, temperature


def _min_new_tokens(meta: dict) -> int:
    """``metadata['min_new_tokens']`` checked (an int >= 0; missing or None is 0)."""
    min_new = meta.get("min_new_tokens", 0) or 0
    if isinstance(min_new, bool) or not isinstance(min_new, numbers.Integral) or min_new < 0:
        raise ValueError(f"metadata['min_new_tokens'] must be an int >= 0, got {min_new!r}")
    return int(min_new)


def _stop_token_ids(meta: dict) -> tuple[int, ...]:
    """``metadata['stop_token_ids']`` checked (a list or tuple of int ids >= 0; missing is ())."""
    stop_ids = meta.get("stop_token_ids") or ()
    if isinstance(stop_ids, (str, bytes)) or not isinstance(stop_ids, (list, tuple)) or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0
            for t in stop_ids):
        raise TypeError(f"metadata['stop_token_ids'] must be a list of int token ids, got "
                        f"{stop_ids!r}")
    return tuple(int(t) for t in stop_ids)


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


async def decode(lm, prompt_text: str, prompt_ids: list[int], config: GenerationConfig, *,
                 max_new_tokens: int, stop: list[str], eos_ids: set[int], max_length: int | None = None,
                 on_event: Callable[[StreamEvent], None] | None = None, metadata: dict | None = None,
                 ) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``.

    The tokens come from ``lm.generate_stream`` (one ``choose_next`` step per token on
    ``AsyncTransformer``; one streamed request sampled by vLLM on ``AsyncVirtualLM``). Stops
    at an EOS token or one of ``config.stop_token_ids`` (not included; ``finish_reason="eos"`` /
    ``"stop"``; neither can end it before ``config.min_new_tokens``: they are banned until then),
    when the text contains a stop string (checked on the new text of each step; the text is cut
    at the earliest one; ``"stop"``; the stream is closed then, so the backend stops
    generating), or after ``max_new_tokens`` tokens or at the model's ``max_length``
    (``"length"``). ``on_event`` receives the :class:`StreamEvent` of every step, the last
    carrying the output.

    Returns:
        ``GenerationOutput(prompt=prompt_text, text, metadata)`` with metadata ``finish_reason``,
        ``prompt_tokens``, ``completion_tokens`` (tokens generated, EOS excluded), ``token_ids``,
        ``stop`` when a stop string or stop id ended it, and with ``logprobs`` / ``top_logprobs``
        asked for, ``logprobs`` (one float per generated token) / ``top_logprobs`` (one list of
        ``[token id, log-prob]`` pairs per generated token); plus the request's ``metadata``.
    """
    limit = max_new_tokens
    if max_length:
        limit = max(0, min(limit, max_length - len(prompt_ids)))
    run = _Run(lm.tokenizer, config, eos_ids, [s for s in stop if s])
    stream = lm.generate_stream(prompt_ids, config.params, limit, sorted(eos_ids),
                                min_new_tokens=config.min_new_tokens,
                                stop_token_ids=config.stop_token_ids)
    try:
        async for choice in stream:
            if not run.step(choice, on_event):
                break
    finally:
        await stream.aclose()  # a stop string ended it early: the backend stops generating
    return run.output(prompt_text, prompt_ids, metadata, on_event)


@dataclass
class _Run:
    """One generation in progress (``decode``'s state): the tokens and log-probs so far, the
    text, how much of it the events have carried, and what ended it."""

    tokenizer: object
    config: GenerationConfig
    eos_ids: set[int]
    stops: list[str]  # the non-empty stop strings
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[list]] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of text the events have carried
    pending_ids: list[int] = field(default_factory=list)  # tokens no event has carried yet
    finish: str = "length"
    matched: object = None  # the stop string or stop id that ended the generation
    hold: int = field(init=False)  # characters held back: a stop string could start there

    def __post_init__(self):
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def step(self, choice, on_event) -> bool:
        """Take one chosen token; False when it ends the generation (an EOS or stop id, not
        kept; a stop string in the text, which is cut there). Sends the text settled by this
        step to ``on_event``."""
        if self._ends_at(choice.token):
            return False
        self.generated.append(choice.token)
        self.pending_ids.append(choice.token)
        if self.config.params.logprobs:
            self.logprobs.append(choice.logprob)
        if self.config.params.top_logprobs:
            self.tops.append([[t, lp] for t, lp in choice.top_logprobs])
        if self._cut_at_stop_string():
            return False
        if on_event is not None:
            self._emit_settled(on_event)
        return True

    def _ends_at(self, token: int) -> bool:
        """Whether ``token`` is an EOS (``"eos"``) or stop id (``"stop"``), recording which."""
        if token in self.eos_ids or token in self.config.stop_token_ids:
            self.finish = "eos" if token in self.eos_ids else "stop"
            if self.finish == "stop":
                self.matched = token
            return True
        return False

    def _cut_at_stop_string(self) -> bool:
        """Decode the text; when a stop string appeared, cut the text at the earliest one and
        return True. Only the new text can complete one (back up for one that straddles, and for
        a partial UTF-8 character the new token completed)."""
        before = len(self.text)
        self.text = self.tokenizer.decode(self.generated)
        cut, found = _earliest_stop(self.text, self.stops, max(0, before - self.hold - 2))
        if cut >= 0:
            self.matched, self.text, self.finish = found, self.text[:cut], "stop"
        return cut >= 0

    def _emit_settled(self, on_event) -> None:
        """Send the text no event has carried and no stop string or UTF-8 character can still
        change (the last ``hold`` characters and a trailing U+FFFD wait), if any."""
        safe = len(self.text) - self.hold
        while safe > self.emitted and self.text[safe - 1] == "\ufffd":
            safe -= 1
        if safe > self.emitted:
            on_event(StreamEvent(self.text[self.emitted : safe], self.pending_ids))
            self.emitted, self.pending_ids = safe, []

    def output(self, prompt_text: str, prompt_ids: list[int], metadata: dict | None,
               on_event) -> GenerationOutput:
        """The finished output (``decode``'s Returns), also sent to ``on_event`` with the held
        text."""
        meta = dict(metadata or {})
        meta.update(finish_reason=self.finish, prompt_tokens=len(prompt_ids),
                    completion_tokens=len(self.generated), token_ids=list(self.generated))
        if self.matched is not None:
            meta["stop"] = self.matched
        if self.config.params.logprobs:
            meta["logprobs"] = self.logprobs
        if self.config.params.top_logprobs:
            meta["top_logprobs"] = self.tops
        output = GenerationOutput(prompt=prompt_text, text=self.text, metadata=meta)
        if on_event is not None:
            on_event(StreamEvent(self.text[self.emitted :], self.pending_ids, output))
        return output
