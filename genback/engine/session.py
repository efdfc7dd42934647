"""``GenbackSession``: the Evalution session contract over any ``AsyncLM``.

The session owns an event loop running on its own daemon thread and drives the model from it.
Its public methods are synchronous (Evalution's contract): they hand coroutines to that loop
with ``asyncio.run_coroutine_threadsafe`` and block the *calling* thread until the answers are
there, so they work from plain threads and from inside a running event loop alike (the caller's
loop is blocked for the call, the session's loop never is). Requests in flight are all
concurrent coroutines on the session loop, so the model's batcher forms batches across requests
(continuous batching) and its KV prefix tree shares common prefixes (multiple-choice contexts,
chat system prompts).

Bad requests never stop the session: with ``errors="record"`` (default) a failing request gets
an output carrying ``metadata["error"]`` (``"ValueError: ..."``) and a documented value
(log-likelihood ``-inf`` with ``token_count=0``; generation ``text=""`` with
``finish_reason="error"``) while the other requests are answered normally; with
``errors="raise"`` the first failure is raised after every request of the call has finished.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc as _gc
import logging
import random
import threading
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, Callable

from .base import BaseInferenceSession
from .checks import check_batch_size, check_generation_request, check_rolling_request
from .encoding import (PAIR_ENCODINGS, encode_loglikelihood, encode_text, encode_texts,
                       fit_ids, prefix_token_id)
from .generation import StreamEvent, decode, eos_token_ids, generation_config, prepare_prompt
from .loop_thread import LoopThread, SessionClosed
from .scoring import score, score_requests, score_rolling
from .types import (GenerationOutput, GenerationRequest, LoglikelihoodOutput,
                    LoglikelihoodRequest, RollingLoglikelihoodOutput, RollingLoglikelihoodRequest,
                    generation_error, loglikelihood_error, rolling_error)

__all__ = ["GenbackSession"]

log = logging.getLogger(__name__)

_ERRORS = ("record", "raise")


class GenbackSession(BaseInferenceSession):
    """A live session over one ``AsyncLM``.

    Args:
        lm: the model (``AsyncTransformer``, ``AsyncVirtualLM``, ``MockAsyncLM``, ...).
        owns_lm: close the model (``aclose``) when the session closes.
        backend: the backend name reported by :meth:`describe_execution`.
        max_length: the window in tokens for truncation and rolling windows (the inputs of one
            forward, see :mod:`genback.queries.window`); default the model's ``max_context_length``,
            else 2048 (lm-eval's default); at most the model's.
        max_in_flight: most requests of one call in flight at once (default 256); a call's
            ``batch_size`` overrides it for that call.
        pair_encoding: ``"lm_eval"`` (default) or ``"separate"``; see :mod:`genback.engine.encoding`.
        seed: seeds the per-request seeds of sampled requests without ``metadata["seed"]``.
        errors: ``"record"`` or ``"raise"`` (module docstring).

    Raises:
        ValueError: an option out of range, or ``max_length`` above the model's window.
    """

    def __init__(self, lm, *, owns_lm: bool = False, backend: str | None = None,
                 max_length: int | None = None, max_in_flight: int = 256,
                 pair_encoding: str = "lm_eval", seed: int | None = 0, errors: str = "record"):
        if pair_encoding not in PAIR_ENCODINGS:
            raise ValueError(f"pair_encoding must be one of {PAIR_ENCODINGS}, got {pair_encoding!r}")
        if errors not in _ERRORS:
            raise ValueError(f"errors must be one of {_ERRORS}, got {errors!r}")
        for name, value in (("max_in_flight", max_in_flight), ("max_length", max_length)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.lm = lm
        self.tokenizer = lm.tokenizer
        self.backend = backend or type(lm).__name__
        model_window = getattr(lm, "max_context_length", None)
        if max_length is not None and model_window and max_length > model_window:
            raise ValueError(f"max_length={max_length} is more than the model's window of "
                             f"{model_window} tokens (max_context_length); leave it None to use "
                             f"the model's")
        self.max_length = max_length or model_window or 2048
        self.max_in_flight = max_in_flight
        self.pair_encoding = pair_encoding
        self.errors = errors
        self._owns_lm = owns_lm
        self._seeds = random.Random(seed)
        self._eos = eos_token_ids(lm)
        self._state_lock = threading.Lock()
        self._loop_thread = LoopThread("genback-session")

    # -- plumbing ----------------------------------------------------------------------------------

    def _guarded(self, fn, request, default):
        async def run():
            try:
                return await fn(request)
            except (asyncio.CancelledError, SessionClosed):
                raise
            except Exception as exc:  # one bad request must not fail the others
                if self.errors == "raise":
                    raise
                log.warning("genback request failed: %s: %s", type(exc).__name__, exc)
                return default(request, f"{type(exc).__name__}: {exc}")
        return run()

    async def _gather(self, requests: list, fn, default, limit: int | None) -> list:
        limit = limit or self.max_in_flight
        semaphore = asyncio.Semaphore(limit)

        async def one(request):
            async with semaphore:
                return await self._guarded(fn, request, default)

        results = await asyncio.gather(*(one(r) for r in requests), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    def _run_all(self, requests, fn, default, batch_size) -> list:
        requests = list(requests)
        if not requests:
            return []
        check_batch_size(batch_size)
        return self._loop_thread.call(self._gather(requests, fn, default, batch_size))

    def _continuous(self, items: Iterable, fn, default, batch_size) -> Iterator[tuple[Any, Any]]:
        check_batch_size(batch_size)
        return self._loop_thread.continuous(items, lambda r: self._guarded(fn, r, default),
                                       batch_size or self.max_in_flight)

    # -- log-likelihood ----------------------------------------------------------------------------

    def _encode_ll(self, request: LoglikelihoodRequest) -> tuple[list[int], list[int]]:
        return encode_loglikelihood(self.tokenizer, request, self.pair_encoding, self.max_length)

    async def _loglikelihood_one(self, request: LoglikelihoodRequest) -> LoglikelihoodOutput:
        ctx, cont = self._encode_ll(request)
        logprob, greedy = await score(self.lm, ctx, cont)
        return LoglikelihoodOutput(logprob, greedy, len(cont), dict(request.metadata or {}))

    def _encode_ids(self, pair) -> tuple[list[int], list[int]]:
        return fit_ids(self.tokenizer, pair, self.max_length)

    _ll_error = staticmethod(loglikelihood_error)

    def loglikelihood(self, requests: list[LoglikelihoodRequest], *,
                      batch_size: int | None = None,
                      progress: Callable[[int], None] | None = None) -> list[LoglikelihoodOutput]:
        """Score each request's continuation after its context, one output per request in order.

        Each request is one model query (one forward gives its log-probs and greedy flags); a
        pair longer than the window is truncated on the left as lm-eval does
        (:func:`genback.queries.window.truncate_pair`). Requests are sent in chunks of ``batch_size``
        (default ``max_in_flight``) in an order that puts shared contexts together, so requests
        sharing a context share its KV.

        Args:
            requests: ``LoglikelihoodRequest`` objects (text and/or token-id fields).
            batch_size: requests in flight at once for this call (default ``max_in_flight``).
            progress: called with the number of requests answered after each chunk (on the
                session's loop thread; e.g. a progress bar's ``update``).

        Returns:
            one ``LoglikelihoodOutput`` per request: ``logprob`` the summed natural-log
            probability of the continuation tokens, ``is_greedy`` whether each is the argmax
            given what precedes it, ``token_count`` the number of continuation tokens scored;
            with ``errors="record"`` a failed request gets ``-inf``, ``token_count=0`` and
            ``metadata["error"]``.

        Raises:
            ValueError: ``batch_size`` is not a positive int; with ``errors="raise"``, the first
                request's error (a malformed request, a continuation longer than the window).
            TypeError: with ``errors="raise"``, a request of the wrong type.
            SessionClosed: the session is closed.
        """
        return self._score(requests, self._encode_ll, batch_size, progress)

    def loglikelihood_tokens(self, pairs: list[tuple[list[int], list[int]]], *,
                             batch_size: int | None = None,
                             progress: Callable[[int], None] | None = None
                             ) -> list[LoglikelihoodOutput]:
        """:meth:`loglikelihood` of ``(context_ids, continuation_ids)`` pairs that this model's
        tokenizer made (lm-eval's ``TemplateLM`` hands such pairs to ``GenbackLM``): lists of
        ints that are not re-checked here item by item (the model's query check still rejects
        ids outside its vocabulary, with a ``ValueError`` naming ``context_ids`` /
        ``continuation_ids``). An empty context scores from the prefix token; pairs are cut
        to the window as in :meth:`loglikelihood`; outputs and errors as there (an empty
        continuation is a ``ValueError``).
        """
        return self._score(pairs, self._encode_ids, batch_size, progress)

    def _score(self, items, encode, batch_size, progress) -> list[LoglikelihoodOutput]:
        """:func:`.scoring.score_requests` of ``items`` (each encoded by ``encode``) on the
        session's loop, ``batch_size`` (checked) or ``max_in_flight`` in flight."""
        items = list(items)
        if not items:
            return []
        check_batch_size(batch_size)
        return self._loop_thread.call(score_requests(
            self.lm, items, encode, batch_size or self.max_in_flight, self.errors, progress))

    def loglikelihood_continuous(self, requests: Iterable[tuple[Any, LoglikelihoodRequest]], *,
                                 batch_size: int | None = None
                                 ) -> Iterator[tuple[Any, LoglikelihoodOutput]]:
        """``(request_id, output)`` in completion order; requests are taken from the iterable
        as earlier ones finish (at most ``batch_size`` or ``max_in_flight`` in flight).

        Raises:
            ValueError: ``batch_size`` is not a positive int; with ``errors="raise"``, a failing
                request's error (while iterating).
            SessionClosed: the session is closed.
        """
        return self._continuous(requests, self._loglikelihood_one, self._ll_error, batch_size)

    async def _rolling_one(self, request: RollingLoglikelihoodRequest,
                           known: dict | None = None) -> RollingLoglikelihoodOutput:
        tokens = check_rolling_request(request)  # (its input_ids, checked)
        if tokens is None:
            text = request.text or ""
            tokens = known[text] if known and text in known else encode_text(self.tokenizer, text)
        total = await score_rolling(self.lm, tokens, prefix_token_id(self.tokenizer),
                                    self.max_length)
        return RollingLoglikelihoodOutput(total, len(tokens), dict(request.metadata or {}))

    _rolling_error = staticmethod(rolling_error)

    def loglikelihood_rolling(self, requests: list[RollingLoglikelihoodRequest], *,
                              batch_size: int | None = None) -> list[RollingLoglikelihoodOutput]:
        """Total log-prob of every token of each text (the text encoded with the tokenizer's
        default special tokens, the first token scored after the prefix token) in windows of at
        most ``max_length`` inputs, as lm-eval's ``loglikelihood_rolling``; ``token_count`` is
        the number of tokens scored; windows follow :func:`genback.queries.window.rolling_windows`.

        Raises:
            ValueError: ``batch_size`` is not a positive int; with ``errors="raise"``, the first
                failing request's ``ValueError`` / ``TypeError`` (after the others finished).
            SessionClosed: the session is closed.
        """
        requests = list(requests)
        # the texts of the requests without ids, encoded at once (encode_texts: each distinct
        # text once, batched); a malformed request, or a tokenizer without a prefix token, is
        # left to _rolling_one, where the request fails alone
        try:
            known = encode_texts(self.tokenizer, {
                r.text: None for r in requests if isinstance(r, RollingLoglikelihoodRequest)
                and r.input_ids is None and isinstance(r.text, str)})
        except ValueError:
            known = {}
        return self._run_all(requests, lambda r: self._rolling_one(r, known),
                             self._rolling_error, batch_size)

    # -- generation --------------------------------------------------------------------------------

    def _seed(self) -> int:
        with self._state_lock:
            return self._seeds.getrandbits(63)

    async def _generate_one(self, request: GenerationRequest,
                            on_event: Callable[[StreamEvent], None] | None = None) -> GenerationOutput:
        stop = check_generation_request(request)
        max_new = int(request.max_new_tokens)
        config = generation_config(request)
        if not config.params.greedy and config.params.seed is None:
            config = dataclasses.replace(
                config, params=dataclasses.replace(config.params, seed=self._seed()))
        text, ids = prepare_prompt(self.tokenizer, request)
        if len(ids) > self.max_length:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than the model window "
                             f"max_length={self.max_length}")
        return await decode(self.lm, text, ids, config, max_new_tokens=max_new, stop=stop,
                            eos_ids=self._eos, max_length=self.max_length, on_event=on_event,
                            metadata=request.metadata)

    _gen_error = staticmethod(generation_error)

    def generate(self, requests: list[GenerationRequest], *,
                 batch_size: int | None = None) -> list[GenerationOutput]:
        """One ``GenerationOutput`` per request, in order (see :func:`genback.engine.generation.decode`
        for stopping and metadata, :func:`~genback.engine.generation.generation_config` for
        greedy vs sampling and the options).

        Raises:
            ValueError: ``batch_size`` is not a positive int; with ``errors="raise"``, the first
                failing request's ``ValueError`` / ``TypeError`` (after the others finished).
            SessionClosed: the session is closed.
        """
        return self._run_all(requests, self._generate_one, self._gen_error, batch_size)

    def generate_continuous(self, requests: Iterable[tuple[Any, GenerationRequest]], *,
                            batch_size: int | None = None
                            ) -> Iterator[tuple[Any, GenerationOutput]]:
        """``(request_id, output)`` in completion order while later requests join the running
        batches (at most ``batch_size`` or ``max_in_flight`` in flight). Closing the iterator
        early cancels the requests still running.

        Raises:
            ValueError: ``batch_size`` is not a positive int; with ``errors="raise"``, a failing
                request's error (while iterating).
            SessionClosed: the session is closed.
        """
        return self._continuous(requests, self._generate_one, self._gen_error, batch_size)

    async def agenerate(self, request: GenerationRequest) -> GenerationOutput:
        """Async form of one ``generate`` for callers on their own event loop.

        Raises:
            TypeError / ValueError: a malformed request or a prompt longer than the window
                (always raised, whatever ``errors`` says).
            SessionClosed: the session is closed.
        """
        return await asyncio.wrap_future(self._loop_thread.submit(self._generate_one(request)))

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        """Stream one generation: ``async for event in session.stream(request)``.

        Yields :class:`~genback.engine.generation.StreamEvent` objects as tokens are generated,
        the last one with ``event.output``. Leaving the loop early (``break``) or cancelling the
        consuming task cancels the generation: its pending model queries are dropped before they
        are computed.

        Raises:
            TypeError / ValueError: the request's own error (a malformed request, a prompt
                longer than the window), raised from the iteration.
            SessionClosed: the session is closed, or closed while the generation ran.
        """
        async for event in self._loop_thread.events(
                lambda push: self._generate_one(request, on_event=push),
                lambda event: event.finished):
            yield event

    # -- lifecycle ---------------------------------------------------------------------------------

    def gc(self) -> None:
        """Drop the model's cached rows and unpinned KV (between suites); the model stays.

        Does nothing on a closed session; raises nothing.
        """
        if self._loop_thread.closed:
            return
        self.lm.clear_cache()
        _gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:  # pragma: no cover - torch is a dependency
            pass

    def close(self) -> None:
        """Cancel running requests, close the model if the session owns it, stop the loop
        thread. Idempotent; later calls of other methods raise ``SessionClosed``.

        Raises:
            RuntimeError: called from the session's own loop thread (it would wait on itself).
        """
        self._loop_thread.close(self.lm.aclose if self._owns_lm else None)

    @property
    def closed(self) -> bool:
        return self._loop_thread.closed

    def __enter__(self) -> "GenbackSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe_execution(self) -> dict[str, Any]:
        """Stable facts about how requests run (no counters, no object ids); raises nothing.

        Returns:
            a JSON-serialisable dict: ``backend``, ``model_class``, ``device``, ``batching``,
            ``lm_batch_size``, ``kv_cache``, ``max_length``, ``pair_encoding``, ``errors``.
        """
        lm = self.lm
        device = getattr(lm, "device", None)
        return {
            "backend": self.backend,
            "model_class": type(lm).__name__,
            "device": None if device is None else str(device),
            "batching": lm.batching_kind,
            "lm_batch_size": getattr(lm, "batch_size", None),
            "kv_cache": lm.cache_kind,
            "max_length": self.max_length,
            "pair_encoding": self.pair_encoding,
            "errors": self.errors,
        }

