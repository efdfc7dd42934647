"""Log-likelihood scoring coroutines on any ``AsyncLM``, and the order requests are sent in.

:func:`score` answers one (context ids, continuation ids) pair with a single model query,
``lm.score(ctx, cont)``: one forward over ``ctx + cont[:-1]`` (only the part not already in the
model's KV cache) gives the continuation's log-probs and, from the same logits on the model's
device, whether each continuation token is the argmax. Concurrent requests share forwards (the
model's batcher), and on ``AsyncTransformer`` a context that several requests of one batch share
is forwarded once for all of them (the runner's shared-prefix prefill), so the choices of a
multiple-choice question cost their own tokens only.

:func:`sharing_order` sorts requests so that those sharing a context (or a longer common
prefix, e.g. a few-shot preamble) are sent together; a chunk of requests then meets its shared
KV in one batch, and the runner groups each batch's rows by length so that forwards pad little.

:func:`score_rolling` scores a text in lm-eval's disjoint rolling windows, all windows as
concurrent queries (so the windows of every text in flight share batches).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Callable, Sequence

from ..queries.window import rolling_windows
from .loop_thread import SessionClosed
from .types import LoglikelihoodOutput, loglikelihood_error

__all__ = ["score", "score_pairs", "score_requests", "score_rolling", "sharing_order"]

log = logging.getLogger("genback.engine.session")  # (the session's failures, logged as before)


async def score(lm, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """``(sum_i log p(cont[i] | ctx + cont[:i]), every cont[i] is the argmax)``.

    Args:
        lm: an ``AsyncLM``.
        ctx: non-empty context ids.
        cont: non-empty continuation ids.

    Returns:
        the log-likelihood (float, natural log, summed with ``math.fsum``) and the greedy flag.

    Raises:
        ValueError: an empty ``cont`` or bad ids (from the model's checks).
    """
    if not cont:
        raise ValueError("the continuation tokenizes to no tokens; nothing to score")
    logprobs, greedy = await lm.score(ctx, cont)
    return math.fsum(logprobs.tolist()), bool(greedy.all())


async def score_pairs(lm, pairs: list, limit: int,
                      progress: Callable[[int], None] | None = None) -> list:
    """:func:`score` of every encoded pair of ``pairs``, sent in :func:`sharing_order` in chunks
    of ``limit`` (each chunk one round of concurrent ``lm.score`` queries, so one batch).

    Args:
        lm: an ``AsyncLM``.
        pairs: ``(context ids, continuation ids)`` lists, or an ``Exception`` for a request
            that failed before scoring (it is passed through as its result).
        limit: pairs in flight at once (>= 1).
        progress: called with the number of pairs answered, after each chunk (failed ones first).

    Returns:
        per pair, in the order of ``pairs``: ``(logprob, is_greedy)`` or the exception its query
        raised (``return_exceptions``: one failure does not stop the others).
    """
    results = list(pairs)
    failed = [p is None or isinstance(p, Exception) for p in pairs]
    order = sharing_order([None if bad else p for bad, p in zip(failed, pairs)])
    todo = order[sum(failed):]  # (sharing_order puts the failed ones first)
    if progress is not None and len(todo) < len(order):
        progress(len(order) - len(todo))
    for start in range(0, len(todo), limit):
        chunk = todo[start:start + limit]
        outs = await asyncio.gather(*(score(lm, *pairs[i]) for i in chunk),
                                    return_exceptions=True)
        for i, out in zip(chunk, outs):
            results[i] = out
        if progress is not None:
            progress(len(chunk))
    return results


async def score_requests(lm, requests: list, encode, limit: int, errors: str,
                         progress: Callable[[int], None] | None = None
                         ) -> list[LoglikelihoodOutput]:
    """The outputs of scoring requests, in request order: ``encode(request)`` gives each one's
    ``(context ids, continuation ids)`` (an exception there is that request's error), the
    pairs are scored by :func:`score_pairs` (``limit`` in flight), and a failed request
    becomes :func:`~genback.engine.types.loglikelihood_error`'s output (``errors="record"``)
    or, with ``errors="raise"``, the first failure is raised once every request is done.

    Raises:
        Exception: with ``errors="raise"``, the first failed request's error (in request
            order); whatever ``errors`` says, a cancellation or ``SessionClosed``.
    """
    encoded: list = []
    for request in requests:
        try:
            encoded.append(encode(request))
        except Exception as exc:  # noqa: BLE001 - reported as this request's error
            encoded.append(exc)
    results = await score_pairs(lm, encoded, limit, progress)
    outputs, error = [], None
    for request, pair, res in zip(requests, encoded, results):
        if not isinstance(res, BaseException):
            meta = getattr(request, "metadata", None)
            outputs.append(LoglikelihoodOutput(res[0], res[1], len(pair[1]), dict(meta or {})))
            continue
        if errors == "raise" or isinstance(res, (asyncio.CancelledError, SessionClosed)):
            error = error or res
        else:
            log.warning("genback request failed: %s: %s", type(res).__name__, res)
        outputs.append(loglikelihood_error(request, f"{type(res).__name__}: {res}"))
    if error is not None:
        raise error
    return outputs


async def score_rolling(lm, tokens: list[int], prefix: int, max_length: int) -> float:
    """Total log-prob of every token of ``tokens`` (natural log), scored in the disjoint
    :func:`~genback.queries.window.rolling_windows` of at most ``max_length`` inputs each; the
    windows are queried concurrently.

    Raises:
        ValueError: empty ``tokens``.
    """
    if not tokens:
        raise ValueError("the text tokenizes to no tokens; nothing to score")
    windows = list(rolling_windows(tokens, prefix, max_length))
    parts = await asyncio.gather(*(lm.token_logprobs(c, t) for c, t in windows))
    return math.fsum(math.fsum(p.tolist()) for p in parts)


def sharing_order(pairs: Sequence[tuple[Sequence[int], Sequence[int]] | None]) -> list[int]:
    """Indices of ``pairs`` in the order to send them: ``None`` entries (requests that failed
    to encode) first, then by the tokens of ``context + continuation`` in lexicographic order, so
    requests with a common context or prefix are adjacent (ties keep their input order)."""
    bad = [i for i, p in enumerate(pairs) if p is None]
    good = [i for i, p in enumerate(pairs) if p is not None]
    good.sort(key=lambda i: (tuple(pairs[i][0]), tuple(pairs[i][1])))
    return bad + good
