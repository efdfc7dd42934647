"""The uniform decode step: every row one new token after a cached context, replayed as a CUDA graph.

An SMC step or a decoding step asks, for each of ``R`` rows, the next-token logits after a
context whose KV is cached but for its last token. On a GPU the tree path
(:class:`..forward.tree.TreeForward`) is launch-bound there: ~40 kernels per layer from transformers'
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

Worked example (``tests/test_decode_layout.py`` runs it, with level 0 kept for this short
prompt: see ``level0_min_tokens``): 3 rows after a 4-token prompt in slots 1-4; rows a and b
one token on (slots 5 and 6), row c two (slots 7 and 8); the step's new tokens go to slots 9,
10, 11. The layout (:class:`.cascade.StepLayout`)::

    prefix = [1, 2, 3, 4]
    table  = [[0, 5,  9],        pads = [1, 1, 0]       bias1 = [[-inf, 0, 0],
              [0, 6, 10],                                        [-inf, 0, 0],
              [7, 8, 11]]                                        [   0, 0, 0]]

In its bucket ``(4, 32, 256)`` the buffers hold it padded: a 4 x 32 table (the padded row 3 all
slot 0, reading only its last real column), ``bias1`` -inf beyond column 2, and a 256-slot
prefix whose ``bias0`` is -inf beyond its 4 real slots.

**Buckets.** Rows are padded to a power of two, the table's width and the prefix to multiples
of 16 (the alignment CUDA's fused attention asks of a bias): powers of two (from 32) for the
width, 256 for the prefix. A padded row reads only its own new token (written to the dummy slot
0, never read unmasked) and its logits are never read. One graph per ``(rows, width, prefix)``
bucket, captured lazily at its second use (the first runs eagerly: :mod:`.graphs`) into one
memory pool shared by all of them; a capture that fails warns once and later steps run eagerly.
Graphs are dropped when the pool's store grows (their addresses are baked in).

**Chunks.** A step whose table would exceed :data:`MAX_TABLE_SLOTS` (or that has more than
:data:`MAX_ROWS` rows) runs as halves, then quarters of its rows (:meth:`DecodeStep.layouts`),
one forward each (:mod:`.chunks`); beyond :data:`.chunks.MAX_CHUNKS` chunks, the tree path.

The same code runs eagerly (``graphs=False``, any device): that is what the CPU tests compare
with the tree path and an uncached forward.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import torch

from ..cache.kv_pool import KVPool
from ..forward import attention as tree_attention
from ..forward.base import ForwardOut, cached_lengths, last_tokens
from ..forward.results import outputs, results
from ..forward.tree_cache import TreeCache, cache_argument
from ..plan.lanes import Lanes, path_tokens
from ..plan.segments import split_segments
from ....queries.context import last_ids
from . import compiled as glue
from .buckets import _pow2, bucket
from .chunks import Chunks
from .cascade import (FLASH0_MIN_WORK, DecodeBuffers, StepLayout, decode_attention,
                      flash_level0_pays)
from .fused import FusedNorms
from .graphs import StepGraphs
from .level0 import KeptPrefixes
from .projections import FusedProjections
from .rope import RopeOp

NAME = "genback_decode"

# most rows x table width one forward of the step may have (the level-1 gather is [2, kv_heads,
# rows * width, head_dim] per layer); a wider step is run in chunks of rows (.chunks)
MAX_TABLE_SLOTS = 1 << 16
MAX_ROWS = 512

class DecodeStep(Chunks):
    """Runs uniform decode steps over static buffers; on CUDA replays one captured graph per
    bucket.

    Args:
        model: the causal LM (transformers, attention interface).
        pool: the runner's :class:`~..cache.kv_pool.KVPool`.
        graphs: capture and replay CUDA graphs, each checked at its first replay
            (:class:`.graphs.StepGraphs`; False: run the same code eagerly).
        row_device: where next-token rows go.
        max_graphs: most graphs kept; further buckets run eagerly.
        max_graph_bytes: no more captures once the graphs' memory pool (counted as the device
            memory each capture reserved) reaches this (None: an eighth of the device's memory);
            further buckets run eagerly.

    Attributes:
        min_prefix: level 0 of the cascade is used when the step's rows (two or more) share at
            least this many cached tokens (default 1); ``sys.maxsize``: never, every row
            attends its whole context in level 1 (the dense layout; a step wider than
            :data:`MAX_TABLE_SLOTS` then runs in chunks of rows, or takes the tree path). For
            measuring where the cascade pays (``bench_gpu.py --genback graphs-dense``).
        level0_min_tokens, level0_min_saved: a shared prefix shorter than
            ``level0_min_tokens`` (default 256, level 0's bucket) whose reads saved,
            ``(rows - 1) * length``, are under ``level0_min_saved`` (default 4,096) is laid out
            in every row instead (the dense layout), where that fits. Measured with CUDA graphs
            (``benchmarks/RESULTS.md``, "Where level 0 pays", an H100 and an H200, 1B and 8B
            Llama shapes): over a 100-token prompt at 4 and 16 rows the dense layout was 9-25 %
            faster; at 64 rows, or from 500 tokens on, the cascade (up to 2.1x).
        flash_level0: level 0's real keys attended without a bias, by FlashAttention-2's
            kernel on CUDA in bf16 / fp16, and only its last 256 keys (where the prefix's
            padding lies) with one (:func:`.cascade._prefix_chunks`); False: the
            memory-efficient kernel with a bias over the whole prefix; None (default): on CUDA
            in bf16 / fp16 where a bucket's level 0 is large (:func:`flash_level0_pays`),
            elsewhere off. Set it before the first step: a captured graph keeps the kernels it
            was captured with.
        norm_op: the model's RMSNorms run as torch's ``rms_norm`` operator (:mod:`.fused`'s
            :func:`~.fused.rms_norm_op`: on CUDA one fused kernel and the weight's product for
            transformers' 8) during the step's forwards; default True on CUDA (measured in
            ``benchmarks/RESULTS.md``, "Issue 38, part 1 on an H200 (session 57)"), False elsewhere (on a
            CPU the operator computes what the model's norm does). Set it before the first step.
        keep_level0: level 0's KV kept across steps (:mod:`.level0`, in ``level0``: copied for
            all layers when the prefix changes, then read in place, not gathered by each layer
            at each step); default True on CUDA, False elsewhere.
        rope_op: the model's rotary position embeddings run as :func:`.rope.apply_rotary_pos_emb`
            during the step's forwards (the same values bit for bit, 4 kernels for the query and
            4 for the key of each layer where transformers runs 5 each: :mod:`.rope`); default
            True on CUDA, False elsewhere. Set it before the first step.
        fuse_projections: each layer's query, key and value projections run as one matrix
            product, and its MLP's gate and up as one, during the step's forwards
            (:mod:`.projections`: the model's weights are laid out once as blocks of one tensor,
            values unchanged); default True on CUDA, False elsewhere. Set it before the first
            step.
        fused: the model's RMSNorms run as one ``torch.compile``'d function (:mod:`.fused`) and
            the cascade's levels are merged by a compiled :func:`.cascade.merge_levels`; compile:
            that and each layer's glue compiled too (:mod:`.compiled`). Both default False (fused
            took the least GPU time on an H200 but compiled for 4-7 s: ``benchmarks/RESULTS.md``,
            session 57; ``bench_gpu.py --genback auto-fused``, ``auto-compiled``). Set them first.
        graphs: the :class:`.graphs.StepGraphs` (its statistics: replays, captures, verified
            and rejected buckets, graph memory).
        steps (forwards run: a step split into chunks counts each), lane_steps (steps laid out
            from the last step's rows, :mod:`..plan.lanes`), split_steps (steps run in chunks of
            rows, :meth:`layouts`): statistics.
    """

    def __init__(self, model, pool: KVPool, *, graphs: bool, row_device: torch.device,
                 max_graphs: int = 32, max_graph_bytes: int | None = None):
        self.model = model
        self.pool = pool
        self.row_device = row_device
        self.graphs = StepGraphs(pool.device, pool.dtype, enabled=graphs, max_graphs=max_graphs,
                                 max_graph_bytes=max_graph_bytes)
        cfg = model.config
        heads = getattr(cfg, "num_attention_heads", pool.heads)
        self.groups = max(1, heads // pool.heads)
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self.buffers: dict[tuple, DecodeBuffers] = {}
        self._version = pool.version
        self.steps = self.lane_steps = self.split_steps = 0
        self.min_prefix = 1
        self.level0_min_tokens, self.level0_min_saved = 256, 4096
        self.flash_level0: bool | None = None
        self.norm_op = self.rope_op = self.keep_level0 = self.fuse_projections = \
            pool.device.type == "cuda"
        self.level0 = KeptPrefixes(pool)
        self.fused = self.compile = False
        self._layers: glue.CompiledLayers | None = None
        self._norms, self._rope = None, None  # (FusedNorms, RopeOp: made at the first forward)
        self._projections: FusedProjections | None = None
        self._lanes: list[Lanes] = []  # the last step's rows, per chunk (see .lanes)
        self._rows = 0  # the last step's rows
        self._split_age = 0  # steps split alike since the whole step was tried
        tree_attention.register(NAME, decode_attention)

    def stats(self) -> dict:
        return {"decode_steps": self.steps, "decode_lane_steps": self.lane_steps,
                "decode_split_steps": self.split_steps,
                "decode_level0_copies": self.level0.copies, **self.graphs.stats()}

    def clear(self) -> None:
        """Drop every graph and buffer (their memory goes back to the allocator)."""
        self.graphs.clear()
        self.buffers.clear()
        self.level0.clear()
        self._lanes = []

    def run(self, group) -> ForwardOut | None:
        """Run the uniform step ``group`` (paths, :func:`..plan.batch.is_uniform`) as one forward or a few
        over chunks of its rows (:meth:`layouts`); None, with nothing taken from the pool, when
        it does not fit: then the tree path runs it. Each chunk's rows are read before the next
        chunk runs (the logits live in the bucket's static buffer); if a chunk fails, every
        chunk's new slots go back to the pool."""
        chunks = self.layouts(group)
        if chunks is None:
            return None
        values, read = [], 0
        try:
            for c in chunks:
                logits, chunk_read = self.forward(c.layout)
                values += outputs(group[c.start:c.stop], logits, self.row_device)
                read += chunk_read
        except BaseException:
            for c in chunks:
                self.pool.free(c.layout.new_slots)
            raise
        new = (chunks[0].layout.new_slots if len(chunks) == 1
               else np.concatenate([c.layout.new_slots for c in chunks]))
        return ForwardOut(values, new.reshape(len(group), 1), read, len(chunks))

    @property
    def lanes(self) -> Lanes | None:
        """The last step's rows when it ran as one forward (None: in chunks, or none kept):
        what a step chain continues (:class:`..chain.StepChain`)."""
        lanes = self._lanes
        return lanes[0] if len(lanes) == 1 else None

    def step(self, queries: list, contexts: list, rows: np.ndarray, lengths: np.ndarray,
             adapter) -> ForwardOut | None:
        """A uniform step given as rows, not paths (:class:`..chain.StepChain`), as
        :meth:`..forward.tree.TreeForward.step`: query ``i`` asks for ``contexts[i]``
        (``lengths[i]`` tokens, ``int64``), the context of row ``rows[i]`` of :attr:`lanes`
        (valid: :meth:`..plan.lanes.Lanes.rows`) plus one token. The same forward as
        :meth:`run` of their paths laid out from those lanes in one chunk; None, with nothing
        taken from the pool, when that does not fit (:meth:`_from_lanes`). A failed forward
        frees its new slots and keeps no lanes."""
        lanes, R = self.lanes, len(rows)
        laid = self._from_lanes(lanes, rows) if R <= MAX_ROWS else None
        if laid is None:
            return None
        new_slots, table, pads, prefix = laid
        self._lanes = []  # (a failed forward leaves none)
        layout = StepLayout(np.array(last_ids(contexts), dtype=np.int64), lengths - 1,
                            new_slots, table, pads, prefix)
        try:
            logits, read = self.forward(layout)
            values = results(queries, logits, self.row_device)  # (read before the next forward)
        except BaseException:
            self.pool.free(new_slots)
            raise
        self._lanes = [Lanes(contexts, adapter, table, pads, prefix, self.pool.frees,
                             lanes.age + 1)]
        self._rows, self._split_age = R, 0
        self.lane_steps += 1
        return ForwardOut(values, new_slots.reshape(R, 1), read, 1)

    def layout(self, group, lanes: Lanes | None = None) -> tuple[StepLayout, Lanes] | None:
        """The :class:`.cascade.StepLayout` of one forward over ``group`` and its
        :class:`..plan.lanes.Lanes`, or None when it is too wide for this path (new slots taken
        from the pool here). When every path extends a context of ``lanes`` (a last forward's rows)
        by one token, the table is those rows plus a column; else, or every
        :data:`..plan.lanes.REFRESH` steps, the tree's segments (:mod:`..plan.segments`)."""
        R = len(group)
        if R > MAX_ROWS:
            return None
        rows = None if lanes is None else lanes.rows(
            [p.outputs[0].query.parent for p in group], group[0].adapter, self.pool.frees)
        laid = None if rows is None else self._from_lanes(lanes, rows)
        age = 0 if laid is None else lanes.age + 1
        if laid is None:
            laid = self._from_tree(group)
            if laid is None:
                return None
        new_slots, table, pads, prefix = laid
        return (StepLayout(last_tokens(group), cached_lengths(group), new_slots, table, pads,
                           prefix),
                Lanes(list(map(path_tokens, group)), group[0].adapter, table, pads, prefix,
                      self.pool.frees, age))

    @staticmethod
    def _fits(rows: int, width: int) -> bool:
        """Whether a table of ``rows`` x ``width`` (bucketed) stays within
        :data:`MAX_TABLE_SLOTS`."""
        return _pow2(rows) * bucket(rows, width, 0)[1] <= MAX_TABLE_SLOTS

    def _from_lanes(self, lanes: Lanes, rows: np.ndarray):
        """``(new_slots, table, pads, prefix)`` of a layout from the last step's ``rows``
        (:meth:`..plan.lanes.Lanes.gather`) plus a column of new slots (taken from the pool
        here), as :meth:`_from_tree`'s; None, nothing taken, when that table would not fit (a
        full layout may share more)."""
        past, pads = lanes.gather(rows)
        if not self._fits(len(rows), past.shape[1] + 1):
            return None
        new_slots = self.pool.alloc(len(rows))
        return new_slots, np.concatenate([past, new_slots[:, None]], axis=1), pads, lanes.prefix

    def _from_tree(self, group):
        """``(new_slots, table, pads, prefix)`` of a full layout from the tree's segments, or
        None (nothing taken from the pool) when the table would not fit. Level 0 is the prefix
        of two or more rows, when it pays (``level0_min_tokens``, ``level0_min_saved``); a
        single row's whole context is its own (its width then grows through power-of-two
        buckets, not a prefix bucket per 256)."""
        R = len(group)
        shared, private = split_segments(group, self.min_prefix if R > 1 else sys.maxsize,
                                         shared_by_all=True)
        prefix = (np.concatenate([s for s, _ in shared]) if shared
                  else np.empty(0, dtype=np.int64))
        width = int(private.path_lengths().max()) + 1 if R else 1
        P = len(prefix)
        if 0 < P < self.level0_min_tokens and (R - 1) * P < self.level0_min_saved \
                and self._fits(R, width + P):  # level 0 does not pay: the dense layout
            shared, private = split_segments(group, sys.maxsize, shared_by_all=True)
            prefix, width = prefix[:0], width + P
        if not self._fits(R, width):
            return None
        new_slots = self.pool.alloc(R)
        table, pads = private.layout(new_slots[:, None])
        return new_slots, table, pads, prefix

    def forward(self, layout: StepLayout) -> tuple[torch.Tensor, int]:
        """Run one forward of the step from its ``layout``; return the rows' logits float32
        ``[R, V]`` (a view of the bucket's static buffer: read it before the next forward) and
        the KV bytes attention read."""
        R, W = layout.table.shape
        P = len(layout.prefix)
        if self.pool.version != self._version:  # the store moved: graphs hold its old address
            self.clear()
            self._version = self.pool.version
        if self.fuse_projections and self._projections is None:
            self._projections = FusedProjections(self.model)
            if self._projections.relaid:  # (weights moved: a graph would read the old ones)
                self.clear()
        key = bucket(R, W, P)
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = DecodeBuffers(self.pool, key, self.groups, self.vocab)
            flash0 = self.flash_level0
            if flash0 is None:
                flash0 = (self.pool.device.type == "cuda"
                          and self.pool.dtype in (torch.bfloat16, torch.float16)
                          and flash_level0_pays(key[0] * self.groups, key[2]))
            buf.flash0, buf.fused = flash0, self.fused or self.compile
            buf.level0 = self.level0.get(key[2]) if self.keep_level0 and key[2] else None
        buf.fill(layout)
        if buf.level0 is not None:
            buf.level0.refresh(self.pool, layout.prefix, buf.prefix)
        self.steps += 1
        self.graphs.run(buf, self._forward, R)
        return buf.logits[:R], self.pool.token_bytes * (P + R * (W - 1))

    def _forward(self, buf: DecodeBuffers) -> None:
        model = self.model
        compiled = self.fused or self.compile  # (the compiled norm)
        if (compiled or self.norm_op) and (self._norms is None or self._norms.compiled != compiled):
            norm = glue.compiled("rms_norm") if compiled else None  # (one for all: .compiled)
            self._norms = FusedNorms(model, compiled, norm)
        norms = self._norms if compiled or self.norm_op else contextlib.nullcontext()
        rotate = glue.compiled("rotate") if self.compile else None
        if self.rope_op and (self._rope is None or self._rope.rotate is not rotate):
            self._rope = RopeOp(model, rotate)
        rope = self._rope if self.rope_op else contextlib.nullcontext()
        if self.compile and self._layers is None:
            self._layers = glue.CompiledLayers(model)
        layers = self._layers if self.compile else contextlib.nullcontext()
        projections = (self._projections if self.fuse_projections and self._projections
                       else contextlib.nullcontext())
        with torch.inference_mode(), tree_attention.active(buf), norms, rope, projections, \
                layers, tree_attention.use_tree_attention(model.config, NAME):
            buf.prepare()
            out = model(input_ids=buf.ids, position_ids=buf.positions, use_cache=True,
                        logits_to_keep=1, **cache_argument(model, TreeCache(buf)))
            buf.logits.copy_(out.logits[:, -1])


__all__ = ["DecodeStep", "FLASH0_MIN_WORK", "bucket", "flash_level0_pays"]
