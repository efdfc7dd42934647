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
import math
from typing import Sequence

from ..queries.window import rolling_windows

__all__ = ["score", "score_rolling", "sharing_order"]


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
