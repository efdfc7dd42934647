"""A caller's several queries awaited as one future (``Batcher.enqueue_many``, the route of
``batch_next_token_logprobs``): results in order, shared computation with other callers, a
failure, a cancellation and a reset, each against what one future per query does."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import pytest
import torch

from genback.batching.batcher import Batcher, BatcherClosed
from genback.queries.rows import StepRows


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


async def test_a_step_call_is_one_entry_that_later_callers_join():
    """A group queued into an empty pending batch (a step's one call) is one entry: later
    callers of its keys join it (computed once), repeated keys are computed once and their
    later items get copies, and the counts see every caller and distinct query."""
    with _batcher() as (b, computed):
        group = b.enqueue_many([(k, k) for k in (5, 3, 5, 4)])
        loop = asyncio.get_running_loop()
        assert b.pending(loop) == [5, 3, 4]  # its distinct queries
        joiner, other = b.enqueue(3, 3), b.enqueue(9, 9)
        got, alone, nine = await group, await joiner, await other
        assert computed == [[5, 3, 4, 9]] and b.queries == 4 and b.batches == 1
        assert got == [[5], [3], [5], [4]] and alone == [3] and nine == [9]
        assert got[0] is not got[2] and got[1] is not alone  # copies for second callers
        assert b._states[loop].sizes[1] == 6  # its four items and two single callers


async def test_a_cancelled_step_call_still_serves_its_joiners():
    with _batcher(window=0.05) as (b, computed):
        group = b.enqueue_many([(1, 1), (2, 2), (3, 3)])
        joiner = b.enqueue(2, 2)
        group.cancel()
        assert await joiner == [2] and computed == [[2]]
        late = b.enqueue(2, 2)  # a new batch: its own entry
        assert await late == [2] and computed == [[2], [2]]


async def test_a_failing_query_of_a_step_call_fails_it_and_its_joiner_only_there():
    with _batcher() as (b, computed):
        group = b.enqueue_many([(1, 1), ("bad y", "bad y")])
        good, bad = b.enqueue(1, 1), b.enqueue("bad y", "bad y")
        with pytest.raises(ValueError, match="bad y"):
            await group
        assert await good == [1]
        with pytest.raises(ValueError, match="bad y"):
            await bad
        assert computed == [[1, "bad y"]]


async def test_a_step_call_larger_than_a_batch_is_split_as_before():
    computed: list = []

    def compute(queries):
        computed.append(list(queries))
        return [[q] for q in queries]
    b = Batcher(compute, window=0.0, max_batch_size=3)
    try:
        assert await b.enqueue_many([(k, k) for k in range(7)]) == [[k] for k in range(7)]
        assert sorted(map(len, computed)) == [1, 3, 3]
        assert await b.enqueue_many([(k, k) for k in (1, 1, 2)]) == [[1], [1], [2]]
        assert computed[-1] == [1, 2]  # (fits: one entry, a repeated key once)
    finally:
        b.close()


async def test_a_steps_rows_come_as_their_block_and_are_the_callers_own(tiny_lm, monkeypatch):
    """An SMC step of ``lm.context`` objects in one call (every row new: one batcher entry, the
    rows handed as the block they were computed in; with a repeated context, stacked): the rows
    equal single queries' on a fresh state, and writing into the returned tensor changes no
    cached row."""
    lm = tiny_lm
    stacked = []
    real = StepRows.stacked
    monkeypatch.setattr(StepRows, "stacked", lambda self: stacked.append(len(self)) or real(self))
    root = lm.context([1, 2, 3, 4])
    await lm.next_token_logprobs(root)
    tokens = [(5, 6, 7, 8), (9, 10, 9)]
    steps = [await lm.batch_next_token_logprobs([root + [t] for t in ts]) for ts in tokens]
    assert stacked == [4]  # (the first step: its block; the second: a repeated row's copy)
    kept = [s.clone() for s in steps]
    for s in steps:
        s.zero_()  # (the caller's own: the output cache keeps copies)
    for ts, k in zip(tokens, kept):
        assert torch.equal(await lm.batch_next_token_logprobs([root + [t] for t in ts]), k)
    lm.clear_cache()
    lm.clear_kv_cache()
    for ts, k in zip(tokens, kept):
        singles = torch.stack([await lm.next_token_logprobs([1, 2, 3, 4, t]) for t in ts])
        assert torch.allclose(k, singles, atol=1e-5)
