"""Choosing the next token: the one sampling module of every backend that samples on our side.

A decoding step is a :class:`Pick`: the :class:`SamplingParams` of the request plus what the step
needs besides the context (how many tokens of the context are the prompt, the step number for
the seeded draw, tokens banned at this step). :func:`choose` applies it to one row of logits on
the model's device, in this order (the order of the serving engines and of
``transformers.generate``'s logits processors):

1. ``repetition_penalty`` over every token of the context (prompt and generated): a seen token's
   logit is divided by the penalty when positive, multiplied when negative;
2. ``presence_penalty`` / ``frequency_penalty`` over the generated tokens: subtract the penalty
   once per distinct token / once per occurrence;
3. ``no_repeat_ngram_size = n``: tokens that would repeat an n-gram of the context are banned;
4. the step's banned tokens (EOS and stop ids before ``min_new_tokens``);
5. greedy: argmax. Sampling: ``/ temperature``, ``top_k``, ``top_p`` (nucleus: the smallest set
   of most likely tokens whose mass reaches ``top_p``), ``min_p`` (drop tokens below ``min_p``
   times the top probability), then one ``torch.multinomial`` draw from a generator seeded with
   ``(seed, step)``, so a seeded request draws the same tokens whatever runs beside it.

The reported log-probs (``Choice.logprob``, ``Choice.top_logprobs``) are the model's own
(``log_softmax`` of the raw logits), as vLLM reports them by default.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .context import flat

__all__ = ["SamplingParams", "Pick", "Choice", "choose", "choose_rows"]

_MASK = 0x7FFF_FFFF_FFFF_FFFF


def _real(value, name: str, lo: float, hi: float = math.inf, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}: {value!r}")
    if value < lo or value > hi or (lo_open and value == lo):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value!r}")
    return float(value)


def _int(value, name: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return int(value)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request chooses its tokens (validated at construction).

    Args:
        greedy: argmax (True) or a draw (False; ``temperature`` > 0 then).
        temperature: > 0; logits are divided by it before the draw.
        top_k: keep the ``top_k`` most likely tokens (0: all).
        top_p: in ``(0, 1]``; nucleus sampling (1: off).
        min_p: in ``[0, 1]``; drop tokens below ``min_p`` x the top probability (0: off).
        seed: int or None; with a seed the draws are reproducible.
        repetition_penalty: > 0 (1: off), over prompt and generated tokens.
        presence_penalty, frequency_penalty: any real (0: off), over generated tokens.
        no_repeat_ngram_size: >= 0 (0: off).
        logprobs: report the chosen token's log-prob.
        top_logprobs: >= 0; also report that many most likely tokens and their log-probs.

    Raises:
        TypeError / ValueError: a field of the wrong type or out of range (the message names it).
    """

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self):
        if not isinstance(self.greedy, bool):
            raise TypeError(f"greedy must be a bool, got {self.greedy!r}")
        if not isinstance(self.logprobs, bool):
            raise TypeError(f"logprobs must be a bool, got {self.logprobs!r}")
        set_ = object.__setattr__
        set_(self, "temperature", _real(self.temperature, "temperature", 0.0, lo_open=True))
        set_(self, "top_k", _int(self.top_k, "top_k", 0))
        set_(self, "top_p", _real(self.top_p, "top_p", 0.0, 1.0, lo_open=True))
        set_(self, "min_p", _real(self.min_p, "min_p", 0.0, 1.0))
        if self.seed is not None:
            set_(self, "seed", _int(self.seed, "seed", -(1 << 63)))
        set_(self, "repetition_penalty",
             _real(self.repetition_penalty, "repetition_penalty", 0.0, lo_open=True))
        set_(self, "presence_penalty", _real(self.presence_penalty, "presence_penalty", -math.inf))
        set_(self, "frequency_penalty",
             _real(self.frequency_penalty, "frequency_penalty", -math.inf))
        set_(self, "no_repeat_ngram_size", _int(self.no_repeat_ngram_size,
                                                "no_repeat_ngram_size", 0))
        set_(self, "top_logprobs", _int(self.top_logprobs, "top_logprobs", 0))

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits: the choice is the raw argmax."""
        return (self.greedy and self.repetition_penalty == 1.0 and self.presence_penalty == 0.0
                and self.frequency_penalty == 0.0 and self.no_repeat_ngram_size == 0)


@dataclass(frozen=True, slots=True)
class Pick:
    """One decoding step of a request: ``params``, the number of context tokens that are the
    prompt (the rest were generated), the step number (0 for the first new token) and the
    token ids banned at this step."""

    params: SamplingParams
    prompt_length: int
    step: int
    banned: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Choice:
    """The chosen token; ``logprob`` (None unless asked for) is its model log-prob,
    ``top_logprobs`` the most likely ``(token id, log-prob)`` pairs (empty unless asked for)."""

    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def _penalise(logits: torch.Tensor, context, pick: Pick) -> torch.Tensor:
    """logits: float32 [V] on the device (a copy: changed in place) -> the processed logits."""
    p = pick.params
    dev, V = logits.device, logits.shape[0]
    if (p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
            or p.no_repeat_ngram_size):
        context = flat(context)  # (a Context's flat tuple once: the penalties read it all)
    if p.repetition_penalty != 1.0 and context:
        seen = torch.tensor(sorted(set(context)), dtype=torch.long, device=dev)
        seen = seen[seen < V]
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                   vals * p.repetition_penalty)
    generated = (context[pick.prompt_length:] if p.presence_penalty or p.frequency_penalty
                 else ())
    if generated:
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long, device=dev),
                                minlength=V)[:V].float()
        logits -= p.presence_penalty * (counts > 0).float() + p.frequency_penalty * counts
    n = p.no_repeat_ngram_size
    if n and len(context) >= n:
        prefix = tuple(context[len(context) - n + 1:]) if n > 1 else ()
        banned = {context[i + n - 1] for i in range(len(context) - n + 1)
                  if tuple(context[i:i + n - 1]) == prefix}
        if banned:
            logits[torch.tensor(sorted(banned), dtype=torch.long, device=dev)] = -math.inf
    if pick.banned:
        logits[torch.tensor(pick.banned, dtype=torch.long, device=dev)] = -math.inf
    return logits


def _draw(logits: torch.Tensor, pick: Pick) -> int:
    p = pick.params
    logits = logits / p.temperature
    V = logits.shape[0]
    if 0 < p.top_k < V:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits.double(), dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the tokens ranked above
        drop = before >= p.top_p
        drop[0] = False
        probs = probs.clone()
        probs[order[drop]] = 0.0
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    generator = torch.Generator(device=logits.device)
    if p.seed is None:
        generator.seed()
    else:
        generator.manual_seed(hash((p.seed, pick.step)) & _MASK)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def choose(logits: torch.Tensor, context, pick: Pick) -> Choice:
    """Choose the next token from one row of logits.

    Args:
        logits: ``[V]`` logits (any float dtype) on any device; not modified.
        context: the token ids before the chosen token (prompt then generated), a sequence of
            ints (used by the penalties).
        pick: the step (:class:`Pick`).

    Returns:
        :class:`Choice`; only the token id and the asked-for log-probs leave the device.

    Raises:
        ValueError: every token was banned (nothing can be chosen).
    """
    p = pick.params
    row = logits.float()
    if p.plain_greedy and not pick.banned:
        chosen = row.argmax()
    else:
        processed = _penalise(row.clone(), context, pick)
        if not bool(torch.isfinite(processed).any()):
            raise ValueError("every token is banned at this step (no_repeat_ngram_size / "
                             "min_new_tokens): nothing can be chosen")
        chosen = processed.argmax() if p.greedy else None
        if chosen is None:
            token = _draw(processed, pick)
            chosen = torch.tensor(token, device=row.device)
    if not (p.logprobs or p.top_logprobs):
        return Choice(int(chosen))
    lps = torch.log_softmax(row, dim=-1)
    top = ()
    if p.top_logprobs:
        values, ids = torch.topk(lps, min(p.top_logprobs, lps.shape[0]))
        top = tuple(zip(ids.tolist(), values.tolist()))
    return Choice(int(chosen), float(lps[chosen]), top)


def choose_rows(logits: torch.Tensor, contexts, picks) -> list[Choice]:
    """:func:`choose` for each row of ``logits`` ``[K, V]`` (``contexts[k]``, ``picks[k]``); the
    plain greedy steps (no penalty, ban or log-probs) share one argmax and one transfer."""
    out: list = [None] * len(picks)
    plain = [k for k, p in enumerate(picks)
             if p.params.plain_greedy and not p.banned and not p.params.logprobs
             and not p.params.top_logprobs]
    if plain:
        idx = torch.tensor(plain, dtype=torch.long, device=logits.device)
        for k, token in zip(plain, logits.index_select(0, idx).argmax(dim=-1).tolist()):
            out[k] = Choice(int(token))
    for k, pick in enumerate(picks):
        if out[k] is None:
            out[k] = choose(logits[k], contexts[k], pick)
    return out
