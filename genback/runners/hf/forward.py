"""One forward of a group of planned rows through a Hugging Face causal LM.

Both paths feed the rows' new tokens right-padded to the longest (``[R, m]``), with explicit
positions, and keep logits only at the positions some row needs (``logits_to_keep``):

* :func:`tree_forward`: tree attention (:mod:`.tree_attention`): shared segments are read in
  place once for all rows below them; each row's private past is laid out layer by layer from
  the runner's :class:`~.past_pool.PastPool`.
* :func:`dense_forward`: for models without the attention interface: each row's whole past is
  assembled (left-padded) into a ``DynamicCache``.

The language-model head runs only at the (row, position) pairs some row needs. Each fills
``row.result`` (float32 CPU ``[V]`` for a next-token row, ``[n]`` for target log-probs, with
``query.greedy`` the pair of those and bool ``[n]`` argmax flags, None for KV-only) and ``row.new_kv`` (``[layers, 2, kv_heads, n_new, dim]``), and
returns the KV bytes its attention read.
"""

from __future__ import annotations

import torch

from ...sampling import choose_rows
from . import tree_attention
from .past_pool import PastPool
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


def _picks(rows: list[Row], n_new: list[int], wanted: list[int]) -> list[int]:
    """Flat indices into the ``[R, len(wanted)]`` grid of the (row, position) pairs whose logits
    the rows need, row by row (each row's positions in order)."""
    column = {j: k for k, j in enumerate(wanted)}
    W = len(wanted)
    return [i * W + column[j] for i, (r, m) in enumerate(zip(rows, n_new))
            if r.query.targets != () for j in range(m - r.query.n_outputs, m)]


# target log-probs are taken in slices of this many positions: the float32 temporaries of a
# slice (128 x 49,152 x 4 bytes = 25 MB on SmolLM2) stay in reused heap memory; slices of 1,024
# positions (200 MB, fresh pages each time) took 3.2x longer (0.80 s vs 0.25 s for 4,663
# positions on one CPU core, measured)
_SLICE = 128


def _results(rows: list[Row], logits: torch.Tensor) -> None:
    """Fill ``row.result`` from ``logits`` ``[K, V]`` (on the model's device), the needed positions
    of the rows in :func:`_picks` order.

    A next-token row gets ``log_softmax`` of its position (float32 CPU ``[V]``), a decoding step
    (``query.pick``) the :class:`~genback.sampling.Choice` made on the device; a target row
    its targets' log-probs (float32 CPU ``[n]``), and with ``query.greedy`` also whether each
    target is its position's argmax (bool CPU ``[n]``). Only these leave the device: one
    transfer for all target rows, one for all next-token rows.
    """
    dev = logits.device
    row_at, row_rows, tgt_at, targets = [], [], [], []
    k = 0
    for r in rows:
        t = r.query.targets
        if t == ():  # KV only (a shared-prefix prefill)
            continue
        if t is None:
            row_at.append(k)
            row_rows.append(r)
            k += 1
        else:
            tgt_at.extend(range(k, k + len(t)))
            targets.extend(t)
            k += len(t)
    picks = [r for r in rows if r.query.pick is not None]
    if len(picks) < len(row_at):
        idx = torch.tensor([k for k, r in zip(row_at, row_rows) if r.query.pick is None],
                           device=dev)
        full = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1).cpu()
    if tgt_at:
        idx = torch.tensor(tgt_at, device=dev)
        tgt = torch.tensor(targets, device=dev)
        # argmax flags only when a scoring row asks for them (not for rolling / token_logprobs)
        greedy = any(r.query.greedy for r in rows if r.query.targets)
        lps, flags = [], []
        for s in range(0, len(tgt_at), _SLICE):
            part = logits.index_select(0, idx[s:s + _SLICE]).float()  # [n, V]
            want = tgt[s:s + _SLICE, None]
            if greedy:
                flags.append(part.argmax(dim=-1) == want[:, 0])
            # log_softmax, not x - logsumexp(x): the latter rounds ~1e-5 lower on CPU
            lps.append(torch.log_softmax(part, dim=-1).gather(1, want)[:, 0])
        lps = torch.cat(lps).cpu()
        flags = torch.cat(flags).cpu() if greedy else None
    if picks:  # decoding steps: chosen on the device
        at = torch.tensor([k for k, r in zip(row_at, row_rows) if r.query.pick is not None],
                          device=dev)
        for r, choice in zip(picks, choose_rows(logits.index_select(0, at),
                                                [r.query.tokens for r in picks],
                                                [r.query.pick for r in picks])):
            r.result = choice
    a = b = 0
    for r in row_rows:
        if r.query.pick is None:
            r.result = full[a].clone()
            a += 1
    for r in rows:
        t = r.query.targets
        if t is None or t == ():
            continue
        lp = lps[b:b + len(t)].clone()
        r.result = (lp, flags[b:b + len(t)].clone()) if r.query.greedy else lp
        b += len(t)


def _run_model(model, input_ids, positions, rows, n_new, cache, attention_mask=None):
    """Forward; return the logits ``[K, V]`` of the positions the rows need (:func:`_picks`).

    The language-model head runs only on those positions: a pre-hook on the output embeddings
    selects them from the hidden states ``[R, W, H]`` of the union of the rows' positions
    (``logits_to_keep``), so rows that need different positions pay for their own only.
    """
    dev = model.device if hasattr(model, "device") else input_ids.device
    wanted = _wanted(rows, n_new)
    picks = torch.tensor(_picks(rows, n_new, wanted), dtype=torch.long, device=dev)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def select(module, args):  # hidden [R, W, H] -> [1, K, H]
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, picks)[None],) + args[1:]

    handle = head.register_forward_pre_hook(select) if head is not None else None
    try:
        with torch.inference_mode():
            out = model(
                input_ids=input_ids.to(dev),
                attention_mask=attention_mask,
                position_ids=positions.to(dev),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=torch.tensor(wanted, dtype=torch.long, device=dev),
            )
    finally:
        if handle is not None:
            handle.remove()
    logits = out.logits
    if head is None:  # no head module to hook: select from the full grid
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, picks)
    return out, logits.reshape(-1, logits.shape[-1])


def _split_new_kv(rows: list[Row], n_new: list[int], new_kv: torch.Tensor) -> None:
    # new_kv: [layers, 2, R, kv_heads, m, dim] -> per row [layers, 2, kv_heads, n_new, dim]
    for i, r in enumerate(rows):
        r.new_kv = new_kv[:, :, i, :, : n_new[i]]


def tree_forward(model, rows: list[Row], *, pad_id: int, layout: tuple, min_shared_tokens: int,
                 kernel: str, pool: PastPool) -> int:
    """Forward ``rows`` with tree attention; return the KV bytes read (all layers).

    ``layout``: ``(layers, kv_heads, head_dim, dtype, device)`` of the model's KV; ``pool``: the
    runner's :class:`~.past_pool.PastPool` of private pasts.
    """
    n_layers, heads, dim, dtype, dev = layout
    input_ids, positions, n_new = _inputs(rows, pad_id)
    R, m = input_ids.shape
    shared, private = split_segments(rows, min_shared_tokens)

    # private pasts: the pool holds each distinct private segment once (kept across forwards:
    # a decoding step copies in only the last step's new tokens); each layer lays out its rows'
    # pasts and new tokens with one index from it, so a layout exists for one layer at a time
    placed = pool.place(private, m)
    P = 0 if placed is None else placed[1]
    mask = torch.ones((R, 1, m, P + m), dtype=torch.bool)
    mask[:, :, :, P:] = torch.ones((m, m), dtype=torch.bool).tril()
    index = out = None
    if placed is not None:
        index, _, pads = placed
        for i, pad in enumerate(pads):
            mask[i, :, :, :pad] = False
        out = torch.empty((2, heads, R * (P + m), dim), dtype=dtype, device=dev)

    segments = [tree_attention.Segment(
        kv, None if len(idx) == R else torch.tensor(idx, dtype=torch.long, device=dev), len(idx))
        for kv, idx in shared]
    new_kv = torch.empty((n_layers, 2, R, heads, m, dim), dtype=dtype, device=dev)
    batch = tree_attention.TreeBatch(segments, pool if placed is not None else None, index, P,
                                     mask.to(dev), new_kv, kernel, out)
    with tree_attention.active(batch), tree_attention.use_tree_attention(model.config):
        _, logits = _run_model(model, input_ids, positions, rows, n_new, TreeCache(batch))
    _results(rows, logits)
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
    out, logits = _run_model(model, input_ids, positions, rows, n_new, cache,
                             None if bool(mask.all()) else mask.to(dev))
    _results(rows, logits)
    layers = out.past_key_values.layers
    new_kv = torch.empty((n_layers, 2, R, heads, m, dim), dtype=dtype, device=dev)
    for j, layer in enumerate(layers):  # the new tokens' KV, one copy
        new_kv[j, 0].copy_(layer.keys[:, :, P:])
        new_kv[j, 1].copy_(layer.values[:, :, P:])
    _split_new_kv(rows, n_new, new_kv)
    return n_layers * 2 * heads * dim * new_kv.element_size() * R * P
