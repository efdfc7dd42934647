"""RMSNorms with fewer kernels for the decode step: ``DecodeStep.norm_op`` (torch's own
``rms_norm`` operator, eager; on by default on CUDA) and part of ``DecodeStep.fused`` (compiled;
off by default; the other part is the cascade's compiled merge, :func:`.cascade.merge_levels`).

A captured decode step on a GPU is bound at small row counts by the number of kernels, not by
their work (``benchmarks/RESULTS.md``, "Issue 38, part 1 on an H100": an 8B Llama step at 16
rows spends ~3.9 ms of 10.8 in small kernels). transformers' RMSNorm runs 8 of them per call
(a cast to float32, a square, a mean, an add, a reciprocal square root, a product, a cast back,
the weight's product), 65 calls per step on the 8B shape. :func:`rms_norm` is that computation
written out, compiled by ``torch.compile`` for ``fused`` (inductor fuses it into one or two
kernels); :func:`rms_norm_op` is the same through ``torch.nn.functional.rms_norm``, whose CUDA
implementation is one fused kernel (``aten::_fused_rms_norm``, PyTorch 2.8 and newer),
followed by the weight's product: two kernels, no compilation. :class:`FusedNorms` swaps one of
them in for the model's RMSNorms while the decode step runs its forward (warm-ups and captures:
a replay runs what was captured), leaving the model as it was after each forward.

Only norms whose class computes exactly this are swapped: those named in :data:`NORMS` (the
transformers classes whose ``forward`` is Llama's; Gemma's ``1 + weight`` form is not).
"""

from __future__ import annotations

import torch

NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm",
                   "Phi3RMSNorm", "GraniteRMSNorm"})
"""transformers' RMSNorm classes whose ``forward`` is :func:`rms_norm` (weight times the
normalised input cast back)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm (Zhang and Sennrich 2019): ``weight * (x / sqrt(mean(x^2) +
    eps))`` over the last dimension, computed in float32 and cast back to ``x``'s dtype before
    the weight's product. ``x`` ``[..., H]``, ``weight`` ``[H]``; returns ``x``'s shape, of the
    product's dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` through ``torch.nn.functional.rms_norm`` without a weight (which
    computes a half-precision input in float32 and casts the result back, as transformers'
    norm does before the weight's product), then the weight's product: on CUDA two kernels."""
    return weight * torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=eps)


class FusedNorms:
    """The model's :data:`NORMS` modules, and the norm that replaces theirs: :func:`rms_norm`
    compiled once for all of them (``compiled`` True; ``norm``: that compiled function, made
    by the caller), or :func:`rms_norm_op` (False).

    Use ``with fused:`` around a forward: each norm's ``forward`` is that function for
    its duration (an instance attribute, deleted on exit, so the class's is back). ``count``:
    how many norms are swapped (0: nothing to fuse, the context does nothing).
    """

    def __init__(self, model: torch.nn.Module, compiled: bool = True, norm=None):
        self.modules = [m for m in model.modules()
                        if type(m).__name__ in NORMS and "forward" not in vars(m)
                        and isinstance(getattr(m, "weight", None), torch.Tensor)
                        and isinstance(getattr(m, "variance_epsilon", None), float)]
        self.count = len(self.modules)
        self.compiled = compiled
        self._norm = None
        if self.count:  # (norm: the decode step's one compiled rms_norm, .compiled's)
            self._norm = norm or (torch.compile(rms_norm, dynamic=None) if compiled
                                  else rms_norm_op)

    def __enter__(self) -> "FusedNorms":
        fn = self._norm
        for m in self.modules:
            m.forward = (lambda w, e: lambda x: fn(x, w, e))(m.weight, m.variance_epsilon)
        return self

    def __exit__(self, *exc) -> None:
        for m in self.modules:
            vars(m).pop("forward", None)


__all__ = ["FusedNorms", "NORMS", "rms_norm", "rms_norm_op"]
