"""The uniform decode step: every row one new token after a cached context, replayed as a CUDA graph.

An SMC step or a decoding step asks, for each of ``R`` rows, the next-token logits after a
context whose KV is cached but for its last token. On a GPU the tree path
(:func:`.forward.tree_forward`) is launch-bound there: ~40 kernels per layer from transformers'
modules plus tree attention's, each costing the host ~5-9 us, while the device idles. This
module runs such a step over **static buffers** (token ids, positions, new slots, a slot table,
attention biases), so the whole model forward can be captured once per bucket as a CUDA graph
and replayed with a few copies, as vLLM, SGLang, nano-vllm and gpt-fast do for their decode
steps. Prefill and mixed batches stay on the tree path.

Attention inside the graph is a fixed **two-level cascade** over the KV pool
(:mod:`.cascade`: :class:`~.cascade.DecodeBuffers` and :func:`~.cascade.decode_attention`):

* level 0: the prefix every row shares (the prompt: the tree's segments on all rows' paths),
  gathered once per layer and attended by all rows' queries stacked in one product;
* level 1: each row's own slots (the rest of its context, left-padded with slot 0) and its new
  token, as a ``[R, W]`` slot table with an additive bias (0 attend, -inf padding);
* the two merged by log-sum-exp.

Worked example (3 rows after a 4-token prompt in slots 1-4, rows a and b one token on, c two,
new tokens in slots 9, 10, 11; ``W`` and the prefix shown padded to 16 for brevity)::

    prefix = [1, 2, 3, 4, 0, 0, ...]          bias0 = [0, 0, 0, 0, -inf, ...]
    table  = [[0, 0, 5, 9, 0, ...],           bias1 = [[-inf, -inf, 0, 0, -inf, ...],
              [0, 0, 6, 10, 0, ...],                   [-inf, -inf, 0, 0, -inf, ...],
              [0, 7, 8, 11, 0, ...]]                   [-inf, 0, 0, 0, -inf, ...]]

**Buckets.** Rows are padded to a power of two, the table's width and the prefix to multiples
of 16 (the alignment CUDA's fused attention asks of a bias): powers of two (from 32) for the
width, 256 for the prefix. A padded row reads only its own new token (written to the dummy slot 0, never
read unmasked) and its logits are never read. One graph per ``(rows, width, prefix)`` bucket,
captured lazily on first use into one memory pool shared by all of them; a capture that fails
warns once and the runner falls back to the tree path. Graphs are dropped when the pool's store
grows (their addresses are baked in).

**Chunks.** A step whose table would exceed :data:`MAX_TABLE_SLOTS` (or that has more than
:data:`MAX_ROWS` rows) runs as halves, then quarters of its rows (:meth:`DecodeStep.layouts`),
one forward each; beyond :data:`MAX_CHUNKS` chunks, the tree path.

The same code runs eagerly (``graphs=False``, any device): that is what the CPU tests compare
with the tree path and an uncached forward.
"""

from __future__ import annotations

import sys
import time
import warnings

import numpy as np
import torch

from . import tree_attention
from .cascade import DecodeBuffers, decode_attention
from .kv_pool import KVPool
from .lanes import REFRESH, Lanes
from .segments import split_segments
from .tree_cache import TreeCache, cache_argument

NAME = "genback_decode"

# most rows x table width one forward of the step may have (the level-1 gather is [2, kv_heads,
# rows * width, head_dim] per layer); a wider step is run in chunks of rows (MAX_CHUNKS)
MAX_TABLE_SLOTS = 1 << 16
MAX_ROWS = 512

# most chunks of rows one step is split into when it does not fit one forward (halves, then
# quarters), else it takes the tree path. Each chunk is one more replay, which reads the weights
# again: on an H100 a 1B step's GPU time is 3.7-7.9 ms and the tree path's step 28-59 ms
# (benchmarks/RESULTS.md, "GPU: the captured decode step"), so four replays stay well under the
# eager tree path; the bound is to be measured with an 8B model
MAX_CHUNKS = 4


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# the table's narrowest bucket: an SMC run's rows grow by a token a step, and each new width bucket
# is a capture (45-70 ms on a 1B model, measured); 32 columns cover a run's first 31 steps
MIN_WIDTH = 32


def bucket(rows: int, width: int, prefix: int) -> tuple[int, int, int]:
    """``(rows, width, prefix)`` rounded up to their bucket: rows to a power of two, the table's
    width to a power of two of at least :data:`MIN_WIDTH`, the prefix to a multiple of 256 (0
    stays 0)."""
    return _pow2(rows), max(MIN_WIDTH, _pow2(width)), -(-prefix // 256) * 256


def is_uniform(group) -> bool:
    """Whether planned paths ``group`` are a uniform decode step: each path forwards one token
    after a cached context and answers one next-token row or decoding step at its end."""
    from ...query import NextToken, Step

    for p in group:
        if p.n_new != 1 or p.cached == 0 or len(p.outputs) != 1:
            return False
        o = p.outputs[0]
        if o.end != len(p.tokens) or type(o.query) not in (NextToken, Step):
            return False
    return True


class DecodeStep:
    """Runs uniform decode steps over static buffers; on CUDA replays one captured graph per
    bucket.

    Args:
        model: the causal LM (transformers, attention interface).
        pool: the runner's :class:`~.kv_pool.KVPool`.
        graphs: capture and replay CUDA graphs (False: run the same code eagerly).
        max_graphs: most graphs kept; further buckets run eagerly.
        max_graph_bytes: no more captures once the graphs' memory pool (counted as the device
            memory each capture reserved) reaches this (None: an eighth of the device's memory);
            further buckets run eagerly.

    Attributes:
        min_prefix: level 0 of the cascade is used when the step's rows (two or more) share at
            least this many cached tokens (default 1); ``sys.maxsize``: never, every row
            attends its whole context in level 1 (the dense layout; a step wider than
            :data:`MAX_TABLE_SLOTS` then runs in chunks of rows, or takes the tree path). For measuring where the cascade
            pays (``bench_gpu.py --genback graphs-dense``).
        steps (forwards run: a step split into chunks counts each), replays, captures,
            capture_seconds, graph_bytes (device memory reserved by captures), lane_steps
            (steps laid out from the last step's rows, :mod:`.lanes`), split_steps (steps run
            in chunks of rows, :meth:`layouts`), failed (the capture error, once: later steps
            run eagerly): statistics.
    """

    def __init__(self, model, pool: KVPool, *, graphs: bool, max_graphs: int = 32,
                 max_graph_bytes: int | None = None):
        self.model = model
        self.pool = pool
        self.graphs_on = graphs
        self.max_graphs = max_graphs
        if max_graph_bytes is None and graphs:
            max_graph_bytes = torch.cuda.get_device_properties(pool.device).total_memory // 8
        self.max_graph_bytes = max_graph_bytes
        cfg = model.config
        heads = getattr(cfg, "num_attention_heads", pool.heads)
        self.groups = max(1, heads // pool.heads)
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self.buffers: dict[tuple, DecodeBuffers] = {}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._mempool = None
        self._version = pool.version
        self.steps = self.replays = self.captures = self.lane_steps = self.split_steps = 0
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        self.failed: str | None = None
        self.min_prefix = 1
        self._lanes: list[Lanes] = []  # the last step's rows, per chunk (see .lanes)
        self._rows = 0  # the last step's rows
        self._split_age = 0  # steps split alike since the whole step was tried
        tree_attention.register(NAME, decode_attention)

    def stats(self) -> dict:
        return {"decode_steps": self.steps, "decode_replays": self.replays,
                "decode_graphs": len(self.graphs), "decode_captures": self.captures,
                "decode_capture_seconds": round(self.capture_seconds, 4),
                "decode_graph_bytes": self.graph_bytes, "decode_lane_steps": self.lane_steps,
                "decode_split_steps": self.split_steps}

    def clear(self) -> None:
        """Drop every graph and buffer (their memory goes back to the allocator)."""
        self.graphs.clear()
        self.buffers.clear()
        self._mempool = None
        self._lanes = []

    def layouts(self, group) -> list[tuple[int, int, tuple]] | None:
        """The step as ``[(start, stop, arrays), ...]``: contiguous chunks of rows
        ``group[start:stop]`` in order, each with :meth:`layout`'s arrays (its new slots taken
        from the pool). One chunk when the step fits one forward; else 2, then
        :data:`MAX_CHUNKS` equal chunks. A step with as many rows as the last one, which was
        split, is split alike at once (each chunk laid out from the same chunk of the last
        step when its rows extend those, :class:`.lanes.Lanes`), the whole tried again every
        :data:`.lanes.REFRESH` steps. None (nothing taken from the pool) when the chunks do
        not fit either: then the tree path runs it."""
        R, last = len(group), self._lanes
        n = start = (len(last) if len(last) > 1 and R == self._rows
                     and self._split_age < REFRESH else 1)
        while n <= MAX_CHUNKS and n <= max(1, R):
            parts, made = [], []
            for j in range(n):
                a, b = R * j // n, R * (j + 1) // n
                out = self.layout(group[a:b], last[j] if len(last) == n else None)
                if out is None:
                    break
                parts.append((a, b, out[0]))
                made.append(out[1])
            else:
                self._lanes, self._rows = made, R
                self.lane_steps += sum(1 for lanes in made if lanes.age)
                if n > 1:
                    self.split_steps += 1
                    self._split_age = 1 if start == 1 else self._split_age + 1
                else:
                    self._split_age = 0
                return parts
            for _, _, arrays in parts:  # (the chunks laid out before one did not fit)
                self.pool.free(arrays[2])
            n *= 2
        self._lanes = []
        return None

    def layout(self, group, lanes: Lanes | None = None) -> tuple[tuple, Lanes] | None:
        """The host arrays of one forward over ``group`` and their :class:`.lanes.Lanes`, or
        None when it is too wide for this path. The arrays: ``(ids, positions, new_slots,
        table, pads, prefix)`` (see :meth:`.cascade.DecodeBuffers.fill`; new slots are taken
        from the pool here). When every path extends a context of ``lanes`` (a last forward's
        rows) by one token, the table is those rows plus a column; otherwise, or every
        :data:`.lanes.REFRESH` steps, the tree's segments are laid out again
        (:func:`.segments.split_segments`)."""
        R = len(group)
        if R > MAX_ROWS:
            return None
        pool, past = self.pool, None
        rows = None if lanes is None else lanes.rows(group, pool.frees)
        if rows is not None:  # the last step's rows, gathered (see .lanes)
            past, pads = lanes.gather(rows)
            prefix, age = lanes.prefix, lanes.age + 1
            if _pow2(R) * bucket(R, past.shape[1] + 1, 0)[1] > MAX_TABLE_SLOTS:
                past = None  # (a full layout may share more)
        if past is None:
            # level 0 is the prefix of two or more rows; a single row's whole context is its
            # own (its width then grows through power-of-two buckets, not a prefix bucket per 256)
            shared, private = split_segments(group, self.min_prefix if R > 1 else sys.maxsize,
                                             shared_by_all=True)
            prefix = (np.concatenate([s for s, _ in shared]) if shared
                      else np.empty(0, dtype=np.int64))
            width = int(private.path_lengths().max()) + 1 if R else 1
            if _pow2(R) * bucket(R, width, 0)[1] > MAX_TABLE_SLOTS:
                return None
            new_slots = pool.alloc(R)
            table, pads = private.layout(new_slots[:, None])
            age = 0
        else:
            new_slots = pool.alloc(R)
            table = np.concatenate([past, new_slots[:, None]], axis=1)
        ids = np.fromiter((p.tokens[-1] for p in group), dtype=np.int64, count=R)
        positions = np.fromiter((p.cached for p in group), dtype=np.int64, count=R)
        return ((ids, positions, new_slots, table, pads, prefix),
                Lanes(group, table, pads, prefix, pool.frees, age))

    def run(self, arrays) -> tuple[torch.Tensor, int]:
        """Run one step from :meth:`layout`'s arrays; return the rows' logits float32 ``[R, V]``
        (a view of the bucket's static buffer: read it before the next step) and the KV bytes
        attention read."""
        ids, positions, new_slots, table, pads, prefix = arrays
        R, W = table.shape
        if self.pool.version != self._version:  # the store moved: graphs hold its old address
            self.clear()
            self._version = self.pool.version
        key = bucket(R, W, len(prefix))
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = DecodeBuffers(self.pool, key, self.groups, self.vocab)
        buf.fill(ids, positions, new_slots, table, pads, prefix)
        self.steps += 1
        graph = self.graphs.get(key)
        if graph is None and self.graphs_on and self.failed is None \
                and len(self.graphs) < self.max_graphs and self.graph_bytes < self.max_graph_bytes:
            graph = self._capture(buf)
        if graph is not None:
            graph.replay()
            self.replays += 1
        else:
            self._forward(buf)
        return buf.logits[:R], self.pool.token_bytes * (len(prefix) + R * (W - 1))

    def _forward(self, buf: DecodeBuffers) -> None:
        model = self.model
        with torch.inference_mode(), tree_attention.active(buf), \
                tree_attention.use_tree_attention(model.config, NAME):
            buf.prepare()
            out = model(input_ids=buf.ids, position_ids=buf.positions, use_cache=True,
                        logits_to_keep=1, **cache_argument(model, TreeCache(buf)))
            buf.logits.copy_(out.logits[:, -1])

    def _capture(self, buf: DecodeBuffers):
        """Capture ``buf``'s bucket (after one eager warm-up run on a side stream, which also
        computes this step); None, with one warning, when capture fails."""
        t0 = time.perf_counter()
        dev = self.pool.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        try:
            with torch.cuda.stream(stream):
                self._forward(buf)  # warm-up (lazy initialisations happen outside capture)
            torch.cuda.current_stream(dev).wait_stream(stream)
            # (torch.cuda.graph empties the allocator's cache on entry: empty it first, so the
            # reserved memory it adds is the graph pool's own)
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(dev)
            if self._mempool is None:
                self._mempool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
                self._forward(buf)
        except Exception as exc:  # noqa: BLE001 (any capture failure falls back)
            self.failed = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"genback: capturing the decode step as a CUDA graph failed; running "
                          f"it without graphs ({self.failed})", RuntimeWarning, stacklevel=2)
            try:
                torch.cuda.synchronize(dev)
            except RuntimeError:  # (a capture error may also surface here)
                pass
            return None
        self.graphs[buf.key] = graph
        self.captures += 1
        self.capture_seconds += time.perf_counter() - t0
        self.graph_bytes += torch.cuda.memory_reserved(self.pool.device) - before
        return graph


__all__ = ["DecodeStep", "bucket", "is_uniform"]
