"""Tree attention: exact attention over a KV prefix tree, reading each shared segment once.

Attention over a set of keys is exact when the keys are split into parts and the parts' results
are merged by log-sum-exp: with ``o_s = softmax(q K_s^T) V_s`` and ``lse_s = logsumexp(q K_s^T)``
for each part ``s``, the full result is ``sum_s exp(lse_s - LSE) o_s`` with
``LSE = logsumexp_s lse_s`` (Hydragen, Juravsky et al. 2024, arXiv 2402.05099; FlashInfer's
cascade attention; SGLang). So a batch of rows that share a prompt attends to the prompt's KV in
one product with all their queries stacked, reading it once, and merges that with each row's own
(private) past and new tokens.

A forward's layout (built by :class:`.tree.TreeForward`, one :class:`TreeBatch` per forward;
all KV lives in the runner's :class:`~..cache.kv_pool.KVPool`):

* ``R`` rows, each with ``m_r <= m`` new tokens (right-padded to ``m``), whose keys and values
  each layer first writes into the slots the forward took for them;
* shared segments (:func:`..plan.segments.split_segments`): tree nodes' slots, read in place where
  they are one run of the pool, each with the paths below it (a path is a row of the forward's
  batch);
* a private past per row: the rest of its cached KV, gathered layer by layer together with the
  row's new tokens from the pool into ``[R, kv_heads, P + m, dim]`` (past left-padded and
  masked, new tokens causal).

On CUDA the private part runs packed instead (:mod:`.varlen`): each row's real past and new
tokens end to end, in one variable-length causal kernel call (FlashAttention-2's in bf16/fp16,
the memory-efficient one in fp32) with no mask and no padding, the forward's input itself packed
(``[1, T]``); masked SDPA with grouped-query heads has no fused CUDA kernel and falls to the math
backend (issue 66). The CPU keeps the masked fused kernel below.

The function is registered with transformers' ``AttentionInterface`` as ``"genback_tree"`` and is
active only while :func:`active` holds a batch on the calling thread (the runner switches the
model's attention implementation to it for its own forwards, under the forward lock).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import varlen

NAME = "genback_tree"
_local = threading.local()

# the attention op of every tree forward: torch's fused attention ops that return the LSE (CPU:
# 6.5x faster than the scores materialised, "math", for 768 stacked queries over a 4,000-token
# segment, measured); "math" stays for the tests that compare the two
KERNEL = "flash"


@dataclass
class Segment:
    """A shared tree segment of ``length`` pool slots: the run ``start ..`` (read in place) when
    ``index`` is None, else the slots ``index`` (long ``[length]`` on the device, gathered); and
    the paths below it (``paths``: their indices in the forward's batch, long ``[n_paths]`` on
    the device, or None for every path)."""

    start: int
    index: torch.Tensor | None
    length: int
    paths: torch.Tensor | None
    n_paths: int

    def read(self, pool, layer: int) -> torch.Tensor:
        """``[2, kv_heads, length, dim]``: this segment's keys and values at ``layer``."""
        if self.index is None:
            return pool.store[layer, :, :, self.start:self.start + self.length]
        return pool.gather(layer, self.index)


@dataclass
class TreeBatch:
    """Everything the attention of one forward needs besides the model's own tensors.

    ``pool``: the runner's :class:`~..cache.kv_pool.KVPool`; ``new_slots``: long ``[R * m]`` on the
    device, the slots of the rows' new tokens (row-major; a row's padding included), written by
    the cache (:class:`.tree_cache.TreeCache`) before the layer's attention runs; ``index``: long
    ``[R * (P + m)]``, each row's left-padded private past and new tokens
    (:meth:`..plan.segments.PrivatePasts.layout`), or None when no row has a private past (P == 0);
    ``out``: the ``[2, kv_heads, R * (P + m), dim]`` buffer each layer's layout is gathered
    into; ``mask``: bool ``[R, 1, m, P + m]`` (True = attend) for the private past and the new
    tokens, or None when every row attends to every column (a decode step, ``m == 1``, with
    no row padded: no mask is built, and the attention runs without one). ``varlen``: a
    :class:`.varlen.Varlen` when the private part runs packed in a variable-length kernel (on
    CUDA: :func:`.varlen.kernel_for`); then ``mask`` and ``index`` are None, the forward's
    tokens are token-major (``[1, T]`` packed rows, or ``[R, 1]``) and each segment's
    ``paths`` are the indices of its tokens.
    """

    segments: list[Segment]
    pool: object
    new_slots: torch.Tensor
    index: torch.Tensor | None
    P: int
    mask: torch.Tensor | None
    out: torch.Tensor | None = None
    varlen: object = None  # a varlen.Varlen: the private part packed (CUDA), else None
    _bias: dict = field(default_factory=dict, repr=False)  # (groups, dtype) -> bias

    def bias(self, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """``mask`` as an additive bias for grouped queries, built once per forward (every layer
        shares it): ``[R, 1, groups * m, P + m]`` of ``dtype``, 0 where a query attends and
        ``-inf`` where it does not. Its rows are padded to a multiple of 16 columns (the
        alignment CUDA's fused attention asks of a bias), the padding sliced off. One per
        ``(groups, dtype)``: layers with other head ratios get their own. None when ``mask``
        is (nothing masked)."""
        bias = self._bias.get((groups, dtype))
        if bias is None and self.mask is not None:
            R, _, m, L = self.mask.shape
            width = -(-L // 16) * 16
            full = torch.zeros((R, 1, groups, m, width), dtype=dtype, device=self.mask.device)
            full[..., :L].masked_fill_(~self.mask.unsqueeze(2), float("-inf"))
            bias = self._bias[(groups, dtype)] = full.view(R, 1, groups * m, width)[..., :L]
        return bias

    def keys_values(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        """Layer ``layer``'s keys and values of every row, private past then new tokens, each
        ``[R, kv_heads, P + m, dim]`` (views of ``out``, one ``index_select`` of the pool); just
        ``key`` / ``value`` (the new tokens, ``[R, kv_heads, m, dim]``) when no row has a
        private past."""
        if self.index is None:
            return key, value
        R, H, m, D = key.shape
        self.pool.gather(layer, self.index, out=self.out)
        kv = self.out.view(2, H, R, self.P + m, D).transpose(1, 2)
        return kv[0], kv[1]


class active:
    """Make ``batch`` the tree batch of forwards on this thread while the ``with`` block runs
    (a class, not a generator: two calls a forward, not six)."""

    __slots__ = ("batch",)

    def __init__(self, batch: TreeBatch):
        self.batch = batch

    def __enter__(self):
        _local.batch = self.batch

    def __exit__(self, *exc) -> None:
        _local.batch = None


def current() -> TreeBatch | None:
    return getattr(_local, "batch", None)


def _attend(q, k, v, scale: float, kernel: str, bias=None):
    """Attention with its log-sum-exp, optionally masked.

    q: [B, H, N, D], k/v: [B, H, L, D], bias: None, or additive, of q's dtype, broadcastable to
    [B, H, N, L] (0 = attend, -inf = masked; every query attends to at least one key) ->
    (out [B, H, N, D], lse float32 [B, H, N]). ``kernel`` ``"flash"``: one fused op on CPU (flash
    attention) and CUDA (memory-efficient attention); ``"flash2"``: as ``"flash"``, but on CUDA
    without a bias, in bf16 or fp16 on compute capability 8.0 or newer, head size <= 256,
    FlashAttention-2's kernel (PyTorch's
    ``_scaled_dot_product_flash_attention``: no bias, its LSE float32 ``[B, H, N]``);
    ``"math"`` (and other devices): scores materialised.
    """
    if kernel == "flash2":
        if (bias is None and q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16)
                and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0 and _ampere(q.device.index)):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, False, False, scale=scale)[:2]
            return out, lse.float()
        kernel = "flash"
    if kernel == "flash" and q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        return out, lse.float()
    if kernel == "flash" and q.device.type == "cuda":
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], -1, -1)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, False, scale=scale)[:2]
        return out, lse[..., : q.shape[2]].float()  # its LSE may be padded to 32 queries
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]).to(v.dtype), v)
    return out, lse


@functools.cache
def _ampere(index: int | None) -> bool:
    """Whether CUDA device ``index`` (None: the current one) runs FlashAttention-2's kernels
    (compute capability 8.0 or newer)."""
    return torch.cuda.get_device_capability(index)[0] >= 8


def _merge(out, lse, out_s, lse_s):
    """Merge two partial attentions by log-sum-exp; all float32, lse [..., N], out [..., N, D].

    ``out * a + out_s * (1 - a)`` with ``a = exp(lse - logaddexp(lse, lse_s))``, as one
    ``lerp`` (four kernels in all)."""
    total = torch.logaddexp(lse, lse_s)
    return torch.lerp(out_s, out, torch.exp(lse - total)[..., None]), total


def tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                   **kwargs):
    """The ``"genback_tree"`` attention function (transformers' attention-interface signature).

    query: [R, Hq, m, D]; key/value: [R, Hkv, m, D] (the new tokens only: the cache keeps the
    past in the tree). Returns ``(out [R, m, Hq, D], None)``.

    Raises:
        RuntimeError: called with no tree batch active (only genback's forwards use it).
    """
    batch = current()
    if batch is None:
        raise RuntimeError("genback_tree attention was called outside a genback forward")
    layer = module.layer_idx
    R, Hq, m, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    scale = scaling if scaling is not None else D ** -0.5
    # queries grouped by KV head: [R, Hkv, G*m, D] (head h reads KV head h // G)
    qg = query.reshape(R, Hkv, G * m, D)

    if batch.varlen is not None:
        return _packed_attention(batch, layer, query, key, value, scale)
    # 1. private past + new tokens, per row (masked: left padding, causal new block)
    k, v = batch.keys_values(layer, key, value)
    if not batch.segments:  # nothing to merge: no LSE needed
        if batch.index is None:  # right-padded new tokens only: causal is exact for real ones
            out = F.scaled_dot_product_attention(query, k, v, is_causal=m > 1, scale=scale,
                                                 enable_gqa=G > 1)
        else:
            out = F.scaled_dot_product_attention(query, k, v, attn_mask=batch.mask, scale=scale,
                                                 enable_gqa=G > 1)
        return out.transpose(1, 2).contiguous(), None
    # mask [R, 1, m, P+m] -> additive bias per grouped query [R, 1, G*m, P+m]
    out, lse = _attend(qg, k, v, scale, KERNEL, batch.bias(G, query.dtype))
    out = out.float()

    # 2. shared segments: every row below a segment attends to it in one product
    for seg in batch.segments:
        ks, vs = seg.read(batch.pool, layer)  # [Hkv, L, D] each, in place where a run
        qs = qg if seg.paths is None else qg.index_select(0, seg.paths)
        n = seg.n_paths
        qs = qs.transpose(0, 1).reshape(1, Hkv, n * G * m, D)
        o_s, l_s = _attend(qs, ks[None], vs[None], scale, KERNEL)
        o_s = o_s[0].reshape(Hkv, n, G * m, D).transpose(0, 1).float()
        l_s = l_s[0].reshape(Hkv, n, G * m).transpose(0, 1)
        out, lse = _merge_rows(out, lse, seg.paths, o_s, l_s)
    out = out.to(query.dtype).reshape(R, Hq, m, D)
    return out.transpose(1, 2).contiguous(), None


def _merge_rows(out, lse, rows, o_s, l_s):
    """``(out, lse)`` with a segment's partial results ``o_s``, ``l_s`` merged (:func:`_merge`)
    into the rows ``rows`` (long ``[n]`` on the device; None: every row) of ``out`` / ``lse``."""
    if rows is None:
        return _merge(out, lse, o_s, l_s)
    o_m, l_m = _merge(out.index_select(0, rows), lse.index_select(0, rows), o_s, l_s)
    out.index_copy_(0, rows, o_m)
    lse.index_copy_(0, rows, l_m)
    return out, lse


def _packed_attention(batch: TreeBatch, layer: int, query, key, value, scale: float):
    """:func:`tree_attention` of a forward whose private part runs packed
    (:mod:`.varlen`): query ``[B, Hq, n, D]`` with ``B * n`` the forward's real tokens, row
    after row (``[1, Hq, T, D]`` packed, or ``[R, Hq, 1, D]``); each shared segment attended
    by its tokens' queries in one memory-efficient call and merged by log-sum-exp."""
    B, Hq, n, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    meta = batch.varlen
    q = query.transpose(1, 2).reshape(B * n, Hq, D)  # token-major [N, Hq, D]
    k, v = meta.keys_values(batch.pool, layer, key, value)
    out, lse = varlen.attend(q, k, v, meta, scale, lse=bool(batch.segments))
    if not batch.segments:
        return out.view(B, n, Hq, D), None
    out = out.float()
    for seg in batch.segments:
        ks, vs = seg.read(batch.pool, layer)  # [Hkv, L, D] each
        qs = q if seg.paths is None else q.index_select(0, seg.paths)
        N = qs.shape[0]
        # queries grouped by KV head: [1, Hkv, N * G, D] (head h reads KV head h // G)
        qs = qs.view(N, Hkv, G, D).transpose(0, 1).reshape(1, Hkv, N * G, D)
        o_s, l_s = _attend(qs, ks[None], vs[None], scale, KERNEL)
        o_s = o_s[0].view(Hkv, N, G, D).transpose(0, 1).reshape(N, Hq, D).float()
        l_s = l_s[0].view(Hkv, N, G).transpose(0, 1).reshape(N, Hq)
        out, lse = _merge_rows(out, lse, seg.paths, o_s, l_s)
    return out.to(query.dtype).view(B, n, Hq, D), None


_registered: set = set()


def register(name: str = NAME, function=None) -> None:
    """Register an attention function with transformers' ``AttentionInterface`` under ``name``
    (idempotent): :func:`tree_attention` as ``"genback_tree"`` by default, or the decode step's
    (:func:`..decode.cascade.decode_attention`)."""
    if name not in _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(name, tree_attention if function is None else function)
        _registered.add(name)


class use_tree_attention:
    """Switch ``config``'s attention implementation to ``name`` (``"genback_tree"``, or the
    decode step's ``"genback_decode"``) for a ``with`` block.

    The switch is local to genback's own forwards (held under the forward lock), so the model
    keeps its own implementation (sdpa, eager, ...) everywhere else. transformers builds no
    mask for an implementation without a registered mask function: the tree batch has its own.
    The attribute is written in the config's ``__dict__``: transformers' ``__setattr__`` and
    ``__getattribute__`` of a config (attribute map, strict validation) cost ~10 µs per forward
    for the two writes (measured, transformers 5.19), ~0.3 µs this way.
    """

    __slots__ = ("fields", "name", "previous")

    def __init__(self, config, name: str = NAME):
        self.fields = object.__getattribute__(config, "__dict__")
        self.name = name

    def __enter__(self):
        self.previous = self.fields.get(_ATTN_FIELD, _ABSENT)
        self.fields[_ATTN_FIELD] = self.name

    def __exit__(self, *exc) -> None:
        if self.previous is _ABSENT:
            self.fields.pop(_ATTN_FIELD, None)
        else:
            self.fields[_ATTN_FIELD] = self.previous


_ATTN_FIELD = "_attn_implementation_internal"  # (what config._attn_implementation reads)
_ABSENT = object()


def support(model) -> str | None:
    """None when ``model`` can run tree attention, else the reason it cannot (one line)."""
    config = model.config
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if not (can_set() if callable(can_set) else getattr(model, "_supports_attention_backend",
                                                          False)):
        return f"{type(model).__name__} does not use transformers' attention interface"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention is not supported by tree attention"
    if getattr(config, "attn_logit_softcapping", None):
        return "attention logit soft-capping is not supported by tree attention"
    return None
