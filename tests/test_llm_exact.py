"""Every cached, batched path returns what an uncached fp32 forward of the context alone returns.

Tolerances: 1e-5 max abs on the tiny GPT-2; on SmolLM2 (30 layers) batched KV-cached fp32 forwards
differ from a batch-1 full forward by rounding alone — ``test_smollm2_rounding_floor`` measures
that floor and the bound below keeps within 1e-4.
"""

from __future__ import annotations

import asyncio
import random

import torch

TINY_TOL = 1e-5
SMOL_TOL = 1e-4


def maxerr(row, ref):
    return float((row - ref).abs().max())


async def test_async_rows_equal_uncached(tiny_lm):
    ids = tiny_lm.tokenizer.encode("Hello world, this is a test of the cache.")
    row = await tiny_lm.next_token_logprobs(ids)
    assert row.dtype == torch.float32 and row.shape == (tiny_lm.vocab_size,)
    assert abs(float(torch.logsumexp(row.double(), 0))) < 1e-5
    assert maxerr(row, tiny_lm.next_token_logprobs_uncached(ids)) <= TINY_TOL


async def test_same_suffix_after_different_prefixes_in_one_batch(tiny_lm):
    """Two contexts that end alike but begin differently must get different, exact rows."""
    a, b = [10, 11, 12], [20, 21, 22]
    await asyncio.gather(tiny_lm.next_token_logprobs(a), tiny_lm.next_token_logprobs(b))
    suffix = [500, 600]
    ra, rb = await asyncio.gather(
        tiny_lm.next_token_logprobs(a + suffix), tiny_lm.next_token_logprobs(b + suffix)
    )
    ref_a = tiny_lm.next_token_logprobs_uncached(a + suffix)
    ref_b = tiny_lm.next_token_logprobs_uncached(b + suffix)
    assert maxerr(ra, ref_a) <= TINY_TOL and maxerr(rb, ref_b) <= TINY_TOL
    assert maxerr(ref_a, ref_b) > 1e-3  # the two contexts really differ


async def test_mixed_past_lengths_in_one_batch(tiny_lm):
    base = list(range(100, 140))
    await tiny_lm.next_token_logprobs(base)  # caches 40 tokens of KV
    contexts = [base + [7], base[:10] + [8, 9], [3], base[:25] + list(range(200, 230)), [1, 2]]
    before = tiny_lm.cache_info()["batches"]
    rows = await asyncio.gather(*(tiny_lm.next_token_logprobs(c) for c in contexts))
    assert tiny_lm.cache_info()["batches"] == before + 1  # one batch, mixed cached lengths
    for c, r in zip(contexts, rows):
        assert maxerr(r, tiny_lm.next_token_logprobs_uncached(c)) <= TINY_TOL


async def test_sync_forms_inside_running_loop_after_async(tiny_lm):
    ids = [5, 6, 7, 8, 9]
    await tiny_lm.next_token_logprobs(ids)
    # called on the loop thread while the loop runs: computes on this thread, uses the caches
    row = tiny_lm.next_token_logprobs_sync(ids + [10])
    assert maxerr(row, tiny_lm.next_token_logprobs_uncached(ids + [10])) <= TINY_TOL
    batch = tiny_lm.batch_next_token_logprobs_sync([ids, ids + [11], [4]])
    assert batch.shape == (3, tiny_lm.vocab_size)
    for c, r in zip([ids, ids + [11], [4]], batch):
        assert maxerr(r, tiny_lm.next_token_logprobs_uncached(c)) <= TINY_TOL


def test_sync_forms_outside_a_loop(tiny_hf, gpt2_tok):
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    try:
        ids = gpt2_tok.encode("Outside any event loop")
        assert maxerr(lm.next_token_logprobs_sync(ids), lm.next_token_logprobs_uncached(ids)) <= TINY_TOL
        rows = lm.batch_next_token_logprobs_sync([ids, ids[:2]])
        assert maxerr(rows[1], lm.next_token_logprobs_uncached(ids[:2])) <= TINY_TOL
    finally:
        lm.close()


async def test_batch_form(tiny_lm):
    contexts = [[1, 2, 3], [1, 2, 3, 4], [9], [1, 2, 3]]
    rows = await tiny_lm.batch_next_token_logprobs(contexts)
    assert rows.shape == (4, tiny_lm.vocab_size)
    for c, r in zip(contexts, rows):
        assert maxerr(r, tiny_lm.next_token_logprobs_uncached(c)) <= TINY_TOL


async def test_token_logprobs_equals_next_token_rows(tiny_lm):
    context, continuation = [50, 51, 52, 53], [60, 61, 62, 63, 64]
    await tiny_lm.next_token_logprobs(context + [60, 61])  # part of it cached already
    got = await tiny_lm.token_logprobs(context, continuation)
    expected = torch.stack([
        tiny_lm.next_token_logprobs_uncached(context + continuation[:k])[continuation[k]]
        for k in range(len(continuation))
    ])
    assert got.shape == (5,) and maxerr(got, expected) <= TINY_TOL
    assert tiny_lm.cache_info()["forwards"] == 2  # one forward for the whole continuation


async def test_eviction_under_tiny_budget_recomputes_exactly(tiny_hf, gpt2_tok):
    from genback.llm import AsyncTransformer

    per_token = 2 * 2 * 64 * 4  # layers * (k, v) * hidden * fp32 bytes
    lm = AsyncTransformer(tiny_hf, gpt2_tok, kv_budget_bytes=30 * per_token, row_cache_size=0)
    try:
        rng = random.Random(0)
        contexts = [[rng.randrange(50000) for _ in range(rng.randrange(1, 20))] for _ in range(30)]
        for c in contexts:
            await lm.next_token_logprobs(c)
            assert lm.cache_info()["kv_bytes"] <= 30 * per_token
        assert lm.cache_info()["evictions"] > 0
        for c in contexts:  # evicted prefixes come back exact
            assert maxerr(await lm.next_token_logprobs(c), lm.next_token_logprobs_uncached(c)) <= TINY_TOL
    finally:
        await lm.aclose()


async def test_clear_cache(tiny_lm):
    ids = [300, 301, 302]
    first = await tiny_lm.next_token_logprobs(ids)
    assert tiny_lm.cache_info()["kv_bytes"] > 0
    tiny_lm.clear_cache()
    info = tiny_lm.cache_info()
    assert info["kv_bytes"] == 0 and info["rows_cached"] == 0
    again = await tiny_lm.next_token_logprobs(ids)
    assert tiny_lm.cache_info()["forwards"] == 2
    assert maxerr(again, first) <= TINY_TOL


async def test_returned_rows_are_the_callers_own(tiny_lm):
    ids = [1, 2]
    row = await tiny_lm.next_token_logprobs(ids)
    row.fill_(0.0)  # a careless caller must not corrupt the cache
    again = await tiny_lm.next_token_logprobs(ids)
    assert maxerr(again, tiny_lm.next_token_logprobs_uncached(ids)) <= TINY_TOL


async def test_smollm2_paris(smol_lm):
    ids = smol_lm.tokenizer.encode("The capital of France is")
    row = await smol_lm.next_token_logprobs(ids)
    top = int(row.argmax())
    assert smol_lm.tokenizer.decode([top]) == " Paris"
    assert abs(float(row[top]) - (-0.258)) < 5e-3


async def test_smollm2_rounding_floor_and_cached_paths(smol_lm):
    """Measure the rounding floor (batched full forward vs batch-1) and keep every path within it."""
    tok = smol_lm.tokenizer
    prompt = tok.encode("In a small village by the sea, an old fisherman told stories")
    rng = random.Random(1)
    contexts = [prompt + [rng.randrange(49152) for _ in range(k)] for k in (0, 1, 2, 3, 5)]
    contexts += [prompt[:7], prompt[:7] + [1000, 2000], tok.encode("Bonjour")]
    refs = [smol_lm.next_token_logprobs_uncached(c) for c in contexts]

    # the floor: two different-length contexts padded into one uncached batch
    a, b = contexts[0], contexts[4]
    with torch.inference_mode():
        pad = len(b) - len(a)
        ids = torch.tensor([[0] * pad + a, b])
        mask = torch.tensor([[0] * pad + [1] * len(a), [1] * len(b)])
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = smol_lm.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        floor = maxerr(torch.log_softmax(out[0, -1], -1), refs[0])
    assert floor <= SMOL_TOL

    await smol_lm.next_token_logprobs(prompt)
    rows = await asyncio.gather(*(smol_lm.next_token_logprobs(c) for c in contexts))
    errs = [maxerr(r, ref) for r, ref in zip(rows, refs)]
    assert max(errs) <= SMOL_TOL, errs
    sync_row = smol_lm.next_token_logprobs_sync(contexts[3] + [42])
    assert maxerr(sync_row, smol_lm.next_token_logprobs_uncached(contexts[3] + [42])) <= SMOL_TOL
    tl = await smol_lm.token_logprobs(prompt[:5], prompt[5:])
    expected = torch.stack([refs_k[prompt[k]] for k, refs_k in
                            ((k, smol_lm.next_token_logprobs_uncached(prompt[:k]))
                             for k in range(5, len(prompt)))])
    assert maxerr(tl, expected) <= SMOL_TOL


def test_host_rows_are_made_in_blocks_equal_to_one_log_softmax():
    """Rows that land on the CPU are computed in blocks of about 1 MiB (memory malloc reuses,
    instead of a fresh mapping of N x V x 4 bytes per step): each row equals one log_softmax of
    the whole batch, is float32 on the row device, and blocks are separate allocations."""
    from genback.queries.rows import HOST_BLOCK_BYTES as _ROW_BLOCK_BYTES, log_softmax_rows as _log_softmax_rows

    torch.manual_seed(0)
    V = 100_000  # 2 rows per block
    per = _ROW_BLOCK_BYTES // (4 * V)
    assert per == 2
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(7, V) * 4).to(dtype)
        rows = _log_softmax_rows(logits, torch.device("cpu"))
        ref = torch.log_softmax(logits.float(), dim=-1)
        assert len(rows) == 7
        for row, want in zip(rows, ref):
            assert row.dtype == torch.float32 and row.shape == (V,) and row.device.type == "cpu"
            assert torch.equal(row, want)
        storages = [r.untyped_storage().data_ptr() for r in rows]
        assert storages[0] == storages[1] != storages[2] == storages[3] != storages[6]
    # a narrow vocabulary: one block, one op, as before
    rows = _log_softmax_rows(torch.randn(300, 512), torch.device("cpu"))
    assert len({r.untyped_storage().data_ptr() for r in rows}) == 1


def test_a_steps_rows_are_copied_a_block_at_a_time_and_equal_their_stack():
    """``copy_blocks`` of the very rows the last ``log_softmax_rows`` made, in order (a step's
    rows, the output cache's copies: ``kept_copies``), copies its blocks (no ``torch.stack``);
    the copies equal the stacked rows byte for byte, in the same blocks. Rows in another order,
    a subset, rows made before the last call, or a second copy of the same rows are stacked."""
    from unittest import mock

    from genback.queries.rows import HOST_BLOCK_BYTES, copy_blocks, kept_copies, log_softmax_rows

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    for K, V in ((300, 512), (7, 100_000), (1, 512)):  # one block; blocks of 2 rows; one row
        per = max(1, HOST_BLOCK_BYTES // (4 * V))
        rows = log_softmax_rows(torch.randn(K, V) * 4, cpu)
        with mock.patch.object(torch, "stack", side_effect=AssertionError("stacked")):
            got = copy_blocks(list(rows))
        stacked = [torch.stack(rows[a:a + per]) for a in range(0, K, per)]
        assert [b.shape for b in got] == [b.shape for b in stacked]
        assert all(torch.equal(b, s) and b.data_ptr() != s.data_ptr()
                   for b, s in zip(got, stacked))
        assert all(b._base is None and b.is_contiguous() for b in got)
        rows = log_softmax_rows(torch.randn(K, V), cpu)
        kept = kept_copies(list(rows))
        assert len(kept) == K and all(torch.equal(k[0][k[1]], r) for k, r in zip(kept, rows))
    for case in ("reversed", "subset", "older", "twice"):
        old = log_softmax_rows(torch.randn(6, 512), cpu)
        rows = log_softmax_rows(torch.randn(6, 512), cpu)
        pick = {"reversed": rows[::-1], "subset": rows[1:], "older": old, "twice": rows}[case]
        if case == "twice":
            copy_blocks(list(rows))
        with mock.patch.object(torch, "stack", wraps=torch.stack) as stack:
            got = copy_blocks(list(pick))
        assert stack.called and torch.equal(got[0], torch.stack(list(pick)))
