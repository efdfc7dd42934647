"""Generations streamed by vLLM: one request per generation, sampled by vLLM's own sampler.

``VLLMRunner`` declares ``Capabilities(streams=True)``: ``AsyncLM.generate_stream`` hands it a
generation when :func:`vllm_can_sample` accepts its options, and streams the
:class:`~genback.queries.sampling.Choice` objects :func:`stream_request` yields as vLLM makes them
(``RequestOutputKind.DELTA``), while row queries and other generations run beside it in vLLM's
batches. Otherwise the facade runs its next-token loop (one row query per token, genback's
sampler on each row).

How :class:`genback.queries.sampling.SamplingParams` map to ``vllm.SamplingParams``
(:func:`vllm_sampling_params`): greedy -> ``temperature=0``; ``temperature``, ``top_k``,
``top_p``, ``min_p``, ``seed`` (vLLM's per-request generator: reproducible, the same distribution
as ``AsyncTransformer``'s draws but another random stream), ``repetition_penalty`` (prompt and
generated tokens), ``presence_penalty`` / ``frequency_penalty`` (generated tokens), ``logprobs``
/ ``top_logprobs`` (vLLM's ``logprobs=k``; the engine's ``raw_logprobs`` mode reports the model's
own log-softmax, as :mod:`genback.queries.sampling` does); ``max_new_tokens`` -> ``max_tokens``,
``min_new_tokens`` -> ``min_tokens``, the enders -> ``stop_token_ids`` with ``ignore_eos=True``
(only the given ids end it). vLLM applies ``min_p`` before ``top_k`` / ``top_p`` (genback's
sampler after them), which matters only when both are set. What vLLM's sampler lacks —
``no_repeat_ngram_size``, ``temperature`` > 2, ``presence_penalty`` / ``frequency_penalty``
outside ``[-2, 2]``, and a ``min_new_tokens`` with enders that leave out the model's own EOS
(vLLM bans those too) — goes to the facade's loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import AsyncIterator

from ...queries.sampling import Choice, SamplingParams

_DONE = object()
_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF  # vLLM reads seed=-1 as "no seed": seeds go in as 63-bit


def vllm_can_sample(params: SamplingParams, min_new_tokens: int, enders: frozenset[int],
                    eos_token_ids: frozenset[int]) -> bool:
    """Whether vLLM's sampler takes this generation as it is (module docstring)."""
    return (params.no_repeat_ngram_size == 0 and params.temperature <= 2.0
            and -2.0 <= params.presence_penalty <= 2.0
            and -2.0 <= params.frequency_penalty <= 2.0
            and not (min_new_tokens and not eos_token_ids <= enders))


def vllm_sampling_params(params: SamplingParams, max_new_tokens: int, min_new_tokens: int,
                         enders: frozenset[int]):
    """The ``vllm.SamplingParams`` of one streamed generation (DELTA outputs, no detokenizing)."""
    import vllm

    top = params.top_logprobs
    want = params.logprobs or top > 0
    return vllm.SamplingParams(
        max_tokens=max_new_tokens, min_tokens=min(min_new_tokens, max_new_tokens),
        temperature=0.0 if params.greedy else params.temperature,
        top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
        seed=None if params.seed is None else params.seed & _SEED_MASK,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        stop_token_ids=sorted(enders), ignore_eos=True, detokenize=False,
        logprobs=top if want else None,
        output_kind=vllm.sampling_params.RequestOutputKind.DELTA)


async def stream_request(engine, prompt: list[int], vparams, lora, tag, top: int,
                         enders: frozenset[int]) -> AsyncIterator[Choice]:
    """The choices of one vLLM request, each as vLLM makes it, up to the first ender.

    Args:
        engine: the runner's :class:`~genback.llm.vllm.engine.EngineLoop`.
        prompt: the prompt ids.
        vparams: its ``vllm.SamplingParams`` (:func:`vllm_sampling_params`).
        lora: its ``LoRARequest`` or None.
        tag: the adapter key (removing the adapter aborts the request).
        top: log-probs of the ``top`` most likely tokens per choice (0: none).
        enders: ids that end it (yielded last).

    Closing the iterator (or cancelling its consumer) aborts the request.

    Raises:
        RuntimeError: the engine failed the request.
        ValueError: its adapter was removed meanwhile.
    """
    want = vparams.logprobs is not None
    queue, future = _submit(engine, prompt, vparams, lora, tag)
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                future.result()  # raises the request's error, if any
                return
            token_ids, logprobs = item
            for i, token in enumerate(token_ids):
                yield choice(token, logprobs[i] if want else None, top)
                if token in enders:
                    return
    finally:
        future.cancel()  # no-op when finished; else aborts the request


def _submit(engine, prompt: list[int], vparams, lora, tag
            ) -> tuple[asyncio.Queue, concurrent.futures.Future]:
    """Submit the request to ``engine``; return ``(queue, future)``: the queue (on the running
    loop) receives ``(token ids, log-probs or None)`` per output of vLLM, in order, then
    ``_DONE`` when ``future`` (the request's, on the engine thread) finishes."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def put(item):  # engine thread -> the consumer's loop, in order
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # that loop is closed: nobody listens any more
            pass

    def on_output(out):
        new = out.outputs[0]
        put((list(new.token_ids), None if new.logprobs is None else list(new.logprobs)))

    future = engine.submit(engine.join(
        object(), lambda: engine.generate(prompt, vparams, on_output, lora), tag))
    future.add_done_callback(lambda _: put(_DONE))
    return queue, future


def choice(token: int, logprobs: dict | None, top: int) -> Choice:
    """A :class:`~genback.queries.sampling.Choice` from one position of vLLM's sample log-probs
    (``{token id: Logprob}``: the top ``top`` by rank, plus the sampled token)."""
    if logprobs is None:
        return Choice(int(token))
    ranked = sorted(logprobs.items(), key=lambda kv: kv[1].rank)[:top] if top else []
    return Choice(int(token), float(logprobs[token].logprob),
                  tuple((int(t), float(lp.logprob)) for t, lp in ranked))
