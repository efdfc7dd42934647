"""A caller's several queries awaited as one future (``Batcher.enqueue_many``, the route of
``batch_next_token_logprobs``): results in order, shared computation with other callers, a
failure, a cancellation and a reset, each against what one future per query does."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import pytest
import torch

from genback.batching.batcher import Batcher, BatcherClosed


@contextmanager
def _batcher(window: float = 0.01):
    """A batcher whose compute records each batch's queries (yielded with it) and answers
    ``[q]``, or a ``ValueError`` for a query named ``"bad ..."``; closed afterwards."""
    computed: list = []

    def compute(queries):
        computed.append(list(queries))
        return [ValueError(f"bad {q}") if isinstance(q, str) and q.startswith("bad")
                else [q] for q in queries]
    b = Batcher(compute, window=window, max_batch_size=64, copy=lambda r: list(r))
    try:
        yield b, computed
    finally:
        b.close()


async def test_a_group_gets_its_results_in_order_in_one_batch_with_other_callers():
    with _batcher() as (b, computed):
        single = b.enqueue(3, 3)
        group = b.enqueue_many([(k, k) for k in (5, 3, 4, 5)])
        assert isinstance(group, asyncio.Future)
        got, alone = await group, await single
        assert got == [[5], [3], [4], [5]] and alone == [3]
        assert computed == [[3, 5, 4]]  # one batch, each distinct query once
        # second callers get copies: the group's 3 is not the single caller's object
        assert got[1] is not alone and (got[0] is got[3]) is False
        assert await b.enqueue_many([]) == [] and computed == [[3, 5, 4]]  # nothing queued


async def test_a_failing_query_fails_the_group_and_no_other_caller():
    with _batcher() as (b, computed):
        other = b.enqueue(1, 1)
        group = b.enqueue_many([(1, 1), ("bad x", "bad x"), (2, 2)])
        with pytest.raises(ValueError, match="bad x"):
            await group
        assert await other == [1]
        assert computed == [[1, "bad x", 2]]


async def test_a_cancelled_group_is_not_computed_unless_another_caller_waits():
    with _batcher(window=0.05) as (b, computed):
        group = b.enqueue_many([(7, 7), (8, 8)])
        other = b.enqueue(8, 8)
        group.cancel()
        assert await other == [8]
        assert computed == [[8]]  # 7 had no caller left; 8 had one


async def test_a_reset_fails_a_pending_group():
    with _batcher(window=10.0) as (b, computed):
        group = b.enqueue_many([(1, 1), (2, 2)])
        assert b.reset() == 2  # two callers' places, one group
        with pytest.raises(BatcherClosed):
            await group
        assert computed == []


async def test_batch_rows_equal_single_rows_and_one_future_serves_them(tiny_lm):
    """``batch_next_token_logprobs`` (one group) against ``next_token_logprobs`` of each
    context on a fresh state: equal rows; a context asked twice and one cached row included."""
    lm = tiny_lm
    contexts = [[1, 2, 3], [1, 2, 3, 4], [5, 6], [1, 2, 3]]
    first = await lm.next_token_logprobs([9, 9])  # cached before the batch
    batch = await lm.batch_next_token_logprobs(contexts + [[9, 9]])
    lm.clear_cache()
    lm.clear_kv_cache()
    singles = [await lm.next_token_logprobs(c) for c in contexts]
    assert batch.shape == (5, first.shape[0])
    assert torch.allclose(batch[:4], torch.stack(singles), atol=1e-5)
    assert torch.equal(batch[4], first)
    batch[0].zero_()  # the caller's own tensor: nothing cached changed
    assert torch.allclose(await lm.next_token_logprobs(contexts[0]), singles[0], atol=1e-5)
