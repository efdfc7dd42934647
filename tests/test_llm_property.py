"""Hypothesis: random interleavings of async, sync, batch, token_logprobs, clear_cache and eviction
on one model all return what an uncached forward returns."""

from __future__ import annotations

import asyncio

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genback.llm import AsyncTransformer

TOL = 1e-5
PER_TOKEN = 2 * 2 * 64 * 4  # tiny GPT-2: layers * (k, v) * hidden * fp32

# contexts drawn from a small token alphabet so that prefixes are shared often
token = st.integers(min_value=0, max_value=5)
context = st.lists(token, min_size=1, max_size=12)
op = st.one_of(
    st.tuples(st.just("async"), st.lists(context, min_size=1, max_size=6)),
    st.tuples(st.just("sync"), st.lists(context, min_size=1, max_size=3)),
    st.tuples(st.just("batch"), st.lists(context, min_size=1, max_size=4)),
    st.tuples(st.just("token_logprobs"), st.tuples(context, context)),
    st.tuples(st.just("clear"), st.none()),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=1, max_size=8), budget=st.sampled_from([8, 40, 10_000]))
def test_random_interleavings_match_uncached(tiny_hf, gpt2_tok, ops, budget):
    lm = AsyncTransformer(tiny_hf, gpt2_tok, kv_budget_bytes=budget * PER_TOKEN,
                          row_cache_size=4)
    refs: dict[tuple, torch.Tensor] = {}

    def ref(ids):
        key = tuple(ids)
        if key not in refs:
            refs[key] = lm.next_token_logprobs_uncached(list(key))
        return refs[key]

    async def run():
        for kind, arg in ops:
            if kind == "async":
                rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in arg))
                for c, r in zip(arg, rows):
                    assert float((r - ref(c)).abs().max()) <= TOL
            elif kind == "sync":
                for c in arg:
                    assert float((lm.next_token_logprobs_sync(c) - ref(c)).abs().max()) <= TOL
            elif kind == "batch":
                rows = await lm.batch_next_token_logprobs(arg)
                for c, r in zip(arg, rows):
                    assert float((r - ref(c)).abs().max()) <= TOL
            elif kind == "token_logprobs":
                ctx, cont = arg
                got = await lm.token_logprobs(ctx, cont)
                want = torch.stack([ref(ctx + cont[:k])[cont[k]] for k in range(len(cont))])
                assert float((got - want).abs().max()) <= TOL
            else:
                lm.clear_cache()
            assert lm.cache_info()["kv_bytes"] <= budget * PER_TOKEN

    try:
        asyncio.run(run())
    finally:
        lm.close()
