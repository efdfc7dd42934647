"""The decode step's per-layer glue compiled: ``DecodeStep.compile`` (off by default).

Around its matrix products, a captured decode step on a GPU runs many small kernels
(``benchmarks/RESULTS.md``, "Issue 38, part 1 on an H200 (session 61)": on the 8B Llama shape at
16 rows ~750 of them, 2.4 ms of a 7.1 ms step; the products themselves near the bandwidth): each
layer's residual additions, its RMSNorms, the MLP's activation and product, RoPE's products
and sums, the cascade's log-sum-exp merge. With ``compile`` each of these runs as one function
compiled by ``torch.compile`` (inductor fuses it into one kernel, or a few), and each is compiled
once for every layer (the layers' weights are its inputs, their shapes alike; ``dynamic=None``:
a bucket of other row counts compiles it once more with dynamic sizes, not once per bucket),
``fullgraph=True`` (no graph break: ``tests/test_decode_compiled.py``):

* :func:`add_rms_norm`: a layer's residual addition after attention and the MLP's input norm,
  one kernel where transformers runs 9 (``norm_op``'s operator: 3); and its residual addition
  after the MLP with the next layer's input norm (computed by the layer, used by the next);
* :func:`.fused.rms_norm`: the first layer's input norm and the model's last
  (:class:`.fused.FusedNorms`);
* :func:`silu_mul`: the MLP's ``silu(gate) * up``, one kernel for two;
* :func:`rotate`: RoPE on the query and key heads of the fused projection's product, in place
  (:mod:`.rope`'s joint rotation), one or two kernels for four;
* :func:`.cascade.merge_levels`: the cascade's merge (``_compiled_merge``).

:class:`CompiledLayers` swaps a forward of that form in for each decoder layer and MLP whose
class computes what Llama's does (their ``forward`` the same code as transformers'
``LlamaDecoderLayer`` and ``LlamaMLP``, their norms in :data:`.fused.NORMS`, the activation SiLU,
no hooks on the norms or the activation) while the decode step runs its forward, and puts the
model's own back after each (as :class:`.fused.FusedNorms` does). Its submodules' own forwards
(attention, projections) are called as before.

The compiled code computes the same function with one rounding where the eager code rounds each
operator's result to the model's dtype (inductor keeps a fused kernel's intermediates in
float32): in float32 the rows equal the eager step's within float32's rounding (an uncached
forward within 1e-4), in bf16 within the captured graph's check (:data:`.graphs.TOLERANCE`).

Compilation happens in a bucket's first (eager) forward and the capture's warm-up, never
during a capture (:mod:`.graphs` runs the step eagerly before capturing it).
"""

from __future__ import annotations

import inspect

import torch
from transformers.models.llama import modeling_llama

from .fused import NORMS, rms_norm
from .rope import _same_code


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + x`` and :func:`.fused.rms_norm` of ``h``: ``(h, norm(h))``, both of
    ``x``'s shape ``[..., H]`` and dtype (``weight`` ``[H]`` of the same dtype)."""
    h = residual + x
    return h, rms_norm(h, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (the gated MLP's hidden state, Shazeer 2020, "GLU variants"), of
    their shape and dtype."""
    return torch.nn.functional.silu(gate) * up


def rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shift: int) -> torch.Tensor:
    """RoPE's half-split rotation written as :mod:`.rope` computes it: ``qk * cos +
    roll(qk, shift) * sin`` over the last axis (``sin`` signed, :func:`.rope._signed`); the
    broadcast of ``qk`` ``[B, H, T, D]`` (or ``[B, T, H, D]``) with ``cos``, ``sin``."""
    return qk * cos + qk.roll(shift, -1) * sin


def _compile(fn):
    return torch.compile(fn, fullgraph=True, dynamic=None)


_COMPILED: dict[str, object] = {}  # name -> the compiled function (one per process)


def compiled(name: str):
    """The compiled form of this module's function ``name`` (``"add_rms_norm"``,
    ``"silu_mul"``, ``"rotate"``, ``"rms_norm"``): made once per process, reused by every layer
    and model (inductor compiles it at its first calls per shape, see the module's doc)."""
    fn = _COMPILED.get(name)
    if fn is None:
        fn = _COMPILED[name] = _compile(rms_norm if name == "rms_norm" else globals()[name])
    return fn


# the names and arguments of transformers' Llama forwards that :class:`CompiledLayers`' own
# forwards reproduce: the layer's of 5.17 to 5.19 (``past_key_values``) and of 5.24 (``cache``;
# the forward wrapped there by a deprecated-argument decorator and gradient checkpointing, both
# unwrapped first); a release that changes them leaves the model's own in place
_LAYER_NAMES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
LAYER_CODES = tuple((_LAYER_NAMES, ("self", "hidden_states", "attention_mask", "position_ids", cache,
                                    "use_cache", "position_embeddings", "kwargs", "residual", "_"))
                    for cache in ("past_key_values", "cache"))
MLP_CODES = ((("down_proj", "act_fn", "gate_proj", "up_proj"), ("self", "x", "down_proj")),)


def _known(fn, codes: tuple) -> bool:
    code = inspect.unwrap(fn).__code__
    return (code.co_names, code.co_varnames) in codes


def _plain_norm(m) -> bool:
    return (type(m).__name__ in NORMS and "forward" not in vars(m) and not m._forward_hooks
            and not m._forward_pre_hooks and isinstance(getattr(m, "weight", None), torch.Tensor)
            and isinstance(getattr(m, "variance_epsilon", None), float))


def _silu(act) -> bool:
    return (type(act) in (torch.nn.SiLU, type(modeling_llama.ACT2FN["silu"]))
            and "forward" not in vars(act) and not act._forward_hooks
            and not act._forward_pre_hooks)


class CompiledLayers:
    """The decoder layers and MLPs of ``model`` whose glue :func:`compiled` functions replace
    (see the module's doc), and ``with layers:`` to run one forward with them. ``layers``,
    ``mlps``: how many are swapped (0 and 0: the context does nothing)."""

    def __init__(self, model: torch.nn.Module):
        layer_forward = modeling_llama.LlamaDecoderLayer.forward
        mlp_forward = modeling_llama.LlamaMLP.forward
        self._layers, self._mlps = [], []
        known = _known(layer_forward, LAYER_CODES), _known(mlp_forward, MLP_CODES)
        for m in model.modules():
            if "forward" in vars(m):
                continue
            own = inspect.unwrap(type(m).forward)
            if (known[0] and _same_code(own, inspect.unwrap(layer_forward))
                    and _plain_norm(getattr(m, "input_layernorm", None))
                    and _plain_norm(getattr(m, "post_attention_layernorm", None))):
                self._layers.append(m)
            elif (known[1] and _same_code(own, inspect.unwrap(mlp_forward))
                  and _silu(getattr(m, "act_fn", None))):
                self._mlps.append(m)
        self.layers, self.mlps = len(self._layers), len(self._mlps)
        # each layer's next one in the list, whose input norm it computes with its last residual
        # addition (None: the last, or hooks that could see or change the tensor in between)
        self._next = [b if not a._forward_hooks and not b._forward_pre_hooks else None
                      for a, b in zip(self._layers, self._layers[1:])] + [None][:self.layers]
        self._stash: list = [None]  # (the sum a layer returned, the weight, its norm)

    def __enter__(self) -> "CompiledLayers":
        norm, add_norm, mul = compiled("rms_norm"), compiled("add_rms_norm"), compiled("silu_mul")
        self._stash[0] = None
        for m, nxt in zip(self._layers, self._next):
            m.forward = _layer_forward(m, nxt, norm, add_norm, self._stash)
        for m in self._mlps:
            m.forward = (lambda m: lambda x: m.down_proj(mul(m.gate_proj(x), m.up_proj(x))))(m)
        return self

    def __exit__(self, *exc) -> None:
        self._stash[0] = None  # (no tensor of a forward kept)
        for m in self._layers + self._mlps:
            vars(m).pop("forward", None)


def _layer_forward(layer, nxt, norm, add_norm, stash: list):
    """``LlamaDecoderLayer.forward`` of ``layer`` with its norms and residual additions compiled
    (the same arguments, the same result). With a next layer ``nxt``, the last addition also
    computes ``nxt``'s input norm of the sum (one kernel), kept in ``stash``: ``nxt`` uses it when
    called on that very tensor, else computes its own."""
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    ln_next = None if nxt is None else nxt.input_layernorm

    def forward(hidden_states, *args, **kwargs):
        last, stash[0] = stash[0], None
        if args:  # (every transformers model passes all but the hidden states by name)
            return type(layer).forward(layer, hidden_states, *args, **kwargs)
        if last is not None and last[0] is hidden_states and last[1] is ln1.weight:
            h = last[2]
        else:
            h = norm(hidden_states, ln1.weight, ln1.variance_epsilon)
        # the layer's other arguments go to its attention as they came (the cache's name is the
        # release's: ``past_key_values`` or ``cache``)
        h, _ = layer.self_attn(hidden_states=h, **kwargs)
        residual, h = add_norm(h, hidden_states, ln2.weight, ln2.variance_epsilon)
        if ln_next is None:
            return residual + layer.mlp(h)
        out, h = add_norm(layer.mlp(h), residual, ln_next.weight, ln_next.variance_epsilon)
        stash[0] = (out, ln_next.weight, h)
        return out
    return forward


__all__ = ["CompiledLayers", "add_rms_norm", "compiled", "rotate", "silu_mul"]
