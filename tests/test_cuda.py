"""genback on a CUDA device (issue 21): every cached path of ``AsyncTransformer`` against an
uncached forward, in fp32 with TF32 off and in bf16, the device-side sampler, and the
token-character trie on the device against the CPU trie.

Each test runs on ``cuda`` when a GPU is present and is skipped otherwise; the same tests also run
on ``cpu``, which checks the tests themselves (and the bf16 bound) on every machine. The model is
the tiny random GPT-2 of ``conftest.py`` over the real GPT-2 tokenizer, copied to the device. Only
public API is used (plus ``ParallelTokenCharacterTrie._as_device_matrix`` to see that a row on the
trie's device is used as it is).
"""

from __future__ import annotations

import asyncio
import copy
import random

import numpy as np
import pytest
import torch

import _vocab_fixtures as F
from genback.llm import AsyncTransformer
from genback.trie import AsyncTokenCharacterTrie, ParallelTokenCharacterTrie, TokenCharacterTrie

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
FP32_TOL = 1e-4          # issue 21: fp32 with TF32 off
# bf16: genback's cached rows may be no worse than the dense path's own error (an uncached bf16
# forward against the fp32 one). Both are bf16 roundings of the same sums in another order, so
# their maxima over a row differ by chance; 2x that error bounds it. On CPU the ratio measured
# 1.0005 (tree, shared segments; chunked prefill) and 1.0 (dense, gathered): 5.45e-3 both.
BF16_FACTOR = 2.0
TOKEN_BYTES = 2 * 2 * 64 * 4  # tiny GPT-2: layers * (k, v) * hidden * fp32 bytes

_models: dict = {}


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def model_on(tiny_hf, device: str, dtype: torch.dtype):
    """The tiny GPT-2's weights on ``device`` in ``dtype`` (one copy per pair, kept)."""
    key = (device, dtype)
    if key not in _models:
        _models[key] = copy.deepcopy(tiny_hf).to(device=device, dtype=dtype).eval()
    return _models[key]


def scenario(lm: AsyncTransformer) -> list[tuple[list[int], torch.Tensor]]:
    """Drive every cached path once; returns ``(context, row)`` pairs to check. Paths: a pinned
    prompt extended by one token per particle (shared segment), an SMC run with resampling,
    mixed past lengths in one batch, nested contexts in one batch, private pasts decoding in
    lockstep (private pasts gathered from the KV pool), rows answered from the output cache."""
    rng = random.Random(0)
    got: list = []
    prompt = [rng.randrange(50257) for _ in range(120)]
    lm.cache_kv(prompt)

    async def run():
        parts = [prompt + [i] for i in range(8)]
        for step in range(6):
            if step and step % 2 == 0:
                parts = [list(rng.choice(parts)) for _ in parts]
            parts = [p + [rng.randrange(50)] for p in parts]
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in parts))
            got.extend(zip(parts, rows))
        mixed = [prompt[:7], prompt[:60] + [5, 6], [3], parts[0][:-2], prompt + [1, 2, 3]]
        nested = [parts[1][:k] for k in range(len(parts[1]) - 5, len(parts[1]) + 1)]
        for batch in (mixed, nested):
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in batch))
            got.extend(zip(batch, rows))
        private = [[rng.randrange(50257) for _ in range(10 + 3 * i)] for i in range(5)]
        for _ in range(4):
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in private))
            got.extend(zip(private, rows))
            private = [c + [rng.randrange(50257)] for c in private]
        got.append((parts[0], await lm.next_token_logprobs(parts[0])))   # a row cache hit

    asyncio.run(run())
    got.extend(zip(parts_sync := [prompt[:30], prompt[:30] + [9]],
                   lm.batch_next_token_logprobs_sync(parts_sync)))
    return got


OPTIONS = {
    "tree-shared": dict(attention="tree", min_shared_tokens=1),
    "tree-gathered": dict(attention="tree", min_shared_tokens=1 << 20),
    # uniform steps through the tree forward, not the decode step (on CUDA: what a LoRA
    # adapter's steps take); mostly no row padded, so no mask (forward/tree.py)
    "tree-steps": dict(attention="tree", min_shared_tokens=1, decode="off"),
    "dense": dict(attention="dense"),
    "evicting": dict(kv_budget_bytes=200 * TOKEN_BYTES, row_cache_size=0),
    "chunked": dict(max_forward_bytes=1 << 20),
}


def _errors(lm, pairs, ref_lm=None) -> list[float]:
    ref_lm = ref_lm or lm
    refs = {}
    out = []
    for ctx, row in pairs:
        key = tuple(ctx)
        if key not in refs:
            refs[key] = ref_lm.next_token_logprobs_uncached(list(key))
        assert row.shape == refs[key].shape and torch.isfinite(row).all()
        out.append(float((row.float() - refs[key]).abs().max()))
    return out


def _count_unmasked_steps(monkeypatch) -> list:
    """The tree forward's decode steps built without a mask (no row padded), listed as they
    run (their row counts)."""
    from genback.llm.hf.forward import tree

    seen, tree_batch = [], tree._tree_batch

    def counted(kernel, pool, shared, layout, pads, slots, R, m, known=None):
        batch = tree_batch(kernel, pool, shared, layout, pads, slots, R, m, known)
        if batch.mask is None:
            seen.append(R)
        return batch

    monkeypatch.setattr(tree, "_tree_batch", counted)
    return seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_cached_paths_fp32_match_uncached(tiny_hf, gpt2_tok, device, option, monkeypatch):
    unmasked = _count_unmasked_steps(monkeypatch)
    lm = AsyncTransformer(model_on(tiny_hf, device, torch.float32), gpt2_tok, batch_window=0.01,
                          **OPTIONS[option])
    try:
        errs = _errors(lm, scenario(lm))
        if option == "evicting":
            assert lm.cache_info()["evictions"] > 0
        if option.startswith("tree"):
            assert lm.cache_info()["attention"].startswith("tree")
        if option == "tree-steps":  # (steps laid out from lanes, some with no mask)
            assert lm.cache_info()["tree_lane_steps"] > 0 and unmasked
    finally:
        lm.close()
    assert max(errs) <= FP32_TOL, (option, max(errs))


@pytest.mark.parametrize("device", DEVICES)
def test_scoring_and_device_sampler_fp32(tiny_hf, gpt2_tok, device):
    lm = AsyncTransformer(model_on(tiny_hf, device, torch.float32), gpt2_tok)
    ctx = list(range(500, 560))
    try:
        lm.cache_kv(ctx)

        async def run():
            conts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
            got = await asyncio.gather(*(lm.token_logprobs(ctx, c) for c in conts))
            for c, g in zip(conts, got):
                want = torch.stack([lm.next_token_logprobs_uncached(ctx + c[:k])[c[k]]
                                    for k in range(len(c))])
                assert g.device.type == "cpu"   # scores on the host; rows on the model's device
                assert float((g - want.cpu()).abs().max()) <= FP32_TOL
            # near-greedy sampling (T = 1e-3): every token is the uncached argmax, up to ties
            toks = await lm.sample(ctx, 6, [], temperature=1e-3, seed=3)
            again = await lm.sample(ctx, 6, [], temperature=1e-3, seed=3)
            assert toks == again and len(toks) == 6
            for k, t in enumerate(toks):
                ref = lm.next_token_logprobs_uncached(ctx + toks[:k])
                assert float(ref.max() - ref[t]) <= 0.05
            logprobs, greedy = await lm.score(ctx, toks)
            assert bool(greedy.all()) or float(logprobs.min()) < -1e-3
            drawn = await lm.sample(ctx, 5, [], temperature=1.0, seed=1)
            assert all(0 <= t < lm.vocab_size for t in drawn)

        asyncio.run(run())
    finally:
        lm.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("option", ["tree-shared", "tree-steps", "dense"])
def test_cached_paths_bf16_no_worse_than_dense(tiny_hf, gpt2_tok, device, option):
    """bf16 rows against the fp32 uncached forward: genback's cached paths within
    ``BF16_FACTOR`` times the error of an uncached bf16 forward of the same context."""
    ref32 = AsyncTransformer(model_on(tiny_hf, device, torch.float32), gpt2_tok)
    lm = AsyncTransformer(model_on(tiny_hf, device, torch.bfloat16), gpt2_tok, batch_window=0.01,
                          **OPTIONS[option])
    try:
        _assert_bf16_no_worse_than_dense(lm, ref32, scenario(lm))
    finally:
        lm.close()
        ref32.close()


def _assert_bf16_no_worse_than_dense(lm, ref32, pairs) -> None:
    """``(context, row)`` ``pairs`` of bf16 ``lm`` against ``ref32``'s fp32 uncached rows:
    within ``BF16_FACTOR`` times the error of ``lm``'s own uncached bf16 rows."""
    cached = max(_errors(lm, pairs, ref_lm=ref32))
    dense = max(_errors(lm, [(c, lm.next_token_logprobs_uncached(c)) for c, _ in pairs],
                        ref_lm=ref32))
    assert 0 < dense and cached <= BF16_FACTOR * dense, (cached, dense)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chosen", ["set", "default"])
def test_decode_step_level0_without_bias_bf16_no_worse_than_dense(tiny_hf, gpt2_tok, device,
                                                                 chosen, monkeypatch):
    """The decode step with ``flash_level0`` (level 0's keys before its last 256 attended
    without a bias: FlashAttention-2 on CUDA), over a 400-token prompt (a prefix bucket of 512):
    bf16 rows within ``BF16_FACTOR`` times an uncached bf16 forward's error against fp32, and on
    CUDA every captured graph verified. ``set``: ``flash_level0 = True``; ``default``: None,
    with the size from which it pays (``FLASH0_MIN_WORK``) lowered to this small step's, so
    that it runs by default on CUDA and not on the CPU."""
    from genback.llm.hf.decode import cascade, step as decode_step
    ref32 = AsyncTransformer(model_on(tiny_hf, device, torch.float32), gpt2_tok)
    lm = AsyncTransformer(model_on(tiny_hf, device, torch.bfloat16), gpt2_tok, batch_window=0.01,
                          decode="auto" if device == "cuda" else "eager")
    if chosen == "set":
        lm.runner.decode_step.flash_level0 = True
    else:
        assert lm.runner.decode_step.flash_level0 is None
        # (where flash_level0_pays reads it; the step module only re-exports it)
        monkeypatch.setattr(cascade, "FLASH0_MIN_WORK", 8 * 512)  # (8 rows x 512 keys)
        assert decode_step.flash_level0_pays(8, 512) and not decode_step.flash_level0_pays(8, 511)
    from genback.llm.hf.forward import attention
    kernels, attend = [], attention._attend
    monkeypatch.setattr(attention, "_attend",
                        lambda q, k, v, scale, kernel, bias=None:
                        kernels.append(kernel) or attend(q, k, v, scale, kernel, bias))
    rng = random.Random(1)
    prompt = [rng.randrange(50257) for _ in range(400)]

    async def run():
        parts, got = [prompt + [i] for i in range(8)], []
        await asyncio.gather(*(lm.next_token_logprobs(c) for c in parts))
        for _ in range(5):
            parts = [p + [rng.randrange(50)] for p in parts]
            got.extend(zip(parts, await asyncio.gather(*(lm.next_token_logprobs(c)
                                                         for c in parts))))
        return got

    try:
        lm.cache_kv(prompt)
        pairs = asyncio.run(run())
        info = lm.cache_info()
        assert info["decode_steps"] >= 5 and info["decode_graphs_rejected"] == 0
        # (the unmasked part of level 0 ran: set, or by default on CUDA only)
        assert ("flash2" in kernels) == (chosen == "set" or device == "cuda")
        if device == "cuda":
            assert info["decode_graphs_verified"] >= 1
        _assert_bf16_no_worse_than_dense(lm, ref32, pairs)
    finally:
        lm.close()
        ref32.close()


# -- the token-character trie on the device ------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_vocab():
    v = F.byte_vocab("gpt2")
    if v is None:
        pytest.fail(F.MISSING["gpt2"])
    return v


def _rel(x, ref) -> float:
    x = x.detach().cpu().double().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    fin = np.isfinite(ref)
    assert (np.isfinite(x) == fin).all() and (x[~fin] == ref[~fin]).all()
    return float((np.abs(x[fin] - ref[fin]) / np.maximum(np.abs(ref[fin]), 1e-300)).max())


@pytest.mark.parametrize("device", DEVICES)
def test_trie_on_device_matches_cpu_trie(gpt2_vocab, device):
    cpu = TokenCharacterTrie(gpt2_vocab)
    rng = np.random.default_rng(0)
    P = torch.tensor(rng.dirichlet(np.full(len(gpt2_vocab), 0.3), size=5), dtype=torch.float32,
                     device=device)
    L = torch.log(P)
    L[0, :100] = -torch.inf                                  # -inf weights for weight_max
    ref_s = cpu.batch_weight_sum(P.double().cpu().numpy())
    ref_m = cpu.batch_weight_max(L.double().cpu().numpy())
    ref_lse = cpu.batch_weight_logsumexp(L.double().cpu().numpy())
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        trie = ParallelTokenCharacterTrie(gpt2_vocab, device=device, dtype=dtype)
        s, m = trie.batch_weight_sum(P), trie.batch_weight_max(L)
        assert s.device.type == device and s.dtype == dtype and s.shape == ref_s.shape
        assert _rel(s, ref_s) <= tol and _rel(m, ref_m) <= tol
        assert _rel(trie.weight_sum(P[2]), ref_s[2]) <= tol
        assert _rel(trie.batch_weight_sum(list(P)), ref_s) <= tol      # a list of device rows
        lse = trie.batch_weight_logsumexp(L).cpu().double().numpy()   # log space: absolute error
        fin = np.isfinite(ref_lse)
        assert (np.isfinite(lse) == fin).all() and np.abs(lse[fin] - ref_lse[fin]).max() <= 10 * tol

    async def queued():
        at = AsyncTokenCharacterTrie.from_vocab(gpt2_vocab, backend="parallel", device=device)
        try:
            return await asyncio.gather(*(at.weight_sum(P[i]) for i in range(3)))
        finally:
            await at.cleanup()

    for i, row in enumerate(asyncio.run(queued())):
        assert row.device.type == device and _rel(row, ref_s[i]) <= 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_trie_uses_device_rows_without_a_host_copy(gpt2_vocab, device, monkeypatch):
    """A torch row never goes through numpy, and a float64 row on the trie's device is used as
    it is (same storage); only numpy inputs take the host path."""
    import genback.trie.base as trie_base  # (where the trie calls as_weight_matrix: the name
    # is imported there, so patching genback.trie.weights would not reach its calls)

    trie = ParallelTokenCharacterTrie(gpt2_vocab, device=device)
    W = torch.rand(3, len(gpt2_vocab), dtype=torch.float64, device=device)
    expected = trie.batch_weight_sum(W.cpu().numpy())          # the numpy (host) path
    expected_max = trie.batch_weight_max(W.float().cpu().numpy())

    def refuse(*a, **k):
        raise AssertionError("a torch row was converted through numpy")

    monkeypatch.setattr(trie_base, "as_weight_matrix", refuse)
    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    assert trie._as_device_matrix(W, "W", True).data_ptr() == W.data_ptr()
    got = trie.batch_weight_sum(W)
    # the same kernels on the same shapes: bit for bit (no atomics, so no order to vary)
    assert got.device == W.device
    assert torch.equal(got, expected)
    assert torch.equal(trie.batch_weight_max(W.float()), expected_max)   # float32 row: cast on the device
    torch.testing.assert_close(trie.weight_sum(W[1]), expected[1], rtol=1e-13, atol=0)


@CUDA
def test_trie_cuda_graphs_equal_kernels_one_by_one(gpt2_vocab):
    """Replayed CUDA graphs give the eager kernels' values for every reduction and batch bucket,
    with fresh inputs each call (the static buffers keep no earlier row) and batches over
    ``max_chunk``."""
    graphed = ParallelTokenCharacterTrie(gpt2_vocab, device="cuda", max_chunk=8)
    eager = ParallelTokenCharacterTrie(gpt2_vocab, device="cuda", max_chunk=8, cuda_graphs=False)
    assert graphed._graphs is not None and eager._graphs is None
    rng = np.random.default_rng(1)
    for B in (1, 3, 8, 5, 19, 1):
        P = torch.tensor(rng.dirichlet(np.full(len(gpt2_vocab), 0.3), size=B), device="cuda")
        L = torch.log(P)
        L[0, :50] = -torch.inf
        torch.testing.assert_close(graphed.batch_weight_sum(P), eager.batch_weight_sum(P),
                                   rtol=1e-13, atol=0)
        assert torch.equal(graphed.batch_weight_max(L), eager.batch_weight_max(L))
        torch.testing.assert_close(graphed.batch_weight_logsumexp(L),
                                   eager.batch_weight_logsumexp(L), rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(graphed.weight_sum(P[-1]), eager.weight_sum(P[-1]),
                                   rtol=1e-13, atol=0)
    # buckets: 1; 3 -> 4; 8; 5 -> 8; 19 = 8 + 8 + 3 -> 8, 4
    assert {b for _, b in graphed._graphs.graphs} == {1, 4, 8}
    assert len({op for op, _ in graphed._graphs.graphs}) == 3


@pytest.mark.parametrize("cuda_graphs", [True, False])
@CUDA
def test_trie_on_cuda_is_deterministic_and_maxima_exact(gpt2_vocab, cuda_graphs):
    """No reduction accumulates through atomics: the same call twice gives bit-identical sums and
    log-sum-exps, maxima equal the CPU trie's bit for bit (``-inf`` and negatives included), sums
    agree with it to float64 rounding; with and without CUDA graphs, at 64 rows."""
    cpu = TokenCharacterTrie(gpt2_vocab)
    rng = np.random.default_rng(4)
    P = torch.tensor(rng.dirichlet(np.full(len(gpt2_vocab), 0.3), size=64), device="cuda")
    L = torch.log(P)
    L[0, :100] = -torch.inf
    L[1] = -L[1]                                             # positive and negative log weights
    trie = ParallelTokenCharacterTrie(gpt2_vocab, device="cuda", cuda_graphs=cuda_graphs)
    for f, X in ((trie.batch_weight_sum, P), (trie.batch_weight_max, L), (trie.batch_weight_logsumexp, L)):
        assert torch.equal(f(X), f(X))
    ref_m = cpu.batch_weight_max(L.cpu().numpy())
    assert np.array_equal(trie.batch_weight_max(L).cpu().numpy(), ref_m)
    assert _rel(trie.batch_weight_sum(P), cpu.batch_weight_sum(P.cpu().numpy())) <= 1e-13


def test_trie_cuda_graphs_must_be_a_bool(gpt2_vocab):
    with pytest.raises(TypeError, match="cuda_graphs must be a bool"):
        ParallelTokenCharacterTrie(gpt2_vocab, device="cpu", cuda_graphs="yes")
    assert ParallelTokenCharacterTrie(gpt2_vocab, device="cpu")._graphs is None  # CUDA only


@pytest.mark.parametrize("device", DEVICES)
def test_rows_come_back_on_the_model_device_unless_asked_for_the_host(tiny_hf, gpt2_tok, device,
                                                                   no_tf32):
    """Rows on the model's device by default (as genlm-backend returns them), on the CPU with
    ``row_device="cpu"``; the same values either way, through the batched, sync and cached
    paths; scores always on the CPU."""
    model = model_on(tiny_hf, device, torch.float32)
    ctx = [464, 3139, 286, 4881, 318]
    on_device = AsyncTransformer(model, gpt2_tok)
    on_host = AsyncTransformer(model, gpt2_tok, row_device="cpu")
    try:
        a = on_device.next_token_logprobs_sync(ctx)
        b = asyncio.run(on_host.batch_next_token_logprobs([ctx, ctx + [11]]))
        c = asyncio.run(on_device.next_token_logprobs(ctx))  # from the output cache
        assert a.device.type == c.device.type == torch.device(device).type
        assert b.device.type == "cpu"
        torch.testing.assert_close(a.cpu(), b[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(c, a, rtol=0, atol=0)
        assert on_device.next_token_logprobs_uncached(ctx).device == a.device
        assert asyncio.run(on_device.token_logprobs(ctx, [11])).device.type == "cpu"
    finally:
        on_device.close()
        on_host.close()


def test_row_device_must_name_a_device(tiny_hf, gpt2_tok):
    with pytest.raises(ValueError, match="row_device must be a torch device"):
        AsyncTransformer(tiny_hf, gpt2_tok, row_device="not-a-device")


@pytest.mark.parametrize("device", DEVICES)
def test_each_caller_owns_its_row(tiny_hf, gpt2_tok, device):
    """Rows handed out are the callers' own (on a GPU made for the whole batch in one copy on
    the worker, `Front._compute_owned`): two callers of one context and a third caller get three
    distinct tensors; writing into one changes neither the other nor what the cache answers."""
    lm = AsyncTransformer(model_on(tiny_hf, device, torch.float32), gpt2_tok, batch_window=0.05)
    ctx, other = [464, 3290, 318], [464, 3290, 257]

    async def run():
        return await asyncio.gather(lm.next_token_logprobs(ctx), lm.next_token_logprobs(ctx),
                                    lm.next_token_logprobs(other))
    try:
        a, b, c = asyncio.run(run())
        assert a.device.type == device and a.data_ptr() != b.data_ptr() != c.data_ptr()
        keep = b.clone()
        a.fill_(0.0)
        torch.testing.assert_close(b, keep, rtol=0, atol=0)
        again = lm.next_token_logprobs_sync(ctx)
        torch.testing.assert_close(again, keep, rtol=0, atol=0)
    finally:
        lm.close()


@pytest.mark.parametrize("device", DEVICES)
def test_callers_copies_come_in_bounded_blocks(device):
    """The callers' copies of a step's rows (Front._compute_owned) are views of blocks of at
    most OWNED_BLOCK_BYTES on a device, HOST_OWNED_BLOCK_BYTES in host memory: a row a caller
    keeps keeps no more than its block alive."""
    from genback.queries.rows import DEVICE_COPY_BLOCK_BYTES as OWNED_BLOCK_BYTES
    from genback.queries.rows import HOST_BLOCK_BYTES as HOST_OWNED_BLOCK_BYTES, owned_copies

    limit = HOST_OWNED_BLOCK_BYTES if device == "cpu" else OWNED_BLOCK_BYTES
    rows = list(torch.randn(100, 100_000, device=device).unbind(0))  # 400 KB a row
    copies = owned_copies(rows)
    per = limit // rows[0].nbytes
    blocks = {}
    for k, (row, copy_) in enumerate(zip(rows, copies)):
        assert torch.equal(row, copy_) and copy_.data_ptr() != row.data_ptr()
        blocks.setdefault(copy_.untyped_storage().data_ptr(), []).append(k)
    assert len(blocks) == -(-100 // per)  # ceil: 20 rows a block on a device, 2 on the CPU
    assert all(len(ks) * rows[0].nbytes <= limit for ks in blocks.values())
    copies[3].fill_(0.0)  # a caller writing into its copy changes no other row
    assert torch.equal(copies[4], rows[4]) and not torch.equal(rows[3], copies[3])
    # a row larger than a block still gets a copy of its own
    (big,) = owned_copies([torch.ones(limit // 4 + 1, device=device)])
    assert big.numel() == limit // 4 + 1
