"""Bad input fails only its caller; failures, cancellation, reset and close leave others served."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from genback.llm import AsyncTransformer, BatcherClosed, load_model_by_name

BAD_IDS = [
    ([], ValueError, "non-empty"),
    ([1, 2, 99999999], ValueError, r"token_ids\[2\] = 99999999 is outside"),
    ([-1], ValueError, r"token_ids\[0\] = -1"),
    ([1, 2.0], TypeError, r"token_ids\[1\] must be an int"),
    ([True, 3], TypeError, r"token_ids\[0\] must be an int"),
    ("hello", TypeError, "must be a list of int token ids, got str"),
    (None, TypeError, "got NoneType"),
    (torch.tensor([[1, 2]]), ValueError, "must be 1-D"),
    (torch.tensor([1.0, 2.0]), TypeError, "dtype torch.float32"),
]


@pytest.mark.parametrize("bad, exc, match", BAD_IDS)
async def test_bad_token_ids_fail_only_that_caller(tiny_lm, bad, exc, match):
    good = [[5, 6], [5, 7], [8]]
    results = await asyncio.gather(
        tiny_lm.next_token_logprobs(good[0]),
        tiny_lm.next_token_logprobs(bad),
        tiny_lm.next_token_logprobs(good[1]),
        tiny_lm.next_token_logprobs(good[2]),
        return_exceptions=True,
    )
    assert isinstance(results[1], exc)
    with pytest.raises(exc, match=match):
        await tiny_lm.next_token_logprobs(bad)
    for ids, row in zip(good, [results[0], results[2], results[3]]):
        assert float((row - tiny_lm.next_token_logprobs_uncached(ids)).abs().max()) <= 1e-5
    with pytest.raises(exc, match=match):
        tiny_lm.next_token_logprobs_sync(bad)


async def test_accepted_id_containers(tiny_lm):
    ref = await tiny_lm.next_token_logprobs([3, 4])
    for ids in ((3, 4), np.array([3, 4]), torch.tensor([3, 4]), [np.int64(3), 4]):
        assert torch.equal(await tiny_lm.next_token_logprobs(ids), ref)


async def test_other_bad_arguments(tiny_lm):
    with pytest.raises(ValueError, match="continuation_ids must be non-empty"):
        await tiny_lm.token_logprobs([1], [])
    with pytest.raises(ValueError, match="context_ids must be non-empty"):
        await tiny_lm.token_logprobs([], [1])
    with pytest.raises(ValueError, match="lora_name='x'"):
        await tiny_lm.next_token_logprobs([1], lora_name="x")
    with pytest.raises(ValueError, match="max_tokens must be an int >= 0, got -1"):
        await tiny_lm.sample([1], -1, [0])
    with pytest.raises(ValueError, match="temperature must be a number > 0, got 0"):
        await tiny_lm.sample([1], 3, [0], temperature=0)
    with pytest.raises(ValueError, match="token_ids_list must hold at least one context"):
        await tiny_lm.batch_next_token_logprobs([])
    with pytest.raises(ValueError, match="more than the model's context of 512"):
        await tiny_lm.next_token_logprobs([1] * 513)


async def test_a_bad_context_in_a_batch_names_its_index_and_queues_nothing(tiny_lm):
    """``batch_next_token_logprobs`` checks every context before it queues any: the error
    names the bad one's index, no query of the batch is computed, and the model serves the
    same batch without it (rows stacked in order, a cached row and a repeated context
    included)."""
    before = tiny_lm.cache_info()["batched_queries"]
    with pytest.raises(ValueError, match=r"token_ids_list\[2\]"):
        await tiny_lm.batch_next_token_logprobs([[5, 6], [5, 7], [5, -1]])
    assert tiny_lm.cache_info()["batched_queries"] == before
    cached = await tiny_lm.next_token_logprobs([5, 6])
    rows = await tiny_lm.batch_next_token_logprobs([[5, 6], [5, 7], [5, 7]])
    assert rows.shape == (3, len(cached)) and torch.equal(rows[0], cached)
    assert torch.equal(rows[1], rows[2])
    for ids, row in zip([[5, 6], [5, 7]], rows):
        assert float((row - tiny_lm.next_token_logprobs_uncached(ids)).abs().max()) <= 1e-5


@pytest.mark.parametrize("option, value", [
    ("kv_budget_bytes", 0), ("kv_budget_bytes", -5), ("batch_size", 0), ("max_batch_tokens", 0),
    ("batch_window", -1.0), ("row_cache_size", -1), ("batch_size", 2.5),
])
def test_bad_options(tiny_hf, gpt2_tok, option, value):
    with pytest.raises(ValueError, match=f"{value}"):
        AsyncTransformer(tiny_hf, gpt2_tok, **{option: value})


def test_unknown_model_and_backend(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="neither an embedded alias"):
        AsyncTransformer.from_name("./no/such/folder")
    with pytest.raises(ValueError, match="model 'smollm-does-not-exist' is a Hub id that is not in"):
        AsyncTransformer.from_name("smollm-does-not-exist")  # a legacy Hub id, not cached
    with pytest.raises(ValueError, match="backend must be one of"):
        load_model_by_name("smollm2-135m", backend="tensorrt")
    with pytest.raises(TypeError, match="model name must be a str"):
        AsyncTransformer.from_name(123)


class _FailingTransformer(AsyncTransformer):
    """Fault injection: the runner raises whenever a batch contains the poison token."""

    POISON = 666

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        run = self.runner.run

        def failing_run(queries):
            if any(self.POISON in q.tokens for q in queries):
                raise RuntimeError("injected forward failure")
            return run(queries)

        self.runner.run = failing_run


async def test_a_failing_forward_fails_only_its_batch(tiny_hf, gpt2_tok):
    lm = _FailingTransformer(tiny_hf, gpt2_tok, batch_size=2, batch_window=0.05)
    try:
        # batches are taken in arrival order, two queries each: [poison, a], [b, c]
        results = await asyncio.gather(
            lm.next_token_logprobs([1, lm.POISON]), lm.next_token_logprobs([1, 2]),
            lm.next_token_logprobs([3, 4]), lm.next_token_logprobs([5]),
            return_exceptions=True,
        )
        assert [type(r).__name__ for r in results[:2]] == ["RuntimeError", "RuntimeError"]
        for ids, row in zip([[3, 4], [5]], results[2:]):
            assert float((row - lm.next_token_logprobs_uncached(ids)).abs().max()) <= 1e-5
        # the failed batch left no half-written cache behind and the model keeps serving
        row = await lm.next_token_logprobs([1, 2])
        assert float((row - lm.next_token_logprobs_uncached([1, 2])).abs().max()) <= 1e-5
    finally:
        await lm.aclose()


async def test_cancelled_caller_is_dropped_and_not_computed(tiny_hf, gpt2_tok):
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05)
    try:
        keep = asyncio.ensure_future(lm.next_token_logprobs([10, 11, 12]))
        gone = asyncio.ensure_future(lm.next_token_logprobs([20, 21, 22, 23, 24, 25]))
        await asyncio.sleep(0)
        gone.cancel()
        row = await keep
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert lm.cache_info()["tokens_forwarded"] == 3  # the cancelled context never ran
        assert float((row - lm.next_token_logprobs_uncached([10, 11, 12])).abs().max()) <= 1e-5
    finally:
        await lm.aclose()


async def test_reset_fails_every_pending_caller(tiny_hf, gpt2_tok):
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=10.0)
    try:
        pending = [asyncio.ensure_future(lm.next_token_logprobs([i + 1])) for i in range(5)]
        await asyncio.sleep(0.01)
        assert lm.reset_async_queries() == 5
        results = await asyncio.gather(*pending, return_exceptions=True)
        assert all(isinstance(r, BatcherClosed) for r in results)
    finally:
        await lm.aclose()
    lm2 = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.0)
    try:
        assert (await lm2.next_token_logprobs([1])).shape == (lm2.vocab_size,)  # still serving
    finally:
        await lm2.aclose()


async def test_aclose_is_idempotent_and_fails_later_queries(tiny_hf, gpt2_tok):
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=10.0)
    pending = asyncio.ensure_future(lm.next_token_logprobs([1, 2]))
    await asyncio.sleep(0.01)
    await lm.aclose()
    await lm.aclose()
    lm.close()
    with pytest.raises(BatcherClosed):
        await pending
    with pytest.raises(BatcherClosed, match="closed"):
        await lm.next_token_logprobs([1])
    with pytest.raises(RuntimeError, match="closed"):
        lm.next_token_logprobs_sync([1])


@pytest.mark.parametrize("window", [float("inf"), float("nan"), -1.0, True, "0.1"])
def test_batch_window_must_be_finite(tiny_hf, gpt2_tok, window):
    with pytest.raises(ValueError, match="batch_window must be a finite number"):
        AsyncTransformer(tiny_hf, gpt2_tok, batch_window=window)


async def test_reset_from_another_thread_while_queries_arrive_leaves_nobody_hanging(
        tiny_hf, gpt2_tok):
    """Every caller ends (answered exactly or failed with BatcherClosed) while another thread
    resets pending queries again and again."""
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.001, batch_size=16)
    stop = threading.Event()

    def resetter():
        while not stop.is_set():
            lm.reset_async_queries()

    thread = threading.Thread(target=resetter)
    thread.start()
    try:
        contexts = [[i % 97, i % 89 + 1] for i in range(2000)]
        results = await asyncio.wait_for(asyncio.gather(
            *(lm.next_token_logprobs(c) for c in contexts), return_exceptions=True), timeout=300)
    finally:
        stop.set()
        thread.join()
    failed = [r for r in results if isinstance(r, BaseException)]
    assert all(isinstance(r, BatcherClosed) for r in failed)
    answered = [(c, r) for c, r in zip(contexts, results) if not isinstance(r, BaseException)]
    for c, r in answered[:20]:
        assert float((r - lm.next_token_logprobs_uncached(c)).abs().max()) <= 1e-5
    await lm.aclose()


async def test_a_closed_model_fails_queries_whose_rows_are_cached(tiny_hf, gpt2_tok):
    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    await lm.next_token_logprobs([1, 2])
    await lm.aclose()
    with pytest.raises(BatcherClosed):
        await lm.next_token_logprobs([1, 2])
    with pytest.raises(BatcherClosed):
        lm.next_token_logprobs_sync([1, 2])


async def test_clear_cache_keeps_the_pinned_prompt(tiny_hf, gpt2_tok):
    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    try:
        prompt = list(range(40, 70))
        lm.cache_kv(prompt)
        await lm.next_token_logprobs(prompt + [1, 2, 3])
        lm.clear_cache()
        assert lm.cache_info()["kv_bytes"] == len(prompt) * 2 * 2 * 64 * 4
        before = lm.cache_info()["tokens_forwarded"]
        await lm.next_token_logprobs(prompt + [9])
        assert lm.cache_info()["tokens_forwarded"] - before == 1
    finally:
        await lm.aclose()


async def test_token_logprobs_longer_than_the_window_is_refused(tiny_hf, gpt2_tok):
    """The window counts the forward's inputs, context + continuation[:-1] (the last token is
    never an input, as lm-eval's HFLM counts): 512 inputs fit the tiny model's 512, 513 fail."""
    lm = AsyncTransformer(tiny_hf, gpt2_tok)  # n_positions = 512
    try:
        # the forward's inputs are counted (context + continuation[:-1]; genback.queries.window)
        with pytest.raises(ValueError, match=r"context_ids \+ continuation_ids has 300 \+ 300 "
                                             r"tokens: the forward takes 599 inputs"):
            await lm.token_logprobs([1] * 300, [2] * 300)
        with pytest.raises(ValueError, match="the forward takes 513 inputs"):
            await lm.token_logprobs([1] * 257, [2] * 257)
        assert lm.cache_info()["forwards"] == 0
        lps = await lm.token_logprobs([1] * 256, [2] * 257)  # 512 inputs: the whole window
        ref = lm.next_token_logprobs_uncached([1] * 256 + [2] * 256)
        assert abs(float(lps[-1]) - float(ref[2])) < 1e-5
    finally:
        await lm.aclose()


async def test_cache_kv_errors_name_prompt_tokens_and_a_pin_that_cannot_fit(tiny_hf, gpt2_tok):
    per_token = 2 * 2 * 64 * 4
    lm = AsyncTransformer(tiny_hf, gpt2_tok, kv_budget_bytes=20 * per_token)
    try:
        with pytest.raises(ValueError, match="prompt_tokens must be non-empty"):
            lm.cache_kv([])
        with pytest.raises(TypeError, match=r"prompt_tokens\[1\]"):
            lm.cache_kv([1, "a"])
        with pytest.raises(ValueError, match="exceeds kv_budget_bytes"):
            lm.cache_kv(list(range(100, 130)))
        lm.cache_kv(list(range(100, 115)))  # fits
        with pytest.raises(ValueError, match="pinned already"):
            lm.cache_kv(list(range(200, 210)))
        before = lm.cache_info()["tokens_forwarded"]
        await lm.next_token_logprobs(list(range(100, 115)) + [1])
        assert lm.cache_info()["tokens_forwarded"] - before == 1
    finally:
        await lm.aclose()


async def test_batch_size_set_after_construction_takes_effect(tiny_hf, gpt2_tok):
    """With a window of 1,000 s, two queries are answered only if the batch is full at two."""
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=1000.0)
    lm.batch_size = 2
    try:
        await asyncio.wait_for(asyncio.gather(lm.next_token_logprobs([1]),
                                              lm.next_token_logprobs([2])), timeout=120)
        assert lm.cache_info()["batches"] == 1
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            lm.batch_size = 0
    finally:
        await lm.aclose()


def test_match_probes_do_not_reorder_the_lru():
    from genback.llm.hf.cache.kvtree import KVTree

    tree = KVTree(10_000)
    tree.insert((1, 2), 0, np.array([1, 2]))
    tree.insert((3, 4), 0, np.array([3, 4]))
    stamps = [n.stamp for n in tree._nodes]
    tree.match((1, 2), touch=False)
    assert [n.stamp for n in tree._nodes] == stamps
    tree.match((1, 2))
    assert [n.stamp for n in tree._nodes] != stamps
    tree.budget_bytes = 2  # the probe left (3, 4) the least recent: evicted first
    tree.evict()
    assert tree.find((1, 2)) is not None and tree.find((3, 4)) is None


def test_model_without_a_kv_cache_is_a_clear_type_error(gpt2_tok):
    """A state-space model (a random 2-layer Mamba2) returns no key/value cache: AsyncTransformer
    refuses it with a TypeError naming the model class, not an AttributeError from inside."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    config = Mamba2Config(vocab_size=len(gpt2_tok), hidden_size=64, num_hidden_layers=2,
                          num_heads=8, head_dim=16, state_size=16, expand=2, n_groups=1,
                          chunk_size=32)
    model = Mamba2ForCausalLM(config).eval()
    with pytest.raises(TypeError, match="Mamba2ForCausalLM returns none"):
        AsyncTransformer(model, gpt2_tok)
