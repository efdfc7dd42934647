"""``ParallelTokenCharacterTrie``: the same node values as ``TokenCharacterTrie`` on a torch device.

Structure and reduction plan are built once on the CPU (``genback.trie.build`` / ``plan``) and
copied to the device. A call runs the plan level by level with ``index_add_`` (sum),
``scatter_reduce_(..., "amax")`` (max) or a max-shifted log-sum-exp, on a ``(U, b)`` work tensor
(``U`` = distinct node slices, at most ``2V``; ``b`` = batch chunk). Memory is O(U · chunk) plus the
``(B, num_nodes)`` result, never O(batch × (token, ancestor) pairs); batches larger than
``max_chunk`` rows run in chunks.

Each level's children occupy one block of rows of the work tensor and are reduced into the rows
after it, so a level of sums or maxes is one kernel (``__init__`` builds the layout). On CUDA
the ~50 levels are still launch-bound (an H100 host spends ~5–9 µs per launch; the loop took
~3 ms a call whatever the batch), so by default each (reduction, batch bucket) is captured once
as a CUDA graph and replayed (buckets are powers of two up to ``max_chunk``; see
:class:`_Graphs`); measured in ``benchmarks/RESULTS.md`` ("The token-character trie on the
GPU"). Sums on CUDA are equal to rounding, not bit for bit, between calls: ``index_add_`` adds
in no fixed order.

dtype: float64 by default on every device, so results match the CPU trie to rounding (sums of
small probabilities keep their relative precision). ``dtype=torch.float32`` halves memory traffic
on a GPU; sums then carry float32 rounding (relative error ~1e-7 per addition) and probabilities
below ~1e-38 underflow, so use ``weight_logsumexp`` on log weights for rare prefixes.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import torch

from .base import TokenCharacterTrie
from .weights import check_weight_dtype

__all__ = ["ParallelTokenCharacterTrie"]


class _Graphs:
    """CUDA graphs of one trie's reductions (PyTorch's ``torch.cuda.CUDAGraph``; the technique
    is NVIDIA's CUDA graphs, used for the same reason by vLLM's and gpt-fast's decode steps).

    One graph per (reduction, bucket), ``bucket`` = the chunk's row count rounded up to a power
    of two (at most ``max_chunk``), captured on first use into one memory pool shared by all of
    the trie's graphs; per bucket a static input ``(bucket, V)`` and work tensor ``(U, bucket)``,
    shared by the reductions. Replays run one at a time (``lock``): the caller reads the work
    tensor before the next replay.
    """

    def __init__(self, trie: "ParallelTokenCharacterTrie"):
        self.trie = trie
        self.pool = torch.cuda.graph_pool_handle()
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.lock = threading.Lock()

    def run(self, Wc: torch.Tensor, op: str) -> torch.Tensor:
        """Segment values ``(U, b)`` of the chunk ``Wc`` ``(b, V)``: a view of the bucket's work
        tensor, valid until the next replay (hold ``lock``)."""
        t, b = self.trie, Wc.shape[0]
        size = min(1 << (b - 1).bit_length(), t.max_chunk)
        if size not in self.buffers:
            self.buffers[size] = (
                torch.zeros((size, t.num_tokens), dtype=t.dtype, device=t.device),
                torch.empty((t._plan.num_segments, size), dtype=t.dtype, device=t.device))
        inp, vals = self.buffers[size]
        inp[:b].copy_(Wc)
        graph = self.graphs.get((op, size))
        if graph is None:
            graph = self.graphs[(op, size)] = self._capture(op, inp, vals)
        graph.replay()
        return vals[:, :b]

    def _capture(self, op: str, inp: torch.Tensor, vals: torch.Tensor) -> torch.cuda.CUDAGraph:
        t = self.trie

        def body():
            t._load(vals, inp, op)
            t._levels(vals, op)

        with torch.cuda.device(t.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up run outside the capture, as CUDA asks
                body()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                body()
        return graph


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
        cuda_graphs: on a CUDA device, replay each reduction as a captured CUDA graph (default
            True; see the module docstring). Ignored on other devices. A capture that fails
            warns once and the trie runs its kernels one by one from then on. Costs device
            memory that stays allocated: per batch bucket used, a ``(bucket, V)`` input and a
            ``(U, bucket)`` work tensor (about twice the largest bucket's in all; cl100k, float64,
            ``max_chunk=64``: ~250 MB).

    Raises:
        ValueError: invalid device, CUDA requested but unavailable, bad dtype or ``max_chunk``.
        TypeError: ``cuda_graphs`` not a bool.

    The reduction methods take ``ws`` ``(V,)`` / ``W`` ``(B, V)`` as numpy arrays, torch tensors
    on any device (moved to ``device``) or lists, and return torch tensors on ``device`` of
    ``dtype``, shape ``(num_nodes,)`` / ``(B, num_nodes)``; pass ``as_numpy=True`` for float64
    numpy arrays. Same dtype rules and errors as ``TokenCharacterTrie``.
    """

    def __init__(self, decode, device=None, dtype: torch.dtype = torch.float64, max_chunk: int = 64,
                 cuda_graphs: bool = True):
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"ParallelTokenCharacterTrie: cuda_graphs must be a bool, got {cuda_graphs!r}")
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

        # Device layout of the (U, b) work tensor: each level's children take one block of rows,
        # levels in order, the roots last. A parent is a child of a later level (or a root), so
        # its row lies after its children's block: a level reduces the slice vals[lo:hi] into
        # vals[hi:] in one kernel (index_add_ / scatter_reduce_), with no gather of the children
        # and no store of the parents.
        row = np.empty(p.num_segments, np.int64)
        roots = np.ones(p.num_segments, bool)
        end, blocks = 0, []
        for _, ch, _, _ in p.levels:
            row[ch] = end + np.arange(len(ch))
            roots[ch] = False
            blocks.append((end, end + len(ch)))
            end += len(ch)
        row[roots] = end + np.arange(int(roots.sum()))
        self._t_order = t(p.order)
        self._t_leaf_rows = t(row[: self.num_tokens])  # segment k < V is leaf-order word k
        self._t_node_rows = t(row[p.node_segment])
        self._t_levels = []
        for (pa, _, _, cnt), (lo, hi) in zip(p.levels, blocks):
            group = np.repeat(np.arange(len(pa)), cnt)  # each child's parent, 0..P-1
            self._t_levels.append((lo, hi, t(row[pa][group] - hi), t(group), t(row[pa] - hi), len(pa)))
        self._graphs = _Graphs(self) if cuda_graphs and self.device.type == "cuda" else None

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
        for lo in range(0, B, self.max_chunk):
            Wc = W[lo : lo + self.max_chunk]
            out[lo : lo + Wc.shape[0]] = self._reduce(Wc, op)
        if torch.isnan(out[:, 0]).any():
            bad = torch.isnan(W).nonzero()
            if len(bad):
                r, c = bad[0].tolist()
                where = f"[{c}]" if name == "ws" else f"[{r}, {c}]"
                raise ValueError(f"{type(self).__name__}: {name}{where} is NaN ({len(bad)} NaN weights)")
        return out

    def _reduce(self, Wc: torch.Tensor, op: str) -> torch.Tensor:
        """Node values ``(b, num_nodes)`` of the chunk ``Wc`` ``(b, V)``."""
        graphs = self._graphs
        if graphs is not None:
            with graphs.lock:
                try:
                    return graphs.run(Wc, op)[self._t_node_rows].T
                except RuntimeError as e:  # capture refused: run the kernels one by one
                    self._graphs = None
                    warnings.warn(f"{type(self).__name__}: CUDA graph capture failed ({e}); "
                                  "running without CUDA graphs", RuntimeWarning, stacklevel=4)
        vals = torch.empty((self._plan.num_segments, Wc.shape[0]), dtype=self.dtype, device=self.device)
        self._load(vals, Wc, op)
        self._levels(vals, op)
        return vals[self._t_node_rows].T

    def _load(self, vals: torch.Tensor, Wc: torch.Tensor, op: str) -> None:
        """Put the leaf weights of ``Wc`` ``(b, V)`` in their rows of ``vals`` (first ``b``
        columns); the inner rows start at the reduction's identity (0 for sums, -inf for maxes)."""
        if op != "logsumexp":  # log-sum-exp writes its parents whole
            vals.fill_(0.0 if op == "sum" else -float("inf"))
        vals[self._t_leaf_rows, : Wc.shape[0]] = Wc[:, self._t_order].T

    def _levels(self, vals: torch.Tensor, op: str) -> None:
        """Fill the inner rows of ``vals`` ``(U, b)`` from its leaf rows, level by level."""
        for lo, hi, dest, group, parent_rows, P in self._t_levels:
            cv, above = vals[lo:hi], vals[hi:]  # disjoint views: children, later rows
            if op == "sum":
                above.index_add_(0, dest, cv)
            elif op == "max":
                above.scatter_reduce_(0, dest[:, None].expand_as(cv), cv, "amax", include_self=True)
            else:
                m = torch.full((P, cv.shape[1]), -float("inf"), dtype=self.dtype, device=self.device)
                m.scatter_reduce_(0, group[:, None].expand_as(cv), cv, "amax", include_self=True)
                m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
                acc = torch.zeros_like(m).index_add_(0, group, torch.exp(cv - m[group]))
                above[parent_rows] = m + torch.log(acc)

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
