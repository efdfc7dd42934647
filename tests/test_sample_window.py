"""Sampling against the model's window, on a real model whose window is small: a random 2-layer
GPT-2 with 32 positions over GPT-2's real tokenizer (``max_context_length`` 32).

A prompt that cannot fit is refused before any work, with one sentence naming the window; a
sample that reaches the window stops there and keeps its tokens (finish reason ``"length"``
through the engine facade); in a batch, every prompt is checked first and a sample reaching the
window does not stop the others. The rule (``Decoding.room``) is the one every backend uses; on
vLLM it is checked in ``tests/test_vllm_generation.py``.
"""

from __future__ import annotations

import pytest
import torch

from genback.llm import AsyncTransformer
from genback.queries.sampling import SamplingParams

WINDOW = 32


@pytest.fixture(scope="module")
def small_window(gpt2_tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(gpt2_tok), n_positions=WINDOW, n_embd=64, n_layer=2,
                        n_head=4, bos_token_id=gpt2_tok.bos_token_id,
                        eos_token_id=gpt2_tok.eos_token_id)
    return GPT2LMHeadModel(config).eval()


@pytest.fixture
def lm(small_window, gpt2_tok):
    lm = AsyncTransformer(small_window, gpt2_tok)
    assert lm.max_context_length == WINDOW
    yield lm
    lm.close()


def _prompt(n: int) -> list[int]:
    return [(7 * i + 11) % 50000 for i in range(n)]


async def test_sample_reaching_the_window_stops_there_and_keeps_its_tokens(lm):
    tokens = await lm.sample(_prompt(10), max_tokens=100, eos_token_ids=[], seed=0)
    assert len(tokens) == WINDOW + 1 - 10  # the last token is never an input
    assert lm.decoding.room(10) == WINDOW + 1 - 10
    # the same draws as a request that asks for exactly what fits
    again = await lm.sample(_prompt(10), max_tokens=WINDOW + 1 - 10, eos_token_ids=[], seed=0)
    assert again == tokens
    # a prompt that fills the window still gets its one token
    assert len(await lm.sample(_prompt(WINDOW), max_tokens=5, eos_token_ids=[], seed=0)) == 1


async def test_prompt_longer_than_the_window_is_refused_before_any_work(lm):
    with pytest.raises(ValueError) as info:
        await lm.sample(_prompt(WINDOW + 1), max_tokens=5, eos_token_ids=[], seed=0)
    assert str(info.value) == (f"prompt_token_ids has {WINDOW + 1} tokens, more than the "
                               f"model's context of {WINDOW}")
    assert lm.cache_info()["queries"] == 0


async def test_batch_checks_every_prompt_first(lm):
    prompts = [_prompt(4), _prompt(WINDOW + 3), _prompt(5)]
    with pytest.raises(ValueError, match=rf"prompt_token_ids_list\[1\] has {WINDOW + 3} tokens, "
                                         rf"more than the model's context of {WINDOW}"):
        await lm.batch_sample(prompts, max_tokens=8, eos_token_ids=[], seed=0)
    assert lm.cache_info()["queries"] == 0  # nothing was sampled for the good prompts


async def test_batch_sample_reaching_the_window_does_not_stop_the_others(lm):
    short, long = _prompt(4), _prompt(WINDOW - 2)
    out = await lm.batch_sample([short, long, short], max_tokens=12, eos_token_ids=[], seed=3)
    assert [len(t) for t in out] == [12, 3, 12]
    alone = await lm.sample(long, max_tokens=12, eos_token_ids=[], seed=4)
    assert out[1] == alone  # prompt i draws with seed + i, whatever runs beside it


async def test_generate_stream_ends_at_the_window_and_the_facade_says_length(lm):
    choices = [c async for c in lm.generate_stream(_prompt(20), SamplingParams(), 50, [])]
    assert len(choices) == WINDOW + 1 - 20
    from genback.engine import GenerationRequest
    from genback.engine.session import GenbackSession

    with GenbackSession(lm, owns_lm=False) as session:
        prompt = lm.tokenizer.decode(_prompt(20))
        ids = lm.tokenizer.encode(prompt)
        (out,) = session.generate([GenerationRequest(prompt=prompt, max_new_tokens=50)])
    assert out.metadata["finish_reason"] == "length"
    assert 0 < out.metadata["completion_tokens"] <= WINDOW + 1 - len(ids)
