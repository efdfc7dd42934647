"""``ParallelTokenCharacterTrie``: the same node values as ``TokenCharacterTrie`` on a torch device.

The trie's block plan (``genback.trie.blocks``, the CPU trie's own) is laid out once for torch
(``genback.trie.device_blocks``) and run as a fixed sequence of dense kernels on a ``(b, R)``
work tensor (``b`` = batch chunk, ``R`` < 2.5 V columns): the weights gathered into leaf order,
one elementwise kernel per level of a segment tree over that order (``log2 V`` levels, whatever
the trie's depth), one gather of every multi-block node slice's blocks and one dense reduction
per group of slices with the same (padded) block count; the caller's ``(B, num_nodes)`` result
rows are then gathered straight from the work tensor. Memory is O(R · chunk) plus the result;
batches larger than ``max_chunk`` rows run in chunks.

No kernel scatters or accumulates through an index (no atomics): results are bit-identical
between calls on every device, maxima equal the CPU trie's bit for bit (``-inf`` and negative
weights included; NaN raises), sums add the same terms as the CPU trie and agree with it to float64
rounding. On CUDA the ~25 kernels of a reduction are still launch-bound at small batches (an H100
host spends ~5–9 µs per launch), so by default each (reduction, batch bucket) is captured once as
a CUDA graph and replayed (buckets are powers of two up to ``max_chunk``; see :class:`_Graphs`);
measured in ``benchmarks/RESULTS.md`` ("The token-character trie on the GPU").

dtype: float64 by default on every device, so results match the CPU trie to rounding (sums of
small probabilities keep their relative precision). ``dtype=torch.float32`` halves memory traffic
on a GPU; sums then carry float32 rounding (relative error ~1e-7 per addition) and probabilities
below ~1e-38 underflow, so use ``weight_logsumexp`` on log weights for rare prefixes.
"""

from __future__ import annotations

import threading
import warnings

import torch

from .base import TokenCharacterTrie
from .device_blocks import gather_columns, make_device_blocks, run_device_blocks
from .weights import check_weight_dtype

__all__ = ["ParallelTokenCharacterTrie"]


class _Graphs:
    """CUDA graphs of one trie's reductions (PyTorch's ``torch.cuda.CUDAGraph``; the technique
    is NVIDIA's CUDA graphs, used for the same reason by vLLM's and gpt-fast's decode steps).

    One graph per (reduction, bucket), ``bucket`` = the chunk's row count rounded up to a power
    of two (at most ``max_chunk``), captured on first use into one memory pool shared by all of
    the trie's graphs; per bucket a static work tensor ``E`` ``(bucket, R)`` and gather buffer
    ``X`` ``(bucket, T)``, shared by the reductions. The leaf weights are gathered into ``E``
    before the replay (outside the graph, straight from the caller's rows); rows past the chunk
    hold stale values that are reduced and never read. Replays run one at a time (``lock``): the
    caller reads ``E`` before the next replay.
    """

    def __init__(self, trie: "ParallelTokenCharacterTrie"):
        self.trie = trie
        self.pool = torch.cuda.graph_pool_handle()
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.lock = threading.Lock()

    def run(self, Wc: torch.Tensor, op: str) -> torch.Tensor:
        """Work tensor rows ``(b, R)`` of the chunk ``Wc`` ``(b, V)``: a view of the bucket's
        ``E``, valid until the next replay (hold ``lock``)."""
        t, b = self.trie, Wc.shape[0]
        size = min(1 << (b - 1).bit_length(), t.max_chunk)
        if size not in self.buffers:
            self.buffers[size] = (t._work(size), t._scratch(size))
        E, X = self.buffers[size]
        t._load(E[:b], Wc)
        graph = self.graphs.get((op, size))
        if graph is None:
            graph = self.graphs[(op, size)] = self._capture(op, E, X)
        graph.replay()
        return E[:b]

    def _capture(self, op: str, E: torch.Tensor, X: torch.Tensor) -> torch.cuda.CUDAGraph:
        t = self.trie
        with torch.cuda.device(t.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up run outside the capture, as CUDA asks
                run_device_blocks(t._blocks_dev, E, X, op)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                run_device_blocks(t._blocks_dev, E, X, op)
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
        max_chunk: most batch rows reduced at once (bounds the ``(chunk, R)`` work tensor).
        cuda_graphs: on a CUDA device, replay each reduction as a captured CUDA graph (default
            True; see the module docstring). Ignored on other devices. A capture that fails
            warns once and the trie runs its kernels one by one from then on. Costs device
            memory that stays allocated: per batch bucket used, a ``(bucket, R)`` work tensor
            and a ``(bucket, T)`` gather buffer (``R + T`` ~3.3 V; about twice the largest
            bucket's in all; cl100k, float64, ``max_chunk=64``: ~340 MB).

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
        self._blocks_dev = make_device_blocks(self._blocks, self._layout.start, self.device)
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
        if not t.is_floating_point():
            t = t.to(self.dtype)  # floating rows keep their dtype: the leaf gather casts them
        return t.to(device=self.device).reshape(-1, V)

    def _run(self, W: torch.Tensor, op: str, name: str = "W") -> torch.Tensor:
        B, N = W.shape[0], self.num_nodes
        out = torch.empty((B, N), dtype=self.dtype, device=self.device)
        if self.num_tokens == 0:
            return out.fill_(0.0 if op == "sum" else -float("inf"))
        for lo in range(0, B, self.max_chunk):
            Wc = W[lo : lo + self.max_chunk]
            self._reduce(Wc, op, out[lo : lo + Wc.shape[0]])
        if torch.isnan(out[:, 0]).any():  # a NaN weight always reaches the root
            bad = torch.isnan(W).nonzero()
            if len(bad):
                r, c = bad[0].tolist()
                where = f"[{c}]" if name == "ws" else f"[{r}, {c}]"
                raise ValueError(f"{type(self).__name__}: {name}{where} is NaN ({len(bad)} NaN weights)")
        return out

    def _work(self, b: int) -> torch.Tensor:
        """A work tensor ``E`` ``(b, R)`` (``genback.trie.device_blocks``)."""
        return torch.zeros((b, self._blocks_dev.num_columns), dtype=self.dtype, device=self.device)

    def _scratch(self, b: int) -> torch.Tensor:
        """A gather buffer ``X`` ``(b, T)``."""
        return torch.zeros((b, self._blocks_dev.num_terms), dtype=self.dtype, device=self.device)

    def _reduce(self, Wc: torch.Tensor, op: str, out: torch.Tensor) -> None:
        """Node values of the chunk ``Wc`` ``(b, V)`` into ``out`` ``(b, num_nodes)`` (contiguous)."""
        db, graphs = self._blocks_dev, self._graphs
        if graphs is not None:
            with graphs.lock:
                try:
                    E = graphs.run(Wc, op)
                except RuntimeError as e:  # capture refused: run the kernels one by one
                    self._graphs = None
                    warnings.warn(f"{type(self).__name__}: CUDA graph capture failed ({e}); "
                                  "running without CUDA graphs", RuntimeWarning, stacklevel=4)
                else:
                    gather_columns(E, db.node_src, out)
                    return
        b = Wc.shape[0]
        E = torch.empty((b, db.num_columns), dtype=self.dtype, device=self.device)
        self._load(E, Wc)
        run_device_blocks(db, E, torch.empty((b, db.num_terms), dtype=self.dtype, device=self.device), op)
        gather_columns(E, db.node_src, out)

    def _load(self, E: torch.Tensor, Wc: torch.Tensor) -> None:
        """Gather the weights ``Wc`` ``(b, V)`` into leaf order, ``E[:, :V]`` (cast to ``dtype``)."""
        leaves = E[:, : self.num_tokens]
        if Wc.dtype == self.dtype:
            gather_columns(Wc, self._blocks_dev.order, leaves)
        else:
            leaves.copy_(torch.index_select(Wc, 1, self._blocks_dev.order))

    def _finish(self, out: torch.Tensor, as_numpy: bool):
        return out.detach().cpu().to(torch.float64).numpy() if as_numpy else out

    def batch_weight_sum(self, W, as_numpy: bool = False):
        """Sums below every node: ``(B, V)`` -> ``(B, num_nodes)`` tensor on ``device`` (see class)."""
        return self._finish(self._run(self._as_device_matrix(W, "W", True), "sum"), as_numpy)

    def batch_weight_max(self, W, as_numpy: bool = False):
        """Maxes below every node (right for ``-inf``): ``(B, V)`` -> ``(B, num_nodes)``."""
        return self._finish(self._run(self._as_device_matrix(W, "W", True), "max"), as_numpy)

    def batch_weight_logsumexp(self, W, as_numpy: bool = False):
        """Log-sum-exp below every node (``logaddexp`` of tree pairs, max-shifted ``logsumexp`` of
        grouped blocks): ``(B, V)`` -> ``(B, num_nodes)``."""
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
