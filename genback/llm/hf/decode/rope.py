"""Rotary position embeddings with fewer kernels for the decode step: ``DecodeStep.rope_op`` (on
by default on CUDA).

A captured decode step on a GPU is bound at small row counts by the number of its kernels, not
by their work (``benchmarks/RESULTS.md``, "Issue 38, part 1 on an H200 (session 57)": an 8B
Llama step at 16 rows spends ~3.2 ms of 8.2 in small kernels, and the host's graph launch grows
with the graph's nodes). transformers' ``apply_rotary_pos_emb`` (RoPE: Su et al. 2021, "RoFormer",
arXiv 2104.09864, in the half-split layout of GPT-NeoX and Llama) runs 5 kernels for each of the
query and the key in every layer: ``rotate_half`` is a negation and a concatenation, then two
products and a sum. :func:`apply_rotary_pos_emb` computes the same values in 4: the rotation is
one ``torch.roll`` of the last dimension, and the negation moves onto the sine, once per
forward (the model passes every layer the same ``sin`` tensor):

    rotate_half(x) * sin == roll(x, h) * signed(sin),  signed(sin) = cat(-sin[:h'], sin[h':])

element by element and bit for bit (``-a * b == a * -b`` in IEEE arithmetic; the products and
the sum are transformers' own, in its order), so the rows are the model's own: 2 kernels fewer
per layer (62 fewer per step on the 8B shape, 30 on the 1B). Where the query and the key are
blocks of one product (the decode step's fused projections, :mod:`.projections`: the key's heads
follow the query's in memory, :func:`joint_heads`), both are rotated together by the same 4
kernels, 4 more fewer per layer; the results are then views of one tensor. In genback's own
forward (inside a :class:`RopeOp`'s ``with``, autograd off) the last kernel writes them in place,
into the product's query and key columns (the unrotated values are read by nothing after:
transformers' attention layers call their three projections before the rotation), so that the
key's heads stay followed by the value's and the cache writes both to the KV pool in one kernel
(:meth:`~..cache.kv_pool.KVPool.write`): one fewer per layer again.

:class:`RopeOp` swaps it in for the modeling modules of the model's attention layers whose
``apply_rotary_pos_emb`` is transformers' half-split form (checked by its code, and its
``rotate_half``'s, against Llama's: most families share it) while the decode step runs a forward
(warm-ups and captures: a replay runs what was captured), and puts theirs back after. The swap is
of a module's global name, so during those forwards another thread's forward of a model of the
same family runs it too, with the same results (there its signed sine is made at every call:
only genback's own forward, on its own thread, keeps it from one layer to the next).
"""

from __future__ import annotations

import inspect
import sys
import threading

import torch
from transformers.models.llama import modeling_llama

_LOCK = threading.Lock()
_SWAPPED: dict[str, tuple[int, object]] = {}  # module name -> (entries, its own function)
_local = threading.local()  # .last: [sin, its signed form] inside a RopeOp's ``with``


def _signed(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first ``D - D // 2`` columns negated (the part ``rotate_half`` negates).
    Inside a :class:`RopeOp`'s ``with`` (genback's own forward, on its thread) it is made once
    per ``sin`` tensor (the model passes one to all its layers, and a forward makes a new
    one); on any other thread that runs the swapped function meanwhile, at every call (a
    tensor of theirs may be a buffer whose values change in place)."""
    last = getattr(_local, "last", None)
    if last is not None and last[0] is sin:
        return last[1]
    h = sin.shape[-1] - sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :h], sin[..., h:]), dim=-1)
    if last is not None:
        last[:] = sin, signed
    return signed


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' ``apply_rotary_pos_emb`` (half-split RoPE), bit for bit, in fewer kernels.

    q: [B, Hq, T, D]; k: [B, Hkv, T, D]; cos, sin: [B, T, D] (``unsqueeze_dim`` 1; 2 for
    ``[B, T, H, D]`` inputs), of q's dtype and device. Returns ``(q_embed, k_embed)`` of q's and
    k's shapes.
    """
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = _signed(sin).unsqueeze(unsqueeze_dim)
    shift = q.shape[-1] - q.shape[-1] // 2  # (rotate_half's second half comes first)
    qk = joint_heads(q, k, unsqueeze_dim)
    if qk is not None:  # (one product's columns: both rotated by the same 4 kernels)
        if getattr(_local, "last", None) is not None and not torch.is_grad_enabled():
            # genback's own forward: rotated in place, so that the product's key and value
            # blocks stay consecutive for the cache's one write (KVPool.write); with a
            # compiled rotation (RopeOp's ``rotate``: DecodeStep.compile) in one kernel or two
            rotate = getattr(_local, "rotate", None)
            if rotate is not None:
                embed = qk.copy_(rotate(qk, cos, sin, shift))
            else:
                embed = torch.add(qk * cos, qk.roll(shift, -1) * sin, out=qk)
        else:
            embed = (qk * cos) + (qk.roll(shift, -1) * sin)
        heads = q.shape[unsqueeze_dim]
        return (embed.narrow(unsqueeze_dim, 0, heads),
                embed.narrow(unsqueeze_dim, heads, k.shape[unsqueeze_dim]))
    q_embed = (q * cos) + (q.roll(shift, -1) * sin)
    k_embed = (k * cos) + (k.roll(shift, -1) * sin)
    return q_embed, k_embed


def joint_heads(q: torch.Tensor, k: torch.Tensor, dim: int) -> torch.Tensor | None:
    """``q`` and ``k`` as one tensor of their heads (axis ``dim``) together, a view, when
    ``k``'s heads continue ``q``'s in memory: the query and key blocks of one product of the
    decode step's fused projections (:mod:`.projections`), viewed as heads by the attention
    layer. None otherwise (each is then rotated apart)."""
    if (q.dim() != 4 or k.dim() != 4 or q.dtype != k.dtype or q.device != k.device
            or q.shape[:dim] + q.shape[dim + 1:] != k.shape[:dim] + k.shape[dim + 1:]
            or any(q.stride(i) != k.stride(i) for i in range(4)  # (a size-1 axis's stride
                   if i != dim and q.shape[i] > 1)  # is never used)
            or (k.shape[dim] > 1 and k.stride(dim) != q.stride(dim))
            or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
            or k.storage_offset() != q.storage_offset() + q.shape[dim] * q.stride(dim)):
        return None
    shape = list(q.shape)
    shape[dim] += k.shape[dim]
    return q.as_strided(shape, q.stride(), q.storage_offset())


def _same_code(a, b) -> bool:
    """Whether functions ``a`` and ``b`` compile to the same code (instructions, names,
    constants but the docstring, defaults)."""
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return (ca is not None and cb is not None and ca.co_code == cb.co_code
            and ca.co_names == cb.co_names and ca.co_varnames == cb.co_varnames
            and _constants(a) == _constants(b)
            and getattr(a, "__defaults__", None) == getattr(b, "__defaults__", None))


def _constants(fn) -> tuple:
    """``fn``'s code constants but its docstring (where a Python version keeps it there)."""
    doc = fn.__doc__
    return tuple(c for c in fn.__code__.co_consts if not (type(c) is str and c == doc))


def is_half_split_rope(fn) -> bool:
    """Whether ``fn`` is transformers' Llama ``apply_rotary_pos_emb``, or a family's copy of it
    whose module's ``rotate_half`` is Llama's too (the same code: what :func:`apply_rotary_pos_emb`
    computes)."""
    glob = getattr(fn, "__globals__", {})
    return (getattr(fn, "__module__", "").startswith("transformers.")
            and _same_code(fn, modeling_llama.apply_rotary_pos_emb)
            and _same_code(glob.get("rotate_half"), modeling_llama.rotate_half))


def _own_function(name: str):
    """Module ``name``'s own ``apply_rotary_pos_emb``: the one kept while a :class:`RopeOp`
    has swapped it, else the module's (None: it has none)."""
    swapped = _SWAPPED.get(name)
    return swapped[1] if swapped else getattr(sys.modules[name], "apply_rotary_pos_emb", None)


class RopeOp:
    """The modeling modules of ``model``'s attention layers whose RoPE :func:`apply_rotary_pos_emb`
    replaces, and ``with rope:`` to run one forward with it (each module's own function is put
    back at the end of the last ``with`` that swapped it, whichever thread it runs on; one
    instance is entered by one thread at a time: the decode step's, under the forward lock).
    ``count``: the attention layers it serves (0: none, the context does nothing)."""

    def __init__(self, model: torch.nn.Module, rotate=None):
        self.rotate = rotate  # (the joint in-place rotation's function: compiled.rotate's
        # compiled form, or None: the eager kernels)
        served: dict[str, bool] = {}  # modeling module -> its RoPE is the half-split form
        count = 0
        for m in model.modules():
            forward = getattr(type(m), "forward", None)
            if forward is not None:
                forward = inspect.unwrap(forward)  # (through decorators that wrap it)
            name = type(m).__module__
            if ("apply_rotary_pos_emb" in getattr(getattr(forward, "__code__", None),
                                                  "co_names", ())
                    and name in sys.modules):
                if name not in served:
                    served[name] = is_half_split_rope(_own_function(name))
                count += served[name]
        self.modules = sorted(name for name, ok in served.items() if ok)
        self.count = count
        # per open ``with``: the modules it swapped, and the thread's signed sine before it
        self._entered: list[tuple[list[str], list | None]] = []

    def __enter__(self) -> "RopeOp":
        fn = apply_rotary_pos_emb  # (looked up now: a test may count its calls)
        with _LOCK:
            swapped = []
            for name in self.modules:
                entries, own = _SWAPPED.get(name, (0, None))
                if not entries:
                    own = _own_function(name)
                    if not is_half_split_rope(own):  # (replaced since: left as it is)
                        continue
                    sys.modules[name].apply_rotary_pos_emb = fn
                _SWAPPED[name] = (entries + 1, own)
                swapped.append(name)
            self._entered.append((swapped, getattr(_local, "last", None),
                                  getattr(_local, "rotate", None)))
        _local.last = [None, None]  # (this forward's signed sine: none yet)
        _local.rotate = self.rotate
        return self

    def __exit__(self, *exc) -> None:
        with _LOCK:
            swapped, _local.last, _local.rotate = self._entered.pop()  # (no tensor kept)
            for name in swapped:
                entries, own = _SWAPPED[name]
                if entries > 1:
                    _SWAPPED[name] = (entries - 1, own)
                else:
                    del _SWAPPED[name]
                    sys.modules[name].apply_rotary_pos_emb = own


__all__ = ["RopeOp", "apply_rotary_pos_emb", "is_half_split_rope", "joint_heads"]
