"""Level 0's KV kept across decode steps (genback.llm.hf.decode.level0): the rows equal the
per-layer gather's bit for bit, on the tiny random GPT-2 and the real SmolLM2, with the copies
counted (one per prefix, not one per step); a kept copy is made again once the pool frees slots
or its store moves, so slots handed out again with other KV are never read stale; the memory
budget."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from genback.llm import AsyncTransformer
from genback.llm.hf.cache.kv_pool import KVPool
from genback.llm.hf.decode.level0 import KeptPrefix, KeptPrefixes

from test_decode_rope import _Ops
from test_decode_step import CUDA, _llama, _steps, no_tf32  # noqa: F401 (a fixture)
from test_llm_tree import _smc_trace


def _run(model, tok, trace, keep: bool, every_prefix: bool):
    lm = AsyncTransformer(model, tok, batch_window=0.05, row_cache_size=0, decode="eager")
    step = lm.runner.decode_step
    assert not step.keep_level0  # (off by default on the CPU)
    step.keep_level0 = keep
    if every_prefix:
        step.level0_min_tokens = 0  # level 0 whenever the rows share a token
    kept, gathers, forward = [], [], step._forward

    def counted(buf):  # the KV gathers (index_select) each forward dispatches
        with _Ops() as ops:
            forward(buf)
        gathers.append(ops.ops.count("index_select"))

    step._forward = counted
    try:
        lm.cache_kv(trace[0][0][:-1])
        rows = _steps(lm, trace)
        info = lm.cache_info()
        assert info["decode_steps"] == len(trace)
        worst = 0.0
        for i in (1, len(trace) // 2, len(trace) - 1):
            for j in (0, len(trace[i]) - 1):
                ref = lm.next_token_logprobs_uncached(trace[i][j]).float()
                worst = max(worst, float((rows[i][j] - ref).abs().max()))
        kept = [b.level0 for b in step.buffers.values()]
        return rows, info["decode_level0_copies"], worst, kept, gathers
    finally:
        lm.close()


@pytest.mark.parametrize("prompt_len,particles,resample", [(300, 24, 3), (40, 6, 2)])
def test_kept_level0_rows_equal_the_gathered_ones(tiny_hf, gpt2_tok, prompt_len, particles,
                                                  resample):
    """SMC with resampling, level 0 whenever rows share a token: with level 0 kept, every row
    is the per-layer gather's bit for bit and within 1e-5 of an uncached forward, and the prefix
    was copied once per prefix (here: the prompt's), not once per step."""
    trace = _smc_trace(random.Random(prompt_len), prompt_len, particles, 12, resample, 50)
    gathered, copies0, err0, kept0, n0 = _run(tiny_hf, gpt2_tok, trace, False, True)
    kept_rows, copies, err, kept, n = _run(tiny_hf, gpt2_tok, trace, True, True)
    assert copies0 == 0 and all(k is None for k in kept0)
    assert any(k is not None for k in kept)
    assert 1 <= copies <= 2 < len(trace)
    # each forward gathers level 1's KV only: one gather a layer, not two
    layers = tiny_hf.config.num_hidden_layers
    assert len(n) == len(n0) == len(trace) and n == [layers] * len(trace)
    assert n0 == [2 * layers] * len(trace)
    assert err0 <= 1e-5 and err <= 1e-5
    for a, b in zip(gathered, kept_rows):
        assert torch.equal(a, b)


def test_smollm2_kept_level0_rows_equal_the_gathered_ones(smol_hf):
    """The real model (Llama, grouped-query attention) over a 300-token prompt (level 0 by the
    default rule): rows equal to the gather's, within 1e-4 of an uncached forward."""
    model, tok = smol_hf
    trace = _smc_trace(random.Random(12), 300, 8, 6, 2, 2000)
    gathered, _, err0, _, _ = _run(model, tok, trace, False, False)
    kept_rows, copies, err, _, _ = _run(model, tok, trace, True, False)
    assert copies == 1 and err0 <= 1e-4 and err <= 1e-4
    for a, b in zip(gathered, kept_rows):
        assert torch.equal(a, b)


def _write(pool: KVPool, slots: np.ndarray, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    index = torch.from_numpy(slots)
    for layer in range(pool.layers):
        k, v = (torch.randn(pool.heads, len(slots), pool.dim, generator=g) for _ in range(2))
        pool.write(layer, index, k, v)


def _padded(prefix: np.ndarray, Pb: int) -> torch.Tensor:
    index = torch.zeros(Pb, dtype=torch.long)
    index[:len(prefix)] = torch.from_numpy(prefix)
    return index


def test_a_kept_prefix_is_copied_again_once_slots_are_freed_or_the_store_moves():
    """The copy holds the pool's KV at the prefix's slots (the padding: slot 0's); the same
    slots asked again are not copied again; once the pool frees slots (here the prefix's own,
    handed out again with other KV) or grows, the next refresh copies the new KV."""
    pool = KVPool((2, 2, 4, torch.float32, torch.device("cpu")), capacity=64)
    slots = pool.alloc(20)
    _write(pool, slots, 0)
    prefix, Pb = slots[:10].copy(), 256
    kept = KeptPrefix(pool, Pb)
    kept.refresh(pool, prefix, _padded(prefix, Pb))
    want = pool.read(prefix).clone()  # [layers, 2, heads, 10, dim] (read: a view of the run)
    assert kept.copies == 1 and torch.equal(kept.kv[:, :, :, :10], want)
    assert torch.equal(kept.kv[:, :, :, 10:], pool.read(np.zeros(Pb - 10, dtype=np.int64)))
    kept.refresh(pool, prefix.copy(), _padded(prefix, Pb))  # (equal slots, another array)
    assert kept.copies == 1
    pool.free(slots[:10])
    again = pool.alloc(10)
    assert sorted(again.tolist()) == sorted(prefix.tolist())  # the same slots, handed out again
    _write(pool, again, 1)
    assert not torch.equal(pool.read(prefix), want)
    kept.refresh(pool, prefix, _padded(prefix, Pb))
    assert kept.copies == 2 and torch.equal(kept.kv[:, :, :, :10], pool.read(prefix))
    pool.alloc(100)  # the store grows (moves): a new copy
    kept.refresh(pool, prefix, _padded(prefix, Pb))
    assert kept.copies == 3 and torch.equal(kept.kv[:, :, :, :10], pool.read(prefix))


def test_kept_prefixes_stay_within_their_budget():
    pool = KVPool((2, 2, 4, torch.float32, torch.device("cpu")), capacity=64)
    kept = KeptPrefixes(pool, max_bytes=768 * pool.token_bytes)
    a = kept.get(256)
    assert a is not None and kept.get(256) is a and a.kv.shape == (2, 2, 2, 256, 4)
    assert kept.get(1024) is None  # past the budget: that bucket gathers per layer
    assert kept.get(512) is not None and kept.nbytes == 768 * pool.token_bytes
    prefix = pool.alloc(5)
    a.refresh(pool, prefix, _padded(prefix, 256))
    kept.clear()
    assert kept.kept == {} and kept.nbytes == 0 and kept.copies == 1
    assert kept.get(1024) is None and kept.get(768) is not None


@CUDA
def test_kept_level0_in_captured_cuda_steps_equals_the_gather(gpt2_tok, no_tf32):
    """On CUDA (fp32, TF32 off), the captured steps of a grouped-query Llama over a 300-token
    prompt: with level 0 kept (the default there) the rows equal the per-layer gather's (the
    same bytes attended) and lie within 1e-4 of an uncached forward; the prefix copied once."""
    model = _llama(len(gpt2_tok), "cuda", torch.float32)
    trace = _smc_trace(random.Random(21), 300, 12, 10, 3, 400)
    rows, copies = {}, {}
    for keep in (True, False):
        lm = AsyncTransformer(model, gpt2_tok, batch_window=0.05, row_cache_size=0,
                              decode="graphs", row_device="cpu")
        try:
            assert lm.runner.decode_step.keep_level0  # (the default on CUDA)
            lm.runner.decode_step.keep_level0 = keep
            lm.cache_kv(trace[0][0][:-1])
            rows[keep] = _steps(lm, trace)
            info = lm.cache_info()
            copies[keep] = info["decode_level0_copies"]
            assert info["decode_graphs_verified"] >= 1 and info["decode_graphs_rejected"] == 0
            for j in (0, len(trace[-1]) - 1):
                ref = lm.next_token_logprobs_uncached(trace[-1][j]).float().cpu()
                assert float((rows[keep][-1][j] - ref).abs().max()) <= 1e-4
        finally:
            lm.close()
    assert copies == {True: 1, False: 0}
    for a, b in zip(rows[True], rows[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
