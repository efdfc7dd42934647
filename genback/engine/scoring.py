"""Log-likelihood scoring coroutines on any ``AsyncLM``.

:func:`score` answers one (context ids, continuation ids) pair with three model queries that
other requests share:

1. ``lm.next_token_logprobs(ctx)``: the next-token row after the context. Every choice of a
   multiple-choice question asks the same one, so the batcher computes it once and the output
   cache keeps it; on ``AsyncTransformer`` it also leaves the context's KV in the prefix tree.
2. ``lm.token_logprobs(ctx, cont)``: one forward over ``cont[:-1]`` (plus the context's last
   token) on top of the cached context KV; the sum of its entries is the log-likelihood.
3. only when needed for ``is_greedy``: next-token rows at the continuation positions whose token
   is not settled. A position is settled when its token has probability > 1/2 (then it is
   necessarily the argmax), and the whole answer is settled ``False`` as soon as one position's
   row has another argmax; the first position's row is query 1's. So most choices of a
   multiple-choice question cost no extra query.

Issuing query 1 first (and awaiting it) makes choices reuse the context's KV instead of each
choice prefilling it.
"""

from __future__ import annotations

import asyncio
import math

from .encoding import rolling_windows

__all__ = ["score", "score_rolling"]

_HALF = math.log(0.5)


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
    first_row = await lm.next_token_logprobs(ctx)
    lps = (await lm.token_logprobs(ctx, cont)).tolist()
    total = math.fsum(lps)
    if int(first_row.argmax()) != cont[0]:
        return total, False
    unsure = [i for i in range(1, len(cont)) if lps[i] <= _HALF]
    if not unsure:
        return total, True
    rows = await asyncio.gather(*(lm.next_token_logprobs(ctx + cont[:i]) for i in unsure))
    return total, all(int(row.argmax()) == cont[i] for i, row in zip(unsure, rows))


async def score_rolling(lm, tokens: list[int], prefix: int, max_length: int) -> float:
    """Total log-prob of every token of ``tokens`` (natural log), scored in the disjoint
    :func:`~genback.engine.encoding.rolling_windows` of at most ``max_length`` inputs each; the
    windows are queried concurrently.

    Raises:
        ValueError: empty ``tokens``.
    """
    if not tokens:
        raise ValueError("the text tokenizes to no tokens; nothing to score")
    windows = list(rolling_windows(tokens, prefix, max_length))
    parts = await asyncio.gather(*(lm.token_logprobs(c, t) for c, t in windows))
    return math.fsum(math.fsum(p.tolist()) for p in parts)
