"""A chain of uniform steps run from the last step's rows and committed to the KV tree later
(genback.llm.hf.chain): its rows equal an uncached forward and the planned steps' rows; it does
the same forwards and tokens and leaves the same KV cached; it is committed before anything
else reads the tree (a scoring query, a walk, a picture, a pin, clear, the ``tree`` itself) and
before an eviction, and ``cache_info`` (read without the forward lock) commits nothing; a failed
step leaves the chain as it was; counted chained steps."""

from __future__ import annotations

import asyncio
import copy
import random

import pytest
import torch

from genback.llm import AsyncTransformer
from genback.llm.hf.decode import step as decode_step
from genback.llm.hf.forward import tree as tree_forward
from genback.llm.hf.plan.lanes import REFRESH

from test_llm_tree import TINY_TOKEN_BYTES, _max_err, _smc_trace


def _planned(lm):
    """``lm`` with every step planned and committed at once (the chain off): the reference."""
    lm.runner.chain = None
    return lm


async def _steps(lm, trace, api: str, refs: dict) -> float:
    """Ask every step of ``trace`` (contexts as lists) through ``api`` (``gather`` of
    ``next_token_logprobs`` over lists, or ``batch`` of ``batch_next_token_logprobs`` over
    ``lm.context`` objects, each particle's context its parent's ``+ [token]``); the largest
    difference from an uncached forward."""
    worst, held = 0.0, {}
    for contexts in trace:
        if api == "gather":
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        else:
            objs = []
            for c in contexts:  # (a particle's context object extends its parent's)
                parent = held.get(tuple(c[:-1]))
                objs.append(lm.context(c) if parent is None else parent + [c[-1]])
            held = {tuple(o): o for o in objs}
            rows = list(await lm.batch_next_token_logprobs(objs))
        worst = max(worst, _max_err(rows, contexts, lm, refs))
    return worst


# each forward a chain continues: the tree forward (the CPU's default) and the decode step, run
# eagerly here (on a GPU it replays captured graphs: tests/test_cuda.py)
DECODES = ["auto", "eager"]


def _cached_length(lm, context) -> int:
    return lm.runner.tree.match(list(context), touch=False)[1]


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("api", ["gather", "batch"])
@pytest.mark.parametrize("particles,resample", [(12, 3), (1, 2), (9, 1)])
def test_chained_steps_equal_uncached_and_planned_steps(tiny_hf, gpt2_tok, api, particles,
                                                        resample, decode):
    """SMC with resampling over more steps than a lane table lives: the chained steps' rows
    equal an uncached forward and the planned steps' (<= 1e-5), every step but the prompt's and
    the full layouts is chained (counted), both runs forward the same tokens in the same
    forwards and keep the same KV, and every last context is cached whole once committed."""
    trace = _smc_trace(random.Random(particles), 40, particles, REFRESH + 8, resample, 50)
    refs: dict = {}
    infos = []
    for planned in (False, True):
        lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, row_cache_size=0,
                              decode=decode)
        if planned:
            _planned(lm)
        else:  # (the chain continues the forward that runs the steps)
            want = lm.runner.forward if decode == "auto" else lm.runner.decode_step
        try:
            assert asyncio.run(_steps(lm, trace, api, refs)) <= 1e-5
            assert all(_cached_length(lm, c) == len(c) for c in trace[-1])  # (committed)
            assert planned or lm.runner.chain.source is want
            infos.append(lm.cache_info())
        finally:
            lm.close()
    chained, planned = infos
    assert planned["chained_steps"] == 0
    # the first step plans (its parents: the prompt's prefill); a full layout every REFRESH + 1
    full = -(-(len(trace) - 1) // (REFRESH + 1))
    assert chained["chained_steps"] == len(trace) - 1 - full
    for key in ("forwards", "tokens_forwarded", "kv_bytes", "kv_pool_slots_used"):
        assert chained[key] == planned[key], key


CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU (none visible to torch)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_a_chain_on_the_devices_decode_step_equals_uncached(tiny_hf, gpt2_tok, device):
    """The decode step as a GPU runs it by default (captured graphs, each verified at its first
    replay; on the CPU the same step eagerly), in fp32 with TF32 off: an SMC run with
    resampling chains on the decode step (counted), every row within 1e-4 of an uncached
    forward, no graph rejected."""
    model = copy.deepcopy(tiny_hf).to(device)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    lm = AsyncTransformer(model, gpt2_tok, batch_window=0.05, row_cache_size=0,
                          decode="auto" if device == "cuda" else "eager")
    trace = _smc_trace(random.Random(4), 40, 12, REFRESH + 8, 3, 50)
    try:
        assert asyncio.run(_steps(lm, trace, "batch", {})) <= 1e-4
        info = lm.cache_info()
        assert lm.runner.chain.source is lm.runner.decode_step
        full = -(-(len(trace) - 1) // (REFRESH + 1))
        assert info["chained_steps"] == len(trace) - 1 - full
        assert info["decode_graphs_rejected"] == 0
        if device == "cuda":
            assert info["decode_graphs_verified"] >= 1 and info["decode_replays"] > 0
    finally:
        lm.close()
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _chain_running(lm, trace, steps: int):
    """Run the first ``steps`` steps of ``trace`` (lists) and check that a chain is pending."""
    async def run():
        for contexts in trace[:steps]:
            await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
    asyncio.run(run())
    assert lm.runner.chain.steps > 0  # (uncommitted steps: the tree is behind)


READERS = {
    "tree": lambda lm, ctx: lm.runner.tree,
    "walk_cache": lambda lm, ctx: lm.walk_cache(ctx),
    "visualize_cache": lambda lm, ctx: lm.visualize_cache(),
    "cache_kv": lambda lm, ctx: lm.cache_kv(ctx[:5] + [7, 8, 9]),
    "score": lambda lm, ctx: asyncio.run(lm.token_logprobs(ctx[:-3], ctx[-3:])),
    "clear_kv_cache": lambda lm, ctx: lm.clear_kv_cache(),
}


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_chain_is_committed_before_the_tree_is_read(tiny_hf, gpt2_tok, reader, decode):
    """In the middle of a chain, each way of reading (or changing) the KV tree finds the chain
    committed first: no step left uncommitted, the contexts cached whole (unless cleared), the
    walk's cached length the whole context; and the run then goes on exact."""
    trace = _smc_trace(random.Random(3), 30, 6, 10, 4, 50)
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, row_cache_size=0,
                          decode=decode)
    try:
        _chain_running(lm, trace, 3)
        ctx = trace[2][0]
        out = READERS[reader](lm, ctx)
        assert lm.runner.chain.steps == 0
        if reader == "walk_cache":
            assert out[1] == len(ctx)
        if reader == "score":
            assert out.shape == (3,)
        if reader != "clear_kv_cache":
            assert all(_cached_length(lm, c) == len(c) for c in trace[2])
        assert asyncio.run(_steps(lm, trace[3:], "gather", {})) <= 1e-5
        assert all(_cached_length(lm, c) == len(c) for c in trace[-1])
    finally:
        lm.close()


@pytest.mark.parametrize("decode", DECODES)
def test_cache_info_counts_a_chains_kv_and_commits_nothing(tiny_hf, gpt2_tok, decode):
    """``cache_info()`` is read without the forward lock, so in the middle of a chain it
    changes nothing (the chain stays uncommitted); its ``kv_bytes`` counts the chain's KV, which
    the commit then moves into the tree (less the slots of KV that two rows computed alike,
    which go back to the pool)."""
    trace = _smc_trace(random.Random(6), 30, 6, 10, 2, 50)
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, row_cache_size=0,
                          decode=decode)
    try:
        _chain_running(lm, trace, 6)
        steps, before = lm.runner.chain.steps, lm.cache_info()
        assert lm.runner.chain.steps == steps
        assert before["kv_bytes"] > lm.runner._tree.bytes_held
        lm.runner.tree  # (committed)
        after = lm.cache_info()
        freed = before["kv_pool_slots_used"] - after["kv_pool_slots_used"]
        assert after["kv_bytes"] == lm.runner._tree.bytes_held
        assert after["kv_bytes"] == before["kv_bytes"] - freed * TINY_TOKEN_BYTES
    finally:
        lm.close()


@pytest.mark.parametrize("decode", DECODES)
def test_a_chain_under_a_small_kv_budget_is_committed_before_eviction(tiny_hf, gpt2_tok,
                                                                       decode):
    """A KV budget smaller than the particles' contexts: the chain is committed before each
    eviction its uncommitted KV would pass, evictions happen, no step fails, and every row
    equals an uncached forward; the tree holds no more than its budget after each step."""
    trace = _smc_trace(random.Random(5), 20, 8, 14, 3, 50)
    budget = 100 * TINY_TOKEN_BYTES  # (8 particles, a 20-token prompt, 14 steps: 132 tokens)
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, row_cache_size=0,
                          kv_budget_bytes=budget, decode=decode)
    try:
        refs: dict = {}
        for contexts in trace:
            assert asyncio.run(_steps(lm, [contexts], "gather", refs)) <= 1e-5
            runner = lm.runner
            assert (runner._tree.bytes_held + runner.chain.pending_tokens * TINY_TOKEN_BYTES
                    <= budget)
        info = lm.cache_info()
        assert info["evictions"] > 0 and info["chained_steps"] > 0
    finally:
        lm.close()


@pytest.mark.parametrize("decode", DECODES)
def test_a_failed_chained_step_leaves_the_chain_whole(tiny_hf, gpt2_tok, monkeypatch, decode):
    """A chained step whose forward fails fails its queries alone: its new slots go back to
    the pool, the steps before it are committed as they were, and the same step asked again
    (planned now) and the steps after it equal an uncached forward."""
    trace = _smc_trace(random.Random(8), 30, 5, 9, 4, 50)
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, row_cache_size=0,
                          decode=decode)
    cls, name = ((tree_forward.TreeForward, "_run") if decode == "auto"
                 else (decode_step.DecodeStep, "forward"))
    try:
        _chain_running(lm, trace, 3)
        used = lm.runner.pool.in_use
        run = getattr(cls, name)

        def failing(self, *args):
            monkeypatch.setattr(cls, name, run)  # (once)
            raise RuntimeError("the forward failed")

        monkeypatch.setattr(cls, name, failing)
        with pytest.raises(RuntimeError, match="the forward failed"):
            asyncio.run(_steps(lm, trace[3:4], "gather", {}))
        assert lm.runner.pool.in_use == used  # (the failed step's new slots are free again)
        assert all(_cached_length(lm, c) == len(c) for c in trace[2])
        assert asyncio.run(_steps(lm, trace[3:], "gather", {})) <= 1e-5
    finally:
        lm.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("decode", DECODES)
async def test_smollm2_chained_smc_steps_equal_uncached(smol_lm, smol_hf, decode):
    """The real model: SMC steps over a real prompt, resampled every third step, one call a
    step over ``lm.context`` objects: chained (counted; with the decode step too), every row
    within 1e-4 of an uncached forward, the last contexts cached whole once committed."""
    lm = smol_lm if decode == "auto" else AsyncTransformer(*smol_hf, decode=decode)
    try:
        await _smollm2_chain(lm)
        if decode == "eager":
            assert lm.runner.chain.source is lm.runner.decode_step
    finally:
        if lm is not smol_lm:
            await lm.aclose()


async def _smollm2_chain(lm):
    prompt = lm.tokenizer.encode("Once upon a time, in a small village by the sea, there lived")
    rng = random.Random(0)
    parts = [list(prompt) for _ in range(6)]
    trace = []
    for step in range(8):
        if step and step % 3 == 0:
            parts = [list(rng.choice(parts)) for _ in parts]
        for p in parts:
            p.append(rng.randrange(100, 20_000))
        trace.append([list(p) for p in parts])
    assert await _steps(lm, trace, "batch", {}) <= 1e-4
    assert lm.cache_info()["chained_steps"] >= 5
    with lm.front.lock:  # (the forward lock: as the model's own cache readers take it)
        assert all(_cached_length(lm, c) == len(c) for c in trace[-1])
