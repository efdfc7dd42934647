"""The logits a forward needs: the language-model head runs only at the (path, position)
pairs some output asks for (``logits_to_keep`` and a pre-hook on the output embeddings)."""

from __future__ import annotations

import torch

from ..plan.batch import Path
from .base import as_long
from .tree_cache import cache_argument


def output_spans(paths: list[Path]) -> list[tuple[int, int, int]]:
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


def run_model(model, input_ids, positions, spans, cache, attention_mask=None, device=None):
    """Forward; return the logits ``[K, V]`` of the positions the outputs need (:func:`_flat_positions`).

    The language-model head runs only on those positions: a pre-hook on the output embeddings
    selects them from the hidden states ``[R, W, H]`` of the union of the paths' positions
    (``logits_to_keep``), so paths that need different positions pay for their own only.
    ``spans`` None: one output at each path's last position (a uniform decode step), ``K = R``.
    ``device``: the model's (None: ``model.device``, a walk of its parameters).
    """
    dev = device if device is not None else getattr(model, "device", input_ids.device)
    # (host inputs on a CPU model: no .to, a dispatch that changes nothing)
    on_cpu = dev.type == "cpu" and input_ids.is_cpu and positions.is_cpu
    R, m = input_ids.shape
    if spans is None:
        W, whole_grid = 1, True
    else:
        wanted = _wanted(spans) or [0]  # (a prefill-only forward keeps one position, unused)
        positions_kept = _flat_positions(spans, wanted)
        W = len(wanted)
        # the last W positions of every path, each once, in order (a decode step: the one new
        # token of each path): the head runs on exactly the kept grid, so no selection is
        # needed and ``logits_to_keep`` is the count (transformers keeps the last ``W``)
        whole_grid = wanted[0] == m - W and positions_kept == list(range(R * W))
    flat = head = handle = None
    if not whole_grid:
        flat = as_long(positions_kept, dev)
        head = (model.get_output_embeddings() if hasattr(model, "get_output_embeddings")
                else None)

    def select(module, args):  # hidden [R, W, H] -> [1, K, H]
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat)[None],) + args[1:]

    if head is not None:
        handle = head.register_forward_pre_hook(select)
    try:
        with torch.inference_mode():
            out = model(
                input_ids=input_ids if on_cpu else input_ids.to(dev),
                attention_mask=attention_mask,
                position_ids=positions if on_cpu else positions.to(dev),
                use_cache=True,
                **cache_argument(model, cache),
                logits_to_keep=(W if whole_grid
                                else torch.tensor(wanted, dtype=torch.long, device=dev)),
            )
    finally:
        if handle is not None:
            handle.remove()
    logits = out.logits
    if head is None and flat is not None:  # no head module to hook: select from the full grid
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, flat)
    return out, logits.reshape(-1, logits.shape[-1])
