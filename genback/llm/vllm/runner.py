"""The vLLM runner: every distinct genback query is its own request to vLLM's ``AsyncLLM``.

vLLM's scheduler does what genback's batcher does for the other backends (continuous batching,
chunked prefill, prefix caching), so the runner declares ``batching="engine"`` and ``AsyncLM``'s
front sends each distinct query at once (:class:`genback.batching.immediate.Immediate` ->
:meth:`VLLMRunner.answer_shared`); identical queries in flight share one request and the output
cache stays in front. What each query kind asks of vLLM (:meth:`VLLMRunner.answer`):

* next-token row: ``SamplingParams(max_tokens=1, temperature=0, detokenize=False)`` with
  ``extra_args={"genback_row": [path, slot, width]}``; genback's ``RowTap`` logits processor
  writes the row into that shared-memory slot (:mod:`.tap`). Fallback when no worker could write
  it (an engine without the tap, a worker on another machine): ``logprobs=-1,
  flat_logprobs=True`` on an engine with ``max_logprobs=-1, logprobs_mode="raw_logprobs"``, the
  same log-softmax as flat lists scattered into a row;
* continuation log-probs (and, for scoring queries, greedy flags): one request over exactly the
  score's inputs ``context + continuation[:-1]``: vLLM's prompt log-probs (``prompt_logprobs=0``:
  each prompt token's log-prob and rank, rank 1 the argmax) give the targets inside the prompt,
  and the row after the prompt (as for a next-token row) the last target. A score thus takes the
  positions of its inputs and one generated token, like a row, so one window
  (``max_model_len - 1`` inputs, vLLM's longest prompt) holds for every kind;
* KV only (a :class:`~genback.queries.kinds.Prefill`): one greedy step, so the prompt's blocks enter the
  prefix cache.

Generations are the runner's too (``Capabilities.streams``): :meth:`VLLMRunner.stream` sends one
request per generation, sampled by vLLM's sampler (:mod:`.stream`).

A query under a LoRA adapter (``Query.adapter``, a key from :meth:`VLLMRunner.add_adapter`)
sends its request with that adapter's ``LoRARequest``; vLLM keys its prefix cache by the
adapter's name, which is new for every registration.
"""

from __future__ import annotations

import math
import warnings

import torch

from ...queries.kinds import NextToken, Prefill, Query, Score
from ...batching.runner import Capabilities
from ...queries.sampling import SamplingParams
from .engine import EngineLoop
from .stream import stream_request, vllm_can_sample, vllm_sampling_params
from .tap import TAP_FQCN, TAP_KEY, RowSlots


class VLLMRunner:
    """Runner (:class:`genback.batching.runner.Runner`) over an :class:`EngineLoop`.

    Args:
        engine: the engine loop (the runner closes it).
        width: the logit width ``V`` (rows are float32 ``[V]``).
        use_tap: whether the engine was built with ``RowTap``.
    """

    # vLLM's scheduler batches: AsyncLM sends each query at once (genback.batching.immediate.Immediate)
    capabilities = Capabilities(
        cache_kind="vLLM prefix cache", batching="engine", adapters=True, streams=True,
        batching_kind="continuous (vLLM scheduler, one request per query)")

    def __init__(self, engine: EngineLoop, width: int, use_tap: bool):
        from vllm import SamplingParams

        self.engine = engine
        self.width = width
        self.max_model_len = engine.engine.model_config.max_model_len
        self.slots = RowSlots(width) if use_tap else None
        self.use_tap = use_tap
        self.tap_fallbacks = 0  # rows the tap could not serve (answered by the fallback)
        self.tokens_forwarded = 0  # prompt tokens not served from vLLM's prefix cache
        self._warnings: list[str] = []  # raised on the callers' threads (flush_warnings)
        self._SamplingParams = SamplingParams
        self._kv_params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        self.loras: dict[int, object] = {}  # adapter key -> vllm LoRARequest
        self._next_lora = 1  # vLLM's lora_int_id must be >= 1

    # -- LoRA adapters -----------------------------------------------------------------------------

    def add_adapter(self, path: str) -> int:
        """Load the peft adapter folder ``path`` into the engine; returns its new key (its
        ``lora_int_id``, never reused).

        Raises:
            ValueError: the engine was built without ``enable_lora=True``, or vLLM could not
                load the adapter (the message has vLLM's reason, e.g. a rank above
                ``max_lora_rank``).
        """
        from vllm.lora.request import LoRARequest

        if getattr(self.engine.engine.vllm_config, "lora_config", None) is None:
            raise ValueError(
                "this vLLM engine was built without LoRA: pass engine_opts={'enable_lora': True, "
                "'max_lora_rank': R} (R >= the adapter's rank) to AsyncVirtualLM.from_name")
        key, self._next_lora = self._next_lora, self._next_lora + 1
        request = LoRARequest(f"genback-lora-{key}", key, path)
        try:
            self.engine.call(self.engine.engine.add_lora(request))
        except Exception as exc:  # noqa: BLE001 - vLLM's own exception types vary
            raise ValueError(f"vLLM could not load the LoRA adapter at {path!r}: "
                             f"{type(exc).__name__}: {exc}") from exc
        self.loras[key] = request
        return key

    def remove_adapter(self, key: int, error: BaseException) -> None:
        """Drop adapter ``key``: its requests in flight are aborted and their callers get
        ``error``; the engine unloads it."""
        self.loras.pop(key, None)
        engine = self.engine
        if engine.closed:
            return
        engine.cancel_tagged(key, error)
        try:
            engine.call(engine.engine.remove_lora(key))
        except Exception:  # noqa: BLE001 - never in the engine's adapter slots: nothing to free
            pass

    def lora_request(self, adapter: int | None):
        """The ``LoRARequest`` of adapter key ``adapter`` (None for the base model).

        Raises:
            ValueError: the adapter was removed.
        """
        if adapter is None:
            return None
        request = self.loras.get(adapter)
        if request is None:
            raise ValueError(f"LoRA adapter key {adapter} was removed (remove_lora)")
        return request

    # -- rows ------------------------------------------------------------------------------------

    @property
    def row_source(self) -> str:
        """How next-token rows leave the engine: ``"tap"`` (genback's logits processor, the
        default when the engine has it) or ``"logprobs"`` (vLLM's ``logprobs=-1`` output).
        Settable; ``"tap"`` raises ``ValueError`` on an engine built without ``RowTap``."""
        return "tap" if self.use_tap else "logprobs"

    @row_source.setter
    def row_source(self, value: str) -> None:
        if value not in ("tap", "logprobs"):
            raise ValueError(f"row_source must be 'tap' or 'logprobs', got {value!r}")
        if value == "tap" and self.slots is None:
            raise ValueError("row_source='tap' needs an engine built with "
                             f"logits_processors=[{TAP_FQCN!r}] (from_name does that)")
        self.use_tap = value == "tap"

    # -- generations (streams=True) ------------------------------------------------------------

    def can_stream(self, params: SamplingParams, min_new_tokens: int, enders: frozenset[int],
                   eos_token_ids: frozenset[int]) -> bool:
        """Whether vLLM's sampler takes this generation (:func:`.stream.vllm_can_sample`);
        otherwise the facade runs its next-token loop."""
        return vllm_can_sample(params, min_new_tokens, enders, eos_token_ids)

    def stream(self, prompt: list[int], params: SamplingParams, max_new_tokens: int,
               min_new_tokens: int, enders: frozenset[int], adapter: int | None):
        """Async iterator of the :class:`~genback.queries.sampling.Choice` of each new token, as vLLM
        makes them: one request (:func:`.stream.stream_request`), closed -> aborted. The caller
        (:meth:`genback.core.decoding.Decoding.generate_stream`) has already capped
        ``max_new_tokens`` at the window, so prompt plus new tokens fit ``max_model_len``.

        Raises:
            ValueError: the adapter was removed.
        """
        lora = self.lora_request(adapter)
        if max_new_tokens == 0:
            return _nothing()
        vparams = vllm_sampling_params(params, max_new_tokens, min_new_tokens, enders)
        return stream_request(self.engine, prompt, vparams, lora, adapter,
                              params.top_logprobs, enders)

    # -- on the engine loop --------------------------------------------------------------------

    async def answer(self, q: Query):
        """The result of one query (see :class:`genback.queries.kinds.Query`)."""
        lora = self.lora_request(q.adapter)
        match q:
            case NextToken():
                return (await self._row(q.tokens, lora))[0]
            case Prefill():
                await self._generate(q.tokens, self._kv_params, lora)
                return None
            case Score():
                return await self._score(q, lora)
        raise ValueError(f"the vLLM runner answers rows and scores, not {type(q).__name__} "
                         "(picks=False)")

    async def _generate(self, prompt, params, lora=None):
        out = await self.engine.generate(prompt, params, lora_request=lora)
        self.tokens_forwarded += len(prompt) - (out.num_cached_tokens or 0)
        return out

    async def _score(self, q: Score, lora):
        """A score from one request over ``q.tokens`` (module docstring): the first ``n - 1``
        targets from vLLM's prompt log-probs, the last from the row after the prompt; greedy
        as vLLM ranks (no other token's log-prob at least the target's)."""
        head = len(q.targets) - 1  # targets inside the prompt: q.tokens[-head:]
        row, out = await self._row(q.tokens, lora, prompt_logprobs=head > 0)
        last = row[q.targets[-1]]
        logprobs = last.view(1)
        greedy = (row >= last).sum().view(1) == 1
        if head:
            lps, ranks = prompt_token_logprobs(out.prompt_logprobs, q.tokens, head)
            logprobs = torch.cat([lps, logprobs])
            greedy = torch.cat([ranks == 1, greedy])
        return (logprobs, greedy) if q.greedy else logprobs

    async def _row(self, tokens: tuple[int, ...], lora=None, prompt_logprobs: bool = False):
        """``(row, output)``: the next-token row after ``tokens`` (float32 ``[V]``) and the
        request's last ``RequestOutput`` (with ``prompt_logprobs=0`` when asked)."""
        prompt = {"prompt_logprobs": 0, "flat_logprobs": True} if prompt_logprobs else {}
        if self.use_tap and self.slots is not None:
            seg, slot = self.slots.acquire()
            try:
                params = self._SamplingParams(
                    max_tokens=1, temperature=0.0, detokenize=False,
                    extra_args={TAP_KEY: self.slots.spec(seg, slot)}, **prompt)
                out = await self._generate(tokens, params, lora)
                row = self.slots.read(seg, slot)
            finally:
                self.slots.release(seg, slot)
            if row is not None:
                return row, out
            if self.use_tap:  # first miss: say so once, then skip the tap
                self.use_tap = False
                self._warnings.append(
                    "a vLLM row did not come through genback's shared-memory tap; it and all "
                    "later rows use vLLM's logprobs=-1 output (row_source='logprobs')")
            self.tap_fallbacks += 1
        params = self._SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1,
                                      flat_logprobs=True, detokenize=False, **prompt)
        out = await self._generate(tokens, params, lora)
        return flat_row(out.outputs[0].logprobs, self.width), out

    async def answer_shared(self, q: Query):
        """The result of ``q`` from any event loop: run on the engine loop, sharing one request
        with identical queries in flight; cancelling the caller aborts the request once no
        other caller shares it (``batching="engine"``: the front's ``Immediate`` calls it).

        Raises:
            BatcherClosed: the engine was closed, or reset while the query ran.
            RuntimeError: the engine failed this request (names vLLM and the cause).
            ValueError: its LoRA adapter was removed (before or while it ran).
        """
        engine = self.engine
        result = await engine.run(engine.join(q, lambda: self.answer(q), q.adapter))
        self.flush_warnings()
        return result

    def reset(self, message: str) -> int:
        """Abort every request in flight; their callers get ``BatcherClosed(message)``; returns
        how many callers were failed."""
        return self.engine.reset(message)

    def requests(self) -> int:
        """vLLM requests sent so far (each scheduled by vLLM: genback's "batches")."""
        return self.engine.requests

    # -- the runner protocol (blocking callers) ---------------------------------------------------

    def run(self, queries) -> list:
        """Answer queries from a blocking caller: all are sent at once, then awaited."""
        futures = [self.engine.submit(self.engine.join(q, lambda q=q: self.answer(q),
                                                       q.adapter))
                   for q in queries]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()  # no-op when done; aborts the rest when one failed
            self.flush_warnings()

    def flush_warnings(self) -> None:
        """Raise the runner's pending warnings on the calling thread."""
        while self._warnings:
            warnings.warn(self._warnings.pop(), RuntimeWarning, stacklevel=4)

    def stats(self) -> dict:
        """``requests`` (vLLM requests sent; also reported as ``forwards``: vLLM schedules
        each), ``aborted`` (requests aborted: every caller cancelled, ``reset_async_queries``,
        ``aclose``), ``in_flight``, ``tokens_forwarded`` (prompt tokens not served by vLLM's
        prefix cache), ``tap_fallbacks`` (rows the tap could not serve) and ``row_slots``
        (shared-memory rows allocated)."""
        engine = self.engine
        return {"forwards": engine.requests, "requests": engine.requests,
                "aborted": engine.cancelled, "in_flight": engine.in_flight,
                "tokens_forwarded": self.tokens_forwarded, "tap_fallbacks": self.tap_fallbacks,
                "row_slots": 0 if self.slots is None else
                self.slots.segments * self.slots.segment_rows}

    def clear(self, keep_pinned: bool) -> None:
        if not self.engine.closed:
            self.engine.call(self._reset_prefix_cache())

    async def _reset_prefix_cache(self) -> None:
        await self.engine.engine.reset_prefix_cache()

    def pin(self, tokens, adapter: int | None = None) -> None:
        self.run([Prefill(tuple(tokens), adapter)])  # its full blocks enter the prefix cache

    def close(self) -> None:
        self.engine.close()
        if self.slots is not None:
            self.slots.close()


async def _nothing():
    return
    yield  # an empty async iterator (max_new_tokens=0)


def flat_row(flat, width: int) -> torch.Tensor:
    """float32 ``[width]`` from one position of full-vocabulary ``FlatLogprobs``.

    Raises:
        RuntimeError: vLLM returned fewer than ``width`` entries.
    """
    start, end = flat.start_indices[0], flat.end_indices[0]
    ids = torch.tensor(flat.token_ids[start:end], dtype=torch.long)
    row = torch.full((width,), -math.inf, dtype=torch.float32)
    row[ids] = torch.tensor(flat.logprobs[start:end], dtype=torch.float32)
    seen = torch.zeros(width, dtype=torch.bool)
    seen[ids] = True
    if not bool(seen.all()):
        raise RuntimeError(f"vLLM returned log-probs for {int(seen.sum())} of {width} tokens; "
                           "expected the full vocabulary (logprobs=-1)")
    return row


def prompt_token_logprobs(flat, prompt: tuple[int, ...], n: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probs (float32 ``[n]``) and vLLM ranks (int64 ``[n]``; rank 1 is the argmax) of
    the last ``n`` prompt tokens from vLLM's prompt log-probs (position ``i`` holds prompt token
    ``i``'s own entry first, then the top-k).

    Raises:
        RuntimeError: an entry is for another token than the prompt's.
    """
    values, ranks = [], []
    for pos in range(len(prompt) - n, len(prompt)):
        at = flat.start_indices[pos]
        if flat.token_ids[at] != prompt[pos]:
            raise RuntimeError(f"vLLM prompt log-probs at position {pos} are for token "
                               f"{flat.token_ids[at]}, not {prompt[pos]}")
        values.append(flat.logprobs[at])
        ranks.append(flat.ranks[at])
    return torch.tensor(values, dtype=torch.float32), torch.tensor(ranks, dtype=torch.long)
