"""The decode step's compiled pieces (``DecodeStep.fused``): the RMSNorms (``decode/fused.py``),
transformers' own computation swapped in only during the step's forwards, and the cascade's merge
(``cascade.merge_levels``); and its norms through torch's ``rms_norm`` operator
(``DecodeStep.norm_op``, the default on CUDA); an SMC run with either answers as the tree path
and an uncached forward do."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import random

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from genback.llm import AsyncTransformer
from genback.llm.hf.decode import cascade
from genback.llm.hf.decode import fused as fused_norms
from genback.llm.hf.decode.fused import NORMS, FusedNorms, rms_norm, rms_norm_op

from test_decode_step import _llama
from test_llm_tree import _smc_trace


def test_every_listed_norm_is_llamas_and_rms_norm_computes_it():
    """Each class in ``NORMS`` has Llama's ``forward``, token for token, in the installed
    transformers (a release that changes one must take it off the list); :func:`rms_norm`
    (uncompiled) equals ``LlamaRMSNorm`` bit for bit in float32 and bf16, and
    :func:`rms_norm_op` (torch's operator) within float32's rounding of it (in bf16: the same
    bf16 values but where a float32 rounding tips one, a bf16 unit)."""
    ref = inspect.getsource(LlamaRMSNorm.forward)
    for name in NORMS:
        family = name[: -len("RMSNorm")].lower()
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        assert inspect.getsource(getattr(module, name).forward) == ref, name
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        norm = LlamaRMSNorm(64, eps=1e-5).to(dtype)
        norm.weight.data.normal_()
        x = torch.randn(3, 1, 64, dtype=dtype)
        assert torch.equal(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x)), dtype
        x = torch.randn(64, 1, 64, dtype=dtype) * 3
        want, got = norm(x), rms_norm_op(x, norm.weight, norm.variance_epsilon)
        assert got.dtype == want.dtype == dtype
        want, got = want.float(), got.float()
        unit = 2e-6 if dtype == torch.float32 else 2 ** -7  # (float32's, bf16's relative unit)
        assert torch.all((got - want).abs() <= unit * want.abs())
        assert float((got != want).float().mean()) <= (0.5 if dtype == torch.float32 else 0.02)


def test_fused_step_answers_as_the_tree_path_and_leaves_the_model_as_it_was(gpt2_tok,
                                                                          monkeypatch):
    """SMC with resampling on a Llama (fp32), level 0 kept for its 40-token prompt: with
    ``fused`` every step runs the decode step with the model's 5 norms (2 a layer and the last)
    and each layer's merge of the cascade's levels through the compiled functions (counted),
    and with ``norm_op`` (off by default on the CPU) its norms through torch's operator
    (counted); each row within 1e-5 of
    the tree path's and 1e-4 of an uncached forward; between forwards the model's norms are its
    own again (no instance ``forward`` left)."""
    model = _llama(len(gpt2_tok), "cpu", torch.float32)
    trace = _smc_trace(random.Random(7), 40, 8, 6, 2, 400)
    rows, calls, merges = {}, [], []  # (the spies' counts, cleared after each mode)
    for mode in ("fused", "normop", "off"):
        lm = AsyncTransformer(model, gpt2_tok, batch_window=0.05, row_cache_size=0,
                              decode="off" if mode == "off" else "eager")
        if mode == "fused":  # (each forward's 5 norms and 2 merges through the compiled code)
            step = lm.runner.decode_step
            step.level0_min_tokens = step.level0_min_saved = 0
            step.fused, step._norms = True, FusedNorms(model)
            compiled = step._norms._norm
            step._norms._norm = lambda *a: calls.append(1) or compiled(*a)
            merge = cascade._compiled_merge()
            monkeypatch.setattr(cascade, "_MERGE", lambda *a: merges.append(1) or merge(*a))
        if mode == "normop":  # (the operator's norm, counted; none compiled)
            step = lm.runner.decode_step
            step.level0_min_tokens = step.level0_min_saved = 0
            assert not step.norm_op and not step.fused  # (the CPU's default)
            step.norm_op = True
            monkeypatch.setattr(fused_norms, "rms_norm_op",
                                lambda *a: calls.append(1) or rms_norm_op(*a))
        try:
            lm.cache_kv(trace[0][0][:-1])

            async def run():
                out = []
                for contexts in trace:
                    out.append(torch.stack(await asyncio.gather(
                        *(lm.next_token_logprobs(c) for c in contexts))))
                return out
            rows[mode] = asyncio.run(run())
            info = lm.cache_info()
            if mode != "off":
                assert info["decode_steps"] == len(trace)
                assert step._norms.count == 5 and len(calls) == 5 * info["decode_steps"]
                assert step._norms.compiled == (mode == "fused")
                assert len(merges) == (2 * info["decode_steps"] if mode == "fused" else 0)
                calls.clear()
                merges.clear()
            norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
            assert len(norms) == 5 and not any("forward" in vars(m) for m in norms)
            for j in (0, len(trace[-1]) - 1):
                ref = lm.next_token_logprobs_uncached(trace[-1][j])
                assert float((rows[mode][-1][j] - ref).abs().max()) <= 1e-4
        finally:
            lm.close()
    for mode in ("fused", "normop"):
        for a, b in zip(rows[mode], rows["off"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
