"""The uniform decode step (genback.llm.hf.decode.step): the static-buffer two-level cascade
run eagerly on the CPU against the tree path and an uncached forward, on the tiny random GPT-2
and the real SmolLM2; which steps take it (counted), its buckets, and its slot layout."""

from __future__ import annotations

import asyncio
import random
import sys

import numpy as np
import pytest
import torch

from genback.llm import AsyncTransformer
from genback.llm.hf.decode.step import bucket

from test_llm_tree import _max_err, _smc_trace


def test_buckets_pad_rows_to_powers_of_two_and_align_the_biases():
    assert bucket(1, 1, 0) == (1, 32, 0)
    assert bucket(3, 17, 1) == (4, 32, 256)
    assert bucket(256, 33, 1000) == (256, 64, 1024)
    assert bucket(257, 16, 4000) == (512, 32, 4096)
    for r, w, p in [(5, 9, 300), (100, 200, 4097)]:
        rb, wb, pb = bucket(r, w, p)
        assert rb >= r and wb >= w and pb >= p and wb % 16 == 0 and pb % 16 == 0


def _run_trace(lm, trace, refs, extra_rng=None):
    async def run():
        worst = 0.0
        for contexts in trace:
            batch = list(contexts)
            if extra_rng is not None:  # a context of another length: not a uniform step
                c = extra_rng.choice(contexts)
                batch.append(c[: extra_rng.randrange(1, len(c))])
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in batch))
            worst = max(worst, _max_err(rows, batch, lm, refs))
        return worst
    return asyncio.run(run())


@pytest.mark.parametrize("prompt_len,particles,resample", [(70, 12, 3), (5, 1, 2), (300, 40, 4)])
def test_eager_decode_steps_equal_uncached_and_the_tree_path(tiny_hf, gpt2_tok, prompt_len,
                                                             particles, resample):
    """SMC with resampling over a shared prompt: every step after the first is a uniform decode
    step (counted), every row equals an uncached forward and the tree path's row (<= 1e-5: the
    cascade splits the keys otherwise, so sums round otherwise), and
    both paths forward the same tokens in the same number of forwards. The default (``eager``)
    lays a prefix out as ``dense`` when level 0 does not pay (70 tokens, 12 rows), as
    ``cascade`` (level 0 whenever rows share a token) when it does (300 tokens)."""
    trace = _smc_trace(random.Random(prompt_len), prompt_len, particles, 10, resample, 50)
    got = {}
    # cascade: level 0 whenever rows share a token; dense: the decode step without level 0;
    # flash0: level 0 unmasked but its last 256 keys (whenever rows share a token)
    for decode in ("eager", "cascade", "dense", "flash0", "off"):
        lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, row_cache_size=0,
                              decode="off" if decode == "off" else "eager")
        step = lm.runner.decode_step
        if decode in ("cascade", "flash0"):
            step.level0_min_tokens = step.level0_min_saved = 0
        if decode == "dense":
            step.min_prefix = sys.maxsize
        if decode == "flash0":
            step.flash_level0 = True
        try:
            lm.cache_kv(trace[0][0][:-1])
            refs: dict = {}
            assert _run_trace(lm, trace, refs) <= 1e-5
            info = lm.cache_info()
            got[decode] = (info["forwards"], info["tokens_forwarded"])
            got[decode + " read"] = info["kv_bytes_read"]
            rows = [lm.next_token_logprobs_sync(c) for c in trace[-1][:3]]
            got[decode + " rows"] = torch.stack(rows)
            if decode != "off":
                assert info["decode_steps"] == len(trace) and info["decode_replays"] == 0
            else:
                assert "decode_steps" not in info
        finally:
            lm.close()
    assert got["eager"] == got["cascade"] == got["dense"] == got["flash0"] == got["off"]
    if particles > 1:  # without level 0 every row reads the prompt itself
        assert got["dense read"] > got["cascade read"]
        assert got["eager read"] == got[("cascade" if prompt_len >= 256 else "dense") + " read"]
    for decode in ("eager", "cascade", "dense", "flash0"):
        torch.testing.assert_close(got[decode + " rows"], got["off rows"], rtol=0, atol=1e-5)


def test_mixed_batches_and_eviction_take_the_tree_path_and_stay_exact(tiny_hf, gpt2_tok):
    """Steps with an extra context of another length are not uniform (the tree path), a tiny KV
    budget evicts in the middle of the run (recomputed contexts), and every row stays exact."""
    rng = random.Random(3)
    trace = _smc_trace(rng, 40, 8, 12, 3, 50)
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, row_cache_size=0,
                          decode="eager", kv_budget_bytes=120 * 2 * 2 * 64 * 4)
    try:
        assert _run_trace(lm, trace, {}, extra_rng=rng) <= 1e-5
        assert lm.cache_info()["decode_steps"] < len(trace)
        assert lm.cache_info()["evictions"] > 0
    finally:
        lm.close()


def test_decode_option_is_checked(tiny_hf, gpt2_tok):
    with pytest.raises(ValueError, match="decode must be"):
        AsyncTransformer(tiny_hf, gpt2_tok, decode="fast")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="decode='graphs' needs a CUDA model"):
            AsyncTransformer(tiny_hf, gpt2_tok, decode="graphs")


def test_smollm2_eager_decode_steps_equal_uncached(module_smol_lm, smol_hf):
    """The real model (Llama architecture, grouped-query attention): 8 particles over a
    50-token prompt, 6 steps with resampling, on the eager decode path: every row within 1e-4
    of an uncached forward."""
    model, tok = smol_hf
    trace = _smc_trace(random.Random(11), 50, 8, 6, 2, 2000)
    lm = AsyncTransformer(model, tok, batch_window=0.05, row_cache_size=0, decode="eager")
    try:
        lm.cache_kv(trace[0][0][:-1])
        assert _run_trace(lm, trace, {}) <= 1e-4
        assert lm.cache_info()["decode_steps"] == len(trace)
    finally:
        lm.close()


CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU (none visible to torch)")


@pytest.fixture
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _llama(vocab: int, device: str, dtype: torch.dtype):
    """A random 2-layer Llama with grouped-query attention (4 query heads over 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _steps(lm, trace):
    async def run():
        out = []
        for contexts in trace:
            out.append(torch.stack(await asyncio.gather(
                *(lm.next_token_logprobs(c) for c in contexts))).float().cpu())
        return out
    return asyncio.run(run())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_grouped_query_llama_decode_steps_equal_uncached(gpt2_tok, no_tf32, device):
    """A Llama with grouped queries, fp32 (TF32 off): SMC over a 300-token prompt (level 0
    padded to 512) with resampling. On the CPU the eager decode step; on CUDA the captured
    graphs (counted replays), equal to the eager run of the same code on the same inputs and
    within 1e-4 of an uncached forward on every cached path."""
    model = _llama(len(gpt2_tok), device, torch.float32)
    trace = _smc_trace(random.Random(5), 300, 24, 12, 3, 400)
    modes = ["eager"] + (["graphs"] if device == "cuda" else [])
    rows = {}
    for mode in modes:
        lm = AsyncTransformer(model, gpt2_tok, batch_window=0.05, row_cache_size=0,
                              decode=mode, row_device="cpu")
        try:
            lm.cache_kv(trace[0][0][:-1])
            rows[mode] = _steps(lm, trace)
            info = lm.cache_info()
            assert info["decode_steps"] == len(trace)
            if device == "cuda":  # (its norms through torch's rms_norm operator, its RoPE
                # through decode/rope.py's: the defaults)
                step = lm.runner.decode_step
                assert step.norm_op and step._norms.count == 5
                assert step.rope_op and step._rope.count == 2
                # (q/k/v and gate/up as one product each: 2 groups a layer)
                assert step.fuse_projections and step._projections.count == 4
                # (level 0 kept across steps: the default; copied once per prefix)
                assert step.keep_level0 and 1 <= info["decode_level0_copies"] < len(trace)
            if mode == "graphs":  # every capture checked at its first replay, and kept; a
                # bucket's first step runs eagerly (graphs.CAPTURE_AFTER)
                assert info["decode_replays"] + info["decode_eager_steps"] == len(trace)
                assert info["decode_eager_steps"] >= info["decode_captures"] >= 1
                assert info["decode_graphs_verified"] == info["decode_captures"]
                assert info["decode_graphs_rejected"] == 0 and info["decode_graph_bytes"] >= 0
            for i in (0, len(trace) // 2, len(trace) - 1):
                for j in (0, len(trace[i]) - 1):
                    ref = lm.next_token_logprobs_uncached(trace[i][j]).float().cpu()
                    assert float((rows[mode][i][j] - ref).abs().max()) <= 1e-4
        finally:
            lm.close()
    if "graphs" in rows:
        for a, b in zip(rows["graphs"], rows["eager"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@CUDA
def test_captured_decode_steps_in_bf16_are_no_worse_than_dense(gpt2_tok):
    """bf16 on CUDA: the captured steps' rows are no further from the fp32 model's uncached rows
    than 2x an uncached bf16 forward is (both are bf16 roundings of the same sums)."""
    model32 = _llama(len(gpt2_tok), "cuda", torch.float32)
    model16 = _llama(len(gpt2_tok), "cuda", torch.bfloat16)
    trace = _smc_trace(random.Random(9), 300, 16, 6, 2, 400)  # level 0 pays (>= 256 tokens)
    lm = AsyncTransformer(model16, gpt2_tok, batch_window=0.05, row_cache_size=0,
                          decode="graphs", row_device="cpu")
    try:
        lm.cache_kv(trace[0][0][:-1])
        rows = _steps(lm, trace)[-1]
        info = lm.cache_info()  # (a bucket's first step eager: graphs.CAPTURE_AFTER)
        assert info["decode_replays"] + info["decode_eager_steps"] == len(trace)
        assert info["decode_captures"] >= 1 and info["decode_graphs_rejected"] == 0
        assert lm.runner.decode_step._norms.count == 5  # (torch's rms_norm operator: default)
        assert lm.runner.decode_step._rope.count == 2  # (decode/rope.py's RoPE: default)
        with torch.inference_mode():
            for j in (0, len(trace[-1]) - 1):
                ids = torch.tensor([trace[-1][j]], device="cuda")
                ref = torch.log_softmax(model32(ids).logits[0, -1].float(), -1).cpu()
                dense = torch.log_softmax(model16(ids).logits[0, -1].float(), -1).cpu()
                assert (rows[j] - ref).abs().max() <= 2 * (dense - ref).abs().max()
    finally:
        lm.close()


@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("flash0", [False, True])
@pytest.mark.parametrize("rows,groups,prefix", [(1, 1, 900), (3, 4, 300), (64, 2, 1500),
                                                (2, 2, 200)])
def test_split_prefix_attention_equals_one_softmax(rows, groups, prefix, flash0, kept):
    """Level 0 split into chunks (split-K) and merged by log-sum-exp equals one float64 softmax
    over the real prefix keys; the padding past the prefix is masked, whatever its values. With
    ``flash0`` the keys before the last 256 are attended without a bias, the last 256 (the
    padding's) with it, as one more chunk. ``kept``: the prefix read from its copy kept across
    steps (:mod:`genback.llm.hf.decode.level0`), not gathered."""
    from types import SimpleNamespace

    from genback.llm.hf.decode.cascade import _merge_chunks, _prefix_chunks, _splits

    from genback.llm.hf.cache.kv_pool import KVPool

    torch.manual_seed(rows)
    Hkv, D, cap = 2, 16, 2048
    pool = KVPool((1, Hkv, D, torch.float32, torch.device("cpu")), capacity=cap)
    store = pool.store[0]  # [2, Hkv, cap, D]
    store.copy_(torch.randn(2, Hkv, cap, D))
    slots = torch.randperm(cap - 1)[:prefix] + 1
    Pb = bucket(rows, 1, prefix)[2]
    b = SimpleNamespace(pool=pool, prefix=torch.zeros(Pb, dtype=torch.long),
                        bias0=torch.full((1, 1, 1, Pb), float("-inf")), flash0=flash0)
    b.prefix[:prefix] = slots
    b.bias0[..., :prefix] = 0
    store[:, :, 0] = 1e4  # the dummy slot the padding reads: large, and masked
    b.level0 = None
    if kept:
        from genback.llm.hf.decode.level0 import KeptPrefix
        b.level0 = KeptPrefix(pool, Pb)
        b.level0.refresh(pool, slots.numpy(), b.prefix)
    q = torch.randn(rows, Hkv, groups, D)
    o, l = _prefix_chunks(0, b, q, 0.25)
    if flash0 and Pb > 256:  # the unmasked chunks, then the last 256 keys
        assert o.shape[0] == _splits(Pb - 256, Hkv, rows * groups) + 1
    else:
        assert o.shape[0] == _splits(Pb, Hkv, rows * groups) and (o.shape[0] > 1 or Pb == 256)
    out = _merge_chunks(o, l).view(Hkv, rows, groups, D).transpose(0, 1)
    lse = torch.logsumexp(l, 0).view(Hkv, rows, groups).transpose(0, 1)
    k, v = store[0][:, slots].double(), store[1][:, slots].double()  # [Hkv, P, D]
    scores = torch.einsum("rhgd,hpd->rhgp", q.double(), k) * 0.25
    want = torch.einsum("rhgp,hpd->rhgd", torch.softmax(scores, -1), v)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), rtol=0, atol=1e-5)


def test_decoding_steps_on_the_decode_path_sample_what_the_tree_path_samples(tiny_hf, gpt2_tok):
    """Seeded sampling (decoding steps chosen on the device, one query kind the decode step
    answers besides next-token rows): 6 prompts x 12 tokens give the same tokens on the eager
    decode path as on the tree path, and the decode path answered the steps (counted)."""
    prompts = [list(range(500 + 7 * i, 530 + 7 * i)) for i in range(6)]
    got = {}
    for decode in ("eager", "off"):
        lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, decode=decode)
        try:
            got[decode] = asyncio.run(lm.batch_sample(prompts, max_tokens=12, eos_token_ids=[],
                                                      temperature=1.0, seed=3))
            if decode == "eager":
                assert lm.cache_info()["decode_steps"] >= 10
        finally:
            lm.close()
    assert got["eager"] == got["off"] and all(len(t) == 12 for t in got["eager"])


@pytest.mark.parametrize("level0", ["default", "always"])
def test_steps_laid_out_from_the_last_steps_rows_name_the_trees_slots(tiny_hf, gpt2_tok,
                                                                      monkeypatch, level0):
    """SMC with resampling over more steps than a lane table lives (REFRESH): each step's table
    is the last step's rows plus a column (counted), and every row's slots (level 0, then its
    row without padding) are the tree's slots of its cached context plus its new slot, checked
    against a walk of the tree at every step; rows equal an uncached forward. Over this 60-token
    prompt the default lays the prompt out in every row (level 0 does not pay); ``always``
    keeps it in level 0 (lanes then carry the prefix)."""
    from genback.llm.hf.decode import step as decode_step
    from genback.llm.hf.plan.lanes import REFRESH
    from genback.llm.hf.cache.nodes import prefix_segments

    checked, prefixes = [], []
    layout = decode_step.DecodeStep.layout

    def spy(self, group, lanes=None):
        out = layout(self, group, lanes)
        if out is None:
            return out
        lay = out[0]
        for i, p in enumerate(group):
            tree = [s for _, _, s in prefix_segments(p.holder, p.cached)]
            want = np.concatenate(tree + [lay.new_slots[i:i + 1]])
            got = np.concatenate([lay.prefix, lay.table[i, lay.pads[i]:]])
            assert np.array_equal(got, want) and lay.positions[i] == p.cached
        checked.append(len(group))
        prefixes.append(lay.prefix)
        return out

    monkeypatch.setattr(decode_step.DecodeStep, "layout", spy)
    steps = 2 * REFRESH + 5
    trace = _smc_trace(random.Random(11), 60, 16, steps, 3, 50)
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, row_cache_size=0,
                          decode="eager")
    lm.runner.chain = None  # (every step planned: the chain's steps, test_step_chain.py)
    if level0 == "always":
        lm.runner.decode_step.level0_min_tokens = lm.runner.decode_step.level0_min_saved = 0
    try:
        lm.cache_kv(trace[0][0][:-1])
        assert _run_trace(lm, trace, {}) <= 1e-5
        info = lm.cache_info()
        assert info["decode_steps"] == len(trace) == len(checked)
        assert all(len(p) == 0 for p in prefixes) == (level0 == "default")
        # the first step and one in every REFRESH + 1 are full layouts; the others gathered
        full = info["decode_steps"] - info["decode_lane_steps"]
        assert full == -(-len(trace) // (REFRESH + 1))
    finally:
        lm.close()


@pytest.mark.parametrize("decode,counter", [("eager", "decode_lane_steps"),
                                            ("auto", "tree_lane_steps")])
def test_a_freed_slot_retires_the_last_steps_rows(tiny_hf, gpt2_tok, decode, counter):
    """Any slot freed between two steps (here: the cache cleared and the contexts computed
    again, into other slots) makes the next step lay its rows out from the tree again: on the
    decode step and on the tree path (the CPU's default)."""
    trace = _smc_trace(random.Random(5), 30, 6, 4, 2, 50)
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, row_cache_size=0,
                          decode=decode)
    try:
        lm.cache_kv(trace[0][0][:-1])
        assert _run_trace(lm, trace[:2], {}) <= 1e-5
        lanes = lm.cache_info()[counter]
        assert lanes == 1  # (the second step, from the first one's rows)
        lm.clear_kv_cache()
        lm.batch_next_token_logprobs_sync(trace[1])  # (the last step's contexts, recomputed)
        assert _run_trace(lm, trace[2:3], {}) <= 1e-5
        assert lm.cache_info()[counter] == lanes  # laid out from the tree
        assert _run_trace(lm, trace[3:], {}) <= 1e-5
        assert lm.cache_info()[counter] == lanes + 1  # ... and from lanes again
    finally:
        lm.close()


def test_level0_runs_unmasked_by_default_where_it_was_measured_to_pay():
    """``flash_level0`` None (the default) runs level 0 unmasked on CUDA in half precision from
    ``FLASH0_MIN_WORK`` stacked queries x prefix keys: the H200 cells of ``benchmarks/RESULTS.md``
    (session 57) on their measured side: 1,024 x 4,096 paid (GPU 19.9 against 22.6 ms a step),
    1,024 x 1,024, 64 x 1,024 and 64 x 4,096 did not. (That the default runs it on CUDA and
    not on the CPU, whatever the size: ``test_cuda.py``'s level-0 test, ``default`` case.)"""
    from genback.llm.hf.decode.step import FLASH0_MIN_WORK, flash_level0_pays

    assert flash_level0_pays(1024, 4096) and flash_level0_pays(4096, FLASH0_MIN_WORK // 4096)
    assert not any(flash_level0_pays(q, k) for q, k in [(1024, 1024), (64, 1024), (64, 4096)])


@pytest.mark.parametrize("api", ["lists", "contexts"])
@pytest.mark.parametrize("decode", ["eager", "off"])
def test_particles_with_equal_contexts_keep_their_steps_uniform(tiny_hf, gpt2_tok, monkeypatch,
                                                                api, decode):
    """Particles that drew the same tokens hold equal contexts as other objects; the batcher
    answers their equal queries once, so only one of the objects is noted as a parent. Their
    children's parents are then found by their tokens (``KVTree.end_node``): every step after the
    first is planned as a uniform step, none by the full planner (counted), on the decode step and
    on the tree path, with lists and with context objects; and laid out from the last step's
    rows (the row of the equal context that was answered: ``Lanes.rows``), every step after the
    first (counted); every row exact."""
    from genback.llm.hf import execute as runner_module

    full_plans = []
    plan_batch = runner_module.plan_batch
    monkeypatch.setattr(runner_module, "plan_batch",
                        lambda queries, match: full_plans.append(len(queries))
                        or plan_batch(queries, match))
    rng = random.Random(7)
    prompt = [rng.randrange(50257) for _ in range(40)]
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, row_cache_size=0, decode=decode)

    async def run():
        parts = ([lm.context(prompt)] if api == "contexts" else [list(prompt)]) * 8
        worst, equal = 0.0, 0
        for step in range(8):
            # resampled parents, two tokens: equal contexts, each particle its own object, and
            # contexts of one length and last token that differ before it
            parts = [parts[rng.randrange(8)] + [rng.choice((7, 8))] for _ in parts]
            equal += len(parts) - len({tuple(p) for p in parts})
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in parts))
            worst = max(worst, _max_err(rows, [list(c) for c in parts], lm))
        return worst, equal

    try:
        lm.cache_kv(prompt)
        full_plans.clear()
        worst, equal = asyncio.run(run())
        assert equal > 0  # (equal contexts did occur)
        assert worst <= 1e-5
        assert full_plans == []
        info = lm.cache_info()
        if decode == "eager":
            assert info["decode_steps"] == 8 and info["decode_lane_steps"] == 7
        else:
            assert info["tree_lane_steps"] == 7
    finally:
        lm.close()


def test_smollm2_smc_particles_that_coincide_keep_their_steps_uniform(module_smol_lm,
                                                                      monkeypatch):
    """The real model's rows are peaked, so particles sampling from them often draw the same
    token and hold equal contexts (other objects): after the first step (the prompt's row) no
    step is planned by the full planner (counted), on the default path (the tree path here)."""
    from genback.llm.hf import execute as runner_module

    lm = module_smol_lm
    plans, step = [], [0]
    plan_batch = runner_module.plan_batch
    monkeypatch.setattr(runner_module, "plan_batch",
                        lambda queries, match: plans.append(step[0]) or plan_batch(queries, match))
    prompt = lm.tokenizer.encode("The capital of France is")
    g = torch.Generator().manual_seed(0)

    async def run():
        parts = [lm.context(prompt)] * 12
        equal = 0
        for step[0] in range(6):
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in parts))
            parts = [p + [int(torch.multinomial(r.float().exp(), 1, generator=g))]
                     for p, r in zip(parts, rows)]
            equal += len(parts) - len({tuple(p) for p in parts})
        return equal

    assert asyncio.run(run()) > 0  # (particles did coincide)
    assert set(plans) <= {0}
