"""One forward of a group of planned rows through a Hugging Face causal LM.

Both paths feed the rows' new tokens right-padded to the longest (``[R, m]``), with explicit
positions, and keep logits only at the positions some row needs (``logits_to_keep``):

* :func:`tree_forward`: tree attention (:mod:`.tree_attention`): shared segments are read in
  place once for all rows below them; each row's private past is gathered layer by layer.
* :func:`dense_forward`: for models without the attention interface: each row's whole past is
  assembled (left-padded) into a ``DynamicCache``.

Each fills ``row.result`` (float32 CPU ``[V]`` for a next-token row, ``[n]`` for target
log-probs, None for KV-only) and ``row.new_kv`` (``[layers, 2, kv_heads, n_new, dim]``), and
returns the KV bytes its attention read.
"""

from __future__ import annotations

import torch

from . import tree_attention
from .plan import Row, split_segments
from .tree_cache import TreeCache


def _inputs(rows: list[Row], pad_id: int):
    """input_ids / position_ids ``[R, m]`` (CPU) and the new-token counts."""
    n_new = [r.n_new for r in rows]
    m = max(n_new)
    input_ids = torch.full((len(rows), m), pad_id, dtype=torch.long)
    positions = torch.empty((len(rows), m), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : n_new[i]] = torch.tensor(r.query.tokens[r.cached:])
        positions[i] = torch.arange(r.cached, r.cached + m)
    return input_ids, positions, n_new


def _wanted(rows: list[Row], n_new: list[int]) -> list[int]:
    """Positions (in the new-token axis) whose logits some row needs."""
    return sorted({j for r, m in zip(rows, n_new) for j in range(m - r.query.n_outputs, m)})


def _results(rows: list[Row], n_new: list[int], wanted: list[int], logits: torch.Tensor) -> None:
    """Fill ``row.result`` from logits ``[R, len(wanted), V]``."""
    column = {j: k for k, j in enumerate(wanted)}
    dev = logits.device
    for i, r in enumerate(rows):
        m, targets = n_new[i], r.query.targets
        if targets == ():  # KV only (a shared-prefix prefill)
            continue
        if targets is None:
            r.result = torch.log_softmax(logits[i, column[m - 1]].float(), dim=-1).cpu().clone()
        else:
            cols = torch.tensor([column[j] for j in range(m - len(targets), m)], device=dev)
            rows_lp = torch.log_softmax(logits[i].index_select(0, cols).float(), dim=-1)
            r.result = rows_lp.gather(1, torch.tensor(targets, device=dev)[:, None])[:, 0].cpu()


def _run_model(model, input_ids, positions, wanted, cache, attention_mask=None):
    dev = model.device if hasattr(model, "device") else input_ids.device
    with torch.inference_mode():
        out = model(
            input_ids=input_ids.to(dev),
            attention_mask=attention_mask,
            position_ids=positions.to(dev),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=torch.tensor(wanted, dtype=torch.long, device=dev),
        )
    return out


def _split_new_kv(rows: list[Row], n_new: list[int], new_kv: torch.Tensor) -> None:
    # new_kv: [layers, 2, R, kv_heads, m, dim] -> per row [layers, 2, kv_heads, n_new, dim]
    for i, r in enumerate(rows):
        r.new_kv = new_kv[:, :, i, :, : n_new[i]]


def tree_forward(model, rows: list[Row], *, pad_id: int, layout: tuple, min_shared_tokens: int,
                 kernel: str) -> int:
    """Forward ``rows`` with tree attention; return the KV bytes read (all layers).

    ``layout``: ``(layers, kv_heads, head_dim, dtype, device)`` of the model's KV.
    """
    n_layers, heads, dim, dtype, dev = layout
    input_ids, positions, n_new = _inputs(rows, pad_id)
    R, m = input_ids.shape
    shared, private = split_segments(rows, min_shared_tokens)

    # private pasts: distinct segments concatenated once into a pool; each layer's attention
    # gathers its rows' pasts from it ([.., R, P, ..]) with one index, so the gathered copy
    # exists for one layer at a time
    P = max(sum(kv.shape[3] for kv in segs) for segs in private)
    pool = index = None
    mask = torch.ones((R, 1, m, P + m), dtype=torch.bool)
    mask[:, :, :, P:] = torch.ones((m, m), dtype=torch.bool).tril()
    if P:
        distinct: dict[int, tuple[int, torch.Tensor]] = {}
        offset = 0
        for segs in private:
            for kv in segs:
                key = (kv.data_ptr(), kv.shape[3])
                if key not in distinct:
                    distinct[key] = (offset, kv)
                    offset += kv.shape[3]
        pool = torch.cat([kv for _, kv in distinct.values()]
                         + [torch.zeros((n_layers, 2, heads, 1, dim), dtype=dtype, device=dev)],
                         dim=3)  # the last column is the (masked) padding
        positions_in_pool: list[int] = []
        for i, segs in enumerate(private):
            pad = P - sum(kv.shape[3] for kv in segs)  # left padding
            mask[i, :, :, :pad] = False
            positions_in_pool.extend([offset] * pad)
            for kv in segs:
                start = distinct[(kv.data_ptr(), kv.shape[3])][0]
                positions_in_pool.extend(range(start, start + kv.shape[3]))
        index = torch.tensor(positions_in_pool, dtype=torch.long, device=dev)

    segments = [tree_attention.Segment(
        kv, None if len(idx) == R else torch.tensor(idx, dtype=torch.long, device=dev), len(idx))
        for kv, idx in shared]
    new_kv = torch.empty((n_layers, 2, R, heads, m, dim), dtype=dtype, device=dev)
    batch = tree_attention.TreeBatch(segments, pool, index, P, mask.to(dev), new_kv, kernel)
    wanted = _wanted(rows, n_new)
    with tree_attention.active(batch), tree_attention.use_tree_attention(model.config):
        out = _run_model(model, input_ids, positions, wanted, TreeCache(batch))
    _results(rows, n_new, wanted, out.logits)
    _split_new_kv(rows, n_new, new_kv)
    token_bytes = n_layers * 2 * heads * dim * new_kv.element_size()
    return token_bytes * (sum(kv.shape[3] for kv, _ in shared) + R * P)


def dense_forward(model, rows: list[Row], *, pad_id: int, layout: tuple) -> int:
    """Forward ``rows`` over their assembled pasts (models without the attention interface);
    return the KV bytes read (all layers)."""
    from transformers import DynamicCache

    n_layers, heads, dim, dtype, dev = layout
    input_ids, positions, n_new = _inputs(rows, pad_id)
    R, m = input_ids.shape
    P = max(r.cached for r in rows)
    mask = torch.zeros((R, P + m), dtype=torch.long)
    for i, r in enumerate(rows):
        mask[i, P - r.cached: P + n_new[i]] = 1
    cache = None
    if P:
        past = torch.empty((n_layers, 2, R, heads, P, dim), dtype=dtype, device=dev)
        for i, r in enumerate(rows):
            pos = P - r.cached
            past[:, :, i, :, :pos].zero_()
            for _, _, kv in r.segments:
                past[:, :, i, :, pos: pos + kv.shape[3]].copy_(kv)
                pos += kv.shape[3]
        cache = DynamicCache()
        for layer in range(n_layers):
            # start each layer empty, then hand it the assembled past (no second copy)
            cache.update(past[layer, 0][:, :, :0], past[layer, 1][:, :, :0], layer)
            cache.layers[layer].keys, cache.layers[layer].values = past[layer, 0], past[layer, 1]
        del past
    wanted = _wanted(rows, n_new)
    out = _run_model(model, input_ids, positions, wanted, cache,
                     None if bool(mask.all()) else mask.to(dev))
    _results(rows, n_new, wanted, out.logits)
    layers = out.past_key_values.layers
    new_kv = torch.empty((n_layers, 2, R, heads, m, dim), dtype=dtype, device=dev)
    for j, layer in enumerate(layers):  # the new tokens' KV, one copy
        new_kv[j, 0].copy_(layer.keys[:, :, P:])
        new_kv[j, 1].copy_(layer.values[:, :, P:])
    _split_new_kv(rows, n_new, new_kv)
    return n_layers * 2 * heads * dim * new_kv.element_size() * R * P
