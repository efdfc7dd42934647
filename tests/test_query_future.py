"""A query's awaitable (``genback.batching.futures``): every query method is a coroutine function, as
genlm-backend's, so everything that takes a coroutine or an awaitable works (``await``, ``gather``,
``create_task``, ``ensure_future`` + ``wait``, ``wait_for``; ``tests/test_asyncio_idioms.py`` runs
every idiom on every method); a step asked as one ``batch_next_token_logprobs`` call runs no task
per query; a call made outside a loop runs later; bad input fails its caller alone."""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch


def _counting_tasks(loop) -> list:
    """Install a task factory on ``loop`` that records every task created; return the record."""
    made = []

    def factory(loop, coro, **kwargs):
        task = asyncio.Task(coro, loop=loop, **kwargs)
        made.append(task)
        return task

    loop.set_task_factory(factory)
    return made


async def test_a_batch_step_creates_no_task_a_gather_one_per_query(tiny_lm):
    prompt = list(range(10, 60))
    particles = [prompt + [p] for p in range(16)]
    await asyncio.gather(*(tiny_lm.next_token_logprobs(c) for c in particles))
    loop = asyncio.get_running_loop()
    made = _counting_tasks(loop)
    try:
        for step in range(3):
            particles = [c + [200 + step] for c in particles]
            rows = await tiny_lm.batch_next_token_logprobs(particles)
            assert made == []  # (one future for the step's queries: genback.batching.groups)
            for c, row in zip(particles, rows):
                torch.testing.assert_close(row, tiny_lm.next_token_logprobs_uncached(c),
                                           rtol=0, atol=1e-5)
        particles = [c + [300] for c in particles]
        rows = await asyncio.gather(*(tiny_lm.next_token_logprobs(c) for c in particles))
        assert len(made) == len(particles)  # (gather wraps each coroutine in a task)
        for c, row in zip(particles, rows):
            torch.testing.assert_close(row, tiny_lm.next_token_logprobs_uncached(c),
                                       rtol=0, atol=1e-5)
    finally:
        loop.set_task_factory(None)


async def test_the_query_is_a_coroutine_not_a_future(tiny_lm):
    ctx = list(range(300, 340))
    want = tiny_lm.next_token_logprobs_uncached(ctx)
    query = tiny_lm.next_token_logprobs(ctx + [1])
    assert asyncio.iscoroutine(query) and inspect.iscoroutine(query)
    assert not asyncio.isfuture(query)  # (else ensure_future hands it to wait as it is)
    task = asyncio.ensure_future(query)
    assert isinstance(task, asyncio.Task)
    await asyncio.wait([task])
    torch.testing.assert_close(task.result(), tiny_lm.next_token_logprobs_uncached(ctx + [1]),
                               rtol=0, atol=1e-5)
    row = await asyncio.create_task(tiny_lm.next_token_logprobs(ctx))
    torch.testing.assert_close(row, want, rtol=0, atol=1e-5)
    row = await asyncio.wait_for(tiny_lm.next_token_logprobs(ctx + [2]), timeout=600)
    torch.testing.assert_close(row, tiny_lm.next_token_logprobs_uncached(ctx + [2]), rtol=0,
                               atol=1e-5)
    assert inspect.iscoroutinefunction(tiny_lm.next_token_logprobs)


async def test_a_cancelled_task_cancels_its_query_and_the_others_are_served(tiny_hf, gpt2_tok):
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=600)  # (flushed below, not waited for)
    try:
        base = list(range(400, 430))
        kept = [asyncio.create_task(lm.next_token_logprobs(base + [i])) for i in range(3)]
        dropped = asyncio.create_task(lm.next_token_logprobs(base + [99]))
        early = asyncio.create_task(lm.next_token_logprobs(base + [98]))
        early.cancel()  # (before its first step: its query is never asked)
        await asyncio.sleep(0)  # (each other task has queued its query; the batch waits)
        assert len(lm.scheduler.pending(asyncio.get_running_loop())) == 4
        dropped.cancel()
        lm.scheduler.flush(asyncio.get_running_loop())
        rows = await asyncio.gather(*kept)
        for task in (dropped, early):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert lm.cache_info()["batched_queries"] == 3  # the cancelled ones were not computed
        for i, row in enumerate(rows):
            torch.testing.assert_close(row, lm.next_token_logprobs_uncached(base + [i]),
                                       rtol=0, atol=1e-5)
    finally:
        await lm.aclose()


async def test_bad_input_fails_where_awaited_and_alone(tiny_lm):
    ctx = list(range(500, 520))
    bad = tiny_lm.next_token_logprobs([-1])  # no error at the call: at the await, as a coroutine
    out = await asyncio.gather(bad, tiny_lm.next_token_logprobs(ctx), return_exceptions=True)
    assert isinstance(out[0], ValueError) and "token_ids" in str(out[0])
    torch.testing.assert_close(out[1], tiny_lm.next_token_logprobs_uncached(ctx), rtol=0,
                               atol=1e-5)
    with pytest.raises(TypeError, match="token_ids"):
        await tiny_lm.next_token_logprobs("not ids")


async def test_a_cached_row_is_the_callers_own_copy_without_a_batch(tiny_lm):
    ctx = list(range(600, 640))
    first = await tiny_lm.next_token_logprobs(ctx)
    hits, batches = tiny_lm.cache_info()["row_hits"], tiny_lm.cache_info()["batches"]
    row = await tiny_lm.next_token_logprobs(ctx)
    assert tiny_lm.cache_info()["batches"] == batches
    assert tiny_lm.cache_info()["row_hits"] == hits + 1
    row += 1.0  # the caller's own: neither the first caller's row nor the cache's changes
    torch.testing.assert_close(await tiny_lm.next_token_logprobs(ctx), first, rtol=0, atol=0)


def test_outside_a_loop_it_is_a_coroutine_run_later(tiny_hf, gpt2_tok):
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    try:
        ctx = list(range(700, 730))
        awaitable = lm.next_token_logprobs(ctx)
        assert inspect.iscoroutine(awaitable)
        row = asyncio.run(awaitable)
        torch.testing.assert_close(row, lm.next_token_logprobs_uncached(ctx), rtol=0, atol=1e-5)
    finally:
        lm.close()
