"""``ParallelTokenCharacterTrie``: the same node values as ``TokenCharacterTrie`` on a torch device.

Structure and reduction plan are built once on the CPU (``genback.trie.build`` / ``plan``) and
copied to the device. A call runs the plan level by level with ``index_add_`` (sum),
``scatter_reduce_(..., "amax")`` (max) or a max-shifted log-sum-exp, on a ``(U, b)`` work tensor
(``U`` = distinct node slices, at most ``2V``; ``b`` = batch chunk). Memory is O(U · chunk) plus the
``(B, num_nodes)`` result, never O(batch × (token, ancestor) pairs); batches larger than
``max_chunk`` rows run in chunks.

dtype: float64 by default on every device, so results match the CPU trie to rounding (sums of
small probabilities keep their relative precision). ``dtype=torch.float32`` halves memory traffic
on a GPU; sums then carry float32 rounding (relative error ~1e-7 per addition) and probabilities
below ~1e-38 underflow, so use ``weight_logsumexp`` on log weights for rare prefixes.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import TokenCharacterTrie
from .weights import check_weight_dtype

__all__ = ["ParallelTokenCharacterTrie"]


def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"ParallelTokenCharacterTrie: invalid device {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"ParallelTokenCharacterTrie: device {device!r} requested but CUDA is not available")
    return dev


class ParallelTokenCharacterTrie(TokenCharacterTrie):
    """``TokenCharacterTrie`` whose reductions run in torch on ``device``.

    Args:
        decode: vocabulary items, as for ``TokenCharacterTrie``.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``, or ``None`` (CUDA if
            available, else CPU).
        dtype: ``torch.float64`` (default) or ``torch.float32`` (see the module docstring).
        max_chunk: most batch rows reduced at once (bounds the ``(U, chunk)`` work tensor).

    Raises:
        ValueError: invalid device, CUDA requested but unavailable, bad dtype or ``max_chunk``.

    The reduction methods take ``ws`` ``(V,)`` / ``W`` ``(B, V)`` as numpy arrays, torch tensors
    on any device (moved to ``device``) or lists, and return torch tensors on ``device`` of
    ``dtype``, shape ``(num_nodes,)`` / ``(B, num_nodes)``; pass ``as_numpy=True`` for float64
    numpy arrays. Same dtype rules and errors as ``TokenCharacterTrie``.
    """

    def __init__(self, decode, device=None, dtype: torch.dtype = torch.float64, max_chunk: int = 64):
        super().__init__(decode)
        self.device = _resolve_device(device)
        if dtype not in (torch.float64, torch.float32):
            raise ValueError(f"ParallelTokenCharacterTrie: dtype must be torch.float64 or torch.float32, got {dtype}")
        if not isinstance(max_chunk, int) or max_chunk < 1:
            raise ValueError(f"ParallelTokenCharacterTrie: max_chunk must be a positive int, got {max_chunk!r}")
        self.dtype, self.max_chunk = dtype, max_chunk
        p = self._plan

        def t(a):
            return torch.as_tensor(np.ascontiguousarray(a), dtype=torch.long, device=self.device)

        self._t_order = t(p.order)
        self._t_node_segment = t(p.node_segment)
        self._t_levels = [(t(pa), t(ch), t(np.repeat(np.arange(len(pa)), cnt)), len(pa))
                          for pa, ch, _, cnt in p.levels]

    def _as_device_matrix(self, x, name: str, batched: bool) -> torch.Tensor:
        V = self.num_tokens
        where = type(self).__name__
        if isinstance(x, torch.Tensor):
            if x.is_complex() or x.dtype == torch.bool:
                check_weight_dtype("c" if x.is_complex() else "b", x.dtype, name, where)
            t = x.detach()
        elif batched and isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
            return self._as_device_matrix(torch.stack([r.detach().to(self.device) for r in x]), name, batched)
        else:
            from .weights import as_weight_matrix

            arr = as_weight_matrix(x, V, name, batched, where)
            return torch.as_tensor(arr, device=self.device).to(self.dtype)
        want = f"(B, {V})" if batched else f"({V},)"
        if t.dim() != (2 if batched else 1) or t.shape[-1] != V:
            raise ValueError(f"{where}: {name} must have shape {want} (V = len(decode)), got shape {tuple(t.shape)}")
        return t.to(device=self.device, dtype=self.dtype).reshape(-1, V)

    def _run(self, W: torch.Tensor, op: str, name: str = "W") -> torch.Tensor:
        B, N = W.shape[0], self.num_nodes
        out = torch.empty((B, N), dtype=self.dtype, device=self.device)
        if self.num_tokens == 0:
            return out.fill_(0.0 if op == "sum" else -float("inf"))
        U = self._plan.num_segments
        for lo in range(0, B, self.max_chunk):
            Wc = W[lo : lo + self.max_chunk]
            vals = torch.empty((U, Wc.shape[0]), dtype=self.dtype, device=self.device)
            vals[: self.num_tokens] = Wc[:, self._t_order].T
            for parents, children, group, P in self._t_levels:
                cv = vals[children]
                if op == "sum":
                    acc = torch.zeros((P, cv.shape[1]), dtype=self.dtype, device=self.device)
                    acc.index_add_(0, group, cv)
                elif op == "max":
                    acc = torch.full((P, cv.shape[1]), -float("inf"), dtype=self.dtype, device=self.device)
                    acc.scatter_reduce_(0, group[:, None].expand_as(cv), cv, "amax", include_self=True)
                else:
                    m = torch.full((P, cv.shape[1]), -float("inf"), dtype=self.dtype, device=self.device)
                    m.scatter_reduce_(0, group[:, None].expand_as(cv), cv, "amax", include_self=True)
                    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
                    acc = torch.zeros_like(m).index_add_(0, group, torch.exp(cv - m[group]))
                    acc = m + torch.log(acc)
                vals[parents] = acc
            out[lo : lo + Wc.shape[0]] = vals[self._t_node_segment].T
        if torch.isnan(out[:, 0]).any():
            bad = torch.isnan(W).nonzero()
            if len(bad):
                r, c = bad[0].tolist()
                where = f"[{c}]" if name == "ws" else f"[{r}, {c}]"
                raise ValueError(f"{type(self).__name__}: {name}{where} is NaN ({len(bad)} NaN weights)")
        return out

    def _finish(self, out: torch.Tensor, as_numpy: bool):
        return out.detach().cpu().to(torch.float64).numpy() if as_numpy else out

    def batch_weight_sum(self, W, as_numpy: bool = False):
        """Sums below every node: ``(B, V)`` -> ``(B, num_nodes)`` tensor on ``device`` (see class)."""
        return self._finish(self._run(self._as_device_matrix(W, "W", True), "sum"), as_numpy)

    def batch_weight_max(self, W, as_numpy: bool = False):
        """Maxes below every node (right for ``-inf``): ``(B, V)`` -> ``(B, num_nodes)``."""
        return self._finish(self._run(self._as_device_matrix(W, "W", True), "max"), as_numpy)

    def batch_weight_logsumexp(self, W, as_numpy: bool = False):
        """Log-sum-exp below every node, max-shifted per level: ``(B, V)`` -> ``(B, num_nodes)``."""
        return self._finish(self._run(self._as_device_matrix(W, "W", True), "logsumexp"), as_numpy)

    def weight_sum(self, ws, as_numpy: bool = False):
        """``(V,)`` -> ``(num_nodes,)``: sums below every node."""
        return self._finish(self._run(self._as_device_matrix(ws, "ws", False), "sum", "ws")[0], as_numpy)

    def weight_max(self, ws, as_numpy: bool = False):
        """``(V,)`` -> ``(num_nodes,)``: maxes below every node."""
        return self._finish(self._run(self._as_device_matrix(ws, "ws", False), "max", "ws")[0], as_numpy)

    def weight_logsumexp(self, ws, as_numpy: bool = False):
        """``(V,)`` -> ``(num_nodes,)``: log-sum-exp below every node."""
        return self._finish(self._run(self._as_device_matrix(ws, "ws", False), "logsumexp", "ws")[0], as_numpy)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.num_tokens} tokens, {self.num_nodes} nodes, {self.device}, {self.dtype})"
