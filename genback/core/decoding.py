"""``Decoding``: decoding steps, generation and sampling, a part of ``AsyncLM`` (``lm.decoding``).

``choose_next`` is one decoding step (the token chosen by :mod:`genback.queries.sampling` where the
logits are); ``generate_stream`` streams one generation, deciding once per generation who makes
it: a runner that streams by itself (``Capabilities.streams``: vLLM's engine, one request per
generation, :mod:`genback.llm.vllm.stream`) when it takes the generation's options, else the
next-token loop (one ``choose_next`` step per token); ``sample`` / ``batch_sample`` are ancestral
sampling built on it. The part uses only the front's public methods
(:class:`~genback.core.front.Front`: checks, adapter keys, the output cache, the query path) and
the runner's declared capabilities.
"""

from __future__ import annotations

import asyncio
import math
import numbers
from typing import AsyncIterator

from ..queries.kinds import Step
from ..queries.sampling import Choice, Pick, SamplingParams, choose
from .inputs import check_list, check_token_ids


class Decoding:
    """``choose_next``, ``generate_stream``, ``sample``, ``sample_stream`` and ``batch_sample``
    of :class:`~genback.llm.AsyncLM` (which hands its calls to this part).

    Args:
        front: the model's :class:`~genback.core.front.Front`.
        eos_token_ids: the model's end-of-sequence ids (the default enders).
    """

    def __init__(self, front, eos_token_ids: frozenset[int]):
        self.front = front
        self.eos_token_ids = eos_token_ids

    async def choose_next(self, token_ids, pick: Pick, lora_name=None) -> Choice:
        """One decoding step: choose the token after ``token_ids`` as ``pick`` says.

        Concurrent steps of different requests share forwards (continuous batching: every
        active generation steps in the same batch). Runners that choose on the model's device
        (``AsyncTransformer``, the mock) get the step as a query and return only the token and
        the asked-for log-probs; for the others (vLLM rows) :func:`genback.queries.sampling.choose`
        runs on the next-token row. A row already in the output cache is used as it is.

        Args:
            token_ids: the context (prompt then generated tokens), non-empty ids in ``[0, V)``.
            pick: a :class:`genback.queries.sampling.Pick` (its ``params`` are already validated).

        Returns:
            :class:`genback.queries.sampling.Choice`.

        Raises:
            TypeError / ValueError: bad ``token_ids`` or ``pick``, or every token banned.
        """
        front = self.front
        adapter = front.adapter_key(lora_name)
        if not isinstance(pick, Pick):
            raise TypeError(f"pick must be a genback.queries.sampling.Pick, got {type(pick).__name__}")
        query = front.next_token(token_ids, adapter)
        row = front.lookup(query)  # a row already cached is used as it is
        if row is None:
            if front.capabilities.picks:
                return await front.submit(Step(query.context, pick, adapter,
                                               tokens_hash=query.tokens_hash,
                                               parent=query.parent, n_tokens=query.n_tokens))
            row = await front.submit(query)
        return choose(row, query.context, pick)

    async def generate_stream(
        self, prompt_token_ids, params: SamplingParams, max_new_tokens: int,
        eos_token_ids=None, *, min_new_tokens: int = 0, stop_token_ids=(), lora_name=None,
    ) -> AsyncIterator[Choice]:
        """Stream the tokens of one generation, each as soon as it is chosen.

        Yields one :class:`genback.queries.sampling.Choice` per new token (with its model log-prob and
        top log-probs when ``params.logprobs`` / ``params.top_logprobs`` ask for them). The
        generation ends after ``max_new_tokens`` tokens, or at a token in ``eos_token_ids`` or
        ``stop_token_ids`` (an *ender*): that token is yielded last, so the caller sees why it
        ended, and is not part of the generated text. Enders are banned for the first
        ``min_new_tokens`` tokens. Closing the iterator early (``aclose``, ``break`` out of
        ``async for`` then closing it, or cancelling the consumer) stops the generation.

        The model's window bounds every generation on every backend (:meth:`room`): a prompt
        longer than the window is refused before any work; a generation that reaches the window
        ends there, after ``room(len(prompt))`` tokens, as if ``max_new_tokens`` said so (finish
        reason ``"length"``), keeping its tokens.

        Who makes the tokens is decided once: a runner that streams by itself
        (``Capabilities.streams``, ``AsyncVirtualLM``) gets the generation when its sampler takes
        these options (:mod:`genback.llm.vllm.stream`: one vLLM request, vLLM's sampler);
        otherwise each token is one :meth:`choose_next` step: concurrent generations step
        together, one forward per step for all of them, the token chosen by
        :mod:`genback.queries.sampling` on the model's device.

        Args:
            prompt_token_ids: non-empty ids in ``[0, V)``.
            params: :class:`genback.queries.sampling.SamplingParams` (greedy or sampled, penalties,
                log-probs).
            max_new_tokens: int >= 0, most tokens yielded (ender included).
            eos_token_ids: ids in ``[0, V)`` that end the generation; None: the model's
                :attr:`genback.llm.AsyncLM.eos_token_ids`.
            min_new_tokens: int >= 0; enders cannot be chosen before this many tokens.
            stop_token_ids: more ids in ``[0, V)`` that end it.
            lora_name: None or a registered adapter's name.

        Raises:
            TypeError / ValueError: a bad argument (the message names it), a prompt longer
                than the model's window (``max_context_length``), an unknown ``lora_name``, or
                every token banned at a step; on a streaming runner (vLLM) also the adapter
                removed meanwhile.
            BatcherClosed: the model was closed or reset meanwhile.
            RuntimeError: (vLLM) the engine failed the request.
        """
        front = self.front
        prompt, enders = self.check_generation(prompt_token_ids, params, max_new_tokens,
                                               eos_token_ids, min_new_tokens, stop_token_ids)
        max_new_tokens = min(max_new_tokens, self.room(len(prompt)))
        adapter = front.adapter_key(lora_name)
        if front.capabilities.streams and front.runner.can_stream(
                params, min_new_tokens, enders, self.eos_token_ids):
            steps = self._runner_stream(prompt, params, max_new_tokens, min_new_tokens, enders,
                                        adapter)
        else:
            steps = self._steps(prompt, params, max_new_tokens, min_new_tokens, enders,
                                lora_name)
        try:
            async for choice in steps:
                yield choice
        finally:
            await steps.aclose()

    def _runner_stream(self, prompt, params, max_new_tokens, min_new_tokens, enders,
                       adapter) -> AsyncIterator[Choice]:
        """The generation as the runner streams it (one request of its own engine).

        Raises:
            ValueError: the adapter was removed or replaced.
        """
        front = self.front
        front.check_adapter(adapter)
        stream = front.runner.stream(prompt, params, max_new_tokens, min_new_tokens, enders,
                                     adapter)
        front.count(len(prompt))
        return stream

    async def _steps(self, prompt, params, max_new_tokens, min_new_tokens, enders,
                     lora_name) -> AsyncIterator[Choice]:
        """The generation as :meth:`choose_next` steps, one token each, enders banned for the
        first ``min_new_tokens``; the ender chosen, if any, last."""
        banned = tuple(sorted(enders))
        generated: list[int] = []
        for step in range(max_new_tokens):
            pick = Pick(params, len(prompt), step, banned if step < min_new_tokens else ())
            choice = await self.choose_next(prompt + generated, pick, lora_name=lora_name)
            yield choice
            if choice.token in enders:
                return
            generated.append(choice.token)

    def room(self, prompt_length: int) -> int | float:
        """The most new tokens a generation after a prompt of ``prompt_length`` tokens can have
        on this model: ``max_context_length + 1 - prompt_length`` (a forward's inputs are the
        prompt and all new tokens but the last; vLLM's ``max_model_len`` is that window plus
        one), ``math.inf`` for a model without a window. The one rule of every backend."""
        window = self.front.max_context_length
        return math.inf if not window else window + 1 - prompt_length

    def check_generation(self, prompt_token_ids, params, max_new_tokens, eos_token_ids,
                         min_new_tokens, stop_token_ids) -> tuple[list[int], frozenset[int]]:
        """Checked ``(prompt ids, ender ids)`` of a :meth:`generate_stream` call; raises as it
        documents."""
        prompt = list(self.front.tokens(prompt_token_ids, "prompt_token_ids"))
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a genback.queries.sampling.SamplingParams, got "
                            f"{type(params).__name__}: {params!r}")
        for name, value in (("max_new_tokens", max_new_tokens),
                            ("min_new_tokens", min_new_tokens)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        vocab_size = self.front.vocab_size
        eos = (self.eos_token_ids if eos_token_ids is None else
               check_token_ids(eos_token_ids, vocab_size, "eos_token_ids", allow_empty=True))
        stops = check_token_ids(stop_token_ids, vocab_size, "stop_token_ids",
                                allow_empty=True)
        self.front.check_open()
        return prompt, frozenset(eos) | frozenset(stops)

    async def sample_stream(self, prompt_token_ids, max_tokens, eos_token_ids, temperature=1.0,
                            seed=None, lora_name=None) -> AsyncIterator[int]:
        """Async iterator of the token ids :meth:`sample` returns, each as soon as it is chosen
        (on ``AsyncVirtualLM``: as vLLM produces it). Same arguments, draws and errors as
        :meth:`sample`; leaving the loop early (``break`` then ``aclose``, cancellation) stops
        the generation (vLLM: aborts its request).

        Raises:
            TypeError / ValueError: as :meth:`sample` (raised when iteration starts).
            RuntimeError: (vLLM) the engine failed the request.
        """
        prompt, eos = self.check_sample_args(prompt_token_ids, max_tokens, eos_token_ids,
                                             temperature)
        _check_seed(seed, "seed")
        params = SamplingParams(greedy=False, temperature=float(temperature), seed=seed)
        stream = self.generate_stream(prompt, params, max_tokens, sorted(eos),
                                      lora_name=lora_name)
        try:
            async for choice in stream:
                if choice.token in eos:
                    return
                yield choice.token
        finally:
            await stream.aclose()

    async def sample(
        self, prompt_token_ids, max_tokens, eos_token_ids, temperature=1.0, seed=None,
        lora_name=None,
    ) -> list[int]:
        """Ancestral sampling: :meth:`generate_stream` with ``SamplingParams(greedy=False,
        temperature, seed)``.

        Each token is drawn from ``softmax(logits / temperature)``. On ``AsyncTransformer`` (one
        :meth:`choose_next` step per token, :mod:`genback.queries.sampling` on the model's device) the
        draw uses a generator seeded from ``(seed, step)``: reproducible when ``seed`` is given,
        whatever else is computed beside it. On ``AsyncVirtualLM`` it is vLLM's sampler with a
        per-request seed: the same distribution, reproducible, but another random stream than
        ``AsyncTransformer``'s. Stops after ``max_tokens`` tokens, at a token in
        ``eos_token_ids`` (not included; the model's own EOS does not stop it unless listed), or
        when the model's window is full (after :meth:`room` tokens; the tokens are kept).

        Returns:
            the generated token ids (without the prompt).

        Raises:
            ValueError: ``max_tokens`` < 0, ``temperature`` <= 0, bad ids, a prompt longer than
                the model's window (``max_context_length``; refused before any work), or an
                unknown ``lora_name``.
            TypeError: a ``temperature`` that is not a number (``True`` included), a ``seed``
                that is not an int or None.
            RuntimeError: (vLLM) the engine failed the request.
        """
        return [t async for t in self.sample_stream(prompt_token_ids, max_tokens, eos_token_ids,
                                                    temperature, seed, lora_name)]

    def check_sample_args(self, prompt_token_ids, max_tokens, eos_token_ids, temperature):
        """Checked ``(prompt ids as a list, eos ids as a set)`` of a ``sample`` call; raises as
        :meth:`sample` documents."""
        prompt = list(self.front.tokens(prompt_token_ids, "prompt_token_ids"))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
            raise TypeError(f"temperature must be a number > 0, got "
                            f"{type(temperature).__name__}: {temperature!r}")
        if not temperature > 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
        eos = set(check_token_ids(eos_token_ids, self.front.vocab_size, "eos_token_ids",
                                  allow_empty=True))
        return prompt, eos

    async def batch_sample(
        self, prompt_token_ids_list, max_tokens, eos_token_ids, temperature=1.0, seed=None,
        lora_name=None,
    ) -> list[list[int]]:
        """Sample every prompt concurrently (their steps share batches).

        ``seed``: None, one int (prompt ``i`` uses ``seed + i``), or a list with one seed per prompt.
        Every prompt is checked before any is sampled, so a bad one (bad ids, longer than the
        window) fails the call before any work, naming its index; a prompt whose sample reaches
        the window stops there (:meth:`sample`) while the others go on. If a sample fails
        meanwhile, the others are cancelled rather than left running.

        Returns:
            One list of generated token ids per prompt, in order (as :meth:`sample`).

        Raises:
            TypeError / ValueError: as :meth:`sample` (the message names
                ``prompt_token_ids_list[i]``); also ``prompt_token_ids_list`` not a non-empty
                list, or a ``seed`` list of the wrong length or with a non-int.
        """
        prompts = check_list(prompt_token_ids_list, "prompt_token_ids_list")
        prompts = [list(self.front.tokens(p, f"prompt_token_ids_list[{i}]"))
                   for i, p in enumerate(prompts)]
        if seed is None or (isinstance(seed, numbers.Integral) and not isinstance(seed, bool)):
            seeds = [None if seed is None else int(seed) + i for i in range(len(prompts))]
        elif isinstance(seed, (list, tuple)):
            seeds = list(seed)
            if len(seeds) != len(prompts):
                raise ValueError(f"seed has {len(seeds)} entries for {len(prompts)} prompts")
            for i, s in enumerate(seeds):
                _check_seed(s, f"seed[{i}]")
        else:
            raise TypeError(f"seed must be None, an int, or a list of ints (one per prompt), got "
                            f"{type(seed).__name__}: {seed!r}")
        self.check_sample_args(prompts[0], max_tokens, eos_token_ids, temperature)
        self.front.adapter_key(lora_name)
        return await _all_or_none([
            self.sample(p, max_tokens, eos_token_ids, temperature, s, lora_name)
            for p, s in zip(prompts, seeds)
        ])


def _check_seed(seed, name: str) -> None:
    """``TypeError`` naming ``name`` unless ``seed`` is None or an int (not a bool)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise TypeError(f"{name} must be an int or None, got {type(seed).__name__}: {seed!r}")


async def _all_or_none(coroutines) -> list:
    """The results of ``coroutines`` run concurrently, in order; when one raises, the others are
    cancelled (and awaited) before its exception propagates, so no orphan keeps computing."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
