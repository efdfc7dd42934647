"""The decode step's fused projections (``decode/projections.py``, ``DecodeStep.fuse_projections``,
the default on CUDA): each layer's query, key and value weights, and its MLP's gate and up, laid
out once as blocks of one tensor (values, parameters and every other forward unchanged, saved
files the same), one product per group inside the step's forwards, never a second copy; an SMC
run with it answers as without it, on a random Llama and on the real SmolLM2."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from genback.llm import AsyncTransformer
from genback.llm.hf.cache import kv_pool
from genback.llm.hf.decode import projections, rope
from genback.llm.hf.decode.projections import FusedProjections, joined

from test_decode_step import CUDA, _llama, no_tf32  # noqa: F401 (a fixture)
from test_llm_tree import _smc_trace


class _Products(TorchDispatchMode):
    """Counts the matrix products a forward dispatches."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in (torch.ops.aten.linear, torch.ops.aten.mm,
                                              torch.ops.aten.addmm)
        return func(*args, **(kwargs or {}))


def _groups(model):
    return [[layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
            for layer in model.model.layers] + \
        [[layer.mlp.gate_proj, layer.mlp.up_proj] for layer in model.model.layers]


def _logits(model, ids, fused=None):
    with torch.inference_mode():
        if fused is None:
            return model(ids).logits
        with fused:
            return model(ids).logits


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_weights_become_blocks_of_one_tensor_and_other_forwards_are_unchanged(device, no_tf32):
    """After a FusedProjections: each group's parameters are the same objects with the same
    values, now consecutive blocks of one contiguous tensor (``joined`` finds it); the model's
    own forward gives the same logits bit for bit; inside ``with`` a layer runs 4 products for
    its 7 and the logits are within float32 rounding; a second instance copies nothing. On
    the CPU and on CUDA (fp32, TF32 off)."""
    model = _llama(300, device, torch.float32)
    ids = torch.randint(0, 300, (3, 11), generator=torch.Generator().manual_seed(1)).to(device)
    before = {id(p): p.detach().clone() for p in model.parameters()}
    params = [id(p) for p in model.parameters()]
    ref = _logits(model, ids)
    with _Products() as c:
        _logits(model, ids)
    plain_products = c.count

    fused = FusedProjections(model)
    assert fused.count == fused.relaid == 4  # (2 layers x attention and MLP)
    assert [id(p) for p in model.parameters()] == params
    for p in model.parameters():
        assert torch.equal(p.detach(), before[id(p)])
    for group in _groups(model):
        whole = joined([m.weight.detach() for m in group])
        assert whole is not None and whole.is_contiguous()
        assert whole.shape[0] == sum(m.out_features for m in group)
    assert torch.equal(_logits(model, ids), ref)

    with _Products() as c:
        got = _logits(model, ids, fused)
    assert c.count == plain_products - 3 * 2  # (2 fewer a layer's attention, 1 its MLP)
    assert float((got - ref).abs().max()) <= 1e-5
    assert all(not vars(m).get("forward") for g in _groups(model) for m in g)  # (put back)

    where = [m.weight.data_ptr() for g in _groups(model) for m in g]
    again = FusedProjections(model)
    assert again.count == 4 and again.relaid == 0
    assert [m.weight.data_ptr() for g in _groups(model) for m in g] == where


def test_save_pretrained_writes_the_same_tensors(tmp_path):
    """A model whose weights were joined saves the same tensors under the same names as before
    (transformers copies views that share a storage), and loads back to the same logits."""
    from transformers import LlamaForCausalLM

    model = _llama(300, "cpu", torch.float32)
    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(2))
    model.save_pretrained(tmp_path / "before")
    FusedProjections(model)
    model.save_pretrained(tmp_path / "after")
    a = load_file(tmp_path / "before" / "model.safetensors")
    b = load_file(tmp_path / "after" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    back = LlamaForCausalLM.from_pretrained(tmp_path / "after").eval()
    assert torch.equal(_logits(back, ids), _logits(model, ids))


def test_what_cannot_share_a_product_keeps_its_own():
    """A group with a hooked module, a module shared by two layers, and a module replaced after
    the weights were joined (as a LoRA wrapper would be) are not fused: their weights stay
    where they were, and inside ``with`` every layer's output is its own product's (equal to
    the model's forward without it, within rounding)."""
    model = _llama(300, "cpu", torch.float32)
    layer0, layer1 = model.model.layers
    layer0.self_attn.k_proj.register_forward_hook(lambda *a: None)
    layer1.mlp.up_proj = layer0.mlp.up_proj  # (one module in two groups)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(3))
    k_where = layer0.self_attn.k_proj.weight.data_ptr()
    fused = FusedProjections(model)
    assert fused.count == 1  # (layer 1's attention only)
    assert layer0.self_attn.k_proj.weight.data_ptr() == k_where
    ref = _logits(model, ids)
    assert float((_logits(model, ids, fused) - ref).abs().max()) <= 1e-5
    new_v = torch.nn.Linear(128, layer1.self_attn.v_proj.out_features, bias=False)
    new_v.weight.data.copy_(layer1.self_attn.v_proj.weight.detach() * 2)
    layer1.self_attn.v_proj = new_v  # (replaced: its product is its own)
    ref = _logits(model, ids)
    with _Products() as c:
        got = _logits(model, ids, fused)
    with _Products() as plain:
        _logits(model, ids)
    assert c.count == plain.count  # (nothing fused now)
    assert float((got - ref).abs().max()) <= 1e-5


def test_a_group_without_room_for_its_copy_stays_apart(monkeypatch):
    """When the joined copy of a group does not fit (``torch.cat`` raises the allocator's
    ``OutOfMemoryError``: here the second group's), that group keeps its weights where they were
    and its own products; the others are fused; the logits are the model's."""
    model = _llama(300, "cpu", torch.float32)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(5))
    ref = _logits(model, ids)
    cat, calls = torch.cat, []

    def tight_cat(tensors, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return cat(tensors, *args, **kwargs)
    mlp0 = model.model.layers[0].mlp  # (groups in module order: layer 0's attention, its MLP)
    where = [m.weight.data_ptr() for m in (mlp0.gate_proj, mlp0.up_proj)]
    monkeypatch.setattr(torch, "cat", tight_cat)
    fused = FusedProjections(model)
    monkeypatch.setattr(torch, "cat", cat)
    assert fused.count == fused.relaid == 3
    assert [m.weight.data_ptr() for m in (mlp0.gate_proj, mlp0.up_proj)] == where
    assert joined([mlp0.gate_proj.weight.detach(), mlp0.up_proj.weight.detach()]) is None
    assert float((_logits(model, ids, fused) - ref).abs().max()) <= 1e-5


def test_a_member_called_on_another_input_computes_its_own_product():
    """Inside ``with``, the key projection called on a tensor other than the one the query
    projection saw (or before it) returns its own product of that tensor; on the same tensor,
    its block of the group's product."""
    model = _llama(300, "cpu", torch.float32)
    fused = FusedProjections(model)
    attn = model.model.layers[0].self_attn
    x, y = torch.randn(2, 3, 128), torch.randn(2, 3, 128)
    with torch.inference_mode():
        want_kx, want_ky = attn.k_proj(x), attn.k_proj(y)
        with fused:
            k_first = attn.k_proj(x)
            attn.q_proj(x)
            k_same, k_other = attn.k_proj(x), attn.k_proj(y)
    for got, want in ((k_first, want_kx), (k_same, want_kx), (k_other, want_ky)):
        assert float((got - want).abs().max()) <= 1e-5
    assert k_same.data_ptr() != want_kx.data_ptr() and not k_same.is_contiguous()  # (a view)


def _smc_rows(lm, trace):
    lm.cache_kv(trace[0][0][:-1])

    async def run():
        return [torch.stack(await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts)))
                for contexts in trace]
    return asyncio.run(run())


@pytest.mark.parametrize("model_name", ["llama", "smollm2"])
def test_an_smc_run_with_fused_projections_answers_as_without(gpt2_tok, request, monkeypatch,
                                                              model_name):
    """SMC with resampling through the eager decode step on the CPU (where
    ``fuse_projections`` and ``rope_op`` are off by default), on a random Llama and on
    SmolLM2-135M: with fused projections every layer's groups run as one product at every step
    (counted), every row is within float32 rounding of the run without them and within 1e-4 of
    an uncached forward; with ``rope_op`` as well (CUDA's defaults) every layer's query and key
    are rotated together (counted), in place, so that each layer's new keys and values are
    written to the pool in one copy (counted), and every row equals the fused run's bit for
    bit."""
    model, tok = ((_llama(len(gpt2_tok), "cpu", torch.float32), gpt2_tok)
                  if model_name == "llama" else request.getfixturevalue("smol_hf"))
    layers = model.config.num_hidden_layers
    trace = _smc_trace(random.Random(4), 40, 8, 6, 2, 400)
    calls, joint, joint_writes = [], [], []
    real, real_joint = projections._Group.forwards, rope.joint_heads
    real_kv = kv_pool.consecutive_heads
    monkeypatch.setattr(projections._Group, "forwards",
                        lambda self: calls.append(1) or real(self))
    monkeypatch.setattr(rope, "joint_heads",
                        lambda *a: (lambda qk: joint.append(qk is not None) or qk)(real_joint(*a)))
    monkeypatch.setattr(kv_pool, "consecutive_heads",
                        lambda *a: (lambda kv: joint_writes.append(kv is not None) or kv)(
                            real_kv(*a)))
    rows = {}
    for fuse, rope_op in ((False, False), (True, False), (True, True)):
        lm = AsyncTransformer(model, tok, batch_window=0.05, row_cache_size=0, decode="eager")
        step = lm.runner.decode_step
        assert not step.fuse_projections and not step.rope_op  # (the CPU's defaults)
        step.fuse_projections, step.rope_op = fuse, rope_op
        try:
            rows[fuse, rope_op] = got = _smc_rows(lm, trace)
            assert lm.cache_info()["decode_steps"] == len(trace)
            assert len(calls) == (2 * layers * len(trace) if fuse else 0)
            assert joint == ([True] * layers * len(trace) if rope_op else [])
            # (rotated in place: each step's keys and values written in one copy a layer)
            assert sum(joint_writes) == (layers * len(trace) if rope_op else 0)
            for j in (0, len(trace[-1]) - 1):
                ref = lm.next_token_logprobs_uncached(trace[-1][j])
                assert float((got[-1][j] - ref).abs().max()) <= 1e-4
        finally:
            lm.close()
        calls.clear()
        joint.clear()
        joint_writes.clear()
    for a, b, c in zip(rows[False, False], rows[True, False], rows[True, True]):
        assert float((a - b).abs().max()) <= 1e-5
        assert torch.equal(b, c)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_other_families_fused_answer_as_uncached(gpt2_tok, family):
    """Families whose groups differ from Llama's: Qwen2 (q/k/v with biases: joined too) and
    Qwen3 (a norm on the query's and key's heads after their products). An SMC run through the
    eager decode step with CUDA's defaults (fused projections, the norm and RoPE ops): every
    group fused, every row of the last step within 1e-4 of an uncached forward."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=len(gpt2_tok), hidden_size=128, intermediate_size=256,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=4096)
    model = (Qwen2ForCausalLM(Qwen2Config(**shape)) if family == "qwen2"
             else Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=32))).eval()
    with torch.no_grad():  # (transformers initialises biases to 0: give them values)
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.5)
    trace = _smc_trace(random.Random(5), 40, 8, 4, 2, 400)
    lm = AsyncTransformer(model, gpt2_tok, batch_window=0.05, row_cache_size=0, decode="eager")
    step = lm.runner.decode_step
    step.fuse_projections = step.rope_op = step.norm_op = True
    try:
        rows = _smc_rows(lm, trace)
        assert lm.cache_info()["decode_steps"] == len(trace)
        assert step._projections.count == 4
        attn = model.model.layers[0].self_attn
        if family == "qwen2":  # (the biases are blocks of one tensor as well)
            assert joined([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]) is not None
        for j in range(len(trace[-1])):
            ref = lm.next_token_logprobs_uncached(trace[-1][j])
            assert float((rows[-1][j] - ref).abs().max()) <= 1e-4
    finally:
        lm.close()
