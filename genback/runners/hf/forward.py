"""One forward of a group of planned paths through a Hugging Face causal LM.

Both kinds of forward feed the paths' new tokens right-padded to the longest (``[R, m]``), with
explicit positions, and keep logits only at the positions some output needs (``logits_to_keep``):

* :func:`tree_forward`: tree attention (:mod:`.tree_attention`): shared segments are read in
  place once for all paths below them; each path's private past is gathered layer by layer from
  the runner's :class:`~.kv_pool.KVPool`.
* :func:`dense_forward`: for models without the attention interface: each path's whole past is
  gathered (left-padded) into a ``DynamicCache``.

Each takes pool slots for its paths' new tokens and their KV is written there. The
language-model head runs only at the (path, position) pairs some output needs. Each returns its
outputs' results (:func:`_results`), each path's new slots (``int64 [n_new]``) and the KV bytes
its attention read; nothing is written into the plan.
"""

from __future__ import annotations

import numpy as np
import torch

from ...query import NextToken, Query, Score, Step
from ...sampling import choose_rows
from . import tree_attention
from .kv_pool import KVPool, run_start
from .plan import Path
from .segments import split_segments
from .tree_cache import TreeCache, cache_argument, returned_cache


def _long(values, device=None) -> torch.Tensor:
    """int64 tensor of a list of ints (or of equal-length tuples) on ``device``, through NumPy
    (``torch.tensor`` of a 256-int list costs ~29 us on this project's CPU, NumPy ~4 us)."""
    t = torch.from_numpy(np.array(values, dtype=np.int64))
    return t if device is None else t.to(device)


def _inputs(paths: list[Path], pad_id: int):
    """input_ids / position_ids ``[R, m]`` (CPU) and the new-token counts: one array built from
    the paths' new tokens (right-padded with ``pad_id``), not a torch call per path."""
    R = len(paths)
    n_new = [p.n_new for p in paths]
    m = max(n_new)
    if m == 1:  # a decode step: each path's last token
        ids = np.fromiter((p.tokens[-1] for p in paths), dtype=np.int64, count=R)[:, None]
    else:
        pad = (pad_id,) * m
        ids = np.array([p.tokens[p.cached:] + pad[: m - n] for p, n in zip(paths, n_new)],
                       dtype=np.int64)
    cached = np.fromiter((p.cached for p in paths), dtype=np.int64, count=R)
    positions = cached[:, None] + np.arange(m, dtype=np.int64)
    return torch.from_numpy(ids), torch.from_numpy(positions), n_new


def _spans(paths: list[Path]) -> list[tuple[int, int, int]]:
    """``(path index, first, stop)`` per output with logits, paths' outputs in order: the
    positions in the new-token axis (``0 .. m - 1``) whose logits the output needs."""
    return [(i, o.end - o.query.n_outputs - p.cached, o.end - p.cached)
            for i, p in enumerate(paths) for o in p.outputs if o.query.n_outputs]


def _wanted(spans) -> list[int]:
    """Positions (in the new-token axis) whose logits some output needs, sorted."""
    return sorted({j for _, a, b in spans for j in range(a, b)})


def _flat_positions(spans, wanted: list[int]) -> list[int]:
    """Flat indices into the ``[R, len(wanted)]`` grid of the (path, position) pairs the outputs
    need, output by output (each output's positions in order)."""
    column = {j: k for k, j in enumerate(wanted)}
    W = len(wanted)
    return [i * W + column[j] for i, a, b in spans for j in range(a, b)]


# target log-probs are taken in slices of this many positions: the float32 temporaries of a
# slice (128 x 49,152 x 4 bytes = 25 MB on SmolLM2) stay in reused heap memory; slices of 1,024
# positions (200 MB, fresh pages each time) took 3.2x longer (0.80 s vs 0.25 s for 4,663
# positions on one CPU core, measured)
_SLICE = 128


# next-token rows that land in host memory are made in blocks of about this many bytes. Rows
# live on after the step (the output cache holds them; a block is freed only when none of its
# rows is referenced), so one block of all of a step's rows was a fresh allocation of N x V x 4
# bytes each step: above glibc's largest mmap threshold (32 MiB) it is mmap'ed and every page
# faults when log_softmax writes it. Blocks of ~1 MiB are recycled by malloc instead: SmolLM2's
# 49,152-wide rows, 256 per step with 4,096 kept: ~115-260 µs per row as one block, ~43 µs in
# blocks of 4 rows (benchmarks/RESULTS.md, "Rows in host memory").
_ROW_BLOCK_BYTES = 1 << 20


def _log_softmax_rows(logits: torch.Tensor, row_device: torch.device) -> list[torch.Tensor]:
    """``log_softmax`` of each row of ``logits`` ``[K, V]`` (any float dtype, on the model's
    device) as float32 ``[V]`` tensors on ``row_device``: views of blocks of about
    :data:`_ROW_BLOCK_BYTES` when they land on the CPU, of one block otherwise."""
    K, V = logits.shape
    per = max(1, _ROW_BLOCK_BYTES // (4 * max(1, V))) if row_device.type == "cpu" else K
    on_device = logits.device.type != "cpu"
    if on_device:  # one kernel where it runs; moved to row_device block by block
        logits = torch.log_softmax(logits.float(), dim=-1)
    out: list[torch.Tensor] = []
    for a in range(0, K, per):
        block = logits[a:a + per]
        if not on_device:
            block = torch.log_softmax(block.float(), dim=-1)
        out.extend(block.to(row_device).unbind(0))
    return out


def _results(queries: list[Query], logits: torch.Tensor, row_device: torch.device) -> list:
    """The result of each query (see :mod:`genback.query`) from ``logits`` ``[K, V]`` (on the
    model's device): the needed positions of the queries in order, ``n_outputs`` each.

    A :class:`~genback.query.NextToken` gets ``log_softmax`` of its position (float32 ``[V]`` on
    ``row_device``, a view of a block of such rows, :func:`_log_softmax_rows`: the caller's copy
    is the only copy), a :class:`~genback.query.Step` the :class:`~genback.sampling.Choice` made
    on the device, a :class:`~genback.query.Score` its targets' log-probs (float32 CPU ``[n]``)
    and with ``greedy`` also whether each target is its position's argmax (bool CPU ``[n]``), a
    :class:`~genback.query.Prefill` None. Only these leave the device: one transfer for all
    score outputs, one for all next-token rows.
    """
    dev = logits.device
    if len(queries) == len(logits) and set(map(type, queries)) == {NextToken}:
        # every query a next-token row, one position each (an SMC or decoding step): all rows
        return _log_softmax_rows(logits, row_device)
    rows_at, steps_at, steps, tgt_at, targets = [], [], [], [], []
    k = 0
    greedy = False
    for q in queries:
        match q:
            case NextToken():
                rows_at.append(k)
            case Step():
                steps_at.append(k)
                steps.append(q)
            case Score():
                tgt_at.extend(range(k, k + len(q.targets)))
                targets.extend(q.targets)
                greedy = greedy or q.greedy
        k += q.n_outputs
    if rows_at:
        rows = _log_softmax_rows(logits.index_select(0, torch.tensor(rows_at, device=dev)),
                                 row_device)
    if tgt_at:
        idx = torch.tensor(tgt_at, device=dev)
        tgt = torch.tensor(targets, device=dev)
        lps, flags = [], []
        for s in range(0, len(tgt_at), _SLICE):
            part = logits.index_select(0, idx[s:s + _SLICE]).float()  # [n, V]
            want = tgt[s:s + _SLICE, None]
            if greedy:  # argmax flags only when a scoring query asks (not rolling / token_logprobs)
                flags.append(part.argmax(dim=-1) == want[:, 0])
            # log_softmax, not x - logsumexp(x): the latter rounds ~1e-5 lower on CPU
            lps.append(torch.log_softmax(part, dim=-1).gather(1, want)[:, 0])
        lps = torch.cat(lps).cpu()
        flags = torch.cat(flags).cpu() if greedy else None
    chosen = iter(choose_rows(logits.index_select(0, torch.tensor(steps_at, device=dev)),
                              [q.context for q in steps], [q.pick for q in steps])
                  if steps else ())
    out: list = []
    a = b = 0
    for q in queries:
        match q:
            case NextToken():
                out.append(rows[a])
                a += 1
            case Step():
                out.append(next(chosen))
            case Score():
                n = len(q.targets)
                lp = lps[b:b + n]
                out.append((lp, flags[b:b + n]) if q.greedy else lp)
                b += n
            case _:
                out.append(None)
    return out


def _run_model(model, input_ids, positions, spans, cache, attention_mask=None):
    """Forward; return the logits ``[K, V]`` of the positions the outputs need (:func:`_flat_positions`).

    The language-model head runs only on those positions: a pre-hook on the output embeddings
    selects them from the hidden states ``[R, W, H]`` of the union of the paths' positions
    (``logits_to_keep``), so paths that need different positions pay for their own only.
    """
    dev = model.device if hasattr(model, "device") else input_ids.device
    wanted = _wanted(spans) or [0]  # (a prefill-only forward keeps one position, unused)
    flat = _long(_flat_positions(spans, wanted), dev)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def select(module, args):  # hidden [R, W, H] -> [1, K, H]
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat)[None],) + args[1:]

    handle = head.register_forward_pre_hook(select) if head is not None else None
    try:
        with torch.inference_mode():
            out = model(
                input_ids=input_ids.to(dev),
                attention_mask=attention_mask,
                position_ids=positions.to(dev),
                use_cache=True,
                **cache_argument(model, cache),
                logits_to_keep=torch.tensor(wanted, dtype=torch.long, device=dev),
            )
    finally:
        if handle is not None:
            handle.remove()
    logits = out.logits
    if head is None:  # no head module to hook: select from the full grid
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, flat)
    return out, logits.reshape(-1, logits.shape[-1])


def _new_slots(pool: KVPool, n_new: list[int], m: int) -> np.ndarray:
    """``int64 [R, m]``: fresh pool slots for each path's new tokens (row-major), the dummy slot
    0 in its right padding (a padded position's KV is written there and never read unmasked)."""
    n = np.asarray(n_new, dtype=np.int64)
    slots = np.zeros((len(n_new), m), dtype=np.int64)
    slots[np.arange(m)[None, :] < n[:, None]] = pool.alloc(int(n.sum()))
    return slots


def _split_new_slots(n_new: list[int], slots: np.ndarray) -> list[np.ndarray]:
    """Each path's new slots ``int64 [n_new]`` (rows of ``slots`` ``[R, m]`` without padding)."""
    m = slots.shape[1]
    return [row if n == m else row[:n] for row, n in zip(slots, n_new)]


def _outputs(paths: list[Path], logits: torch.Tensor, row_device: torch.device) -> list:
    """Each output's result, paths' outputs in order (:func:`_results` of their queries)."""
    return _results([o.query for p in paths for o in p.outputs], logits, row_device)


def tree_forward(model, paths: list[Path], *, pad_id: int, min_shared_tokens: int,
                 kernel: str, pool: KVPool, row_device: torch.device
                 ) -> tuple[list, list[np.ndarray], int]:
    """Forward ``paths`` with tree attention; return each output's result (paths' outputs
    in order), each path's new slots ``int64 [n_new]`` (KV written in ``pool``) and the KV bytes
    read (all layers).

    ``pool``: the runner's :class:`~.kv_pool.KVPool` (the paths' cached KV, and where the new
    tokens' KV goes).
    """
    dev = pool.device
    input_ids, positions, n_new = _inputs(paths, pad_id)
    R, m = input_ids.shape
    shared, private = split_segments(paths, min_shared_tokens)
    new_slots = _new_slots(pool, n_new, m)
    try:
        # private pasts and new tokens: each layer gathers its paths' keys and values from the
        # pool with one index (the new tokens' slots written first, by the cache)
        layout, pads = private.layout(new_slots)
        P = layout.shape[1] - m
        mask = torch.ones((R, 1, m, P + m), dtype=torch.bool)
        mask[:, :, :, P:] = torch.ones((m, m), dtype=torch.bool).tril()
        index = out = None
        if P:
            # each row's left padding of the private past: columns < pad are masked (one op)
            mask[:, 0, :, :P] = (torch.arange(P)[None, :]
                                 >= torch.from_numpy(pads)[:, None])[:, None, :]
            index = torch.from_numpy(layout.ravel()).to(dev)
            out = torch.empty((2, pool.heads, R * (P + m), pool.dim), dtype=pool.dtype,
                              device=dev)
        segments = []
        for slots, idx in shared:
            start = run_start(slots)
            segments.append(tree_attention.Segment(
                start, None if start >= 0 else torch.from_numpy(slots).to(dev), len(slots),
                None if len(idx) == R else _long(idx, dev),
                len(idx)))
        batch = tree_attention.TreeBatch(segments, pool,
                                         torch.from_numpy(new_slots.ravel()).to(dev), index, P,
                                         mask.to(dev), kernel, out)
        with tree_attention.active(batch), tree_attention.use_tree_attention(model.config):
            _, logits = _run_model(model, input_ids, positions, _spans(paths), TreeCache(batch))
    except BaseException:
        pool.free(new_slots[new_slots > 0])
        raise
    read = pool.token_bytes * (sum(len(slots) for slots, _ in shared) + R * P)
    return _outputs(paths, logits, row_device), _split_new_slots(n_new, new_slots), read


def dense_forward(model, paths: list[Path], *, pad_id: int, pool: KVPool,
                  row_device: torch.device) -> tuple[list, list[np.ndarray], int]:
    """Forward ``paths`` over their gathered pasts (models without the attention
    interface); return as :func:`tree_forward` does."""
    from transformers import DynamicCache

    dev = pool.device
    input_ids, positions, n_new = _inputs(paths, pad_id)
    R, m = input_ids.shape
    P = max(r.cached for r in paths)
    mask = torch.zeros((R, P + m), dtype=torch.long)
    past = np.zeros((R, P), dtype=np.int64)  # each path's past slots, left-padded with slot 0
    for i, r in enumerate(paths):
        mask[i, P - r.cached: P + n_new[i]] = 1
        if r.cached:
            past[i, P - r.cached:] = np.concatenate([s for _, _, s in r.segments])
    cache = None
    if P:
        index = torch.from_numpy(past.ravel()).to(dev)
        cache = DynamicCache()
        for layer in range(pool.layers):
            kv = pool.gather(layer, index).view(2, pool.heads, R, P, pool.dim).transpose(1, 2)
            # start each layer empty, then hand it the gathered past (no second copy)
            cache.update(kv[0][:, :, :0], kv[1][:, :, :0], layer)
            cache.layers[layer].keys, cache.layers[layer].values = kv[0], kv[1]
    new_slots = _new_slots(pool, n_new, m)
    try:
        out, logits = _run_model(model, input_ids, positions, _spans(paths), cache,
                                 None if bool(mask.all()) else mask.to(dev))
        values = _outputs(paths, logits, row_device)
        index = torch.from_numpy(new_slots.ravel()).to(dev)
        for j, layer in enumerate(returned_cache(out).layers):  # the new tokens' KV, one copy
            H, D = layer.keys.shape[1], layer.keys.shape[3]
            pool.write(j, index, layer.keys[:, :, P:].transpose(0, 1).reshape(H, R * m, D),
                       layer.values[:, :, P:].transpose(0, 1).reshape(H, R * m, D))
    except BaseException:
        pool.free(new_slots[new_slots > 0])
        raise
    return values, _split_new_slots(n_new, new_slots), pool.token_bytes * R * P
