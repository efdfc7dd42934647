"""Every asyncio way of waiting on a query works as on genlm-backend (issue 67's must-hold), on
every query method of ``AsyncLM``, cancellation through each included.

The idioms: ``await``, ``gather``, ``ensure_future`` + ``wait``, ``create_task`` + ``wait``,
``as_completed``, ``wait_for``, ``shield``, ``TaskGroup``, ``asyncio.run`` and
``loop.run_until_complete`` of one query. Each answer is compared with the uncached model (rows
<= 1e-5) or, for seeded sampling, with a plain ``await`` of the same call. A cancellation is
tested against a batch held open (a 600 s window, flushed by the test): a query whose every
caller was cancelled is not computed; one that a caller still waits for (``shield``'s inner task)
is. The query methods are coroutine functions (:mod:`genback.batching.futures`)."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import threading
import time

import pytest
import torch
from conftest import until

from genback.queries.sampling import Pick, SamplingParams

METHODS = ["next_token_logprobs", "batch_next_token_logprobs", "token_logprobs", "score",
           "sample", "batch_sample", "choose_next"]


def ctx_of(salt: int) -> list[int]:
    """A context of its own for each test (no row cached by another)."""
    return [1000 + 7 * salt + i for i in range(24)]


def call(lm, method: str, salt: int):
    """A fresh awaitable of ``method`` on ``salt``'s context(s)."""
    ctx = ctx_of(salt)
    if method == "next_token_logprobs":
        return lm.next_token_logprobs(ctx)
    if method == "batch_next_token_logprobs":
        return lm.batch_next_token_logprobs([ctx, ctx + [5]])
    if method == "token_logprobs":
        return lm.token_logprobs(ctx, [7, 8, 9])
    if method == "score":
        return lm.score(ctx, [7, 8, 9])
    if method == "sample":
        return lm.sample(ctx, 3, eos_token_ids=[], seed=salt)
    if method == "batch_sample":
        return lm.batch_sample([ctx, ctx + [5]], 3, eos_token_ids=[], seed=salt)
    assert method == "choose_next"
    return lm.choose_next(ctx, Pick(SamplingParams(greedy=True), len(ctx), 0))


def reference(lm, method: str, salt: int):
    """What ``call`` must give, from the uncached model (sampling: None, compared with a
    plain ``await`` instead)."""
    ctx, cont = ctx_of(salt), [7, 8, 9]
    row = lm.next_token_logprobs_uncached
    if method == "next_token_logprobs":
        return row(ctx)
    if method == "batch_next_token_logprobs":
        return torch.stack([row(ctx), row(ctx + [5])])
    rows = [row(ctx + cont[:i]) for i in range(len(cont))]
    if method in ("token_logprobs", "score"):
        lp = torch.stack([r[t] for r, t in zip(rows, cont)])
        greedy = torch.tensor([int(r.argmax()) == t for r, t in zip(rows, cont)])
        return lp if method == "token_logprobs" else (lp, greedy)
    if method == "choose_next":
        return int(row(ctx).argmax())
    return None


def check(got, want, method: str) -> None:
    if method == "choose_next":
        assert got.token == want
    elif method == "score":
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
        assert torch.equal(got[1], want[1])
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def want_sample(got, method) -> None:
    """A seeded sample: ``3`` ids per prompt."""
    for ids in (got if method == "batch_sample" else [got]):
        assert len(ids) == 3 and all(isinstance(t, int) for t in ids)


# -- the idioms on a running loop: each returns every answer it got ------------------------------

async def by_await(make):
    return [await make()]


async def by_gather(make):
    return list(await asyncio.gather(make(), make()))


async def by_ensure_future_wait(make):
    tasks = [asyncio.ensure_future(make()) for _ in range(2)]
    done, pending = await asyncio.wait(tasks)
    assert not pending
    return [t.result() for t in tasks]


async def by_create_task_wait(make):
    tasks = [asyncio.create_task(make()) for _ in range(2)]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.ALL_COMPLETED)
    assert done == set(tasks) and not pending
    return [t.result() for t in tasks]


async def by_as_completed(make):
    return [await f for f in asyncio.as_completed([make(), make()])]


async def by_wait_for(make):
    return [await asyncio.wait_for(make(), timeout=600)]


async def by_shield(make):
    return [await asyncio.shield(make())]


async def by_task_group(make):
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(make()) for _ in range(2)]
    return [t.result() for t in tasks]


IDIOMS = {"await": by_await, "gather": by_gather, "ensure_future+wait": by_ensure_future_wait,
          "create_task+wait": by_create_task_wait, "as_completed": by_as_completed,
          "wait_for": by_wait_for, "shield": by_shield, "TaskGroup": by_task_group}


def test_every_query_method_is_a_coroutine_function(tiny_hf, gpt2_tok):
    from genback.llm import AsyncTransformer

    for method in METHODS:
        assert inspect.iscoroutinefunction(getattr(AsyncTransformer, method)), method


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("idiom", list(IDIOMS))
async def test_each_idiom_on_each_method(tiny_lm, method, idiom):
    salt = METHODS.index(method) * 20 + list(IDIOMS).index(idiom)
    want = reference(tiny_lm, method, salt)
    if want is None:  # (sampling: the plain await's answer, on a model of its own state)
        want = await call(tiny_lm, method, salt)
        tiny_lm.clear_cache()
    answers = await IDIOMS[idiom](lambda: call(tiny_lm, method, salt))
    assert answers
    for got in answers:
        if method in ("sample", "batch_sample"):
            assert got == want
            want_sample(got, method)
        else:
            check(got, want, method)


# -- cancellation through each idiom (a batch held open by a 600 s window) -----------------------

async def cancel_await(make, ready):
    async def caller():
        return await make()
    task = asyncio.create_task(caller())
    await ready()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return True


async def cancel_gather(make, ready):
    both = asyncio.gather(make(), make())
    await ready()
    both.cancel()
    with pytest.raises(asyncio.CancelledError):
        await both
    return True


async def cancel_ensure_future_wait(make, ready):
    tasks = [asyncio.ensure_future(make()) for _ in range(2)]
    done, pending = await asyncio.wait(tasks, timeout=0.05)  # (the window is 600 s)
    assert not done and pending == set(tasks)
    for t in pending:
        t.cancel()
    done, pending = await asyncio.wait(tasks)
    assert not pending and all(t.cancelled() for t in done)
    return True


async def cancel_create_task_wait(make, ready):
    tasks = [asyncio.create_task(make()) for _ in range(2)]
    await ready()
    for t in tasks:
        t.cancel()
    done, pending = await asyncio.wait(tasks)
    assert not pending and all(t.cancelled() for t in done)
    return True


async def cancel_as_completed(make, ready):
    tasks = [asyncio.create_task(make()) for _ in range(2)]
    await ready()
    for t in tasks:
        t.cancel()
    for f in asyncio.as_completed(tasks):
        with pytest.raises(asyncio.CancelledError):
            await f
    return True


async def cancel_wait_for(make, ready):
    with pytest.raises(asyncio.TimeoutError):  # (its timeout cancels the query)
        await asyncio.wait_for(make(), timeout=0.05)
    return True


async def cancel_shield(make, ready):
    inner = asyncio.create_task(make())
    outer = asyncio.shield(inner)
    await ready()
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert not inner.cancelled()
    return inner  # (shielded: still computed; its answer checked after the flush)


async def cancel_task_group(make, ready):
    async def body():
        async with asyncio.TaskGroup() as tg:
            for _ in range(2):
                tg.create_task(make())
    task = asyncio.create_task(body())
    await ready()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return True


CANCELS = {"await": cancel_await, "gather": cancel_gather,
           "ensure_future+wait": cancel_ensure_future_wait,
           "create_task+wait": cancel_create_task_wait, "as_completed": cancel_as_completed,
           "wait_for": cancel_wait_for, "shield": cancel_shield, "TaskGroup": cancel_task_group}


async def drain(lm, task) -> None:
    """Flush the batches ``task`` waits on until it is done (a sample waits on several)."""
    loop = asyncio.get_running_loop()
    while not task.done():
        await until(lambda: task.done() or lm.scheduler.pending(loop), "a query pending")
        lm.scheduler.flush(loop)
        await asyncio.sleep(0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("idiom", list(CANCELS))
async def test_cancellation_through_each_idiom(tiny_hf, gpt2_tok, method, idiom):
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=600)  # (flushed, never waited for)
    loop = asyncio.get_running_loop()
    salt = 300 + METHODS.index(method) * 20 + list(CANCELS).index(idiom)
    try:
        async def ready():
            await until(lambda: lm.scheduler.pending(loop), "the query pending")

        outcome = await CANCELS[idiom](lambda: call(lm, method, salt), ready)
        live = lm.scheduler.pending(loop)
        if outcome is True:  # every caller cancelled: nothing left to compute
            assert live == []
        before = lm.cache_info()["batched_queries"]
        keep_ctx = ctx_of(salt) + [11, 12]
        keep = asyncio.create_task(lm.next_token_logprobs(keep_ctx))
        await until(lambda: len(lm.scheduler.pending(loop)) == len(live) + 1, "keep pending")
        lm.scheduler.flush(loop)
        torch.testing.assert_close(await keep, lm.next_token_logprobs_uncached(keep_ctx),
                                   rtol=0, atol=1e-5)
        assert lm.cache_info()["batched_queries"] - before == len(live) + 1
        if outcome is not True:  # shield: the inner query was computed for its task
            assert live
            await drain(lm, outcome)
            want = reference(lm, method, salt)
            if want is not None:
                check(outcome.result(), want, method)
    finally:
        await lm.aclose()


# -- asyncio.run and run_until_complete of one query (no loop running) --------------------------

@pytest.mark.parametrize("method", METHODS)
def test_asyncio_run_and_run_until_complete(tiny_hf, gpt2_tok, method):
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    try:
        salt = 600 + METHODS.index(method)
        want = reference(lm, method, salt)
        first = asyncio.run(call(lm, method, salt))  # (made outside any loop, run later)
        loop = asyncio.new_event_loop()
        try:
            lm.clear_cache()
            second = loop.run_until_complete(call(lm, method, salt))
        finally:
            loop.close()
        for got in (first, second):
            if want is None:
                assert got == first
                want_sample(got, method)
            else:
                check(got, want, method)
    finally:
        lm.close()


def _interrupt_once_pending(lm, queries_before: int) -> threading.Thread:
    """A thread that sends this process SIGINT (Ctrl-C) once a query has been counted: what
    ``asyncio.run`` turns into its main task's cancellation."""
    def send():
        deadline = time.monotonic() + 120
        while lm.front.queries == queries_before and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("method", METHODS)
def test_cancellation_through_asyncio_run_and_run_until_complete(tiny_hf, gpt2_tok, method):
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=600)
    try:
        salt = 700 + METHODS.index(method)
        # asyncio.run: Ctrl-C cancels its main task (the query), as on genlm-backend
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            thread = _interrupt_once_pending(lm, lm.front.queries)
            with pytest.raises(KeyboardInterrupt):
                asyncio.run(call(lm, method, salt))
            thread.join()
        # run_until_complete: the query cancelled by a task of the same loop once pending
        loop = asyncio.new_event_loop()
        try:
            async def cancel_the_query():
                await until(lambda: lm.scheduler.pending(loop), "the query pending")
                for task in asyncio.all_tasks():
                    if task is not asyncio.current_task():
                        task.cancel()

            canceller = loop.create_task(cancel_the_query())
            with pytest.raises(asyncio.CancelledError):
                loop.run_until_complete(call(lm, method, salt))
            loop.run_until_complete(canceller)
            assert lm.scheduler.pending(loop) == []  # (dropped, never computed)
            before = lm.cache_info()["batched_queries"]
            ctx = ctx_of(salt) + [3]

            async def keep():
                task = asyncio.create_task(lm.next_token_logprobs(ctx))
                await until(lambda: lm.scheduler.pending(loop), "keep pending")
                lm.scheduler.flush(loop)
                return await task

            torch.testing.assert_close(loop.run_until_complete(keep()),
                                       lm.next_token_logprobs_uncached(ctx), rtol=0, atol=1e-5)
            assert lm.cache_info()["batched_queries"] == before + 1
        finally:
            loop.close()
    finally:
        lm.close()


# -- the idiom on the real SmolLM2 -----------------------------------------------------

@pytest.mark.slow
async def test_ensure_future_then_wait_on_smollm2(smol_lm):
    """``tasks = [asyncio.ensure_future(lm.next_token_logprobs(ids)) for ids in batch]; await
    asyncio.wait(tasks)``: raised ``TypeError: Passing coroutines is forbidden`` while the query
    was handed out as a future that was also a coroutine."""
    tok = smol_lm.tokenizer
    batch = [tok.encode("The capital of France is"), tok.encode("The capital of Italy is")]
    tasks = [asyncio.ensure_future(smol_lm.next_token_logprobs(ids)) for ids in batch]
    done, pending = await asyncio.wait(tasks)
    assert done == set(tasks) and not pending
    for ids, task in zip(batch, tasks):
        torch.testing.assert_close(task.result(), smol_lm.next_token_logprobs_uncached(ids),
                                   rtol=0, atol=1e-4)  # (two rows of a padded forward)
    paris = tok.encode(" Paris")[0]
    assert int(tasks[0].result().argmax()) == paris
