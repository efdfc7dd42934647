"""The decode step's RoPE (``decode/rope.py``, ``DecodeStep.rope_op``, the default on CUDA):
transformers' half-split rotary embedding bit for bit in fewer operators, swapped in for the
model's modeling modules only during the step's forwards and put back after, whichever thread
and however nested; an SMC run with it answers exactly as without it."""

from __future__ import annotations

import asyncio
import importlib
import random
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.llama import modeling_llama

from genback.llm import AsyncTransformer
from genback.llm.hf.decode import rope
from genback.llm.hf.decode.rope import (RopeOp, apply_rotary_pos_emb, is_half_split_rope,
                                            joint_heads)

from test_decode_step import CUDA, _llama
from test_llm_tree import _smc_trace

LLAMAS = modeling_llama.apply_rotary_pos_emb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_rope_is_transformers_bit_for_bit(device, dtype):
    """Every shape a forward passes (one new token or several, heads before the positions as a
    transposed view or after them: ``unsqueeze_dim`` 1 or 2, an odd head size), every float
    dtype, on the CPU and on CUDA (its own kernels): the same values as Llama's
    ``apply_rotary_pos_emb``, bit for bit (random inputs, scaled so that products round)."""
    g = torch.Generator().manual_seed(0)
    for D in (64, 8, 7):
        for T in (1, 5):
            for dim in (1, 2):
                q = (torch.randn(3, T, 4, D, generator=g) * 7).to(device, dtype)
                k = (torch.randn(3, T, 2, D, generator=g) * 7).to(device, dtype)
                if dim == 1:  # (heads first, as attention layers make them: a transposed view)
                    q, k = q.transpose(1, 2), k.transpose(1, 2)
                cos, sin = (torch.randn(3, T, D, generator=g).to(device, dtype)
                            for _ in range(2))
                want = LLAMAS(q, k, cos, sin, unsqueeze_dim=dim)
                got = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=dim)
                for a, b in zip(got, want):
                    assert a.dtype == b.dtype and a.shape == b.shape
                    assert torch.equal(a, b), (D, T, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_rope_of_one_products_query_and_key_is_transformers_bit_for_bit(device, dtype):
    """The query and the key as an attention layer views them from one product of the fused
    projections (``[B, T, (Hq + Hk + Hv) * D]``: heads after the positions, transposed or not):
    rotated together (``joint_heads`` finds them; the kernels of one tensor, counted: 4 for
    the 8 of two) to the same values as Llama's ``apply_rotary_pos_emb``, bit for bit. Tensors
    that only look alike (another product's key, a key not right after the query) are rotated
    apart, with the same values."""
    g = torch.Generator().manual_seed(1)
    B, Hq, Hk, D = 3, 4, 2, 64
    for T, dim in ((1, 1), (1, 2), (2, 1), (2, 2)):  # (one new token: a decode step's)
        y = (torch.randn(B, T, (Hq + 2 * Hk) * D, generator=g) * 7).to(device, dtype)
        cos, sin = (torch.randn(B, T, D, generator=g).to(device, dtype) for _ in range(2))
        q = y[..., :Hq * D].view(B, T, Hq, D)
        k = y[..., Hq * D:(Hq + Hk) * D].view(B, T, Hk, D)
        v = y[..., (Hq + Hk) * D:].view(B, T, Hk, D)
        if dim == 1:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        assert joint_heads(q, k, dim) is not None
        assert joint_heads(q, v, dim) is None and joint_heads(k, q, dim) is None
        assert joint_heads(q, k.clone(), dim) is None
        want = LLAMAS(q, k, cos, sin, unsqueeze_dim=dim)
        with _Ops() as c:
            got = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=dim)
        assert len(c.ops) == 2 + 4  # (the signed sine, made outside a RopeOp: 2)
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.equal(a, b), dim
        apart = apply_rotary_pos_emb(q, k.clone(), cos, sin, unsqueeze_dim=dim)
        for a, b in zip(apart, want):
            assert torch.equal(a, b), dim


def test_rope_of_one_products_query_and_key_rotates_in_place_only_in_genbacks_forward(gpt2_tok):
    """Inside a RopeOp's ``with`` with autograd off (genback's decode-step forward) the query
    and key of one product are rotated into the product's own columns (the results are views of
    it; the value's columns untouched), bit for bit Llama's values; outside the ``with``
    (another thread's forward while the function is swapped) or with autograd on, new tensors,
    the product left as it was."""
    g = torch.Generator().manual_seed(2)
    B, Hq, Hk, D = 3, 4, 2, 16
    cos, sin = (torch.randn(B, 1, D, generator=g) for _ in range(2))
    model = _llama(len(gpt2_tok), "cpu", torch.float32)

    def heads(y):
        q, k, v = (y[..., a * D:b * D].view(B, 1, b - a, D).transpose(1, 2)
                   for a, b in ((0, Hq), (Hq, Hq + Hk), (Hq + Hk, Hq + 2 * Hk)))
        return q, k, v

    for inside, grad in ((True, False), (False, False), (True, True)):
        y = torch.randn(B, 1, (Hq + 2 * Hk) * D, generator=g, requires_grad=grad)
        before = y.detach().clone()
        q, k, v = heads(y)
        want = LLAMAS(q, k, cos, sin)
        with torch.set_grad_enabled(grad):
            if inside:
                with RopeOp(model):
                    got = apply_rotary_pos_emb(q, k, cos, sin)
            else:
                got = apply_rotary_pos_emb(q, k, cos, sin)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        in_place = inside and not grad
        assert (got[1].data_ptr() == k.data_ptr()) == in_place
        assert torch.equal(y.detach()[..., (Hq + Hk) * D:], before[..., (Hq + Hk) * D:])
        if in_place:
            q0, k0, _ = heads(before)
            assert torch.equal(q, want[0]) and torch.equal(k, want[1])
            assert not torch.equal(q0, want[0])
        else:
            assert torch.equal(y.detach(), before)
        if grad:  # (autograd still works through the rotation)
            sum(t.sum() for t in got).backward()
            assert y.grad is not None


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket not in (torch.ops.aten.unsqueeze, torch.ops.aten.slice,
                                       torch.ops.aten.as_strided):
            self.ops.append(func.overloadpacket.__name__)  # (views launch no kernel)
        return func(*args, **(kwargs or {}))


def test_rope_runs_two_operators_fewer_a_layer(gpt2_tok):
    """Inside a RopeOp's ``with`` (genback's forward), a layer's RoPE (query and key)
    dispatches 8 operators where transformers' dispatches 10, once the forward's signed sine is
    made (by the first layer: 2 more, once); a new ``sin`` tensor (the next forward's) makes a
    new one. Outside it (another thread's forward while the function is swapped) nothing is
    kept: a ``sin`` whose values changed in place gives the new values' rotation."""
    q, k = torch.randn(4, 4, 1, 64), torch.randn(4, 2, 1, 64)
    cos, sin = torch.randn(4, 1, 64), torch.randn(4, 1, 64)
    counts = []
    with RopeOp(_llama(len(gpt2_tok), "cpu", torch.float32)):
        for fn, s in ((LLAMAS, sin), (apply_rotary_pos_emb, sin), (apply_rotary_pos_emb, sin),
                      (apply_rotary_pos_emb, sin.clone())):
            with _Ops() as c:
                fn(q, k, cos, s)
            counts.append(len(c.ops))
    assert counts == [10, 10, 8, 10]
    with _Ops() as c:
        apply_rotary_pos_emb(q, k, cos, sin)
    assert len(c.ops) == 10
    sin.mul_(-0.5)  # (a buffer reused with new values)
    for a, b in zip(apply_rotary_pos_emb(q, k, cos, sin), LLAMAS(q, k, cos, sin)):
        assert torch.equal(a, b)


def test_the_half_split_check_takes_llamas_copies_and_no_other_form():
    """Families whose RoPE is Llama's code (Mistral, Qwen2, Qwen3, Granite) pass the check;
    Phi-3's (a partial rotation inside the function) and GPT-J's (pairs of neighbours) do not,
    nor anything outside transformers."""
    for family in ("llama", "mistral", "qwen2", "qwen3", "granite"):
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        assert is_half_split_rope(module.apply_rotary_pos_emb), family
    for family in ("phi3", "gptj"):
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        fn = getattr(module, "apply_rotary_pos_emb", None)
        assert fn is not None and not is_half_split_rope(fn), family
    assert not is_half_split_rope(apply_rotary_pos_emb)  # (genback's own: not transformers')
    assert not is_half_split_rope(lambda q, k, cos, sin, unsqueeze_dim=1: (q, k))


def test_rope_op_swaps_during_the_with_and_puts_back_after_the_last(gpt2_tok):
    """A Llama's RopeOp serves its 2 attention layers through Llama's modeling module: inside
    ``with`` the module's function is genback's, after it Llama's again; nested and
    interleaved ``with`` s of two models put it back only at the last exit; a function
    replaced by someone else is left as it is (and a RopeOp made then serves nothing)."""
    a, b = (RopeOp(_llama(len(gpt2_tok), "cpu", torch.float32)) for _ in range(2))
    assert a.count == b.count == 2 and a.modules == [modeling_llama.__name__]
    with a:
        assert modeling_llama.apply_rotary_pos_emb is apply_rotary_pos_emb
        with b:
            with a:
                assert modeling_llama.apply_rotary_pos_emb is apply_rotary_pos_emb
        assert modeling_llama.apply_rotary_pos_emb is apply_rotary_pos_emb
    assert modeling_llama.apply_rotary_pos_emb is LLAMAS and not rope._SWAPPED
    assert getattr(rope._local, "last", None) is None  # (nothing of a forward kept)
    with pytest.raises(KeyError):  # (an error inside still puts it back)
        with a:
            raise KeyError("x")
    assert modeling_llama.apply_rotary_pos_emb is LLAMAS

    def theirs(q, k, cos, sin, unsqueeze_dim=1):
        return LLAMAS(q, k, cos, sin, unsqueeze_dim)
    modeling_llama.apply_rotary_pos_emb = theirs
    try:
        assert RopeOp(_llama(len(gpt2_tok), "cpu", torch.float32)).count == 0
        with a:  # (made before: it checks again, and leaves theirs)
            assert modeling_llama.apply_rotary_pos_emb is theirs
        assert modeling_llama.apply_rotary_pos_emb is theirs and not rope._SWAPPED
    finally:
        modeling_llama.apply_rotary_pos_emb = LLAMAS


def test_rope_op_from_many_threads_leaves_llamas_function(gpt2_tok):
    """Eight threads, each with its own RopeOp, entering and leaving 200 times at once: the
    module's function is genback's whenever one is inside, and Llama's at the end."""
    model = _llama(len(gpt2_tok), "cpu", torch.float32)
    ops = [RopeOp(model) for _ in range(8)]
    start, wrong = threading.Barrier(len(ops)), []

    def work(op):
        start.wait()
        for _ in range(200):
            with op:
                if modeling_llama.apply_rotary_pos_emb is not apply_rotary_pos_emb:
                    wrong.append(1)
    threads = [threading.Thread(target=work, args=(op,)) for op in ops]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong and modeling_llama.apply_rotary_pos_emb is LLAMAS and not rope._SWAPPED


def test_an_smc_run_with_rope_op_answers_bit_for_bit_as_without(gpt2_tok, monkeypatch):
    """SMC with resampling on a Llama (fp32), the eager decode step on the CPU (where
    ``rope_op`` is off by default): with it on, every layer's RoPE of every step runs through
    genback's (counted) and every row equals the run without it exactly, and an uncached
    forward within 1e-4; after the run the model's module has Llama's function."""
    model = _llama(len(gpt2_tok), "cpu", torch.float32)
    trace = _smc_trace(random.Random(3), 40, 8, 6, 2, 400)
    calls = []
    monkeypatch.setattr(rope, "apply_rotary_pos_emb",
                        lambda *a, **k: calls.append(1) or apply_rotary_pos_emb(*a, **k))
    rows = {}
    for on in (True, False):
        lm = AsyncTransformer(model, gpt2_tok, batch_window=0.05, row_cache_size=0,
                              decode="eager")
        step = lm.runner.decode_step
        assert not step.rope_op  # (the CPU's default)
        step.rope_op = on
        try:
            lm.cache_kv(trace[0][0][:-1])

            async def run():
                return [torch.stack(await asyncio.gather(
                    *(lm.next_token_logprobs(c) for c in contexts))) for contexts in trace]
            rows[on] = asyncio.run(run())
            assert lm.cache_info()["decode_steps"] == len(trace)
            assert len(calls) == (2 * len(trace) if on else 0)
            assert (step._rope.count == 2) if on else step._rope is None
            assert modeling_llama.apply_rotary_pos_emb is LLAMAS
            for j in (0, len(trace[-1]) - 1):
                ref = lm.next_token_logprobs_uncached(trace[-1][j])
                assert float((rows[on][-1][j] - ref).abs().max()) <= 1e-4
        finally:
            lm.close()
        calls.clear()
    for a, b in zip(rows[True], rows[False]):
        assert torch.equal(a, b)
