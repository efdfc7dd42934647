"""The model window (genback.queries.window), and requests longer than it answered as lm-eval's HFLM
answers them, at the model's *own* window (no ``max_length`` given to either side).

Two models: a random GPT-2 whose own window is 64 positions (a forward of 65 inputs would fail
in its position embedding, so nothing can overrun the window unnoticed), over the real GPT-2
tokenizer; and the real SmolLM2 with its config's window set to 96 tokens for the module (its
rotary embedding does not depend on that number, so log-probs are the model's own; a context
several times 8,192 tokens would take minutes per forward on one CPU thread).
"""

from __future__ import annotations

import random

import pytest
import torch

from genback.engine import GenbackEngine, LoglikelihoodRequest, RollingLoglikelihoodRequest
from genback.queries.window import check_pair, pair_inputs, rolling_windows, truncate_pair

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the [eval] extra")

SMOL_WINDOW = 96


def test_rolling_windows_are_lm_evals():
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    for window in range(1, 10):
        for n in range(0, 31):
            tokens = list(range(100, 100 + n))
            ours = list(rolling_windows(tokens, 7, window))
            theirs = [make_disjoint_window(w)
                      for w in get_rolling_token_windows(tokens, 7, window, 1)]
            assert ours == [(list(c), list(t)) for c, t in theirs], (window, n)
            assert all(pair_inputs(len(c), len(t)) <= window for c, t in ours)
            assert [x for _, t in ours for x in t] == tokens


def test_truncate_pair_keeps_hflms_inputs():
    rng = random.Random(0)
    for _ in range(500):
        window = rng.randrange(1, 20)
        ctx = [rng.randrange(1000) for _ in range(rng.randrange(1, 50))]
        cont = [rng.randrange(1000) for _ in range(rng.randrange(1, window + 1))]
        c, x = truncate_pair(ctx, cont, window)
        assert x == cont and c and c == ctx[len(ctx) - len(c):]
        # HFLM's inputs: (context + continuation)[-(max_length + 1):][:-1]
        assert (c + x)[:-1] == (ctx + cont)[-(window + 1):][:-1]
        check_pair(len(c), len(x), window)  # what AsyncLM checks accepts what was fitted
    assert truncate_pair([1, 2], [3], None) == ([1, 2], [3])
    assert truncate_pair([1, 2, 3], [4, 5], 3) == ([2, 3], [4, 5])  # inputs 2, 3, 4
    assert truncate_pair([1, 2, 3], [4, 5, 6], 3) == ([3], [4, 5, 6])  # continuation == window
    with pytest.raises(ValueError, match="continuation has 4 tokens, more than the model's window of 3"):
        truncate_pair([1], [4, 5, 6, 7], 3)


def test_check_pair_counts_forward_inputs():
    check_pair(5, 4, 8)  # 5 + 4 - 1 = 8 inputs fit a window of 8
    check_pair(10**6, 1, None)
    with pytest.raises(ValueError, match=r"5 \+ 5 tokens: the forward takes 9 inputs .* window of 8"):
        check_pair(5, 5, 8)
    with pytest.raises(ValueError, match="window must be a positive int"):
        list(rolling_windows([1, 2], 0, 0))


# -- against HFLM at the model's own window ---------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_small_window(gpt2_tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    config = GPT2Config(vocab_size=len(gpt2_tok), n_positions=64, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=gpt2_tok.bos_token_id, eos_token_id=gpt2_tok.eos_token_id)
    return GPT2LMHeadModel(config).eval(), gpt2_tok


@pytest.fixture(scope="module")
def smol_small_window(smol_hf):
    model, tok = smol_hf
    saved = model.config.max_position_embeddings
    model.config.max_position_embeddings = SMOL_WINDOW
    yield model, tok
    model.config.max_position_embeddings = saved


@pytest.fixture(params=["gpt2", "smollm2"])
def pair(request):
    return request.getfixturevalue({"gpt2": "gpt2_small_window",
                                    "smollm2": "smol_small_window"}[request.param])


def _hflm(model, tok):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=tok, batch_size=4, device="cpu")


def _instances(kind, args_list):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, args, i) for i, args in enumerate(args_list)]


def _text(words: int, seed: int) -> str:
    from pathlib import Path

    source = (Path(__file__).parent / "data" / "engine" / "passage.txt").read_text().split()
    rng = random.Random(seed)
    return " ".join(rng.choice(source) for _ in range(words))


def _session(model, tok, **opts):
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(model, tok)
    return GenbackEngine(lm=lm, **opts).build(), lm


def test_loglikelihood_beyond_the_window_equals_hflm(pair):
    model, tok = pair
    hflm = _hflm(model, tok)
    session, lm = _session(model, tok)
    window = lm.max_context_length
    assert window == hflm.max_length == session.max_length in (64, SMOL_WINDOW)
    pairs = [(_text(3 * window, 1), " the harbour at night"), (_text(5 * window, 2), " and"),
             (_text(window, 3), " " + _text(window // 3, 4)), ("Short.", " Fine.")]
    for ctx, _ in pairs[:3]:
        assert len(tok.encode(ctx)) > window  # every long context is longer than the window
    try:
        ref = hflm.loglikelihood(_instances("loglikelihood", pairs), disable_tqdm=True)
        outs = session.loglikelihood([LoglikelihoodRequest(c, x) for c, x in pairs])
    finally:
        session.close()
        lm.close()
    for p, (logprob, greedy), out in zip(pairs, ref, outs):
        assert "error" not in out.metadata, out.metadata
        assert out.logprob == pytest.approx(logprob, abs=1e-4), p[1]
        assert out.is_greedy == greedy


def test_rolling_beyond_the_window_equals_hflm(pair):
    model, tok = pair
    hflm = _hflm(model, tok)
    session, lm = _session(model, tok)
    window = lm.max_context_length
    texts = [_text(4 * window, 5), _text(window // 2, 6)]
    # texts of exactly window and window + 1 tokens (the first window's edge)
    ids = tok.encode(_text(3 * window, 7))
    texts += [tok.decode(ids[:n]) for n in (window, window + 1)]
    try:
        ref = hflm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in texts]),
                                         disable_tqdm=True)
        outs = session.loglikelihood_rolling([RollingLoglikelihoodRequest(t) for t in texts])
    finally:
        session.close()
        lm.close()
    assert outs[0].token_count > 3 * window
    for text, r, out in zip(texts, ref, outs):
        assert "error" not in out.metadata, out.metadata
        # 1e-4, or two float32 ulps of the sum where that is coarser: a rolling sum of
        # thousands of tokens (-2,910 on SmolLM2) is itself resolved to 2.4e-4 in float32
        assert out.logprob == pytest.approx(r, rel=2 ** -22, abs=1e-4), len(text)


def test_continuation_longer_than_the_window_fails_alone(gpt2_small_window):
    model, tok = gpt2_small_window
    session, lm = _session(model, tok)
    long_cont = " " + _text(200, 8)
    try:
        good, bad = session.loglikelihood([LoglikelihoodRequest(_text(150, 9), " fine"),
                                           LoglikelihoodRequest("Hello", long_cont)])
        assert "error" not in good.metadata and good.logprob < 0 and good.token_count == 1
        assert bad.logprob == float("-inf") and bad.token_count == 0
        assert "more than the model's window of 64" in bad.metadata["error"]
    finally:
        session.close()
        lm.close()
    session, lm = _session(model, tok, errors="raise")
    try:
        with pytest.raises(ValueError, match="continuation has .* tokens, more than the model's window"):
            session.loglikelihood([LoglikelihoodRequest("Hello", long_cont)])
    finally:
        session.close()
        lm.close()


def test_max_length_above_the_models_window_is_refused(gpt2_small_window):
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(*gpt2_small_window)
    try:
        with pytest.raises(ValueError, match="max_length=65 is more than the model's window of 64"):
            GenbackEngine(lm=lm, max_length=65).build()
        with GenbackEngine(lm=lm, max_length=32).build() as s:
            assert s.max_length == 32
    finally:
        lm.close()
