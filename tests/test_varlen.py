"""The packed variable-length private attention of tree forwards (issue 66,
genback.llm.hf.forward.varlen) and the forward budget sized by what its kernel holds.

On the CPU the packed path runs through the reference kernel (``varlen.FORCE = "reference"``:
the same packing, layouts and merges as CUDA, row-by-row attention) and must equal an uncached
forward; on CUDA (skipped without one) the real kernels run with PyTorch's math backend excluded
and every kernel call counted: fp32 (TF32 off) within 1e-4 of an uncached forward, bf16 no worse
than the dense path's own error.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from genback.llm import AsyncTransformer
from genback.queries.kinds import Score
from genback.llm.hf.forward import attention, varlen
from genback.llm.hf.plan.batch import Path, group_paths, query_path
from genback.llm.hf.plan.budget import forward_budget

from test_cuda import (BF16_FACTOR, CUDA, FP32_TOL, _errors, model_on, no_tf32,  # noqa: F401
                       scenario)

KERNELS = [("cpu", "reference"), pytest.param("cuda", "flash", marks=CUDA),
           pytest.param("cuda", "efficient", marks=CUDA)]


def _rows(rng: random.Random, R: int):
    """Random rows: (private past, new tokens) counts, some rows without a past."""
    return [(rng.choice([0, rng.randrange(1, 9)]), rng.randrange(1, 6)) for _ in range(R)]


@pytest.mark.parametrize("device,kernel", KERNELS)
@pytest.mark.parametrize("G", [1, 3])
def test_packed_rows_equal_one_masked_softmax_per_row(device, kernel, G):
    """Every kernel against float64 brute force per row: query ``i`` of a row with ``k`` keys
    and ``n`` queries sees keys ``0 .. k - n + i`` (causal from the bottom right); LSE too.
    bf16 for flash (it has no fp32), fp32 otherwise."""
    rng = random.Random(G)
    torch.manual_seed(G)
    rows = _rows(rng, 7)
    dtype = torch.bfloat16 if kernel == "flash" else torch.float32
    Hkv, D = 2, 16
    P = max(p for p, _ in rows)
    m = max(n for _, n in rows)
    pads = np.array([P - p for p, _ in rows], dtype=np.int64)
    n_new = np.array([n for _, n in rows], dtype=np.int64)
    layout = np.zeros((len(rows), P + m), dtype=np.int64)  # (slot numbers: any, unused here)
    meta = varlen.Varlen.of(kernel, layout + 1, pads, n_new, m, torch.device(device))
    T, K = int(n_new.sum()), int(sum(p + n for p, n in rows))
    assert (meta.max_q, meta.max_k) == (m, max(p + n for p, n in rows))
    q = torch.randn(T, Hkv * G, D, device=device).to(dtype)
    k = torch.randn(K, Hkv, D, device=device).to(dtype)
    v = torch.randn(K, Hkv, D, device=device).to(dtype)
    out, lse = varlen.attend(q, k, v, meta, 0.3)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (T, Hkv * G)
    a = b = 0
    for p, n in rows:
        qr, kr, vr = q[a:a + n].double(), k[b:b + p + n].double(), v[b:b + p + n].double()
        kr, vr = kr.repeat_interleave(G, 1), vr.repeat_interleave(G, 1)
        s = torch.einsum("ihd,jhd->hij", qr, kr) * 0.3
        s = s.masked_fill(~torch.ones(n, p + n, dtype=torch.bool, device=device).tril(p),
                          float("-inf"))
        want = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vr)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[a:a + n].double(), want, rtol=0, atol=tol)
        torch.testing.assert_close(lse[a:a + n].double(), torch.logsumexp(s, -1).t(), rtol=0,
                                   atol=tol)
        a, b = a + n, b + p + n
    _, none = varlen.attend(q, k, v, meta, 0.3, lse=False)
    assert none is None


def _llama(tok, device: str, dtype: torch.dtype):
    """A random 2-layer Llama with grouped-query attention (4 query heads over 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _counted(monkeypatch) -> dict:
    """Count the kernels the tree forwards' attention calls: ``varlen`` (the packed private
    part, by kernel), ``segment`` (``_attend``'s kernel of the shared segments), ``masked``
    (the padded, masked private part)."""
    seen: dict = {}
    attend, _attend, masked = varlen.attend, attention._attend, attention.TreeBatch.keys_values

    def counted_varlen(q, k, v, meta, scale, lse=True):
        seen.setdefault("varlen", []).append(meta.kernel)
        return attend(q, k, v, meta, scale, lse)

    def counted_attend(q, k, v, scale, kernel, bias=None):
        seen.setdefault("segment" if bias is None else "masked", []).append(kernel)
        return _attend(q, k, v, scale, kernel, bias)

    def counted_masked(batch, layer, key, value):
        seen.setdefault("masked", []).append("keys_values")
        return masked(batch, layer, key, value)

    monkeypatch.setattr(varlen, "attend", counted_varlen)
    monkeypatch.setattr(attention, "_attend", counted_attend)
    monkeypatch.setattr(attention.TreeBatch, "keys_values", counted_masked)
    return seen


def _run_without_math(lm):
    """:func:`test_cuda.scenario` on ``lm``, on CUDA with PyTorch's math attention backend
    excluded (a call that would fall back to it raises)."""
    if lm.runner.device.type != "cuda":
        return scenario(lm)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.CUDNN_ATTENTION]):
        return scenario(lm)


OPTIONS = {"shared": dict(min_shared_tokens=1), "gathered": dict(min_shared_tokens=1 << 20)}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("model", ["gpt2", "llama-gqa"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_packed_tree_path_fp32_matches_uncached(tiny_hf, gpt2_tok, device, model, option,
                                                 monkeypatch, no_tf32):
    """Every cached path (shared segments, private pasts, left-padded rows, nested contexts,
    scoring) with the private part packed: on the CPU through the reference kernel, on CUDA
    through the memory-efficient varlen kernel (fp32), never the masked or math path; rows
    within 1e-4 of an uncached forward (CPU: 1e-5); no padding forwarded."""
    if device == "cpu":
        monkeypatch.setattr(varlen, "FORCE", "reference")
    hf = (model_on(tiny_hf, device, torch.float32) if model == "gpt2"
          else _llama(gpt2_tok, device, torch.float32))
    seen = _counted(monkeypatch)
    lm = AsyncTransformer(hf, gpt2_tok, batch_window=0.01, attention="tree", decode="off",
                          **OPTIONS[option])
    if option == "shared":  # (every segment under two paths shared, however few copies it saves)
        lm.runner.forward.packed_min_saved_tokens = 0
    try:
        assert lm.runner.budget.packed
        pairs = _run_without_math(lm)
        info = lm.cache_info()
        errs = _errors(lm, pairs)
    finally:
        lm.close()
    want = "reference" if device == "cpu" else "efficient"
    assert seen.get("varlen") and set(seen["varlen"]) == {want}
    assert "masked" not in seen
    if option == "shared":  # (shared segments read by the fused kernel: on CUDA memory-efficient)
        assert seen.get("segment") and set(seen["segment"]) == {attention.KERNEL}
    assert info["padded_tokens_forwarded"] == info["tokens_forwarded"]
    assert max(errs) <= (1e-5 if device == "cpu" else FP32_TOL), max(errs)


@CUDA
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_packed_tree_path_bf16_on_cuda_no_worse_than_dense(gpt2_tok, option, monkeypatch,
                                                          no_tf32):
    """bf16 on CUDA (FlashAttention's varlen kernel, grouped-query heads): cached rows within
    ``BF16_FACTOR`` times the error of an uncached bf16 forward, both against fp32."""
    ref32 = AsyncTransformer(_llama(gpt2_tok, "cuda", torch.float32), gpt2_tok)
    seen = _counted(monkeypatch)
    lm = AsyncTransformer(_llama(gpt2_tok, "cuda", torch.bfloat16), gpt2_tok, batch_window=0.01,
                          attention="tree", decode="off", **OPTIONS[option])
    if option == "shared":
        lm.runner.forward.packed_min_saved_tokens = 0
    try:
        pairs = _run_without_math(lm)
        cached = max(_errors(lm, pairs, ref_lm=ref32))
        dense = max(_errors(lm, [(c, lm.next_token_logprobs_uncached(c)) for c, _ in pairs],
                            ref_lm=ref32))
    finally:
        lm.close()
        ref32.close()
    assert set(seen["varlen"]) == {"flash"} and "masked" not in seen
    assert 0 < dense and cached <= BF16_FACTOR * dense, (cached, dense)


def _scoring_paths(n: int, lo: int, hi: int, seed: int = 0) -> list[Path]:
    """``n`` uncached scoring requests as lm-eval sends them: ``lo .. hi - 1``-token contexts,
    1-20-token continuations, every continuation token scored."""
    rng = random.Random(seed)
    paths = []
    for i in range(n):
        ctx = tuple(rng.randrange(1000) for _ in range(rng.randrange(lo, hi)))
        cont = tuple(rng.randrange(1000) for _ in range(rng.randrange(1, 21)))
        p = query_path(Score(ctx, cont), i)
        p.matched(0, None)
        paths.append(p)
    return paths


class _Config:  # a Llama-3.2-1B's shape
    num_attention_heads, hidden_size, intermediate_size, vocab_size = 32, 2048, 8192, 128256


@pytest.mark.parametrize("n,lo,hi", [(800, 40, 121), (400, 20, 201), (80, 20, 900)])
def test_scoring_batch_forwards_under_each_kernels_accounting(n, lo, hi):
    """A batch of scoring requests (the issue's mixes: multiple choice, unique pairs,
    rolling-like): with a varlen kernel (CUDA) the rows are packed, so forwards are filled to
    ``max_batch_tokens`` real tokens, ceil(tokens / 4096) forwards (+1: a greedy fill) with
    no padding; with the masked kernels (CPU, unchanged) the padding rule splits them into
    more forwards (twice as many where lengths spread: 20-200, 20-900 tokens)."""
    paths = _scoring_paths(n, lo, hi)
    tokens = sum(p.n_new for p in paths)
    groups = {}
    for kernel in (None, "flash", "efficient"):
        budget = forward_budget(_Config, 2 << 30, kernel, 8)
        assert budget.packed == (kernel is not None)
        assert budget.score_bytes == (4 * 32 if kernel is None else 0)
        groups[kernel] = group_paths(paths, 4096, 2 << 30, budget.score_bytes, budget)
        got = sorted(id(p) for g in groups[kernel] for p in g)
        assert got == sorted(map(id, paths))
    packed, masked = groups["flash"], groups[None]
    assert len(groups["efficient"]) == len(packed) <= -(-tokens // 4096) + 1
    assert all(sum(p.n_new for p in g) <= 4096 for g in packed)
    assert len(masked) > len(packed) and (hi - lo < 100 or len(masked) >= 1.7 * len(packed))
    # the working set (activations, logits) bounds a packed forward too: 1/16 of the bytes
    small = forward_budget(_Config, (2 << 30) // 16, "flash", 8)
    assert len(group_paths(paths, 4096, small.max_bytes, 0, small)) > len(packed)


def test_packed_path_shares_only_segments_that_save_many_copies(gpt2_tok, monkeypatch):
    """With the packed kernel, multiple-choice scoring (each short context under its four
    continuations) reads every context in the rows' own packed pasts: no segment attention at
    all under the default :data:`PACKED_MIN_SAVED_TOKENS`; with the bound at 0 the same batch
    attends to the contexts as shared segments; both within 1e-5 of a plain forward of each
    context + continuation."""
    from genback.llm.hf.forward.tree import PACKED_MIN_SAVED_TOKENS

    monkeypatch.setattr(varlen, "FORCE", "reference")
    hf = _llama(gpt2_tok, "cpu", torch.float32)
    rng = random.Random(1)
    contexts = [[rng.randrange(1000) for _ in range(rng.randrange(70, 90))] for _ in range(6)]
    pairs = [(c, [rng.randrange(1000) for _ in range(rng.randrange(2, 6))])
             for c in contexts for _ in range(4)]
    with torch.no_grad():
        want = []
        for c, t in pairs:
            logits = hf(torch.tensor([c + t])).logits[0, len(c) - 1:-1].float()
            want.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(t)[:, None])[:, 0])
    for bound in (PACKED_MIN_SAVED_TOKENS, 0):
        seen = _counted(monkeypatch)
        lm = AsyncTransformer(hf, gpt2_tok, batch_window=0.05, attention="tree", decode="off",
                              min_shared_tokens=64)
        lm.runner.forward.packed_min_saved_tokens = bound
        try:
            for c in contexts:  # (cached first: the continuations then share them)
                lm.cache_kv(c)

            async def score():
                return await asyncio.gather(*(lm.token_logprobs(c, t) for c, t in pairs))

            got = asyncio.run(score())
        finally:
            lm.close()
        assert ("segment" in seen) == (bound == 0), (bound, sorted(seen))
        assert max(float((a - b).abs().max()) for a, b in zip(got, want)) <= 1e-5
