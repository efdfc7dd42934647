"""Per-query mlx-lm LoRA adapters on AsyncMlxLM.

The model is a random 2-layer GPT-2 (fp32) on GPT-2's real tokenizer, saved as a Hugging Face
folder and loaded by mlx-lm. Adapters are made as mlx-lm makes them: mlx-lm's own
``linear_to_lora_layers`` on a frozen copy of the model, non-zero random ``lora_a`` / ``lora_b``,
saved as ``mlx_lm.lora`` saves them (``adapters.safetensors`` of the trainable parameters and
``adapter_config.json``). The reference for an adapter is the *fused* model (mlx-lm's
``load_adapters`` then each LoRA layer's ``fuse()``), one uncached forward per context.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

pytest.importorskip("mlx.core", reason='mlx is not installed: pip install "genback[mlx]"')
pytest.importorskip("mlx_lm", reason='mlx-lm is not installed: pip install "genback[mlx]"')

from genback.llm import AsyncMlxLM  # noqa: E402

TOL = 1e-4  # adapter rows vs the fused model (W + s·(ab)ᵀ rounds differently from W, a, b apart)
PARAMS = {"rank": 4, "scale": 10.0, "dropout": 0.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from _hub_standins import _gpt2

    out = tmp_path_factory.mktemp("tiny_gpt2")
    _gpt2(out)
    return out


def _make_adapter(model_dir, out, seed, num_layers=2, params=PARAMS):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    model.freeze()
    linear_to_lora_layers(model, num_layers, params)
    mx.random.seed(seed)
    weights = {k: mx.random.normal(v.shape) * 0.05
               for k, v in tree_flatten(model.trainable_parameters())}
    assert weights and all(".lora_" in k for k in weights)
    out.mkdir()
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}))
    return out


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx_adapters")
    return {name: _make_adapter(model_dir, root / name, seed) for name, seed in (("a", 1), ("b", 2))}


def _fused(model_dir, adapter):
    """An AsyncMlxLM over the model with ``adapter`` fused into its weights (the reference)."""
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import load_adapters, load_model
    from transformers import AutoTokenizer

    model, _ = load_model(model_dir)
    model = load_adapters(model, str(adapter))
    fused = [(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]
    assert fused
    model.update_modules(tree_unflatten(fused))
    model.eval()
    return AsyncMlxLM(model, AutoTokenizer.from_pretrained(model_dir))


@pytest.fixture(scope="module")
def refs(model_dir, adapters):
    lms = {name: _fused(model_dir, path) for name, path in adapters.items()}
    yield lms
    for lm in lms.values():
        lm.close()


@pytest.fixture
def lm(model_dir):
    lm = AsyncMlxLM.from_name(str(model_dir))
    yield lm
    lm.close()


@pytest.fixture(scope="module")
def contexts(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = ["The capital of France is", "Once upon a time, in a small village",
             "def fibonacci(n):", "The capital of France is Paris"]
    return [tok.encode(t) for t in texts]


def test_rows_under_adapters_equal_fused_models_and_base_is_untouched(lm, adapters, refs, contexts):
    base_before = [lm.next_token_logprobs_uncached(c) for c in contexts]
    lm.add_new_lora(str(adapters["a"]), "a")
    lm.add_new_lora(str(adapters["b"]), "b")
    assert lm.lora_names == ["a", "b"]

    async def interleaved():
        jobs = [lm.next_token_logprobs(c, lora_name=name)
                for c in contexts for name in ("a", None, "b")]
        return await asyncio.gather(*jobs)

    rows = asyncio.run(interleaved())
    for i, c in enumerate(contexts):
        got_a, got_base, got_b = rows[3 * i: 3 * i + 3]
        assert torch.equal(got_base, base_before[i])  # bit-for-bit: no adapter on the base path
        assert (got_a - refs["a"].next_token_logprobs_uncached(c)).abs().max() < TOL
        assert (got_b - refs["b"].next_token_logprobs_uncached(c)).abs().max() < TOL
        assert (got_a - got_base).abs().max() > 1e-2 and (got_a - got_b).abs().max() > 1e-2
    # the uncached reference path and the sync form take the adapter too
    c = contexts[0]
    assert (lm.next_token_logprobs_uncached(c, lora_name="a") - rows[0]).abs().max() < 1e-4
    assert torch.equal(lm.next_token_logprobs_sync(c, lora_name="b"), rows[2])


def test_kv_reuse_is_per_adapter(lm, adapters, refs, contexts):
    lm.add_new_lora(str(adapters["a"]), "a")
    ctx = contexts[1]
    lm.next_token_logprobs_sync(ctx, lora_name="a")
    before = lm.tokens_forwarded
    row = lm.next_token_logprobs_sync(ctx + [13], lora_name="a")
    assert lm.tokens_forwarded - before == 1  # one token on top of the adapter's own KV
    assert (row - refs["a"].next_token_logprobs_uncached(ctx + [13])).abs().max() < TOL
    before = lm.tokens_forwarded
    base = lm.next_token_logprobs_sync(ctx + [13])  # the base never reads the adapter's KV
    assert lm.tokens_forwarded - before == len(ctx) + 1
    assert torch.equal(base, lm.next_token_logprobs_uncached(ctx + [13]))
    # cache_kv under the adapter pins its KV through clear_cache
    lm.cache_kv(contexts[2], lora_name="a")
    lm.clear_cache()
    before = lm.tokens_forwarded
    row = lm.next_token_logprobs_sync(contexts[2] + [13], lora_name="a")
    assert lm.tokens_forwarded - before == 1
    assert (row - refs["a"].next_token_logprobs_uncached(contexts[2] + [13])).abs().max() < TOL
    # score and token_logprobs under the adapter: one query, the rows' values
    lp, greedy = asyncio.run(lm.score(ctx, [13, 262], lora_name="a"))
    want = refs["a"].next_token_logprobs_uncached(ctx)[13]
    assert abs(float(lp[0]) - float(want)) < TOL and greedy.dtype == torch.bool


def test_replace_remove_and_errors(lm, adapters, refs, contexts, model_dir, tmp_path):
    c = contexts[2]
    lm.add_new_lora(str(adapters["a"]), "x")
    first = lm.next_token_logprobs_sync(c, lora_name="x")
    lm.add_new_lora(str(adapters["b"]), "x")  # re-registering replaces: rows and KV dropped
    second = lm.next_token_logprobs_sync(c, lora_name="x")
    assert (second - refs["b"].next_token_logprobs_uncached(c)).abs().max() < TOL
    assert (first - second).abs().max() > 1e-2
    lm.remove_lora("x")
    with pytest.raises(ValueError, match="lora_name"):
        lm.next_token_logprobs_sync(c, lora_name="x")
    with pytest.raises(ValueError, match="lora_name"):
        lm.remove_lora("x")
    with pytest.raises(TypeError, match="lora_name"):
        lm.add_new_lora(str(adapters["a"]), 3)
    with pytest.raises(ValueError, match="lora_path"):
        lm.add_new_lora(str(tmp_path / "missing"), "m")
    peft_like = tmp_path / "peft"
    peft_like.mkdir()
    (peft_like / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    with pytest.raises(ValueError, match="adapters.safetensors"):
        lm.add_new_lora(str(peft_like), "p")
    wide = _make_adapter(model_dir, tmp_path / "wide", seed=3, num_layers=1)
    with pytest.raises(ValueError, match="layout"):
        lm.add_new_lora(str(wide), "wide")  # the model's adapters wrap 2 layers
    assert lm.lora_names == []
