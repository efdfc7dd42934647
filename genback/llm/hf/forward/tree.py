"""The tree forward: a group of paths through the model with tree attention (:mod:`.attention`):
shared segments are read in place once for all paths below them; each path's private past is
gathered layer by layer from the runner's :class:`~..cache.kv_pool.KVPool`; the new tokens'
KV is written to fresh pool slots.

A uniform decode step whose every path extends a row of the last step
(:class:`..plan.lanes.Lanes`: an SMC or decoding step after the one before) is laid out from
the last step's rows (its private rows plus a column of new slots, its shared segments with
their rows renumbered) instead of from the tree's segments
(:func:`..plan.segments.split_segments`); a full layout every :data:`..plan.lanes.REFRESH`
steps and after any slot was freed."""

from __future__ import annotations

import numpy as np
import torch

from ....queries.context import last_ids
from ..cache.kv_pool import KVPool, run_start
from ..plan.batch import Path
from ..plan.anchors import Anchors
from ..plan.lanes import Lanes, path_tokens
from ..plan.segments import split_segments
from . import attention, varlen
from .base import ForwardOut, as_long, model_inputs, new_slots, packed, split_new_slots
from .logits import output_spans, run_model
from .results import outputs, results
from .tree_cache import TreeCache

_max = np.maximum.reduce  # (ndarray.max / .any without their Python wrappers)

#: With the packed varlen kernel (CUDA, :mod:`.varlen`), a segment is read once for the paths
#: below it only when that saves at least this many token copies, ``(n - 1) * length``: each
#: shared segment is an attention call, its reads and an LSE merge of its own in every layer,
#: while a private copy is only KV gathered into the packed rows. Measured on an H200
#: (Llama-3.2-1B shape, bf16, 800 multiple-choice scoring requests over 40-120-token contexts,
#: ``benchmarks/lab/profile_scoring.py``): the contexts shared by their four continuations made
#: 2,080 segment attentions, 0.45 s of host time in a 0.72 s batch, to save ~240 token copies
#: each. A 1,000-token prompt under 16 particles (15,000 copies) is still shared.
PACKED_MIN_SAVED_TOKENS = 8192


class TreeForward:
    """The tree forward of the runner's model over its pool (one per runner).

    Args:
        model: the causal LM (transformers, attention interface; :func:`.attention.register`
            done).
        pool: the runner's :class:`~..cache.kv_pool.KVPool` (the paths' cached KV, and where the
            new tokens' KV goes).
        pad_id: the token id of the inputs' right padding.
        min_shared_tokens: see :func:`..plan.segments.split_segments`.
        row_device: where next-token rows go.
    """

    def __init__(self, model, pool: KVPool, *, pad_id: int, min_shared_tokens: int,
                 row_device: torch.device):
        self.model, self.pool, self.pad_id = model, pool, pad_id
        self.min_shared_tokens, self.row_device = min_shared_tokens, row_device
        self.anchors = Anchors()  # (where the last forward's paths all met: see split_segments)
        self.lanes: Lanes | None = None  # the last uniform step's rows (see the module's doc)
        self._segments: dict = {}  # id(shared slots) -> (slots, start, index): see _tree_batch
        self.lane_steps = 0  # forwards laid out from the last step's rows
        self.packed_min_saved_tokens = PACKED_MIN_SAVED_TOKENS  # (tests set 0 to share all)

    def run(self, paths: list[Path], uniform: bool = False) -> ForwardOut:
        """Forward ``paths`` with tree attention (:class:`.base.ForwardOut`; the new slots are
        freed again if the forward fails). ``uniform``: the paths are a uniform decode step
        (:func:`..plan.batch.is_uniform`), which may be laid out from the last one's rows."""
        pool = self.pool
        input_ids, positions, n_new = model_inputs(paths, self.pad_id)
        R, m = input_ids.shape
        spans = None if uniform else output_spans(paths)
        min_saved, kernel = 0, varlen.kernel_for(pool.device, pool.dtype, pool.dim)
        if m > 1 and kernel is not None:
            # rows packed end to end, no padding (the private part's kernel takes them so)
            input_ids, positions, spans = packed(input_ids, positions, n_new, spans)
            min_saved = self.packed_min_saved_tokens
        last, self.lanes = self.lanes, None  # (dropped: a failed forward leaves none)
        rows = (last.rows([p.outputs[0].query.parent for p in paths], paths[0].adapter,
                          pool.frees) if uniform and last is not None and paths else None)
        if rows is None:
            shared, private = split_segments(paths, self.min_shared_tokens, anchors=self.anchors,
                                             min_saved_tokens=min_saved)
            self._segments = {}  # (a step from lanes reads the same shared arrays again)
        slots = new_slots(pool, n_new, m)
        if rows is not None:
            logits, layout, pads, shared, read = self._from_lanes(last, rows, input_ids,
                                                                  positions, slots, kernel)
        else:
            try:
                layout, pads = private.layout(slots)
                batch = _tree_batch(kernel, pool, shared, layout, pads, slots, R, m,
                                    self._segments)
                logits = self._run(batch, input_ids, positions, spans)
            except BaseException:
                pool.free(slots[slots > 0])
                raise
            read = pool.token_bytes * (sum(len(s) for s, _ in shared) + R * batch.P)
        if uniform:
            self.lanes = Lanes(list(map(path_tokens, paths)), paths[0].adapter, layout, pads,
                               shared, pool.frees, 0 if rows is None else last.age + 1)
        return ForwardOut(outputs(paths, logits, self.row_device), split_new_slots(n_new, slots),
                          read)

    def step(self, queries: list, contexts: list, rows: np.ndarray, lengths: np.ndarray,
             adapter) -> ForwardOut:
        """A uniform decode step given as rows, not paths (:class:`..chain.StepChain`): query
        ``i`` (a next-token row or a decoding step, :attr:`~genback.queries.kinds.Query.at_end`)
        asks for ``contexts[i]`` (``lengths[i]`` tokens, ``int64``), its parent's plus one token,
        that parent the context of row ``rows[i]`` of the last step's lanes (``lanes``, which
        must be valid: :meth:`..plan.lanes.Lanes.rows`). The same forward as
        :meth:`run` of their paths laid out from the lanes; the new slots ``int64 [R, 1]``."""
        pool, last, self.lanes = self.pool, self.lanes, None
        input_ids = torch.from_numpy(np.array(last_ids(contexts), dtype=np.int64)[:, None])
        positions = torch.from_numpy((lengths - 1)[:, None])
        slots = pool.alloc(len(rows))[:, None]
        logits, layout, pads, shared, read = self._from_lanes(
            last, rows, input_ids, positions, slots,
            varlen.kernel_for(pool.device, pool.dtype, pool.dim))
        self.lanes = Lanes(contexts, adapter, layout, pads, shared, pool.frees, last.age + 1)
        return ForwardOut(results(queries, logits, self.row_device), slots, read)

    def _from_lanes(self, last: Lanes, rows: np.ndarray, input_ids, positions, slots, kernel):
        """Run a step of one new token a row laid out from ``last``'s ``rows`` (each row's past
        plus its new slot ``slots[i]``): ``(logits, layout, pads, shared, bytes read)``; the new
        slots are freed again if the forward fails."""
        pool, R = self.pool, len(rows)
        try:
            past, pads = last.gather(rows)
            layout, shared = np.concatenate([past, slots], axis=1), _renumber(
                last.prefix, rows, len(last.pads))
            self.lane_steps += 1
            batch = _tree_batch(kernel, pool, shared, layout, pads, slots, R, 1, self._segments)
            logits = self._run(batch, input_ids, positions, None)
        except BaseException:
            pool.free(slots[slots > 0])
            raise
        read = pool.token_bytes * (sum(len(s) for s, _ in shared) + R * batch.P)
        return logits, layout, pads, shared, read

    def _run(self, batch, input_ids, positions, spans) -> torch.Tensor:
        """The model's logits of the needed positions of a forward laid out as ``batch``."""
        with attention.active(batch), attention.use_tree_attention(self.model.config):
            return run_model(self.model, input_ids, positions, spans, TreeCache(batch),
                             device=self.pool.device)[1]


def _renumber(shared: list, rows: np.ndarray, last_rows: int) -> list:
    """The last step's ``shared`` segments ``(slots, row indices)`` (of ``last_rows`` rows) for a
    step whose row ``i`` extends the last step's row ``rows[i]``: a segment every last row read
    is read by every row; another by the rows that extend one of its rows (dropped when none
    does)."""
    R = len(rows)
    everyone = list(range(R))
    out = []
    for seg, idx in shared:
        if len(idx) == last_rows:
            out.append((seg, everyone))
            continue
        mine = np.flatnonzero(np.isin(rows, idx))
        if len(mine):
            out.append((seg, everyone if len(mine) == R else mine.tolist()))
    return out


def _tree_batch(kernel: str | None, pool: KVPool, shared: list, layout, pads, slots, R: int,
                m: int, known: dict | None = None) -> attention.TreeBatch:
    """The :class:`.attention.TreeBatch` of a forward of ``R`` rows of ``m`` new tokens whose
    private attention runs in ``kernel`` (:func:`.varlen.kernel_for`; None: the masked path):
    ``shared`` segments ``(slots, rows)`` read in place; ``layout`` ``int64 [R, P + m]`` each
    row's left-padded private past and new tokens, ``pads`` ``int64 [R]`` its padding; ``slots``
    ``int64 [R, m]`` the new tokens' slots. ``known``: each shared array's first slot of its
    run (or its index on the device) by the array's identity, filled here, so the steps laid
    out from one layout's lanes (the same arrays) test and copy each array once."""
    dev = pool.device
    cpu = dev.type == "cpu"  # (there a host tensor needs no .to: a dispatch that changes nothing)
    P = layout.shape[1] - m
    if kernel is not None:
        return _varlen_batch(kernel, pool, shared, layout, pads, slots, R, m, known)
    # built in NumPy, one tensor at the end (a torch op on small tensors costs several times a
    # NumPy one on the host): each row's left padding of the private past masked (columns <
    # pad), the new tokens causal
    if m == 1:  # a decode step: its one new token (column P >= every row's padding) attended
        # no row padded (mostly: the rows of an SMC step have pasts of one length): every row
        # attends to every column, and the attention needs no mask
        mask = ((np.arange(P + 1) >= pads[:, None]).reshape(R, 1, 1, P + 1) if _max(pads)
                else None)
    else:
        mask = np.empty((R, 1, m, P + m), dtype=bool)
        mask[:, 0, :, :P] = (np.arange(P) >= pads[:, None])[:, None, :]
        mask[:, 0, :, P:] = np.tri(m, dtype=bool)
    index = out = None
    if P:
        index = torch.from_numpy(layout.ravel())
        index = index if cpu else index.to(dev)
        out = torch.empty((2, pool.heads, R * (P + m), pool.dim), dtype=pool.dtype, device=dev)
    segments = _segments(pool, shared, R, known) if shared else []
    slots = torch.from_numpy(slots.ravel())
    mask = None if mask is None else torch.from_numpy(mask)
    if not cpu:
        slots, mask = slots.to(dev), None if mask is None else mask.to(dev)
    return attention.TreeBatch(segments, pool, slots, index, P, mask, out)


def _segments(pool: KVPool, shared: list, R: int, known: dict | None, tokens=None) -> list:
    """The :class:`.attention.Segment` s of ``shared`` (see :func:`_tree_batch`); ``tokens``:
    ``(first, counts)`` int64 ``[R]`` each row's first token and token count when the forward's
    tokens are packed (a segment's ``paths`` are then its rows' tokens)."""
    dev = pool.device
    segments = []
    known = {} if known is None else known
    for seg_slots, idx in shared:
        hit = known.get(id(seg_slots))
        if hit is None or hit[0] is not seg_slots:
            start = run_start(seg_slots)
            hit = known[id(seg_slots)] = (seg_slots, start, None if start >= 0 else
                                          torch.from_numpy(seg_slots).to(dev))
        rows = None
        if len(idx) != R:
            rows = np.asarray(idx, dtype=np.int64)
            if tokens is not None:  # each row's tokens: first[r] .. first[r] + counts[r] - 1
                first, counts = tokens[0][rows], tokens[1][rows]
                rows = np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(
                    int(counts.sum()))
        segments.append(attention.Segment(
            hit[1], hit[2], len(seg_slots), None if rows is None else as_long(rows, dev),
            len(idx) if rows is None else len(rows)))
    return segments


def _varlen_batch(kernel: str, pool: KVPool, shared: list, layout, pads, slots, R: int, m: int,
                  known: dict | None) -> attention.TreeBatch:
    """:func:`_tree_batch` of a forward whose private part runs packed in varlen ``kernel``
    (:mod:`.varlen`): no mask, no padded layout; the new tokens' slots without the padding
    (the model's input is packed when ``m > 1``: :func:`.base.packed`)."""
    n_new = np.count_nonzero(slots, axis=1) if m > 1 else np.ones(R, dtype=np.int64)
    meta = varlen.Varlen.of(kernel, layout, pads, n_new, m, pool.device)
    first = np.cumsum(n_new) - n_new
    segments = _segments(pool, shared, R, known, (first, n_new) if m > 1 else None)
    new = torch.from_numpy(slots[slots > 0] if m > 1 else slots.ravel())
    if pool.device.type != "cpu":
        new = new.to(pool.device)
    return attention.TreeBatch(segments, pool, new, None, layout.shape[1] - m, None, None,
                               varlen=meta)
