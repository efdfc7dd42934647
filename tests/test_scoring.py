"""The scoring primitive ``AsyncLM.score`` and the engine's one-query-per-request scoring.

Reference: an uncached fp32 forward of ``context + continuation`` alone (brute force). Work is
counted with ``cache_info()`` (forwards, batches, tokens forwarded), never timed.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from genback.engine import GenbackEngine, LoglikelihoodRequest, RollingLoglikelihoodRequest
from genback.engine.encoding import encode_pair
from genback.queries.window import rolling_windows
from genback.engine.scoring import sharing_order
from genback.llm import AsyncTransformer, MockAsyncLM


def brute(model, ctx, cont):
    """Uncached forward: (log-probs float32 [n], argmax flags bool [n]) of ``cont`` after ``ctx``."""
    with torch.inference_mode():
        logits = model(torch.tensor([ctx + cont]), use_cache=False).logits[0].float()
    rows = torch.log_softmax(logits, -1)[len(ctx) - 1: len(ctx) + len(cont) - 1]
    target = torch.tensor(cont)
    return rows.gather(1, target[:, None])[:, 0], rows.argmax(-1) == target


TEXT_PAIRS = [
    ("The capital of France is", " Paris, a city of art and light."),
    ("The capital of France is", " London"),
    ("Question: what is two plus two?\nAnswer:", " 4"),
    ("Once upon a time", ", there was a king who lived in a castle."),
    ("def f(x):\n    return", " x + 1"),
    ("Température", " élevée"),
]


async def test_score_equals_brute_force_on_tiny_gpt2(tiny_lm, tiny_hf):
    rng = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(0, 50000, (n,), generator=rng).tolist(),
              torch.randint(0, 50000, (k,), generator=rng).tolist())
             for n, k in ((5, 3), (40, 1), (12, 20), (1, 7), (64, 2))]
    before = tiny_lm.cache_info()["batches"]
    got = await asyncio.gather(*(tiny_lm.score(c, x) for c, x in pairs))
    assert tiny_lm.cache_info()["batches"] == before + 1  # one batch for all of them
    for (ctx, cont), (lps, greedy) in zip(pairs, got):
        ref_lps, ref_greedy = brute(tiny_hf, ctx, cont)
        assert lps.dtype == torch.float32 and greedy.dtype == torch.bool
        assert lps.shape == greedy.shape == (len(cont),)
        assert float((lps - ref_lps).abs().max()) <= 1e-5
        assert greedy.tolist() == ref_greedy.tolist()
        assert torch.allclose(lps, await tiny_lm.token_logprobs(ctx, cont), atol=1e-5)


async def test_greedy_flags_are_true_on_the_greedy_path(tiny_lm, tiny_hf):
    ctx = [464, 3139, 286]
    path = []
    for _ in range(5):
        with torch.inference_mode():
            logits = tiny_hf(torch.tensor([ctx + path])).logits[0, -1]
        path.append(int(logits.argmax()))
    lps, greedy = await tiny_lm.score(ctx, path)
    assert greedy.all()
    wrong = path[:2] + [(path[2] + 1) % 50000] + path[3:]
    _, greedy = await tiny_lm.score(ctx, wrong)
    assert greedy.tolist()[:3] == [True, True, False]


async def test_score_equals_brute_force_on_smollm2(smol_lm, smol_hf):
    model, tok = smol_hf
    pairs = [encode_pair(tok, c, x) for c, x in TEXT_PAIRS]
    got = await asyncio.gather(*(smol_lm.score(c, x) for c, x in pairs))
    flags = []
    for (ctx, cont), (lps, greedy) in zip(pairs, got):
        ref_lps, ref_greedy = brute(model, ctx, cont)
        assert float((lps - ref_lps).abs().max()) <= 1e-4
        assert greedy.tolist() == ref_greedy.tolist()
        flags += greedy.tolist()
    assert any(flags) and not all(flags)  # both kinds of flag are exercised
    assert got[0][1][0]  # " Paris" is the greedy next token after "The capital of France is"


async def test_score_bad_input_fails_alone(tiny_lm):
    good = tiny_lm.score([1, 2, 3], [4, 5])
    with pytest.raises(ValueError, match="continuation_ids"):
        await tiny_lm.score([1, 2, 3], [])
    with pytest.raises(TypeError, match="context_ids"):
        await tiny_lm.score("abc", [4])
    with pytest.raises(ValueError, match="context_ids"):
        await tiny_lm.score([1, 2, 10 ** 9], [4])
    lps, greedy = await good
    assert lps.shape == (2,)


async def test_mock_score_matches_its_rows(gpt2_tok):
    lm = MockAsyncLM(gpt2_tok)
    ctx, cont = [5, 6, 7], [8, 9, 10, 11]
    lps, greedy = await lm.score(ctx, cont)
    rows = [await lm.next_token_logprobs(ctx + cont[:i]) for i in range(len(cont))]
    assert torch.allclose(lps, torch.stack([r[t] for r, t in zip(rows, cont)]))
    assert greedy.tolist() == [int(r.argmax()) == t for r, t in zip(rows, cont)]
    path = []
    for _ in range(3):
        path.append(int((await lm.next_token_logprobs(ctx + path)).argmax()))
    assert (await lm.score(ctx, path))[1].all()
    await lm.aclose()


def test_sharing_order_puts_shared_contexts_together():
    pairs = [([3, 1], [5]), None, ([1, 2, 3], [9]), ([3, 1], [4]), ([1, 2], [7]), ([1, 2, 3], [8])]
    order = sharing_order(pairs)
    assert order[0] == 1  # failed encodings first
    assert [pairs[i] for i in order[1:]] == [([1, 2], [7]), ([1, 2, 3], [8]), ([1, 2, 3], [9]),
                                             ([3, 1], [4]), ([3, 1], [5])]


# -- the engine: one query per request, counted work --------------------------------------------


def test_distinct_pairs_cost_one_batch_and_one_forward(smol_hf):
    """Requests with no shared prefix: one batch, one forward (no prefill, no row queries)."""
    model, tok = smol_hf
    texts = [("Bright stars shine over", " the quiet harbour"),
             ("Seven ducks", " swam"),
             ("Why is the sky blue?", " Because of Rayleigh scattering."),
             ("import numpy as", " np")]
    pairs = [encode_pair(tok, c, x) for c, x in texts]
    assert len({tuple(c[:1]) for c, _ in pairs}) == len(pairs)  # no two share a first token
    lm = AsyncTransformer(model, tok)
    with GenbackEngine(lm=lm).build() as s:
        outs = s.loglikelihood([LoglikelihoodRequest(c, x) for c, x in texts])
        info = lm.cache_info()
    lm.close()
    assert info["batches"] == 1 and info["forwards"] == 1
    assert info["tokens_forwarded"] == sum(len(c) + len(x) - 1 for c, x in pairs)
    for (ctx, cont), out in zip(pairs, outs):
        ref_lps, ref_greedy = brute(model, ctx, cont)
        assert out.logprob == pytest.approx(float(ref_lps.double().sum()), abs=1e-4)
        assert out.is_greedy == bool(ref_greedy.all())
        assert out.token_count == len(cont)


def test_multiple_choice_forwards_each_context_once(smol_hf):
    """Two questions of four choices (of 2-3 tokens: one scoring forward pads little): one batch;
    the runner forwards the two contexts once (one prefill forward) and then every choice's own
    tokens (one scoring forward)."""
    model, tok = smol_hf
    questions = [
        ("In the old library above the post office, a librarian named Ada kept a ledger of every "
         "book that left the building. She had worked there for",
         [" thirty years", " a long time", " the council", " many years"]),
        ("Recipe: whisk two eggs with a cup of milk, then fold in the flour slowly until the "
         "batter is smooth. Finally,",
         [" bake it", " let it rest", " add salt", " serve it"]),
    ]
    requests, pairs = [], []
    for context, choices in questions:
        for c in choices:
            requests.append(LoglikelihoodRequest(context, c))
            pairs.append(encode_pair(tok, context, c))
    lm = AsyncTransformer(model, tok)
    with GenbackEngine(lm=lm).build() as s:
        outs = s.loglikelihood(requests[::-1])[::-1]  # any input order
        info = lm.cache_info()
    lm.close()
    contexts = {tuple(c) for c, _ in pairs}
    assert info["batches"] == 1 and info["forwards"] == 2
    # each context but its last token once, then each choice's continuation (its first input is
    # the context's last token, whose logits give the first target's log-prob)
    assert info["tokens_forwarded"] == sum(len(c) - 1 for c in contexts) + sum(
        len(x) for _, x in pairs)
    for (ctx, cont), out in zip(pairs, outs):
        ref_lps, ref_greedy = brute(model, ctx, cont)
        assert out.logprob == pytest.approx(float(ref_lps.double().sum()), abs=1e-4)
        assert out.is_greedy == bool(ref_greedy.all())


def test_chunks_are_one_batch_each(smol_hf):
    model, tok = smol_hf
    lm = AsyncTransformer(model, tok)
    requests = [LoglikelihoodRequest(f"Item {i}: the colour is", c)
                for i in range(3) for c in (" red", " green")]
    with GenbackEngine(lm=lm, max_in_flight=2).build() as s:
        outs = s.loglikelihood(requests)
        info = lm.cache_info()
    lm.close()
    assert info["batches"] == 3  # 6 requests in chunks of 2
    assert all(o.token_count == 1 and o.logprob < 0 for o in outs)


def test_rolling_windows_of_all_texts_share_one_batch(smol_hf):
    model, tok = smol_hf
    texts = ["The quick brown fox jumps over the lazy dog. " * 4,
             "A short line.",
             "Numbers: " + ", ".join(str(i) for i in range(30))]
    lm = AsyncTransformer(model, tok)
    with GenbackEngine(lm=lm, max_length=16).build() as s:
        outs = s.loglikelihood_rolling([RollingLoglikelihoodRequest(t) for t in texts])
        info = lm.cache_info()
    lm.close()
    windows = {t: list(rolling_windows(tok.encode(t), tok.bos_token_id, 16)) for t in texts}
    assert sum(len(w) for w in windows.values()) > 6
    assert info["batches"] == 1  # every window of every text in one batch
    for t, out in zip(texts, outs):
        total = sum(float(brute(model, c, x)[0].double().sum()) for c, x in windows[t])
        assert out.logprob == pytest.approx(total, abs=1e-4)
        assert out.token_count == len(tok.encode(t))
        assert math.isfinite(out.logprob)


async def test_query_too_large_for_one_forward_is_answered_in_pieces(tiny_hf, gpt2_tok):
    """A scoring query whose forward exceeds ``max_forward_bytes`` is answered by forwards that
    each fit (its context prefilled in chunks, its continuation scored in slices): the same
    log-probs and greedy flags as brute force, in the counted number of forwards."""
    torch.manual_seed(0)
    ctx = torch.randint(100, 5000, (300,)).tolist()
    cont = torch.randint(100, 5000, (30,)).tolist()
    L = len(ctx) + len(cont) - 1
    per_position = L * 16 + 4 * tiny_hf.config.vocab_size  # scores (4 heads fp32) + logits
    limit = 2 * per_position * 5  # slices of 5 targets; prefill chunks of limit // (2 * L * 16)
    lm = AsyncTransformer(tiny_hf, gpt2_tok, max_forward_bytes=limit)
    try:
        lps, flags = await lm.score(ctx, cont)
        want_lps, want_flags = brute(tiny_hf, ctx, cont)
        assert float((lps - want_lps).abs().max()) <= 1e-5
        assert flags.tolist() == want_flags.tolist()
        chunk = limit // (2 * L * 16)
        chunks = len(range(chunk, len(ctx), chunk))  # prefill ends before the first target
        assert lm.cache_info()["forwards"] == chunks + 6  # 30 targets in slices of 5
    finally:
        await lm.aclose()


async def test_query_that_cannot_fit_fails_alone_naming_the_limit(tiny_hf, gpt2_tok):
    """When even one position's forward exceeds ``max_forward_bytes``, that query fails with a
    ValueError naming the limit; the queries batched with it are answered."""
    per_short = 8 * 16 + 4 * tiny_hf.config.vocab_size
    lm = AsyncTransformer(tiny_hf, gpt2_tok, max_forward_bytes=per_short + 2000,
                          batch_window=0.05)
    try:
        long_ctx = list(range(1000, 1400))
        short = [[1000 + i, 7, 8] for i in range(4)]
        got = await asyncio.gather(lm.score(long_ctx, [5, 6]),
                                   *(lm.next_token_logprobs(c) for c in short),
                                   return_exceptions=True)
        assert isinstance(got[0], ValueError) and "max_forward_bytes" in str(got[0])
        for row, ctx in zip(got[1:], short):
            assert float((row - lm.next_token_logprobs_uncached(ctx)).abs().max()) <= 1e-5
        assert lm.cache_info()["batches"] == 1
        # the model keeps serving
        assert (await lm.next_token_logprobs([1, 2, 3])).shape == (tiny_hf.config.vocab_size,)
    finally:
        await lm.aclose()
