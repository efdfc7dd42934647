"""Tree attention and work-sized batches: exact against uncached forwards on random trees, KV
read once per shared segment (counted bytes), memory bounded by the tree, dense fallback."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genback.llm import AsyncTransformer

TINY_TOKEN_BYTES = 2 * 2 * 64 * 4  # tiny GPT-2: layers * (k, v) * hidden * fp32


def _max_err(rows, contexts, lm, refs=None):
    refs = {} if refs is None else refs
    worst = 0.0
    for row, ctx in zip(rows, contexts):
        key = tuple(ctx)
        if key not in refs:
            refs[key] = lm.next_token_logprobs_uncached(list(key))
        worst = max(worst, float((row - refs[key]).abs().max()))
    return worst


def _smc_trace(rng: random.Random, prompt_len: int, particles: int, steps: int, resample: int,
               vocab: int, base: int = 100):
    """Contexts of a synthetic SMC run: a shared prompt, particles extended by one random token
    per step, resampled (duplicated / dropped at random) every ``resample`` steps."""
    prompt = [base + rng.randrange(vocab) for _ in range(prompt_len)]
    parts = [list(prompt) for _ in range(particles)]
    trace = []
    for step in range(steps):
        if step and step % resample == 0:
            parts = [list(rng.choice(parts)) for _ in range(particles)]
        for p in parts:
            p.append(base + rng.randrange(vocab))
        trace.append([list(p) for p in parts])
    return trace


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), prompt_len=st.integers(1, 40),
       particles=st.integers(1, 12), resample=st.integers(1, 4),
       budget=st.sampled_from([30, 200, 100_000]), min_shared=st.sampled_from([1, 8, 64]))
def test_random_smc_trees_match_uncached_tiny(tiny_hf, gpt2_tok, seed, prompt_len, particles,
                                              resample, budget, min_shared):
    """Shared prompts, branching, resampling, mixed lengths and eviction in the middle of a run:
    every row equals an uncached forward, whichever segments are read as shared."""
    rng = random.Random(seed)
    lm = AsyncTransformer(tiny_hf, gpt2_tok, kv_budget_bytes=budget * TINY_TOKEN_BYTES,
                          min_shared_tokens=min_shared, row_cache_size=0)
    trace = _smc_trace(rng, prompt_len, particles, 6, resample, 50)
    # mixed lengths: a few extra contexts of other lengths join some steps
    refs: dict = {}

    async def run():
        for contexts in trace:
            extra = [c[: rng.randrange(1, len(c) + 1)] for c in rng.sample(contexts, 1)]
            batch = contexts + extra
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in batch))
            assert _max_err(rows, batch, lm, refs) <= 1e-5
            assert lm.cache_info()["kv_bytes"] <= lm.cache_info()["kv_budget_bytes"]

    try:
        asyncio.run(run())
    finally:
        lm.close()


async def test_shared_prompt_is_read_once_per_forward(tiny_hf, gpt2_tok):
    """N rows one token beyond a shared P-token prompt: the forward reads P + N tokens of KV
    (the prompt once), not N * P; the dense path reads N * P."""
    P, N = 200, 16
    prompt = list(range(1000, 1000 + P))
    read = {}
    for attention in ("tree", "dense"):
        lm = AsyncTransformer(tiny_hf, gpt2_tok, attention=attention)
        try:
            lm.cache_kv(prompt)
            before = lm.cache_info()["kv_bytes_read"]
            contexts = [prompt + [i] for i in range(N)]
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
            assert lm.cache_info()["forwards"] == 1 + 1  # the prompt, then one forward for all
            read[attention] = lm.cache_info()["kv_bytes_read"] - before
            assert _max_err(rows, contexts, lm) <= 1e-5
            assert lm.cache_info()["attention"].startswith(attention)
        finally:
            await lm.aclose()
    assert read["tree"] == P * TINY_TOKEN_BYTES
    assert read["dense"] == N * P * TINY_TOKEN_BYTES


async def test_all_particles_of_a_step_share_one_forward(tiny_hf, gpt2_tok):
    """256 particles over a 300-token prompt: each step is one batch and one forward, however
    long the contexts (the budget counts forwarded tokens, not context lengths)."""
    prompt = list(range(2000, 2300))
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05)
    try:
        lm.cache_kv(prompt)
        parts = [prompt + [i % 50] for i in range(256)]
        for step in range(3):
            info = lm.cache_info()
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in parts))
            after = lm.cache_info()
            assert after["batches"] - info["batches"] == 1
            assert after["forwards"] - info["forwards"] == 1
            assert after["tokens_forwarded"] - info["tokens_forwarded"] == len(set(map(tuple, parts)))
            parts = [c + [step] for c in parts]
        assert _max_err(rows[:8], parts[:8] and [p[:-1] for p in parts[:8]], lm) <= 1e-5
    finally:
        await lm.aclose()


async def test_decoding_steps_take_one_pool_slot_per_new_token(tiny_hf, gpt2_tok):
    """Rows with distinct prompts (private pasts) decoding in lockstep for 40 steps. KV lives in
    the pool's token slots and the tree holds slot indices: a step takes exactly one slot per
    row (no KV is copied to lay out pasts or to merge nodes), each row's leaf grows in place
    (``KVTree.extend``; past ``EXTEND_MAX`` tokens a child, merged geometrically by
    ``KVTree.compact``), so each path keeps O(log steps) segments instead of one per generated
    token, clearing the cache frees every slot, and every row stays exact."""
    rng = random.Random(7)
    rows_n, steps = 12, 40
    parts = [[100 + rng.randrange(500) for _ in range(20 + 3 * i)] for i in range(rows_n)]
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, row_cache_size=0)
    try:
        used = []
        for step in range(steps):
            got = await asyncio.gather(*(lm.next_token_logprobs(c) for c in parts))
            used.append(lm.cache_info()["kv_pool_slots_used"])
            assert _max_err(got, parts, lm) <= 1e-5
            parts = [c + [100 + rng.randrange(500)] for c in parts]
        prompts = sum(len(c) for c in parts) - rows_n * steps
        assert prompts - rows_n < used[0] <= prompts  # the prompts (a shared first token once)
        assert all(b - a == rows_n for a, b in zip(used, used[1:])), used
        tree = lm.runner.tree
        assert len(tree) <= 3 * rows_n  # (not a node per row and step)
        assert lm.cache_info()["kv_bytes"] == used[-1] * lm.runner.kv_token_bytes
        depths = [len(tree.match(tuple(c[:-1]), touch=False)[0]) for c in parts]
        assert max(depths) <= 2 * math.log2(steps) + 2, depths  # not one node per step
        lm.clear_kv_cache()
        assert lm.cache_info()["kv_pool_slots_used"] == 0
    finally:
        await lm.aclose()


def test_smollm2_random_trees_match_uncached(module_smol_lm):
    """The real model: SMC-shaped trees over a 60-token prompt, resampling, a tiny minimum for
    shared segments so both attention parts are used, and eviction under a small budget."""
    lm = module_smol_lm
    hf = lm.model
    c = hf.config
    token_bytes = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4
    small = AsyncTransformer(hf, lm.tokenizer, min_shared_tokens=4, row_cache_size=0,
                             kv_budget_bytes=70 * token_bytes)
    rng = random.Random(3)
    refs: dict = {}
    worst = 0.0
    try:
        for trace in (_smc_trace(rng, 60, 6, 5, 2, 5000), _smc_trace(rng, 3, 4, 4, 1, 5000)):
            for contexts in trace:
                rows = small.batch_next_token_logprobs_sync(contexts)
                worst = max(worst, _max_err(rows, contexts, small, refs))
        assert small.cache_info()["evictions"] > 0
        assert small.cache_info()["attention"] == "tree"
    finally:
        small.close()
    assert worst <= 1e-4


async def test_dense_fallback_is_exact_and_says_why(tiny_hf, gpt2_tok):
    lm = AsyncTransformer(tiny_hf, gpt2_tok, attention="dense")
    try:
        assert lm.cache_info()["attention"] == "dense (attention=dense)"
        rng = random.Random(0)
        for contexts in _smc_trace(rng, 20, 5, 4, 2, 50):
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
            assert _max_err(rows, contexts, lm) <= 1e-5
    finally:
        await lm.aclose()
    with pytest.raises(ValueError, match="attention must be"):
        AsyncTransformer(tiny_hf, gpt2_tok, attention="flash")


async def test_token_logprobs_over_shared_context_match_rows(tiny_hf, gpt2_tok):
    """Continuations (several new tokens per row) over a shared cached context, tree path."""
    lm = AsyncTransformer(tiny_hf, gpt2_tok, min_shared_tokens=1)
    ctx = list(range(500, 560))
    try:
        lm.cache_kv(ctx)
        conts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
        got = await asyncio.gather(*(lm.token_logprobs(ctx, c) for c in conts))
        for c, g in zip(conts, got):
            want = torch.stack([lm.next_token_logprobs_uncached(ctx + c[:k])[c[k]]
                                for k in range(len(c))])
            assert float((g - want).abs().max()) <= 1e-5
    finally:
        await lm.aclose()
