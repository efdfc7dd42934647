"""The attention of a uniform decode step: its static buffers and the two-level cascade.

A decode step (:mod:`.step`) runs over **static buffers** (:class:`DecodeBuffers`: token
ids, positions, new slots, a slot table, attention biases), so that the whole model forward can
be captured as a CUDA graph. :func:`decode_attention` is the attention function the model's
layers call inside it (registered with transformers' attention interface as
:data:`.step.NAME`): a fixed **two-level cascade** over the KV pool
(:class:`~..cache.kv_pool.KVPool`; Hydragen, Juravsky et al. 2024, arXiv 2402.05099; FlashInfer's
cascade attention):

* level 0: the prefix every row shares, gathered once per layer and attended by all rows'
  queries stacked in one product, split into chunks attended in parallel (split-K);
* level 1: each row's own slots and its new token, as a ``[R, W]`` slot table with an additive
  bias (0 attend, -inf padding);
* level 1's result joined to level 0's chunks as one more chunk, and all merged by
  log-sum-exp at once (:func:`_merge_chunks`: a softmax over the chunks' LSEs weights their
  outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..forward import attention as tree_attention
from ..cache.kv_pool import KVPool


@dataclass(slots=True)
class StepLayout:
    """The host arrays of one forward of a decode step (:meth:`.step.DecodeStep.layout`), all
    ``int64``: ``ids`` / ``positions`` / ``new_slots`` ``[R]`` (each row's last token, its
    position, the pool slot its KV goes to); ``table`` ``[R, W]`` (each row's own slots,
    left-padded with the dummy slot 0, its new slot last); ``pads`` ``[R]`` (each row's padding
    columns: its first real column); ``prefix`` ``[P]`` (the slots every row reads first,
    level 0)."""

    ids: np.ndarray
    positions: np.ndarray
    new_slots: np.ndarray
    table: np.ndarray
    pads: np.ndarray
    prefix: np.ndarray


class DecodeBuffers:
    """The static inputs of one bucket's step (all on the pool's device).

    One long buffer ``packed`` holds every integer input, filled by one host-to-device copy per
    step (:meth:`fill`); the rest are views of it or built from it on the device by
    :meth:`prepare`, inside the captured graph: ``ids`` / ``positions`` long ``[Rb, 1]``;
    ``new_slots`` long ``[Rb]``; ``pads`` long ``[Rb]`` (each row's padding columns: its first real table column);
    ``table`` long ``[Rb * Wb]`` (row-major slot table, last real column the new token);
    ``prefix`` long ``[Pb]``; ``sizes`` long ``[2]`` (the table's real width ``W``, the prefix's
    real length ``P``). Built: ``bias1`` ``[Rb, 1, G, Wb]`` and ``bias0`` ``[1, 1, 1, Pb]`` of the
    model's dtype (0 attend, -inf padding; None when ``Pb == 0``). ``logits`` float32 ``[Rb,
    V]``, written by the step.
    """

    def __init__(self, pool: KVPool, key: tuple[int, int, int], groups: int, vocab: int):
        Rb, Wb, Pb = key
        self.flash0 = False  # level 0 without a bias but on its last 256 keys (_prefix_chunks)
        self.fused = False  # the levels merged by the compiled merge_levels
        self.level0 = None  # level 0's KV kept across steps (.level0.KeptPrefix), or gathered
        dev, dt = pool.device, pool.dtype
        self.pool = pool
        self.key = key
        sizes = [Rb, Rb, Rb, Rb, Rb * Wb, Pb, 2]
        self.packed = torch.zeros(sum(sizes), dtype=torch.long, device=dev)
        parts = self.packed.split(sizes)
        self.ids, self.positions = parts[0].view(Rb, 1), parts[1].view(Rb, 1)
        self.new_slots, self.pads, self.table, prefix, self.sizes = parts[2:]
        self.prefix = prefix if Pb else None
        # the same parts of the host array fill copies from (one host-to-device copy a step)
        ends = np.cumsum(sizes)
        self._parts = [slice(e - n, e) for n, e in zip(sizes, ends)]
        self.columns = torch.arange(max(Wb, Pb), device=dev)
        self.bias1 = torch.zeros((Rb, 1, groups, Wb), dtype=dt, device=dev)
        self.bias0 = torch.zeros((1, 1, 1, Pb), dtype=dt, device=dev) if Pb else None
        self.logits = torch.zeros((Rb, vocab), dtype=torch.float32, device=dev)

    def fill(self, layout: StepLayout) -> None:
        """Copy one forward's :class:`StepLayout` in, one host-to-device copy. A padded row
        (``R <= row < Rb``) reads only its last real column: its own new token, written to the
        dummy slot 0."""
        Rb, Wb, Pb = self.key
        R, W = layout.table.shape
        host = np.zeros(self.packed.shape[0], dtype=np.int64)
        ids, positions, new_slots, pads, table, prefix, sizes = (host[s] for s in self._parts)
        ids[:R], positions[:R], new_slots[:R] = layout.ids, layout.positions, layout.new_slots
        pads[:] = W - 1
        pads[:R] = layout.pads
        table.reshape(Rb, Wb)[:R, :W] = layout.table
        prefix[:len(layout.prefix)] = layout.prefix
        sizes[:] = W, len(layout.prefix)
        self.packed.copy_(torch.from_numpy(host))

    def prepare(self) -> None:
        """Build the biases from ``packed`` on the device (kernels of the captured graph)."""
        Rb, Wb, Pb = self.key
        cols = self.columns[:Wb]
        keep = (cols[None, :] >= self.pads[:, None]) & (cols[None, :] < self.sizes[0])
        self.bias1.copy_(torch.where(keep, 0.0, float("-inf"))[:, None, None, :]
                         .expand_as(self.bias1))
        if Pb:
            self.bias0.copy_(torch.where(self.columns[:Pb] < self.sizes[1], 0.0,
                                         float("-inf")).view(1, 1, 1, Pb))


def decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """The ``"genback_decode"`` attention function (transformers' attention-interface signature).

    query: [Rb, Hq, 1, D]; key/value: [Rb, Hkv, 1, D] (already written to the pool by the cache).
    Returns ``(out [Rb, 1, Hq, D], None)``.

    Raises:
        RuntimeError: called with no decode step active.
    """
    b = tree_attention.current()
    if not isinstance(b, DecodeBuffers):
        raise RuntimeError("genback_decode attention was called outside a genback decode step")
    layer = module.layer_idx
    Rb, Hq, _, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    Wb = b.key[1]
    scale = scaling if scaling is not None else D ** -0.5
    qg = query.reshape(Rb, Hkv, G, D)  # head h reads KV head h // G
    kv = b.pool.gather(layer, b.table).view(2, Hkv, Rb, Wb, D).transpose(1, 2)
    out, lse = tree_attention._attend(qg, kv[0], kv[1], scale, "flash", b.bias1)
    if b.prefix is not None:  # level 0: the shared prefix, read once for all rows
        o0, l0 = _prefix_chunks(layer, b, qg, scale)  # [S, Hkv, N, D], [S, Hkv, N]
        merge = _compiled_merge() if b.fused else merge_levels
        return merge(o0, l0, out, lse), None
    out = out.to(query.dtype).reshape(Rb, Hq, 1, D)
    return out.transpose(1, 2).contiguous(), None


def merge_levels(o0: torch.Tensor, l0: torch.Tensor, o1: torch.Tensor, l1: torch.Tensor
                 ) -> torch.Tensor:
    """The cascade's two levels merged: level 0's chunks ``o0`` ``[S, Hkv, N, D]`` with their
    float32 log-sum-exps ``l0`` ``[S, Hkv, N]`` (query ``r * G + g`` of KV head ``h`` being row
    ``r``'s head ``h * G + g``) and level 1's ``o1`` ``[Rb, Hkv, G, D]`` with ``l1`` ``[Rb, Hkv,
    G]``, level 1 joined as one more chunk, so that one softmax-weighted sum
    (:func:`_merge_chunks`) merges all ``S + 1`` parts. Returns ``[Rb, 1, Hkv * G, D]`` of
    ``o1``'s dtype, contiguous (the attention interface's output layout)."""
    S, Hkv, N, D = o0.shape
    Rb, _, G, _ = o1.shape
    o = torch.cat([o0, o1.transpose(0, 1).reshape(1, Hkv, N, D)])
    lses = torch.cat([l0, l1.transpose(0, 1).reshape(1, Hkv, N)])
    merged = _merge_chunks(o, lses).view(Hkv, Rb, G, D).transpose(0, 1)
    out = torch.empty((Rb, Hkv, G, D), dtype=o1.dtype, device=o1.device)
    out.copy_(merged)
    return out.reshape(Rb, 1, Hkv * G, D)


_MERGE = None  # merge_levels compiled (once per process: DecodeStep.fused)


def _compiled_merge():
    """:func:`merge_levels` compiled by ``torch.compile`` (shapes dynamic: one compilation for
    every bucket; no graph break), for :class:`.step.DecodeStep`'s ``fused`` and ``compile``:
    its ~8 kernels a layer fused."""
    global _MERGE
    if _MERGE is None:
        _MERGE = torch.compile(merge_levels, dynamic=True, fullgraph=True)
    return _MERGE


# stacked queries x prefix keys from which level 0 runs unmasked by default on CUDA
# (flash_level0_pays)
FLASH0_MIN_WORK = 1 << 22


def flash_level0_pays(queries: int, keys: int) -> bool:
    """Whether level 0 of a bucket with ``queries`` stacked queries (rows x query heads per KV
    head) over a ``keys``-slot prefix bucket runs its keys before the last 256 unmasked
    (``DecodeStep.flash_level0`` None, on CUDA): from :data:`FLASH0_MIN_WORK` on. Measured on
    an H200, 8B Llama shape, bf16 (``benchmarks/RESULTS.md``, "Issue 38, part 1 on an H200
    (session 57)"): GPU time a step, unmasked / with the bias, 1,024 queries x 4,096 keys 19.9 /
    22.6 ms (the masked memory-efficient kernel 8.1 ms of it); 1,024 x 1,024 17.9 / 17.6; 64 x
    1,024 9.7 / 9.2 and 64 x 4,096 14.3 / 13.3 (FlashAttention's split-KV and combine kernels
    and the extra masked chunk cost more than they save)."""
    return queries * keys >= FLASH0_MIN_WORK


# a fused attention kernel works on tiles of 64 queries: fewer than this many (kv head, query
# tile) pairs leave most of an H100's 132 multiprocessors idle, so the prefix is split
SPLIT_TARGET_BLOCKS = 128


def _splits(Pb: int, Hkv: int, queries: int) -> int:
    """How many chunks of the padded prefix ``Pb`` (a multiple of 256) level 0 attends to in
    parallel: enough (kv head, query tile, chunk) triples to fill the device, each chunk of at
    least 256 keys, and every chunk holding a real key (the prefix's padding is < 256)."""
    tiles = Hkv * -(-queries // 64)
    return max(1, min(Pb // 256, SPLIT_TARGET_BLOCKS // tiles))


def _merge_chunks(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Attention over keys split into chunks, from each chunk's result ``o`` ``[S, H, N, D]``
    (any float dtype) and float32 log-sum-exp ``lse`` ``[S, H, N]``: float32 ``[H, N, D]``,
    ``sum_s softmax_s(lse)[s] * o[s]`` (the log-sum-exp merge of :mod:`..forward.attention`, for
    S parts at once: a softmax, a product, a sum). Every query must have a finite ``lse`` in at
    least one chunk."""
    w = torch.softmax(lse, dim=0)
    return (w[..., None] * o).sum(dim=0)


def _prefix_chunks(layer: int, b: DecodeBuffers, qg, scale: float):
    """Level 0: every row's queries over the shared prefix, split into ``S`` chunks attended in
    parallel (split-K, FlashAttention's "flash-decoding", Dao et al. 2023), for
    :func:`_merge_chunks`: ``(o [S, Hkv, Rb * G, D]`` of the queries' dtype, ``lse`` float32
    ``[S, Hkv, Rb * G])``, query ``r * G + g`` of KV head ``h`` being row ``r``'s head
    ``h * G + g``.

    With ``b.flash0`` (:class:`.step.DecodeStep`'s ``flash_level0``) and a prefix over one
    bucket of 256, the prefix's first ``Pb - 256`` keys (all real: its padding is under 256) are attended
    without a bias (a FlashAttention kernel on CUDA, :func:`..forward.attention._attend`'s
    ``"flash2"``) and its last 256 with ``bias0`` as one more chunk.

    qg: [Rb, Hkv, G, D]; the prefix's slots ``b.prefix`` ``[Pb]`` (gathered here, or read in
    place from ``b.level0``, kept across steps: :mod:`.level0`) and bias ``b.bias0``."""
    Rb, Hkv, G, D = qg.shape
    Pb = b.prefix.shape[0]
    kv0 = (b.pool.gather(layer, b.prefix) if b.level0 is None  # [2, Hkv, Pb, D]
           else b.level0.kv[layer])
    qt = qg.transpose(0, 1)  # [Hkv, Rb, G, D], a view
    if not (b.flash0 and Pb > 256):
        return _chunks(kv0, qt, scale, b.bias0, "flash")
    head = Pb - 256
    o, lse = _chunks(kv0[:, :, :head], qt, scale, None, "flash2")
    N = Rb * G
    q1 = qt.reshape(1, Hkv, N, D)
    o_t, lse_t = tree_attention._attend(q1, kv0[0, None, :, head:], kv0[1, None, :, head:],
                                        scale, "flash", b.bias0[..., head:].expand(1, 1, N, 256))
    return torch.cat([o, o_t]), torch.cat([lse, lse_t])


def _chunks(kv0, qt, scale: float, bias0, kernel: str):
    """The queries ``qt`` ``[Hkv, Rb, G, D]`` (``N = Rb * G`` a KV head) over keys and values
    ``kv0`` ``[2, Hkv, L, D]`` (``L`` a multiple of 256) in ``S`` chunks attended in parallel,
    masked by ``bias0`` ``[1, 1, 1, L]`` (None: none): ``(o [S, Hkv, N, D], lse float32 [S, Hkv,
    N])``. The queries of every chunk are laid out by one copy (one kernel: a view expanded
    ``S`` times, made contiguous)."""
    _, Hkv, L, D = kv0.shape
    N = qt.shape[1] * qt.shape[2]
    S = _splits(L, Hkv, N)
    C = L // S
    k0 = kv0[0].reshape(Hkv, S, C, D).transpose(0, 1)  # [S, Hkv, C, D]
    v0 = kv0[1].reshape(Hkv, S, C, D).transpose(0, 1)
    q0 = qt[None].expand(S, -1, -1, -1, -1).reshape(S, Hkv, N, D)
    bias = None if bias0 is None else bias0.view(S, 1, 1, C).expand(S, 1, N, C)
    return tree_attention._attend(q0, k0, v0, scale, kernel, bias)
