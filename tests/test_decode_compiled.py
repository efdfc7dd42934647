"""The decode step's per-layer glue compiled (``DecodeStep.compile``, ``decode/compiled.py``):
each compiled function one graph (``fullgraph=True``), reused by every layer, and equal to its
eager form; an SMC run with ``compile`` answers as the uncompiled step and an uncached forward
do, the model left as it was; on CUDA the captured graphs with the compiled code are verified at
their first replay, fp32 within 1e-4 of uncached, bf16 no worse than the dense path.

Compiling takes seconds on the CPU (inductor's C++): a 2-layer model only."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm

from genback.llm import AsyncTransformer
from genback.llm.hf.decode import cascade, compiled, rope
from genback.llm.hf.decode.fused import rms_norm

from test_decode_step import CUDA, _llama, _steps, no_tf32  # noqa: F401 (a fixture)
from test_llm_tree import _smc_trace

NAMES = ("rms_norm", "add_rms_norm", "silu_mul", "rotate")
EAGER = {"rms_norm": rms_norm, "add_rms_norm": compiled.add_rms_norm,
         "silu_mul": compiled.silu_mul, "rotate": compiled.rotate}
# CUDA's defaults (the compiled glue is written for them: the joint RoPE needs the fused product)
DEFAULTS = ("norm_op", "rope_op", "fuse_projections", "keep_level0")


def _inputs(name: str, rows: int, dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(rows)

    def t(*shape):
        return torch.randn(*shape, generator=g).to(dtype)
    if name == "rms_norm":
        return t(rows, 1, 64), t(64), 1e-5
    if name == "add_rms_norm":
        return t(rows, 1, 64), t(rows, 1, 64), t(64), 1e-5
    if name == "silu_mul":
        return t(rows, 1, 96), t(rows, 1, 96)
    return t(rows, 6, 1, 32), t(rows, 1, 1, 32), t(rows, 1, 1, 32), 16


def _entries(fn) -> int:
    """The compiled graphs dynamo keeps for the code of ``fn``."""
    return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__))


def test_each_compiled_function_is_one_graph_for_all_rows_and_equals_its_eager_form():
    """Each function compiles with ``fullgraph=True`` (a graph break would raise), to at most
    two graphs over four row counts (a static one, then one with dynamic sizes: not one per
    bucket; one more for bf16), and computes its eager form's values: float32 within its
    rounding, bf16 within a bf16 unit (the compiled kernel rounds once where the eager code
    rounds each operator)."""
    with torch.inference_mode():
        for name in NAMES:
            fn = compiled.compiled(name)
            before = _entries(EAGER[name])  # (other tests' shapes may have compiled it)
            assert fn is compiled.compiled(name)  # (one per process)
            for dtype, unit, counts in ((torch.float32, 1e-6, (1, 4, 16, 64)),
                                        (torch.bfloat16, 2 ** -7, (16,))):
                for rows in counts:
                    args = _inputs(name, rows, dtype)
                    got, want = fn(*args), EAGER[name](*args)
                    for a, b in zip(*((got, want) if isinstance(got, tuple)
                                      else ((got,), (want,)))):
                        assert a.dtype == b.dtype == dtype and a.shape == b.shape
                        scale = max(1.0, float(b.float().abs().max()))
                        assert float((a.float() - b.float()).abs().max()) <= 2 * unit * scale
            assert _entries(EAGER[name]) - before <= 3, name


def _counted(monkeypatch) -> dict:
    """Spies on the compiled functions (and the cascade's merge): calls per name."""
    calls = dict.fromkeys(NAMES + ("merge",), 0)

    def spy(name, fn):
        def counted(*args):
            calls[name] += 1
            return fn(*args)
        return counted
    for name in NAMES:
        monkeypatch.setitem(compiled._COMPILED, name, spy(name, compiled.compiled(name)))
    monkeypatch.setattr(cascade, "_MERGE", spy("merge", cascade._compiled_merge()))
    return calls


def _smc(lm, trace, compile_: bool, level0: bool = True):
    step = lm.runner.decode_step
    for name in DEFAULTS:
        setattr(step, name, True)
    if level0:  # (level 0 for a short prompt: the merge runs)
        step.level0_min_tokens = step.level0_min_saved = 0
    step.compile = compile_
    lm.cache_kv(trace[0][0][:-1])
    return _steps(lm, trace)


def test_compiled_step_answers_as_the_uncompiled_step_and_leaves_the_model_as_it_was(
        gpt2_tok, monkeypatch):
    """SMC with resampling on a 2-layer Llama (fp32) through the eager decode step with CUDA's
    defaults, ``compile`` on and off: every forward runs each layer's input norm, residual and
    MLP norm, MLP product and RoPE, the model's last norm and each layer's merge through the
    compiled functions (counted); rows within 1e-5 of the uncompiled step's, within 1e-4 of an
    uncached forward; between forwards the model's modules and RoPE are its own again."""
    model = _llama(len(gpt2_tok), "cpu", torch.float32)
    trace = _smc_trace(random.Random(7), 40, 8, 6, 2, 400)
    calls = _counted(monkeypatch)
    rows = {}
    for mode in (True, False):
        lm = AsyncTransformer(model, gpt2_tok, batch_window=0.05, row_cache_size=0,
                              decode="eager")
        try:
            assert lm.runner.decode_step.compile is False  # (the default, CPU and CUDA)
            rows[mode] = _smc(lm, trace, mode)
            steps = lm.cache_info()["decode_steps"]
            assert steps == len(trace)
            layers = lm.runner.decode_step._layers
            if mode:
                assert layers.layers == 2 and layers.mlps == 2
            # (the first layer's input norm and the last; the second layer's input norm with
            # the first's last residual addition)
            want = dict.fromkeys(NAMES, 2 * steps) | {"rms_norm": 2 * steps,
                                                      "add_rms_norm": 3 * steps,
                                                      "merge": 2 * steps}
            assert calls == (want if mode else dict.fromkeys(calls, 0)), mode
            for j in (0, len(trace[-1]) - 1):
                ref = lm.next_token_logprobs_uncached(trace[-1][j])
                assert float((rows[mode][-1][j] - ref).abs().max()) <= 1e-4
        finally:
            lm.close()
        calls.update(dict.fromkeys(calls, 0))
        for m in model.modules():
            if isinstance(m, (LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm)):
                assert "forward" not in vars(m)
        assert getattr(rope._local, "rotate", None) is None
    for a, b in zip(rows[True], rows[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_qwen3_compiled_answers_as_uncached(gpt2_tok):
    """Qwen3 (its layers' and MLPs' forwards are Llama's code; a norm on the query's and key's
    heads, its own head size): an SMC run through the eager decode step with ``compile``, every
    layer and MLP swapped, the last step's rows within 1e-4 of an uncached forward."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(gpt2_tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=4096)).eval()
    trace = _smc_trace(random.Random(5), 40, 8, 4, 2, 400)
    lm = AsyncTransformer(model, gpt2_tok, batch_window=0.05, row_cache_size=0, decode="eager")
    try:
        rows = _smc(lm, trace, True)
        layers = lm.runner.decode_step._layers
        assert lm.cache_info()["decode_steps"] == len(trace)
        assert layers.layers == 2 and layers.mlps == 2
        for j in range(len(trace[-1])):
            ref = lm.next_token_logprobs_uncached(trace[-1][j])
            assert float((rows[-1][j] - ref).abs().max()) <= 1e-4
    finally:
        lm.close()


def test_what_does_not_compute_llamas_glue_keeps_its_own(gpt2_tok):
    """A layer whose norm has a hook, and an MLP whose activation is not SiLU, are not swapped;
    the rest are."""
    model = _llama(len(gpt2_tok), "cpu", torch.float32)
    first, second = model.model.layers
    first.post_attention_layernorm.register_forward_hook(lambda *a: None)
    second.mlp.act_fn = torch.nn.GELU()
    layers = compiled.CompiledLayers(model)
    assert layers._layers == [second] and layers._mlps == [first.mlp]
    assert layers._next == [None]  # (the last layer computes no next norm)
    model = _llama(len(gpt2_tok), "cpu", torch.float32)  # (a hook between two layers: each
    model.model.layers[0].register_forward_hook(lambda *a: None)  # layer its own input norm)
    assert compiled.CompiledLayers(model)._next == [None, None]


def test_a_swapped_layer_answers_as_its_own_forward_by_name_and_by_position(gpt2_tok):
    """Inside ``with layers:`` a decoder layer called as this transformers release's model calls
    it (all but the hidden states by name, the cache under the release's own name) and with its
    arguments by position (its own forward then) returns its own forward's values (float32)."""
    import inspect as _inspect
    model = _llama(len(gpt2_tok), "cpu", torch.float32)
    layer = model.model.layers[0]
    layers = compiled.CompiledLayers(model)
    assert layers.layers == 2 and layers.mlps == 2  # (this release's Llama code is known)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 5, 128, generator=g)
    positions = torch.arange(5).expand(2, 5)
    rotary = model.model.rotary_emb(h, positions)
    names = list(_inspect.signature(_inspect.unwrap(type(layer).forward)).parameters)
    cache = names[4]  # (self, hidden_states, attention_mask, position_ids, the cache, ...)
    assert cache in ("past_key_values", "cache")
    kwargs = {"attention_mask": None, "position_ids": positions, cache: None,
              "use_cache": False, "position_embeddings": rotary}
    with torch.no_grad():
        own = layer(h, **kwargs)
        with layers:
            assert "forward" in vars(layer)
            by_name = layer(h, **kwargs)
            by_position = layer(h, None, positions, None, False, rotary)
        assert "forward" not in vars(layer)
    assert float((by_name - own).abs().max()) <= 1e-5
    assert torch.equal(by_position, own)


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_compiled_steps_are_verified_and_exact(gpt2_tok, no_tf32, dtype):  # noqa: F811
    """On CUDA, ``compile`` on with the captured graphs (compiled in each bucket's eager first
    step and warm-up, then captured): every capture verified at its first replay, none
    rejected; fp32 (TF32 off) within 1e-4 of an uncached forward and within 5e-5 of the
    uncompiled captured step; bf16 no further from the fp32 model's rows than 2x an uncached
    bf16 forward (the dense path)."""
    model = _llama(len(gpt2_tok), "cuda", dtype)
    trace = _smc_trace(random.Random(9), 300, 16, 8, 2, 400)  # (level 0 kept: >= 256 tokens)
    rows = {}
    for mode in (True, False):
        lm = AsyncTransformer(model, gpt2_tok, batch_window=0.05, row_cache_size=0,
                              decode="graphs", row_device="cpu")
        try:
            rows[mode] = _smc(lm, trace, mode, level0=False)
            info = lm.cache_info()
            assert info["decode_replays"] + info["decode_eager_steps"] == len(trace)
            assert info["decode_captures"] >= 1 and info["decode_graphs_rejected"] == 0
            assert info["decode_graphs_verified"] == info["decode_captures"]
            if dtype == torch.float32:
                for j in (0, len(trace[-1]) - 1):
                    ref = lm.next_token_logprobs_uncached(trace[-1][j]).float().cpu()
                    assert float((rows[mode][-1][j] - ref).abs().max()) <= 1e-4
        finally:
            lm.close()
    if dtype == torch.float32:  # (Triton's reductions may sum in another order than torch's)
        for a, b in zip(rows[True], rows[False]):
            torch.testing.assert_close(a, b, rtol=0, atol=5e-5)
        return
    model32 = _llama(len(gpt2_tok), "cuda", torch.float32)
    with torch.inference_mode():
        for j in (0, len(trace[-1]) - 1):
            ids = torch.tensor([trace[-1][j]], device="cuda")
            ref = torch.log_softmax(model32(ids).logits[0, -1].float(), -1).cpu()
            dense = torch.log_softmax(model(ids).logits[0, -1].float(), -1).cpu()
            assert (rows[True][-1][j] - ref).abs().max() <= 2 * (dense - ref).abs().max()
