"""Host work per scoring request (issue 66, session 66): the positions a forward keeps and the
scores' targets as arrays (``forward/logits.py``'s ``kept_positions``, ``forward/results.py``'s
``_scores`` in slices sized by bytes), and a ``loglikelihood_rolling`` call's texts encoded
in one batched tokenizer call (``encoding.encode_texts``).

References: the per-position Python these replaced (written out below), uncached forwards and
the per-text encoder. Work is counted (forwards, tokenizer calls), never timed.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from genback.engine import GenbackEngine, RollingLoglikelihoodRequest
from genback.engine.encoding import encode_text, encode_texts, prefix_token_id
from genback.llm import AsyncTransformer
from genback.llm.hf.forward import results as R
from genback.llm.hf.forward.logits import kept_positions, ragged_arange
from genback.queries.window import rolling_windows


def _kept_reference(spans):
    """The per-position version (before session 66): sorted wanted positions, flat indices."""
    wanted = sorted({j for _, a, b in spans for j in range(a, b)}) or [0]
    column = {j: k for k, j in enumerate(wanted)}
    return wanted, [i * len(wanted) + column[j] for i, a, b in spans for j in range(a, b)]


def test_kept_positions_equal_the_per_position_reference():
    rng = random.Random(0)
    cases = [[], [(0, 3, 4)], [(0, 0, 5), (0, 5, 9)], [(0, 2, 5), (1, 0, 2), (1, 3, 4)]]
    for _ in range(200):  # random forwards: rows of m positions, outputs anywhere in them
        R_, m = rng.randint(1, 6), rng.randint(1, 12)
        spans = []
        for i in range(R_):
            a = rng.randint(0, m - 1)
            while a < m and rng.random() < 0.7:
                b = rng.randint(a + 1, m)
                spans.append((i, a, b))
                a = b
        cases.append(spans)
    for spans in cases:
        wanted, flat = kept_positions(spans, 1 + max((i for i, _, _ in spans), default=0))
        ref_wanted, ref_flat = _kept_reference(spans)
        assert wanted.dtype == flat.dtype == np.int64
        assert wanted.tolist() == ref_wanted and flat.tolist() == ref_flat, spans
    assert ragged_arange(np.array([5, 0, 9]), np.array([2, 0, 3])).tolist() == [5, 6, 9, 10, 11]
    assert ragged_arange(np.array([4]), np.array([0])).tolist() == []


def _brute(model, ctx, cont):
    with torch.inference_mode():
        logits = model(torch.tensor([ctx + cont]), use_cache=False).logits[0].float()
    rows = torch.log_softmax(logits, -1)[len(ctx) - 1: len(ctx) + len(cont) - 1]
    target = torch.tensor(cont)
    return rows.gather(1, target[:, None])[:, 0], rows.argmax(-1) == target, rows


@pytest.mark.parametrize("slice_bytes", [None, 3 * 4 * 50_257])
def test_scores_rows_and_prefills_in_one_batch_equal_uncached(tiny_hf, gpt2_tok, monkeypatch,
                                                               slice_bytes):
    """Scores (with and without greedy flags), next-token rows and a shared prefix in one batch;
    the scores' targets taken in one slice, or in slices of 3 positions (``_SLICE_BYTES``):
    every value equals an uncached forward's (<= 1e-5), flags equal."""
    if slice_bytes is not None:
        monkeypatch.setattr(R, "_SLICE_BYTES", {"cpu": slice_bytes})
        monkeypatch.setattr(R, "_MIN_SLICE", 1)
        assert R.slice_positions(torch.device("cpu"), 50_257) == 3
    rng = random.Random(1)
    shared = [rng.randrange(50_000) for _ in range(9)]
    pairs = [(shared + [rng.randrange(50_000) for _ in range(rng.randint(0, 5))],
              [rng.randrange(50_000) for _ in range(rng.randint(1, 7))]) for _ in range(6)]
    rows_for = [shared[:5], shared + [17]]
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05)

    async def go():
        return await asyncio.gather(*(lm.score(c, x) for c, x in pairs[:3]),
                                    *(lm.token_logprobs(c, x) for c, x in pairs[3:]),
                                    *(lm.next_token_logprobs(c) for c in rows_for))

    async def scores_only():  # (their targets are all the logits' rows: read in place)
        return await asyncio.gather(*(lm.score(c, x) for c, x in pairs))

    out = asyncio.run(go())
    info = lm.cache_info()
    lm.clear_kv_cache()
    alone = asyncio.run(scores_only())
    lm.close()
    assert (info["forwards"], info["batches"]) == (2, 1)  # (the shared prefix, then the rest)
    for (ctx, cont), (lps, greedy) in zip(pairs, alone):
        lp, flags, _ = _brute(tiny_hf, ctx, cont)
        assert torch.allclose(lps, lp, atol=1e-5) and torch.equal(greedy, flags)
    for (ctx, cont), got in zip(pairs, out[:6]):
        lp, flags, _ = _brute(tiny_hf, ctx, cont)
        lps, greedy = got if isinstance(got, tuple) else (got, None)
        assert torch.allclose(lps, lp, atol=1e-5)
        assert greedy is None or torch.equal(greedy, flags)
    for ctx, row in zip(rows_for, out[6:]):
        *_, rows = _brute(tiny_hf, ctx, [0])  # (the row after ctx)
        assert torch.allclose(row, rows[0], atol=1e-5)


@pytest.mark.parametrize("which", ["gpt2", "smollm2"])
def test_encode_texts_equals_encode_text_text_by_text(which, gpt2_tok, smol_hf):
    tok = gpt2_tok if which == "gpt2" else smol_hf[1]
    prefix = tok.decode(prefix_token_id(tok))
    texts = ["The capital of France is", prefix + "Question: 2+2=?", "", "Température  élevée",
             "日本の首都は", "The capital of France is"]
    got = encode_texts(tok, texts)
    assert got == {t: encode_text(tok, t) for t in texts}
    assert encode_texts(tok, []) == {}
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str, got int"):
        encode_texts(tok, ["a", 3])


class _CountingTokenizer:
    """A tokenizer wrapper that counts calls (batched ``__call__`` and per-text ``encode``)."""

    def __init__(self, tok):
        self._tok, self.calls, self.encodes = tok, 0, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._tok(*args, **kwargs)

    def encode(self, *args, **kwargs):
        self.encodes += 1
        return self._tok.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_rolling_texts_encoded_in_one_batched_call(tiny_hf, gpt2_tok):
    texts = ["Bright stars shine over the quiet harbour tonight.", "Seven ducks swam.",
             "Bright stars shine over the quiet harbour tonight."]
    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    counting = _CountingTokenizer(gpt2_tok)
    with GenbackEngine(lm=lm, max_length=8).build() as s:
        s.tokenizer = counting
        outs = s.loglikelihood_rolling([RollingLoglikelihoodRequest(t) for t in texts]
                                       + [RollingLoglikelihoodRequest(7)])
    lm.close()
    assert counting.calls == 1 and counting.encodes == 0  # (one batched call, the text once)
    assert outs[3].metadata["error"] == "TypeError: text must be a str or None, got int: 7"
    bos = prefix_token_id(gpt2_tok)
    for text, out in zip(texts, outs):
        ids = encode_text(gpt2_tok, text)
        assert out.token_count == len(ids)
        # windows of at most 8 inputs (max_length=8), each scored uncached
        total, done = 0.0, 0
        for ctx, tgt in rolling_windows(ids, bos, 8):
            total += float(_brute(tiny_hf, ctx, tgt)[0].double().sum())
            done += len(tgt)
        assert done == len(ids) and out.logprob == pytest.approx(total, abs=1e-4)
