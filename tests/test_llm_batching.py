"""Batching, KV reuse accounting, event-loop friendliness, several loops, sampling."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch

from genback.llm import AsyncTransformer


async def test_one_token_extensions_forward_one_token_each(tiny_lm):
    ctx = list(range(1000, 1030))
    await tiny_lm.next_token_logprobs(ctx)
    start = tiny_lm.cache_info()["tokens_forwarded"]
    T = 12
    for t in range(T):
        await tiny_lm.next_token_logprobs(ctx + list(range(2000, 2001 + t)))
    assert tiny_lm.cache_info()["tokens_forwarded"] - start == T


async def test_particles_extending_in_lockstep_forward_one_token_each(tiny_lm):
    prompt = list(range(10, 50))
    particles = [prompt + [p] for p in range(8)]
    await asyncio.gather(*(tiny_lm.next_token_logprobs(c) for c in particles))
    start = tiny_lm.cache_info()["tokens_forwarded"]
    for step in range(5):
        particles = [c + [100 + step] for c in particles]
        await asyncio.gather(*(tiny_lm.next_token_logprobs(c) for c in particles))
    assert tiny_lm.cache_info()["tokens_forwarded"] - start == 5 * 8


@pytest.mark.parametrize("cap", [1, 7, 16, 64])
async def test_gather_of_64_distinct_queries_uses_at_most_ceil_64_over_cap_forwards(
    tiny_hf, gpt2_tok, cap
):
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_size=cap, batch_window=0.05)
    try:
        await asyncio.gather(*(lm.next_token_logprobs([i, i + 1, i + 2]) for i in range(64)))
        assert lm.cache_info()["forwards"] <= math.ceil(64 / cap)
    finally:
        await lm.aclose()


async def test_nested_shared_prefixes_in_one_batch_are_forwarded_once(tiny_hf, gpt2_tok):
    """Four contexts share a 20-token prompt and two of them a further 10 tokens: the prompt and
    the 10 tokens are each forwarded once, then every context forwards only its own last token."""
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05)
    prompt, mid = list(range(100, 120)), list(range(200, 210))
    contexts = [prompt + mid + [1], prompt + mid + [2], prompt + [3], prompt + [4]]
    try:
        rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        assert lm.cache_info()["batches"] == 1
        assert lm.cache_info()["tokens_forwarded"] == len(prompt) + len(mid) + len(contexts)
        for c, row in zip(contexts, rows):
            torch.testing.assert_close(row, lm.next_token_logprobs_uncached(c), rtol=0, atol=1e-5)
    finally:
        await lm.aclose()


async def test_identical_contexts_in_a_batch_are_computed_once(tiny_lm):
    rows = await asyncio.gather(*(tiny_lm.next_token_logprobs([4, 5, 6]) for _ in range(10)))
    assert tiny_lm.cache_info()["tokens_forwarded"] == 3
    assert all(torch.equal(r, rows[0]) for r in rows)
    assert rows[0].data_ptr() != rows[1].data_ptr()  # each caller owns its row


async def test_window_is_measured_from_the_first_query(tiny_hf, gpt2_tok):
    """A steady trickle (one query per ms) must not starve the first query."""
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.01, batch_size=1000)
    try:
        first = asyncio.ensure_future(lm.next_token_logprobs([1, 2, 3]))
        others = []
        first_done_while_trickling = False
        for i in range(150):
            await asyncio.sleep(0.001)
            if first.done():
                first_done_while_trickling = True
                break
            others.append(asyncio.ensure_future(lm.next_token_logprobs([7, i])))
        assert first_done_while_trickling
        await asyncio.gather(first, *others)
    finally:
        await lm.aclose()


LONG = 600.0  # a window no test waits for: a batch that goes before it went by another rule


async def _dispatched(lm, turns: int = 20) -> bool:
    """Whether the loop's pending batch went within ``turns`` loop turns (no waiting)."""
    loop = asyncio.get_running_loop()
    for _ in range(turns):
        await asyncio.sleep(0)
        if not lm.scheduler.pending(loop):
            return True
    return False


async def _cohort_of(lm, n: int) -> list[list[int]]:
    """One gather of ``n`` distinct contexts under a short window (the loop's first batch),
    then a window no test waits for. Returns the contexts."""
    contexts = [[300 + i, 7] for i in range(n)]
    await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
    lm.batch_window = LONG
    return contexts


async def test_a_lockstep_cohort_goes_without_waiting_for_its_window(tiny_hf, gpt2_tok):
    """Once a loop's batch had 8 callers, each later gather of 8 goes as soon as the loop has
    run them all (one batch each, never waiting for the window), with resampling duplicates
    (callers count, not distinct contexts) and with half of the callers a loop turn late."""
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05)
    try:
        particles = await _cohort_of(lm, 8)
        for step in range(6):
            particles = [p + [10 + step] for p in particles]
            if step % 2:  # resampled: four distinct contexts, each asked twice
                particles = [particles[i // 2] for i in range(8)]
            batches = lm.cache_info()["batches"]

            async def ask(i, c):
                if step >= 4 and i % 2:
                    await asyncio.sleep(0)  # a loop turn late
                return await lm.next_token_logprobs(c)

            tasks = [asyncio.ensure_future(ask(i, c)) for i, c in enumerate(particles)]
            assert await _dispatched(lm), step  # (the window would keep it pending for minutes)
            await asyncio.gather(*tasks)
            assert lm.cache_info()["batches"] == batches + 1, step
    finally:
        await lm.aclose()


def _record_threads(lm) -> list:
    """Wrap ``lm``'s runner so that each batch notes the thread it runs on; return the list."""
    threads, run = [], lm.runner.run

    def recording_run(queries):
        threads.append(threading.current_thread())
        return run(queries)

    lm.runner.run = recording_run
    return threads


async def test_a_lockstep_step_runs_on_the_loop_thread_with_the_same_rows(tiny_hf, gpt2_tok):
    """A batch that goes because its cohort is in runs on the event loop's own thread (no
    thread hand-off; ``inline_batches`` counts them), the loop's first batch (it went for its
    window) on the worker; with ``inline_cohort`` off every batch runs on the worker. The rows,
    forwards and tokens forwarded of the two traces are equal, bit for bit."""
    me = threading.current_thread()
    traces = {}
    for inline in (True, False):
        lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05)
        lm.scheduler.inline_cohort = inline
        threads = _record_threads(lm)
        try:
            particles = await _cohort_of(lm, 8)
            rows = []
            for step in range(4):
                particles = [p + [10 + step] for p in particles]
                if step == 2:  # resampled: four distinct contexts, each asked twice
                    particles = [particles[i // 2] for i in range(8)]
                rows.append(torch.stack(await asyncio.gather(
                    *(lm.next_token_logprobs(c) for c in particles))))
            info = lm.cache_info()
            traces[inline] = rows, info["forwards"], info["tokens_forwarded"]
            assert len(threads) == 5 and threads[0] is not me
            if inline:
                assert all(t is me for t in threads[1:])
                assert lm.scheduler.inline_batches == 4
            else:
                assert not any(t is me for t in threads) and lm.scheduler.inline_batches == 0
        finally:
            await lm.aclose()
    (rows_in, *counts_in), (rows_out, *counts_out) = traces[True], traces[False]
    assert counts_in == counts_out
    for a, b in zip(rows_in, rows_out):
        assert torch.equal(a, b)


async def test_a_failing_inline_step_fails_its_callers_only_and_the_next_goes_on(
        tiny_hf, gpt2_tok):
    """A step run on the loop's thread whose computation raises fails exactly its callers
    (with that error); the loop and the model go on: the next step runs inline and its rows
    are exact."""
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05)
    run, fail = lm.runner.run, [False]

    def flaky_run(queries):
        if fail[0]:
            fail[0] = False
            raise RuntimeError("injected failure")
        return run(queries)

    lm.runner.run = flaky_run
    try:
        particles = [p + [9] for p in await _cohort_of(lm, 4)]
        fail[0] = True
        out = await asyncio.gather(*(lm.next_token_logprobs(c) for c in particles),
                                   return_exceptions=True)
        assert all(isinstance(e, RuntimeError) and "injected" in str(e) for e in out)
        assert lm.scheduler.inline_batches == 1
        rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in particles))
        assert lm.scheduler.inline_batches == 2
        for c, row in zip(particles, rows):
            torch.testing.assert_close(row, lm.next_token_logprobs_uncached(c), rtol=0, atol=1e-5)
    finally:
        await lm.aclose()


async def test_the_callers_autocast_never_reaches_a_forward(tiny_hf, gpt2_tok):
    """A step that runs on the caller's thread (its cohort is in) while the caller has CPU
    autocast on, and a sync call under it, give the rows of the same calls without it, bit for
    bit (autocast is thread-local: the worker thread never had it either)."""
    traces = []
    for autocast in (False, True):
        lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05)
        try:
            particles = await _cohort_of(lm, 4)
            rows = []
            for step in range(3):
                particles = [p + [10 + step] for p in particles]
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    rows.append(torch.stack(await asyncio.gather(
                        *(lm.next_token_logprobs(c) for c in particles))))
            assert lm.scheduler.inline_batches == 3
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                rows.append(lm.batch_next_token_logprobs_sync([p + [1] for p in particles]))
            traces.append(rows)
        finally:
            await lm.aclose()
    for a, b in zip(*traces):
        assert torch.equal(a, b)


async def test_a_sequential_caller_does_not_wait_for_the_window(tiny_hf, gpt2_tok):
    """A decoding loop (one query at a time) is its own cohort: each query goes at once."""
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05)
    try:
        ctx = (await _cohort_of(lm, 1))[0]
        for t in range(5):
            ctx = ctx + [20 + t]
            task = asyncio.ensure_future(lm.next_token_logprobs(ctx))
            assert await _dispatched(lm), t
            await task
        assert lm.cache_info()["batches"] == 1 + 5
    finally:
        await lm.aclose()


async def test_fewer_callers_than_the_cohort_wait_for_the_window(tiny_hf, gpt2_tok):
    """After a batch of 8 callers, 4 callers are not a complete cohort: their batch stays
    pending (the window runs) until something dispatches it; then it is one batch."""
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05)
    loop = asyncio.get_running_loop()
    try:
        contexts = await _cohort_of(lm, 8)
        batches = lm.cache_info()["batches"]
        tasks = [asyncio.ensure_future(lm.next_token_logprobs(c + [5])) for c in contexts[:4]]
        assert not await _dispatched(lm)  # many loop turns: the cohort check ran and declined
        assert len(lm.scheduler.pending(loop)) == 4 and not any(t.done() for t in tasks)
        lm.scheduler.flush(loop)
        await asyncio.gather(*tasks)
        assert lm.cache_info()["batches"] == batches + 1
    finally:
        await lm.aclose()


async def test_a_lockstep_cohort_arms_no_window_timer_and_a_short_one_still_goes(
        tiny_hf, gpt2_tok):
    """A batch that goes because its cohort is in makes no window timer at all (the loop's
    ``call_at`` is never asked for the batcher's window); a batch short of its cohort arms
    one when the cohort check declines, and goes when it fires (no flush)."""
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05)
    loop = asyncio.get_running_loop()
    windows, call_at = [], loop.call_at

    def counting_call_at(when, callback, *args, **kwargs):
        if getattr(callback, "__name__", "") == "_on_window":
            windows.append(when)
        return call_at(when, callback, *args, **kwargs)

    loop.call_at = counting_call_at
    try:
        particles = await _cohort_of(lm, 8)  # (the loop's first batch: no cohort yet, a timer)
        assert len(windows) == 1
        windows.clear()
        lm.batch_window = 0.05
        for step in range(4):
            particles = [p + [10 + step] for p in particles]
            await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
        assert windows == []
        batches = lm.cache_info()["batches"]
        tasks = [asyncio.ensure_future(lm.next_token_logprobs(p + [5])) for p in particles[:4]]
        await asyncio.wait_for(asyncio.gather(*tasks), 60)  # (its window fires; no flush)
        assert len(windows) == 1 and lm.cache_info()["batches"] == batches + 1
    finally:
        del loop.call_at
        await lm.aclose()


async def test_loop_keeps_serving_while_the_model_computes(tiny_hf, gpt2_tok):
    """While a forward is in progress, coroutines on the loop keep running: the forward is held
    until a coroutine on the loop has seen it start (a forward on the loop thread would never
    see that, and the wait would give up). Events, not timings."""
    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    in_forward, loop_saw_it = threading.Event(), threading.Event()
    threads = []
    run = lm.runner.run

    def held_run(queries):
        threads.append(threading.current_thread())
        in_forward.set()
        served = loop_saw_it.wait(timeout=60)
        return [None] * len(queries) if not served else run(queries)

    lm.runner.run = held_run

    async def watcher():
        ticks = 0
        while not in_forward.is_set():
            ticks += 1
            await asyncio.sleep(0.001)
        loop_saw_it.set()
        return ticks

    try:
        row, ticks = await asyncio.gather(lm.next_token_logprobs([1, 2, 3]), watcher())
        assert row is not None and loop_saw_it.is_set()
        assert threads and threads[0] is not threading.current_thread()
        info = lm.cache_info()  # statistics never wait for a forward
        assert info["forwards"] == 1
    finally:
        await lm.aclose()


async def test_cache_info_does_not_wait_for_a_running_forward(tiny_hf, gpt2_tok):
    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    in_forward, release = threading.Event(), threading.Event()
    run = lm.runner.run

    def held_run(queries):
        in_forward.set()
        release.wait(timeout=60)
        return run(queries)

    lm.runner.run = held_run
    try:
        task = asyncio.ensure_future(lm.next_token_logprobs([5, 6]))
        await asyncio.get_running_loop().run_in_executor(None, in_forward.wait, 60)
        info = lm.cache_info()  # would deadlock-wait here if it took the forward lock
        assert info["forwards"] == 0 and not release.is_set()
        release.set()
        await task
        assert lm.cache_info()["forwards"] == 1
    finally:
        release.set()
        await lm.aclose()


def test_one_model_serves_successive_event_loops(tiny_hf, gpt2_tok):
    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    try:
        async def ask(ids):
            return await asyncio.gather(lm.next_token_logprobs(ids), lm.next_token_logprobs(ids + [1]))

        first = asyncio.run(ask([3, 4, 5]))
        second = asyncio.run(ask([3, 4, 5, 6]))
        third = asyncio.run(ask([3, 4, 5]))
        assert torch.equal(first[0], third[0])
        ref = lm.next_token_logprobs_uncached([3, 4, 5, 6, 1])
        assert float((second[1] - ref).abs().max()) <= 1e-5
    finally:
        lm.close()


async def test_seeded_sampling_is_reproducible(tiny_lm):
    eos = [gpt2_eos := tiny_lm.tokenizer.eos_token_id]
    a = await tiny_lm.sample([1, 2, 3], max_tokens=12, eos_token_ids=eos, seed=7)
    tiny_lm.clear_cache()
    b = await tiny_lm.sample([1, 2, 3], max_tokens=12, eos_token_ids=eos, seed=7)
    assert a == b and len(a) <= 12 and gpt2_eos not in a
    batch = await tiny_lm.batch_sample([[1, 2, 3], [9, 9]], 12, eos, seed=[7, 8])
    assert batch[0] == a
    again = await tiny_lm.batch_sample([[1, 2, 3], [9, 9]], 12, eos, seed=[7, 8])
    assert again == batch
    others = [await tiny_lm.sample([1, 2, 3], 12, eos, seed=s) for s in range(8, 12)]
    assert any(o != a for o in others)  # the seed matters


async def test_sampling_follows_the_distribution(tiny_lm):
    """First-token frequencies over many seeds match the model's probabilities (chi-square-ish)."""
    prompt = [11, 12]
    probs = torch.exp(await tiny_lm.next_token_logprobs(prompt))
    top = int(probs.argmax())
    n = 400
    draws = await tiny_lm.batch_sample([prompt] * n, 1, [], seed=list(range(n)))
    freq = sum(d[0] == top for d in draws) / n
    p = float(probs[top])
    assert abs(freq - p) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-3


async def test_cache_kv_pins_a_prompt_against_eviction(tiny_hf, gpt2_tok):
    per_token = 2 * 2 * 64 * 4
    lm = AsyncTransformer(tiny_hf, gpt2_tok, kv_budget_bytes=40 * per_token, row_cache_size=0)
    try:
        prompt = list(range(300, 330))
        lm.cache_kv(prompt)
        for i in range(20):  # other contexts push the budget
            await lm.next_token_logprobs([i + 1] * 15)
        assert lm.cache_info()["evictions"] > 0
        before = lm.cache_info()["tokens_forwarded"]
        row = await lm.next_token_logprobs(prompt + [5])
        assert lm.cache_info()["tokens_forwarded"] - before == 1  # the pinned prompt survived
        assert float((row - lm.next_token_logprobs_uncached(prompt + [5])).abs().max()) <= 1e-5
        lm.clear_kv_cache()  # unpins
        assert lm.cache_info()["kv_bytes"] == 0
    finally:
        await lm.aclose()


async def test_a_query_asked_twice_in_a_batch_gives_each_caller_its_own_copy():
    """The batcher's ``copy``: the second and later callers of one (deduplicated) query get
    ``copy(result)``, the first the result itself; without ``copy`` all share it."""
    from genback.batching.batcher import Batcher

    for copy in (None, lambda r: list(r)):
        b = Batcher(lambda qs: [[q] for q in qs], window=0.01, max_batch_size=8, copy=copy)
        try:
            got = await asyncio.gather(b.submit("k", 1), b.submit("k", 1), b.submit("j", 2))
            assert got == [[1], [1], [2]]
            assert (got[0] is got[1]) == (copy is None)
        finally:
            b.close()


async def test_queries_stay_immutable_and_cached_keys_drop_the_lineage_hint(tiny_lm):
    """The front's row cache keeps a copy of a query without its ``parent`` (a cached key must
    not keep the parent context alive); the query itself is never changed."""
    from genback.queries.kinds import NextToken

    parent = (464, 3139, 286)
    await tiny_lm.next_token_logprobs(list(parent))
    query = tiny_lm.front.next_token(list(parent) + [4881], None)
    assert query.parent == parent  # found by lineage: the validated parent context
    [row] = tiny_lm.front.ask_sync([query])
    assert query.parent == parent
    cached = tiny_lm.front.cache.get(NextToken(query.tokens))
    assert cached is not None and torch.equal(cached, row)
    [key] = [k for k in tiny_lm.front.cache._rows if k == query]  # (the cache's own keys)
    assert key is not query and key.parent is None


async def test_the_batchers_compute_hands_fresh_rows_out_and_caches_copies(tiny_lm):
    """The batcher's compute step (``Front._compute_owned``) on host rows: the rows the runner
    computed go to their callers as they are and the output cache keeps copies of them (one
    :class:`genback.queries.rows.BlockRow` each, a block of its own); a row the cache held already is
    handed out as a copy. Every row equals an uncached forward's, and writing into a handed-out
    row changes nothing the cache hands out later."""
    from genback.queries.rows import BlockRow

    front = tiny_lm.front
    old = [464, 3139, 286]
    kept = await tiny_lm.next_token_logprobs(old)
    cached_row = front.cache.get(front.next_token(old, None))
    queries = [front.next_token(c, None) for c in (old, old + [11], old + [12])]
    rows = front._compute_owned(queries)
    assert rows[0].data_ptr() != cached_row.data_ptr()  # the cached row: a copy
    entries = [front.cache._rows[q] for q in queries[1:]]
    assert all(type(e) is BlockRow for e in entries) and entries[0].block is entries[1].block
    block = entries[0].block
    for r in rows[1:]:  # the fresh rows: not in the cache's block
        assert not block.data_ptr() <= r.data_ptr() < block.data_ptr() + block.nbytes
    for q, r in zip(queries, rows):
        want = tiny_lm.next_token_logprobs_uncached(list(q.tokens))
        assert (r - want).abs().max() <= 1e-5
    torch.testing.assert_close(rows[0], kept, rtol=0, atol=0)
    want = [r.clone() for r in rows]
    for r in rows:
        r.fill_(0.0)
    for q, w in zip(queries, want):
        torch.testing.assert_close(await tiny_lm.next_token_logprobs(list(q.tokens)), w,
                                   rtol=0, atol=0)
