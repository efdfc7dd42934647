"""The sampling module (genback.queries.sampling), decoding steps on the device, and the engine's
generation config against ``transformers.generate`` on the real SmolLM2."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from conftest import until
from genback.engine import GenbackEngine, GenerationRequest
from genback.llm import AsyncTransformer
from genback.queries.sampling import Choice, Pick, SamplingParams, choose


def step(params=SamplingParams(), prompt_length=0, n=0, banned=()):
    return Pick(params, prompt_length, n, banned)


# -- SamplingParams -------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, error, match", [
    ("temperature", 0, ValueError, "temperature must be in"),
    ("temperature", True, TypeError, "temperature must be a number, got bool"),
    ("top_k", -1, ValueError, "top_k must be an int >= 0, got -1"),
    ("top_k", 1.5, TypeError, "top_k must be an int, got float"),
    ("top_p", 0.0, ValueError, "top_p must be in"),
    ("min_p", 1.5, ValueError, "min_p must be in"),
    ("seed", "abc", TypeError, "seed must be an int, got str: 'abc'"),
    ("repetition_penalty", 0, ValueError, "repetition_penalty must be in"),
    ("presence_penalty", float("nan"), TypeError, "presence_penalty must be a number"),
    ("no_repeat_ngram_size", -2, ValueError, "no_repeat_ngram_size must be an int >= 0"),
    ("top_logprobs", "3", TypeError, "top_logprobs must be an int, got str"),
    ("logprobs", 1, TypeError, "logprobs must be a bool"),
])
def test_params_name_the_bad_field(field, value, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**{field: value})


# -- choose on constructed logits -------------------------------------------------------------------


def test_greedy_and_the_penalties():
    logits = torch.tensor([1.0, 3.0, 2.9, -1.0, 0.5])
    assert choose(logits, [0], step()).token == 1
    # repetition: a seen positive logit is divided (3 / 2 = 1.5 < 2.9), a negative multiplied
    assert choose(logits, [1], step(SamplingParams(repetition_penalty=2.0))).token == 2
    # presence / frequency count only generated tokens (after prompt_length)
    presence = SamplingParams(presence_penalty=0.5)
    assert choose(logits, [1, 7], step(presence, prompt_length=2)).token == 1
    assert choose(logits, [7, 1], step(presence, prompt_length=1)).token == 2
    freq = SamplingParams(frequency_penalty=0.06)
    assert choose(logits, [9, 1], step(freq, prompt_length=1)).token == 1  # 2.94 > 2.9
    assert choose(logits, [9, 1, 1], step(freq, prompt_length=1)).token == 2  # 2.88 < 2.9
    # no_repeat_ngram_size=2: "1 4" was seen, the context ends in 1 -> 4 banned
    logits4 = torch.tensor([0.0, 0.0, 0.0, 0.0, 9.0])
    assert choose(logits4, [1, 4, 2, 1], step(SamplingParams(no_repeat_ngram_size=2))).token != 4
    assert choose(logits4, [1, 4, 2, 3], step(SamplingParams(no_repeat_ngram_size=2))).token == 4
    # banned ids (min_new_tokens)
    assert choose(logits, [0], step(banned=(1, 2))).token == 0
    with pytest.raises(ValueError, match="every token is banned"):
        choose(logits, [0], step(banned=(0, 1, 2, 3, 4)))
    assert torch.equal(logits, torch.tensor([1.0, 3.0, 2.9, -1.0, 0.5]))  # not modified


def test_logprobs_are_the_models():
    logits = torch.tensor([1.0, 3.0, 2.9, -1.0, 0.5])
    lps = torch.log_softmax(logits, -1)
    got = choose(logits, [1], step(SamplingParams(repetition_penalty=2.0, logprobs=True,
                                                  top_logprobs=2)))
    assert got.token == 2 and got.logprob == pytest.approx(float(lps[2]))
    assert [t for t, _ in got.top_logprobs] == [1, 2]
    assert got.top_logprobs[0][1] == pytest.approx(float(lps[1]))


def test_truncation_and_seeded_draws():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sample = SamplingParams(greedy=False, seed=3)
    for params in (SamplingParams(greedy=False, top_k=1, seed=1),
                   SamplingParams(greedy=False, top_p=0.4, seed=1),
                   SamplingParams(greedy=False, min_p=0.9, seed=1)):
        assert all(choose(logits, [], step(params, n=i)).token == 0 for i in range(20))
    draws = [choose(logits, [], step(sample, n=i)).token for i in range(2000)]
    again = [choose(logits, [], step(sample, n=i)).token for i in range(2000)]
    assert draws == again  # (seed, step) fixes the draw
    for token, p in enumerate([0.5, 0.3, 0.15, 0.05]):
        freq = draws.count(token) / len(draws)
        assert abs(freq - p) <= 4 * math.sqrt(p * (1 - p) / len(draws))
    # top_p=0.8 keeps {0, 1} (mass before token 2 is 0.8), min_p=0.5 keeps {0, 1} (0.3 >= 0.25)
    for params in (SamplingParams(greedy=False, top_p=0.8, seed=2),
                   SamplingParams(greedy=False, min_p=0.5, seed=2)):
        assert {choose(logits, [], step(params, n=i)).token for i in range(200)} == {0, 1}
    # temperature sharpens: at 0.05 the top token is (almost surely) drawn
    cold = SamplingParams(greedy=False, temperature=0.05, seed=4)
    assert all(choose(logits, [], step(cold, n=i)).token == 0 for i in range(50))


# -- decoding steps through AsyncLM -------------------------------------------------------------------


async def test_steps_on_the_device_equal_steps_on_rows(tiny_lm):
    """A decoding step chosen in the runner equals ``choose`` on the uncached row."""
    contexts = [[1, 2, 3], [40, 41], [7] * 9]
    params = [SamplingParams(), SamplingParams(greedy=False, seed=11, top_k=50),
              SamplingParams(repetition_penalty=1.5, logprobs=True, top_logprobs=3)]
    got = await asyncio.gather(*(tiny_lm.choose_next(c, Pick(p, 1, 2))
                                 for c, p in zip(contexts, params)))
    for c, p, choice in zip(contexts, params, got):
        row = tiny_lm.next_token_logprobs_uncached(c)
        ref = choose(row, c, Pick(p, 1, 2))
        assert isinstance(choice, Choice) and choice.token == ref.token
        if p.logprobs:
            assert choice.logprob == pytest.approx(ref.logprob, abs=1e-5)
            assert [t for t, _ in choice.top_logprobs] == [t for t, _ in ref.top_logprobs]


async def test_concurrent_generations_step_in_one_forward(tiny_lm):
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]]  # same length: one prefill
    before = tiny_lm.cache_info()
    outs = await asyncio.gather(*(tiny_lm.sample(p, 6, [], seed=i) for i, p in enumerate(prompts)))
    info = tiny_lm.cache_info()
    assert all(len(o) == 6 for o in outs)
    assert info["batches"] - before["batches"] == 6
    assert info["forwards"] - before["forwards"] == 6  # one forward per step for all four
    assert info["tokens_forwarded"] - before["tokens_forwarded"] == 4 * 3 + 5 * 4


async def test_late_joiners_merge_into_the_lockstep_batch(tiny_lm):
    """Generations started in two waves end up stepping in one batch: the batcher dispatches
    the pending queries only after the callers it just answered have queued their next ones.
    The second wave starts while the first wave's first forward runs (an event, not a sleep: a
    fast machine ran several steps of the first wave alone within a fixed sleep)."""
    loop = asyncio.get_running_loop()
    second: list = []

    def start_second():
        second.extend(asyncio.create_task(tiny_lm.sample([30 + i, 6], 12, [], seed=i))
                      for i in range(3))

    def on_first_forward(module, args):
        if not started:
            started.append(True)
            loop.call_soon_threadsafe(start_second)

    started: list = []
    hook = tiny_lm.runner.model.register_forward_pre_hook(on_first_forward)
    try:
        before = tiny_lm.cache_info()["batches"]
        first = [asyncio.create_task(tiny_lm.sample([20 + i, 5], 12, [], seed=i))
                 for i in range(3)]
        await until(lambda: len(second) == 3, "the second wave started")
        outs = await asyncio.gather(*first, *second)
    finally:
        hook.remove()
    assert all(len(o) == 12 for o in outs)
    # 12 steps each, the first wave's first alone; two waves split into two cohorts would take
    # ~24 batches
    assert tiny_lm.cache_info()["batches"] - before <= 12 + 2


async def test_generate_stream_is_the_choose_next_loop(tiny_lm):
    """The base ``generate_stream``: one ``choose_next`` query per token (the ender yielded last),
    enders banned before ``min_new_tokens``, and closing it early asks nothing more."""
    prompt, params = [3, 4, 5], SamplingParams(greedy=False, seed=4, logprobs=True)
    tokens = [c.token async for c in tiny_lm.generate_stream(prompt, params, 8, [])]
    assert tokens == await tiny_lm.sample(prompt, 8, [], seed=4)  # sample is built on it
    steps = [await tiny_lm.choose_next(prompt + tokens[:k], Pick(params, 3, k)) for k in range(8)]
    assert [c.token for c in steps] == tokens
    ended = [c.token async for c in tiny_lm.generate_stream(prompt, params, 8, [tokens[2]])]
    assert ended == tokens[:3]  # the ender ends it and comes last
    late = [c.token async for c in tiny_lm.generate_stream(prompt, params, 8, [tokens[0]],
                                                            min_new_tokens=1)]
    assert late[0] != tokens[0]  # banned at step 0
    before = tiny_lm.cache_info()["queries"]
    stream = tiny_lm.generate_stream([9, 9], SamplingParams(), 50, [])
    await stream.__anext__()
    await stream.__anext__()
    await stream.aclose()
    assert tiny_lm.cache_info()["queries"] - before == 2
    with pytest.raises(TypeError, match="params must be a genback.queries.sampling.SamplingParams"):
        await stream_all(tiny_lm.generate_stream([1], "greedy", 2))
    with pytest.raises(ValueError, match="min_new_tokens must be an int >= 0, got -1"):
        await stream_all(tiny_lm.generate_stream([1], SamplingParams(), 2, min_new_tokens=-1))


async def stream_all(stream):
    return [c async for c in stream]


async def test_sample_argument_errors_name_the_argument(tiny_lm):
    with pytest.raises(TypeError, match="temperature must be a number > 0, got bool: True"):
        await tiny_lm.sample([1], 3, [0], temperature=True)
    with pytest.raises(TypeError, match="seed must be an int or None, got str: 'abc'"):
        await tiny_lm.sample([1], 3, [0], seed="abc")
    with pytest.raises(TypeError, match="seed must be None, an int, or a list of ints"):
        await tiny_lm.batch_sample([[1], [2]], 3, [0], seed=1.5)
    with pytest.raises(TypeError, match=r"seed\[1\] must be an int or None, got str"):
        await tiny_lm.batch_sample([[1], [2]], 3, [0], seed=[1, "x"])
    with pytest.raises(TypeError, match="pick must be a genback.queries.sampling.Pick"):
        await tiny_lm.choose_next([1], "greedy")


# -- the engine's generation config against transformers.generate --------------------------------------


@pytest.fixture(scope="module")
def session(module_smol_lm):
    s = GenbackEngine(lm=module_smol_lm).build()
    yield s
    s.close()


def hf_generate(model, ids, **kwargs):
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), do_sample=False, pad_token_id=0,
                             eos_token_id=None, **kwargs)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("options", [
    {"repetition_penalty": 1.5},
    {"no_repeat_ngram_size": 2},
])
def test_processors_equal_transformers_generate(session, smol_hf, options):
    model, tok = smol_hf
    prompt = "List: apples, pears, apples, pears, apples,"
    ids = tok.encode(prompt)
    expected = hf_generate(model, ids, max_new_tokens=12, **options)
    out = session.generate([GenerationRequest(prompt=prompt, max_new_tokens=12,
                                              metadata=dict(options))])[0]
    assert out.metadata["token_ids"][: len(expected)] == expected[: len(out.metadata["token_ids"])]
    plain = session.generate([GenerationRequest(prompt=prompt, max_new_tokens=12)])[0]
    assert plain.metadata["token_ids"] != out.metadata["token_ids"]  # the option mattered


def test_stop_ids_min_new_tokens_and_logprobs(session, smol_hf):
    model, tok = smol_hf
    messages = [{"role": "user", "content": "Say OK."}]
    eos = tok.eos_token_id
    plain, held, stopped, scored = session.generate([
        GenerationRequest(messages=messages, max_new_tokens=40),
        GenerationRequest(messages=messages, max_new_tokens=40,
                          metadata={"min_new_tokens": 30}),
        GenerationRequest(messages=messages, max_new_tokens=40),
        GenerationRequest(messages=messages, max_new_tokens=40,
                          metadata={"logprobs": True, "top_logprobs": 2}),
    ])
    n = plain.metadata["completion_tokens"]
    assert plain.metadata["finish_reason"] == "eos" and n < 30
    assert held.metadata["completion_tokens"] >= 30 and eos not in held.metadata["token_ids"]
    first = plain.metadata["token_ids"][0]
    cut = session.generate([GenerationRequest(messages=messages, max_new_tokens=40,
                                              metadata={"stop_token_ids": [first]})])[0]
    assert cut.metadata["completion_tokens"] == 0 and cut.metadata["finish_reason"] == "stop"
    assert cut.metadata["stop"] == first
    # log-probs of the generated tokens are the model's own
    ids = tok.encode(scored.prompt, add_special_tokens=False)
    gen = scored.metadata["token_ids"]
    assert gen == plain.metadata["token_ids"] and len(scored.metadata["logprobs"]) == len(gen)
    with torch.inference_mode():
        rows = torch.log_softmax(model(torch.tensor([ids + gen])).logits[0].float(), -1)
    for i, (t, lp, top) in enumerate(zip(gen, scored.metadata["logprobs"],
                                         scored.metadata["top_logprobs"])):
        row = rows[len(ids) - 1 + i]
        assert lp == pytest.approx(float(row[t]), abs=1e-4)
        assert top[0][0] == t == int(row.argmax()) and len(top) == 2


def test_bad_generation_options_fail_alone(session):
    outs = session.generate([
        GenerationRequest(prompt="Hi", max_new_tokens=2, metadata={"top_p": 0}),
        GenerationRequest(prompt="Hi", max_new_tokens=2, metadata={"seed": "abc"}),
        GenerationRequest(prompt="Hi", max_new_tokens=2, metadata={"stop_token_ids": 5}),
        GenerationRequest(prompt="Hi", max_new_tokens=2, metadata={"repetition_penalty": -1}),
        GenerationRequest(prompt="Hi", max_new_tokens=2),
    ])
    assert "top_p must be in" in outs[0].metadata["error"]
    assert "seed must be an int, got str: 'abc'" in outs[1].metadata["error"]
    assert "stop_token_ids" in outs[2].metadata["error"]
    assert "repetition_penalty" in outs[3].metadata["error"]
    assert outs[4].metadata["completion_tokens"] == 2
