"""The rows' own attention on CUDA: each row's private past and new tokens, packed without
padding, in ONE variable-length causal kernel call that returns the log-sum-exp.

Why this kernel (issue 66). On CUDA, ``F.scaled_dot_product_attention`` with a mask and
grouped-query heads has no fused kernel in torch 2.11-2.13: FlashAttention refuses any mask, the
memory-efficient kernel refuses fewer KV heads than query heads, and what cuDNN declines falls
silently to the math backend, which materialises the scores (3.3 ms a call for a 1B bf16 scoring
forward on an H200, measured: 2.5 s of a 5.7 s lm-eval mix). A row of a tree forward is
"private past + new tokens, causal in the new tokens, grouped-query heads": the query ``i`` of a
row with ``k`` keys and ``n`` queries attends keys ``0 .. k - n + i`` (causal aligned at the
bottom right). Torch's variable-length kernels take exactly that with no mask tensor: rows packed
end to end, delimited by cumulative lengths (``cu_seqlens``), causal from the bottom right:

* ``"flash"``: ``torch.ops.aten._flash_attention_forward`` with ``cum_seq_q`` / ``cum_seq_k``
  (FlashAttention-2's varlen kernel; torch >= 2.1; its causal mask is bottom-right aligned since
  FlashAttention 2.1; grouped-query heads natively; bf16/fp16, compute capability >= 8.0, head
  size a multiple of 8 up to 256). Its LSE is float32 ``[heads, total_q]`` (torch 2.13's meta
  function; a ``[rows, heads, max_q]`` LSE of older builds is read too). With one query a row
  and grouped heads it swaps the groups into the sequence (``seqlenq_ngroups_swapped``) and
  its LSE comes back in that order: when the LSE is needed there, the kernel below runs.
* ``"efficient"``: ``torch.ops.aten._efficient_attention_forward`` with ``cu_seqlens_q`` /
  ``cu_seqlens_k`` and ``custom_mask_type=2`` (causal from the bottom right) for fp32 (flash
  has no fp32) and devices flash does not run on; it wants as many KV heads as query heads, so
  the (gathered) KV is expanded per query head. Its LSE is ``[rows, heads, ceil(max_q/32)*32]``.
* ``"reference"``: the same semantics row by row in PyTorch (any device): the CPU tests run the
  packed path through it. The CPU itself keeps its masked fused kernel (``attention._attend``):
  no varlen kernel there, and a per-row loop costs more than the padding it saves.

FlexAttention's block masks need ``torch.compile`` (uncompiled they materialise the scores), and
FlashInfer / FlashAttention-3 are not stock torch: none is used. Nothing here syncs with the host
(the lengths' maxima come from the plan), so the calls can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

#: the kernel every tree forward's private part uses: None picks by device (:func:`kernel_for`);
#: tests set ``"reference"`` to run the packed path on the CPU, benchmarks ``"masked"`` to run
#: the padded, masked path (``attention._attend``) on CUDA too
FORCE: str | None = None


def kernel_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """The varlen kernel of a tree forward's private part: ``"flash"`` (CUDA, bf16/fp16,
    compute capability >= 8.0, ``head_dim % 8 == 0`` and ``<= 256``), ``"efficient"`` (any
    other CUDA case: fp32 included), None off CUDA (the masked path of ``attention``), or
    :data:`FORCE` when set (``"masked"``: None)."""
    if FORCE is not None:
        return None if FORCE == "masked" else FORCE
    if device.type != "cuda":
        return None
    if (dtype in (torch.bfloat16, torch.float16) and head_dim % 8 == 0 and head_dim <= 256
            and _ampere(device.index)):
        return "flash"
    return "efficient"


@functools.cache
def _ampere(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 8


class Varlen:
    """A forward's rows as packed variable-length sequences (built on the host by :meth:`of`).

    Attributes:
        kernel: :func:`kernel_for`'s choice.
        cu_q / cu_k: int32 ``[R + 1]`` on the device, cumulative query / key counts.
        max_q / max_k: the longest row's queries / keys (host ints).
        k_index: long ``[total_k]`` on the device, each row's real key slots (private past,
            then new tokens) end to end; None when no row has a private past (the keys are
            then the new tokens themselves, ``cu_k`` equal to ``cu_q``).
        q_seq / q_pos: long ``[total_q]``, each query's row and place in it (for a
            ``[rows, heads, max_q]`` LSE).
        host: ``(n_q, n_k)`` int64 NumPy arrays of each row's counts (the reference kernel).
    """

    __slots__ = ("kernel", "cu_q", "cu_k", "max_q", "max_k", "k_index", "q_seq", "q_pos",
                 "host", "out")

    @classmethod
    def of(cls, kernel: str, layout: np.ndarray, pads: np.ndarray, n_new: np.ndarray, m: int,
           device: torch.device) -> "Varlen":
        """From a forward's ``layout`` ``int64 [R, P + m]`` (each row's left-padded private past
        and its new tokens' slots, right-padded), ``pads`` ``int64 [R]`` and ``n_new``
        ``int64 [R]`` (each row's real new tokens); one host-to-device copy."""
        self = cls()
        R, width = layout.shape
        P = width - m
        n_k = P - pads + n_new
        cols = np.arange(width)
        real = (cols >= pads[:, None]) & (cols < (P + n_new)[:, None])
        self.kernel, self.max_q, self.max_k = kernel, int(n_new.max()), int(n_k.max())
        self.host, self.out = (n_new, n_k), None
        cu = np.zeros((2, R + 1), dtype=np.int64)
        np.cumsum(n_new, out=cu[0, 1:])
        np.cumsum(n_k, out=cu[1, 1:])
        q_seq = np.repeat(np.arange(R), n_new)
        q_pos = np.arange(len(q_seq)) - np.repeat(cu[0, :-1], n_new)
        parts = [cu.ravel(), q_seq, q_pos] + ([layout[real]] if P else [])
        flat = torch.from_numpy(np.concatenate(parts))
        flat = flat if device.type == "cpu" else flat.to(device)
        cu_t = flat[: 2 * (R + 1)].view(2, R + 1).to(torch.int32)
        self.cu_q, self.cu_k = cu_t[0], cu_t[1]
        b = 2 * (R + 1)
        T = len(q_seq)
        self.q_seq, self.q_pos = flat[b:b + T], flat[b + T:b + 2 * T]
        self.k_index = flat[b + 2 * T:] if P else None
        return self

    def keys_values(self, pool, layer: int, key: torch.Tensor, value: torch.Tensor):
        """``(k, v)`` ``[total_k, kv_heads, dim]``: the rows' real keys and values (from the
        pool, where the forward's new tokens are written already), or the new tokens' own
        (``key`` / ``value`` ``[B, kv_heads, n, dim]``, no padding) when no row has a past."""
        if self.k_index is None:
            H, D = key.shape[1], key.shape[3]
            return (key.transpose(1, 2).reshape(-1, H, D), value.transpose(1, 2).reshape(-1, H, D))
        if self.out is None:
            self.out = torch.empty((2, pool.heads, len(self.k_index), pool.dim),
                                   dtype=pool.dtype, device=pool.store.device)
        kv = pool.gather(layer, self.k_index, out=self.out)
        return kv[0].transpose(0, 1), kv[1].transpose(0, 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Varlen, scale: float,
           lse: bool = True):
    """Packed causal attention of every row (bottom-right aligned).

    q: ``[total_q, Hq, D]``; k / v: ``[total_k, Hkv, D]`` (``Hq`` a multiple of ``Hkv``; last
    dimension contiguous) -> ``(out [total_q, Hq, D]`` of q's dtype, ``lse`` float32
    ``[total_q, Hq]`` or None when ``lse`` is False).

    Raises:
        ValueError: an unknown ``meta.kernel``.
    """
    kernel = meta.kernel
    if kernel == "flash" and lse and meta.max_q == 1 and q.shape[1] > k.shape[1]:
        # (one query a row with grouped heads: FlashAttention swaps the groups into the
        # sequence, and its LSE comes back in that order; the memory-efficient kernel's does not)
        kernel = "efficient"
    if kernel == "flash":
        out, l = torch.ops.aten._flash_attention_forward(
            q, k, v, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, 0.0, True, False,
            scale=scale)[:2]
        if not lse:
            return out, None
        return out, (l.t() if l.dim() == 2 else l[meta.q_seq, :, meta.q_pos]).float()
    if kernel == "efficient":
        G = q.shape[1] // k.shape[1]
        if G > 1:  # (the kernel wants one KV head per query head)
            k = k.repeat_interleave(G, dim=1)
            v = v.repeat_interleave(G, dim=1)
        out, l = torch.ops.aten._efficient_attention_forward(
            q[None], k[None], v[None], None, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k,
            0.0, 2, lse, scale=scale)[:2]
        return out[0], (l[meta.q_seq, :, meta.q_pos].float() if lse else None)
    if kernel == "reference":
        return _reference(q, k, v, meta, scale, lse)
    raise ValueError(f"unknown varlen kernel {kernel!r}")


def _reference(q, k, v, meta: Varlen, scale: float, want_lse: bool):
    """:func:`attend`'s semantics row by row, scores materialised in float32 (tests)."""
    G = q.shape[1] // k.shape[1]
    outs, lses = [], []
    a = b = 0
    for n_q, n_k in zip(*(x.tolist() for x in meta.host)):
        qr = q[a:a + n_q].transpose(0, 1).float()                          # [Hq, n_q, D]
        kr = k[b:b + n_k].transpose(0, 1).float().repeat_interleave(G, 0)  # [Hq, n_k, D]
        vr = v[b:b + n_k].transpose(0, 1).float().repeat_interleave(G, 0)
        s = qr @ kr.transpose(1, 2) * scale
        allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        s = s.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(s, -1)                                       # [Hq, n_q]
        outs.append((torch.exp(s - lse[..., None]) @ vr).transpose(0, 1))
        lses.append(lse.t())
        a, b = a + n_q, b + n_k
    out = torch.cat(outs).to(q.dtype)
    return out, (torch.cat(lses) if want_lse else None)
